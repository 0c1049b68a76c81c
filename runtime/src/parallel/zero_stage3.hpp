// zero_stage3.hpp — DeepSpeed's ZeRO stage 3 on one rank (internal): every parameter kept as
// a 1/N partition, gathered around each module that uses it by the parameter coordinator
// (trace, prefetch, persistence, reuse distance), each gradient copied into the IPG bucket
// and reduce-scattered into this rank's gradient partition, the fp32 master and the
// optimizer's state of the partition. Read in DeepSpeed @edaa7221 (deepspeed/runtime/zero/:
// stage3.py, partitioned_param_coordinator.py, partition_parameters.py,
// parameter_offload.py; runtime/comm/coalesced_collectives.py) and checked on the CPU against
// DeepSpeed itself on PyTorch's fake process group (tests/data/deepspeed-cpu-2026-11-26).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/optim.hpp"
#include "vramscope/runtime/runtime.hpp"
#include "parallel/zero_optimizer.hpp"

namespace mem::nn::detail {

class ZeroStage3 final : public ZeroOptimizer, public ForwardHooks {
 public:
  /// deepspeed.initialize with zero_optimization.stage 3 on `root`, built on the meta device
  /// when the config asks for zero.Init (each parameter is then made and partitioned in turn)
  /// or whole on the GPU: the partitions, the flat bit16 partition buffer, the fp32 master,
  /// the IPG bucket and the gradient partitions; hooks on every module.
  ZeroStage3(const ParallelConfig& config, const OptimizerConfig& optimizer, Module& root, Runtime& runtime);
  ~ZeroStage3() override;
  ZeroStage3(const ZeroStage3&) = delete;
  ZeroStage3& operator=(const ZeroStage3&) = delete;

  /// The modules' forward hooks: the coordinator's fetch before, its release after, and the
  /// backward hooks on the input and output (ForwardHooks).
  Tensor pre_forward(Module& module, const Tensor& input) override;
  Tensor post_forward(Module& module, const Tensor& output) override;

  void pre_backward() override;
  void grad_ready(TensorImpl& param) override;
  void finalize_backward() override;
  void step() override;
  std::size_t state_bytes() const noexcept override;
  std::int64_t parameter_bytes() const override;
  const std::vector<CommunicationBuffer>& buffers() const noexcept override { return log_; }

 private:
  enum class Status : std::uint8_t { NotAvailable, Inflight, Available };  // ZeroParamStatus
  enum class Trace : std::uint8_t { Invalid, Record, Complete };          // ZeRoTraceMode
  /// One all_gather_coalesced of several parameters: the flat output, copied out into each
  /// parameter at the first wait and freed once every parameter has been waited for.
  struct Handle {
    Tensor flat;
    std::size_t log = SIZE_MAX;
    std::vector<std::size_t> params;
    std::size_t waiting = 0;
    bool copied = false;
    Tensor device_copy;  ///< offload_param: the partition's copy the asynchronous all-gather sends
    std::size_t device_copy_log = SIZE_MAX;
  };
  struct Param {
    Tensor tensor;                 // the parameter every module and node holds
    std::shared_ptr<Storage> data; // param.data: freed while partitioned
    std::size_t data_log = SIZE_MAX;
    std::int64_t numel = 0;        // ds_numel
    std::int64_t partition = 0;    // partition_numel: ceil(numel / N), padded on the last ranks
    bool persistent = false;       // ds_persist
    bool trainable = true;
    Status status = Status::NotAvailable;
    std::shared_ptr<Handle> handle;      // while inflight
    std::vector<const Module*> active;   // ds_active_sub_modules
    Tensor own_partition;                // ds_tensor; a trainable one moves into the flat buffer
    std::size_t partition_log = SIZE_MAX;
    Tensor held_grad;                    // a gradient larger than the bucket, until its reduction
    std::size_t held_log = SIZE_MAX;
    std::size_t sub_group = 0;
  };
  struct Hooked {
    Module* module = nullptr;         // null: a container a flattened Sequential stands for
    std::vector<std::size_t> params;  // iter_params(module, recurse=False), by ds_id
    std::string name;                 // "(root)" or its path
    /// ds_recompute_parameters: frozen parameters a checkpoint's recompute gathered while
    /// this module's backward was active, released with it.
    std::vector<std::size_t> recompute_params;
  };
  struct ParamUse {
    std::size_t param = 0;
    std::int64_t step = 0;  // step_id_last_used_at
  };

  /// A parameter's dtype under DeepSpeed: the model's for those it trains (its bf16 or fp16
  /// config casts them), their own for frozen ones (a quantized base weight keeps its bytes).
  DType dtype_of(const Param& p) const noexcept { return p.trainable ? dtype_ : p.tensor.dtype(); }
  // The coordinator (PartitionedParameterCoordinator).
  void reset_step();
  /// The hooks of module `i` around a call (a module's, or a container's): the fetch and the
  /// post-backward hook on its input; the release and the pre-backward hook on its output.
  Tensor enter(std::size_t i, const Tensor& input);
  Tensor leave(std::size_t i, const Tensor& output);
  /// Adds the containers of the flattened children of `seq`.
  void add_containers(Sequential& seq);
  void record(const Hooked& m);
  void fetch(const Hooked& m, bool forward);
  void all_gather(const std::vector<std::size_t>& params);
  void wait(std::size_t param);
  void release_module(const Hooked& m, bool forward);
  void release_param(std::size_t param);
  /// The module's parameters and its recompute's frozen ones (the latter cleared): what its
  /// backward's release looks at.
  std::vector<std::size_t> take_backward_params(Hooked& m);
  /// `module` no longer holds `param` (ds_active_sub_modules.discard).
  void leave_active(std::size_t param, const Module* module);
  std::vector<std::size_t> params_to_release(const Hooked& m);
  void release_backward_leftovers();
  void release_and_reset_all();
  /// _clean_inflight_param_registry: what was gathered ahead and never waited for is released.
  void clean_inflight();
  /// The post-step gather of the persistent parameters (each its own N x partition buffer).
  void gather_persistent();
  // The gradients.
  void reduce_bucket();
  Tensor make(const std::string& what, std::int64_t numel, DType dtype, ContextId context, std::size_t& entry);
  /// offload_optimizer's: a tensor on the host (no device memory), pinned or pageable, logged.
  Tensor host(const std::string& what, std::int64_t numel, DType dtype, bool pinned, std::size_t& entry);
  bool offload() const noexcept { return config_.cpu_offload; }
  /// offload_param's copy of `p`'s host partition on the GPU, logged (copy_log_); undefined
  /// without offload_param.
  Tensor to_device(const Param& p);
  /// On stage3.py's self.device: the GPU (make), or the host (host) under offload_optimizer.
  Tensor on_optimizer_device(const std::string& what, std::int64_t numel, DType dtype, ContextId context, bool pinned,
                             std::size_t& entry);
  void release(Tensor& tensor, std::size_t entry);
  /// Logs a buffer of `bytes` made now on the current stream; returns its entry.
  std::size_t note(const std::string& what, std::size_t bytes);
  std::string stage() const;

  ParallelConfig config_;
  OptimizerConfig optimizer_;
  Runtime& runtime_;
  Module& root_;
  ContextId gather_context_, partitions_context_, bucket_context_, gradients_context_, optimizer_context_,
      temporaries_context_;
  StreamId allgather_stream_ = 0, reduce_stream_ = 0;
  DType dtype_ = DType::BF16;  // the model's dtype: the flat buffers', the bucket's, the communication's
  std::vector<Param> params_;
  std::unordered_map<const TensorImpl*, std::size_t> index_;
  std::vector<Hooked> modules_;
  std::unordered_map<const Module*, std::size_t> module_index_;
  /// The containers PyTorch has where our Sequential is flat ("model" for LlamaModel around
  /// "model.embed_tokens" ... "model.norm", "layer1" around "layer1.0" ...): their hooks run
  /// before their first child's (outermost first) and after their last child's (innermost first).
  std::unordered_map<const Module*, std::vector<std::size_t>> opens_, closes_;
  std::vector<std::int64_t> sub_groups_;  // Σ partition of each sub group (sub_group_size)
  std::vector<std::size_t> sub_group_params_;  // the parameters in each
  std::int64_t trainable_partition_ = 0;  // S: Σ partition of the trainable parameters

  Tensor overflow_flag_, inf_or_nan_, lp_buffer_, bucket_, grad_partitions_;
  std::vector<Tensor> masters_, moments_;
  // offload_optimizer=cpu: each sub group's fp32 gradient on the host, each gradient
  // partition's norm (a device scalar) until the step, the host's tensors.
  std::vector<Tensor> host_grads_, norms_;
  OffloadedTensors on_host_{runtime_};

  // Coordinator state.
  Trace trace_mode_ = Trace::Invalid;
  std::vector<std::size_t> submodule_order_;  // modules, in fetch order (forward then backward)
  std::vector<ParamUse> param_order_;
  std::deque<ParamUse> param_queue_;
  std::unordered_map<std::size_t, std::int64_t> fetched_for_;  // most_recent_step_id_param_fetched_for
  std::unordered_map<std::size_t, std::deque<std::int64_t>> module_steps_;  // step_id_module_fetched_for
  std::int64_t step_id_ = 0;
  std::int64_t available_numel_ = 0;  // n_available_params
  std::vector<std::size_t> active_backward_;  // active_backward_submodules, in order

  // The IPG bucket's contents.
  std::vector<std::size_t> in_bucket_;
  std::int64_t bucket_elements_ = 0;

  std::size_t steps_ = 0;
  enum class Phase3 : std::uint8_t { Construction, Forward, Backward, Optimizer } phase_ = Phase3::Construction;
  std::vector<CommunicationBuffer> log_;
  std::size_t copy_log_ = SIZE_MAX;  ///< the entry of to_device()'s last copy
};

}  // namespace mem::nn::detail
