// zero_optimizer.hpp — what the training step asks of DeepSpeed's ZeRO, whatever the stage
// (internal): deepspeed.initialize's optimizer, which takes each gradient as autograd
// finishes it, closes the backward and steps. Stages 1 and 2 are ZeroRedundancy
// (zero_redundancy.hpp), stage 3 ZeroStage3 (zero_stage3.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"

namespace mem::nn::detail {

struct TensorImpl;

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

}  // namespace mem::nn::detail
