// zero_optimizer.hpp — what the training step asks of DeepSpeed's ZeRO, whatever the stage
// (internal): deepspeed.initialize's optimizer, which takes each gradient as autograd
// finishes it, closes the backward and steps. Stages 1 and 2 are ZeroRedundancy
// (zero_redundancy.hpp), stage 3 ZeroStage3 (zero_stage3.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/ops.hpp"
#include "vramscope/runtime/optim.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

struct TensorImpl;

/// offload_optimizer's host memory, whatever the stage: tensors with no device block, the
/// pinned ones (get_accelerator().pin_memory: a copy in PyTorch's caching host allocator, the
/// pageable original dropped) counted by the runtime until this goes.
class OffloadedTensors {
 public:
  explicit OffloadedTensors(Runtime& runtime) : runtime_(runtime) {}
  ~OffloadedTensors() {
    for (const std::size_t block : pinned_) runtime_.unpin_host(block);
  }
  OffloadedTensors(const OffloadedTensors&) = delete;
  OffloadedTensors& operator=(const OffloadedTensors&) = delete;

  Tensor make(std::int64_t numel, DType dtype, bool pinned) {
    Tensor t;
    {
      MetaDevice on_host;
      t = empty(runtime_, Shape{numel}, dtype);
    }
    if (pinned) pinned_.push_back(runtime_.pin_host(t.nbytes()));
    return t;
  }

 private:
  Runtime& runtime_;
  std::vector<std::size_t> pinned_;
};

class ZeroOptimizer {
 public:
  virtual ~ZeroOptimizer() = default;
  /// engine.backward(loss), before autograd runs.
  virtual void pre_backward() = 0;
  /// A parameter's post-accumulate-grad hook.
  virtual void grad_ready(TensorImpl& param) = 0;
  /// The backward's end (the last bucket's reduction, the epilogue).
  virtual void finalize_backward() = 0;
  /// engine.step().
  virtual void step() = 0;
  /// Bytes of the optimizer's state on this rank: the fp32 master partition and the moments.
  virtual std::size_t state_bytes() const noexcept = 0;
  /// Bytes of the parameters this rank holds between steps; -1: the whole model's, as on
  /// one GPU (stages 1 and 2 keep every parameter).
  virtual std::int64_t parameter_bytes() const { return -1; }
  /// Every buffer it allocated so far, in order, with its lifetime.
  virtual const std::vector<CommunicationBuffer>& buffers() const noexcept = 0;
};

/// What every stage refuses, before it allocates anything: compute mode (one simulated rank's
/// collectives bring no data from the others), no optimizer (nothing to partition) and
/// bitsandbytes' 8-bit Adam (DeepSpeed runs its own FusedAdam). `engine`: "zero", "zero3".
inline void check_zero_setup(const std::string& engine, const ParallelConfig& config, const OptimizerConfig& optimizer,
                             const Runtime& runtime) {
  if (config.cpu_offload && optimizer.kind != OptimizerKind::Adam) {
    // engine.py 2095-2131: offload_optimizer builds DeepSpeedCPUAdam for Adam and AdamW; a
    // torch optimizer would need zero_force_ds_cpu_optimizer=false (not modelled).
    throw Error(engine + " with offload_optimizer=cpu steps DeepSpeedCPUAdam: give adam");
  }
  if (runtime.computing()) {
    throw Error(engine + " runs as a dry run only: its collectives on one simulated rank bring no data from the others");
  }
  if (optimizer.kind == OptimizerKind::None) {
    throw Error(engine + " partitions an optimizer's state, and there is none: give adam, sgd or sgd-momentum");
  }
  if (optimizer.kind == OptimizerKind::Adam8bit) {
    throw Error(engine + " with bitsandbytes' 8-bit Adam is not modelled: give adam (DeepSpeed's FusedAdam), sgd or "
                "sgd-momentum");
  }
}

}  // namespace mem::nn::detail
