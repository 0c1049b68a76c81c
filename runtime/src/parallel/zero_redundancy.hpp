// zero_redundancy.hpp — DeepSpeed's ZeRO stages 1 and 2 on one rank (internal): the
// parameters flattened into one buffer, the fp32 master and the optimizer's state of this
// rank's partition, each backward's gradient bucket (IPG buffer) and the gradients of the
// parameters the partition touches, the step's transients. With offload_optimizer=cpu the
// master, its gradient and Adam's state are on the host and each gradient leaves the GPU in
// the backward that makes it (copy_grads_in_partition's offload branch). Read in DeepSpeed @edaa7221
// (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer, unless a file is named)
// and checked on the CPU against DeepSpeed itself on PyTorch's fake process group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/optim.hpp"
#include "vramscope/runtime/runtime.hpp"
#include "parallel/zero_optimizer.hpp"

namespace mem::nn::detail {

class ZeroRedundancy final : public ZeroOptimizer {
 public:
  /// deepspeed.initialize(model, optimizer from the config, zero_optimization.stage 1 or 2)
  /// on a model built on the GPU: FusedAdam's flag, the flat buffer the parameters become
  /// views of, the fp32 master partition.
  ZeroRedundancy(const ParallelConfig& config, const OptimizerConfig& optimizer, Module& root, Runtime& runtime);
  ZeroRedundancy(const ZeroRedundancy&) = delete;
  ZeroRedundancy& operator=(const ZeroRedundancy&) = delete;

  /// engine.backward(loss) before autograd: the loss divided by the accumulation steps and
  /// scaled (two scalars that live until the backward is done).
  void pre_backward() override;
  /// The post-accumulate-grad hook of a parameter (process_gradients).
  void grad_ready(TensorImpl& param) override;
  /// The backward's end (allreduce_gradients: stage 1's reduction, then the epilogue).
  void finalize_backward() override;
  /// engine.step(): the overflow check, the norm, the fp32 gradient, the optimizer.
  void step() override;

  /// Bytes of the optimizer's state: the fp32 master partition and Adam's moments.
  std::size_t state_bytes() const noexcept override;
  const std::vector<CommunicationBuffer>& buffers() const noexcept override { return log_; }

 private:
  struct Param {
    Tensor tensor;
    std::int64_t offset = 0;        // in the flat buffer
    std::int64_t numel = 0;
    bool in_partition = false;      // overlaps this rank's partition
    std::int64_t partition_slice = 0;  // elements of it inside the partition
    std::int64_t gradient_offset = 0;  // in grads_in_partition
  };
  void process(std::size_t index);
  void reduce_bucket();
  Tensor make(const std::string& what, std::int64_t numel, DType dtype, ContextId context, std::size_t& entry);
  /// A tensor on the host: no device memory; pinned (get_accelerator().pin_memory) or pageable.
  Tensor host(const std::string& what, std::int64_t numel, DType dtype, bool pinned);
  /// _has_inf_or_nan on `numel` elements of the parameters' dtype: its transients, all freed;
  /// logged in the buffer log when `logged` (the offload branch's, which DeepSpeed's run shows).
  void check_inf_or_nan(std::int64_t numel, bool logged);
  /// copy_grads_in_partition's offload branch for a gradient of this rank's partition.
  void offload_gradient(Param& param);
  bool offload() const noexcept { return config_.cpu_offload; }
  void release(Tensor& tensor, std::size_t entry);
  /// The gradient of `param` becomes a view of `buffer` at `offset` (param.grad.data = ...).
  static void point_grad(Param& param, const Tensor& buffer, std::int64_t offset);
  std::string stage() const;
  bool stage2() const noexcept { return config_.engine == ParallelEngine::Zero2; }

  ParallelConfig config_;
  OptimizerConfig optimizer_;
  Runtime& runtime_;
  ContextId comm_context_, weights_context_, optimizer_context_, gradients_context_, other_context_;
  ContextId offload_context_;  ///< the staging buffer and each gradient's way to the host
  DType dtype_ = DType::BF16;       // the parameters' ("bit16") dtype
  std::vector<Param> params_;
  std::unordered_map<const TensorImpl*, std::size_t> index_;
  std::int64_t padded_ = 0, partition_ = 0, padding_ = 0, gradients_in_partition_ = 0;
  std::int64_t bucket_elements_ = 0;
  std::size_t reduce_bucket_size_ = 0;

  Tensor overflow_flag_, flat_, master_;
  // offload_optimizer=cpu: the host's bit16 copy-back buffer, unused buffer and fp32 gradient,
  // the GPU's staging buffer, each gradient's fp64 norm until the step, the host's tensors.
  Tensor host_bit16_, host_temp_, host_grad_, gpu_offload_buffer_;
  std::vector<std::pair<Tensor, std::size_t>> norms_;  ///< with their log entries
  OffloadedTensors on_host_{runtime_};
  std::vector<Tensor> moments_;
  Tensor ipg_[2];
  std::size_t ipg_log_[2] = {SIZE_MAX, SIZE_MAX};
  Tensor grads_in_partition_, padding_zeros_;
  std::size_t grads_log_ = SIZE_MAX, padding_log_ = SIZE_MAX;
  std::vector<std::size_t> bucket_, large_;
  Tensor loss_scalars_[2];
  std::size_t steps_ = 0;
  bool in_backward_ = false;
  std::vector<CommunicationBuffer> log_;
};

}  // namespace mem::nn::detail
