// optim.hpp — SGD with momentum and Adam, with PyTorch's memory behaviour.
//
// State (momentum buffers, exp_avg, exp_avg_sq) is allocated at the first step,
// so the second iteration's peak is higher, as users see on GPUs. The default
// `foreach` implementation is the one PyTorch picks on CUDA: Adam's
// torch._foreach_sqrt(exp_avg_sq) allocates a temporary as large as all
// parameters together for the duration of the update. Every update runs in a
// ModuleScope(owning module, Phase::Optimizer).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

enum class OptimizerKind : std::uint8_t { SGD, Adam, None, Adam8bit };
/// "sgd", "adam", "none", "adam8bit".
std::string_view optimizer_name(OptimizerKind kind) noexcept;
/// Throws mem::Error listing the valid names.
OptimizerKind parse_optimizer(std::string_view name);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::Adam;
  double lr = 1e-3;
  /// SGD: torch.optim.SGD's default is 0 (no state); with momentum, one buffer per parameter.
  double momentum = 0.0;
  double beta1 = 0.9;         ///< Adam
  double beta2 = 0.999;
  double eps = 1e-8;
  bool foreach = true;        ///< multi-tensor path (PyTorch's CUDA default)
};

/// The optimizers the command offers, by the names it takes: "adam", "adam8bit", "sgd"
/// (torch.optim.SGD's defaults: momentum 0, no state), "sgd-momentum" (momentum 0.9: one
/// buffer per parameter), "none". Throws mem::Error listing them.
OptimizerConfig parse_optimizer_config(std::string_view name);
/// The name parse_optimizer_config takes for `config` ("sgd-momentum" when momentum != 0).
std::string optimizer_label(const OptimizerConfig& config);

class Optimizer {
 public:
  /// `params` must be materialized leaves requiring grad.
  explicit Optimizer(std::vector<Tensor> params);
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient (others are skipped, as in PyTorch).
  virtual void step() = 0;
  /// Frees gradients (set_to_none=True, the default) or zeroes them in place.
  void zero_grad(bool set_to_none = true);
  /// Bytes of optimizer state currently allocated.
  std::size_t state_bytes() const noexcept;
  const std::vector<Tensor>& params() const noexcept { return params_; }
  /// Frees the state.
  void release_state() noexcept { state_.clear(); }

 protected:
  std::vector<Tensor> params_;
  std::vector<ContextId> contexts_;           ///< per param: (owner module, Optimizer)
  std::vector<ContextId> temporaries_;        ///< per param: its step's temporaries' context
  std::vector<std::vector<Tensor>> state_;    ///< per param, allocated at the first step
};

class SGD final : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, const OptimizerConfig& config);
  void step() override;

 private:
  OptimizerConfig config_;
};

/// bitsandbytes' Adam8bit (0.45: optim/optimizer.py, Optimizer2State, block_wise): for a
/// parameter of 4096 elements or more, both moments in u8 of its shape and an f32 absmax per
/// block of 256; smaller ones keep f32 moments; the two 256-value f32 quantization maps once
/// per optimizer. The update is one in-place kernel: no temporaries. Dry runs only.
class Adam8bit final : public Optimizer {
 public:
  explicit Adam8bit(std::vector<Tensor> params);
  void step() override;
};

class Adam final : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, const OptimizerConfig& config);
  void step() override;

 private:
  OptimizerConfig config_;
  std::int64_t step_count_ = 0;
};

/// SGD or Adam per config.kind; nullptr for OptimizerKind::None.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, std::vector<Tensor> params);

}  // namespace mem::nn
