// optim.cpp — SGD (with or without momentum) and Adam, foreach (multi-tensor) and per-tensor
// paths, with PyTorch's allocations: state at the first step, Adam's
// _foreach_sqrt temporary for all parameters at once.
#include "vramscope/runtime/optim.hpp"

#include <cmath>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

std::string owner_path(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string{} : name.substr(0, dot);
}

/// Elementwise in-place update of `dst` from up to three same-shaped tensors (one
/// version bump per call; PyTorch's foreach kernels may bump a tensor more than once
/// per step, which only changes the absolute numbers, never whether a check fails).
template <class F>
void update(const Tensor& dst, const Tensor& a, const Tensor& b, double flops_per, F f) {
  dst.bump_version();  // an in-place op: PyTorch bumps under no_grad too
  Runtime& rt = dst.runtime();
  rt.add_flops(flops_per * static_cast<double>(dst.numel()));
  if (!rt.computing()) return;
  detail::dispatch(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> A(a), B(b);
    HostOut<T> D(dst, true);
    for (std::int64_t i = 0, n_ = dst.numel(); i < n_; ++i) {
      D[i] = f(D[i], a.defined() ? A[i] : T{0}, b.defined() ? B[i] : T{0});
    }
  });
}

}  // namespace

std::string_view optimizer_name(OptimizerKind kind) noexcept {
  switch (kind) {
    case OptimizerKind::SGD: return "sgd";
    case OptimizerKind::Adam: return "adam";
    case OptimizerKind::None: return "none";
    case OptimizerKind::Adam8bit: return "adam8bit";
  }
  return "unknown";
}

OptimizerKind parse_optimizer(std::string_view name) {
  if (name == "sgd") return OptimizerKind::SGD;
  if (name == "adam") return OptimizerKind::Adam;
  if (name == "none") return OptimizerKind::None;
  if (name == "adam8bit") return OptimizerKind::Adam8bit;
  throw Error("unknown optimizer '" + std::string(name) + "'; expected sgd, adam, adam8bit or none");
}

OptimizerConfig parse_optimizer_config(std::string_view name) {
  OptimizerConfig config;
  const bool momentum = name == "sgd-momentum";  // torch.optim.SGD(..., momentum=0.9)
  try {
    config.kind = parse_optimizer(momentum ? "sgd" : name);
  } catch (const Error&) {
    throw Error("unknown optimizer '" + std::string(name) +
                "'; expected adam, adam8bit, sgd (momentum 0, PyTorch's default), sgd-momentum (0.9) or none");
  }
  if (momentum) config.momentum = 0.9;
  return config;
}

std::string optimizer_label(const OptimizerConfig& config) {
  if (config.kind == OptimizerKind::SGD && config.momentum != 0.0) return "sgd-momentum";
  return std::string(optimizer_name(config.kind));
}

Optimizer::Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {
  state_.resize(params_.size());
  for (const Tensor& p : params_) {
    if (!p.defined() || !p.requires_grad()) {
      throw Error("optimizer: parameters must be materialized leaves requiring grad");
    }
    contexts_.push_back(intern_context(owner_path(p.name()), Phase::Optimizer));
    temporaries_.push_back(intern_context(owner_path(p.name()) + " (optimizer temporaries)", Phase::Optimizer));
  }
}

Optimizer::~Optimizer() = default;

void Optimizer::zero_grad(bool set_to_none) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (set_to_none) {
      p.reset_grad();
    } else if (p.grad().defined()) {
      fill_(p.grad(), 0.0);
    }
  }
}

std::size_t Optimizer::state_bytes() const noexcept {
  std::size_t n = 0;
  for (const auto& s : state_) {
    for (const Tensor& t : s) n += t.defined() ? t.storage()->nbytes() : 0;
  }
  return n;
}

SGD::SGD(std::vector<Tensor> params, const OptimizerConfig& config)
    : Optimizer(std::move(params)), config_(config) {}

void SGD::step() {
  NoGradGuard no_grad;
  const double lr = config_.lr, mom = config_.momentum;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    ModuleScope scope(contexts_[i]);
    Tensor step_dir = g;
    if (mom != 0.0) {
      if (state_[i].empty()) {
        // momentum_buffer = torch.clone(grad).detach(): allocated at the first step.
        Tensor buf = empty(p.runtime(), p.shape(), p.dtype());
        detail::copy_raw(buf, g);
        state_[i].push_back(buf);
      } else {
        update(state_[i][0], g, Tensor{}, 2, [mom](auto b, auto gv, auto) { return b * static_cast<decltype(b)>(mom) + gv; });
      }
      step_dir = state_[i][0];
    }
    update(p, step_dir, Tensor{}, 2, [lr](auto w, auto d, auto) { return w - static_cast<decltype(w)>(lr) * d; });
  }
}

Adam::Adam(std::vector<Tensor> params, const OptimizerConfig& config)
    : Optimizer(std::move(params)), config_(config) {}

void Adam::step() {
  NoGradGuard no_grad;
  // The count advances only when the step completes: a step that ran out of
  // memory leaves the optimizer ready to run again.
  const std::int64_t t = step_count_ + 1;
  const double b1 = config_.beta1, b2 = config_.beta2, eps = config_.eps;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(t)));
  const double step_size = config_.lr / bc1;

  std::vector<std::size_t> active;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    active.push_back(i);
    if (state_[i].empty()) {
      // _init_group: exp_avg then exp_avg_sq, zeros_like(p); the step counter is a CPU tensor.
      // Both or neither: an OOM on the second must not leave half a state behind.
      ModuleScope scope(contexts_[i]);
      Tensor exp_avg = zeros(params_[i].runtime(), params_[i].shape(), params_[i].dtype());
      Tensor exp_avg_sq = zeros(params_[i].runtime(), params_[i].shape(), params_[i].dtype());
      state_[i] = {std::move(exp_avg), std::move(exp_avg_sq)};
    }
  }
  // lerp_(grad, 1 - beta1) and mul_(beta2).addcmul_(grad, grad, 1 - beta2) on `g`.
  const auto first_moment = [&](std::size_t i, const Tensor& g) {
    update(state_[i][0], g, Tensor{}, 3, [b1](auto m, auto gv, auto) {
      using T = decltype(m);
      return m + (gv - m) * static_cast<T>(1.0 - b1);
    });
  };
  const auto second_moment = [&](std::size_t i, const Tensor& g) {
    update(state_[i][1], g, Tensor{}, 4, [b2](auto v, auto gv, auto) {
      using T = decltype(v);
      return v * static_cast<T>(b2) + static_cast<T>(1.0 - b2) * gv * gv;
    });
  };
  // A DTensor whose gradient's placement differs from its own (TensorImpl::redistributed_grad):
  // each op reading the gradient first redistributes it to the parameter's placement (the
  // rank's rows of a Replicate gradient, the all-reduce of a Partial one), a copy of the
  // parameter's size per operand: one for lerp_, two for addcmul_(grad, grad) (torch 2.15,
  // measured by tests/models/check_tensor_parallel.py).
  const auto redistributed = [&](std::size_t i) { return params_[i].impl()->redistributed_grad; };
  const auto redistributed_copy = [&](std::size_t i) {
    ModuleScope scope(temporaries_[i]);
    return empty(params_[i].runtime(), params_[i].shape(), params_[i].grad().dtype());
  };
  const auto moments = [&](std::size_t i) {
    const Tensor g = params_[i].grad();
    const auto operand = [&] { return redistributed(i) ? redistributed_copy(i) : g; };
    first_moment(i, operand());
    const Tensor a = operand(), b = operand();
    second_moment(i, a);
  };
  auto apply = [&](std::size_t i, const Tensor& denom) {
    update(params_[i], state_[i][0], denom, 3, [step_size](auto w, auto m, auto d) {
      return w - static_cast<decltype(w)>(step_size) * m / d;  // addcdiv_(exp_avg, denom, -step_size)
    });
  };
  auto denom_from = [&](const Tensor& dst, const Tensor& v) {
    update(dst, v, Tensor{}, 3, [bc2_sqrt, eps](auto, auto vv, auto) {
      using T = decltype(vv);
      return std::sqrt(vv) / static_cast<T>(bc2_sqrt) + static_cast<T>(eps);
    });
  };

  if (config_.foreach) {
    // _foreach_lerp_(exp_avgs, grads), then _foreach_addcmul_(exp_avg_sqs, grads, grads): a
    // redistributed gradient's copies are made per list and live until the op returns (the
    // updates themselves allocate nothing, so they run in one pass after).
    const auto copies = [&](std::vector<Tensor>& out) {
      for (std::size_t i : active) {
        if (redistributed(i)) out.push_back(redistributed_copy(i));
      }
    };
    for (const int operands : {1, 2}) {
      std::vector<Tensor> list;
      for (int k = 0; k < operands; ++k) copies(list);
    }
    for (std::size_t i : active) {
      ModuleScope scope(contexts_[i]);
      first_moment(i, params_[i].grad());
      second_moment(i, params_[i].grad());
    }
    // exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs): one temporary per parameter,
    // all alive until the update finished.
    std::vector<Tensor> sqrt_list;
    sqrt_list.reserve(active.size());
    for (std::size_t i : active) {
      ModuleScope scope(temporaries_[i]);
      sqrt_list.push_back(empty(params_[i].runtime(), params_[i].shape(), params_[i].dtype()));
      denom_from(sqrt_list.back(), state_[i][1]);
    }
    for (std::size_t k = 0; k < active.size(); ++k) {
      ModuleScope scope(contexts_[active[k]]);
      apply(active[k], sqrt_list[k]);
    }
  } else {
    for (std::size_t i : active) {
      ModuleScope scope(contexts_[i]);
      moments(i);
      // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): sqrt allocates,
      // the division allocates, then the sqrt temporary dies.
      Tensor root, denom;
      {
        ModuleScope temporaries(temporaries_[i]);
        root = empty(params_[i].runtime(), params_[i].shape(), params_[i].dtype());
        denom = empty(params_[i].runtime(), params_[i].shape(), params_[i].dtype());
      }
      root = Tensor{};
      denom_from(denom, state_[i][1]);
      apply(i, denom);
    }
  }
  step_count_ = t;
}

Adam8bit::Adam8bit(std::vector<Tensor> params) : Optimizer(std::move(params)) {}

void Adam8bit::step() {
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    Runtime& rt = p.runtime();
    if (rt.computing()) throw Error("adam8bit runs in dry runs only: compute mode has no 8-bit kernels");
    ModuleScope scope(contexts_[i]);
    if (state_[i].empty()) {
      // name2qmap["dynamic"] and ["udynamic"], moved to the device with the first 8-bit
      // state: kept with it.
      bool any = false;
      for (const auto& s : state_) any = any || s.size() > 2;
      const std::int64_t n = p.numel(), blocks = (n + 255) / 256;
      std::vector<Tensor> state;
      if (n < 4096) {  // min_8bit_size: 32-bit state
        state = {zeros(rt, p.shape(), DType::F32), zeros(rt, p.shape(), DType::F32)};
      } else {
        state = {zeros(rt, p.shape(), DType::U8), zeros(rt, p.shape(), DType::U8), zeros(rt, Shape{blocks}, DType::F32),
                 zeros(rt, Shape{blocks}, DType::F32)};
      }
      if (!any && n >= 4096) {
        state.push_back(zeros(rt, Shape{256}, DType::F32));
        state.push_back(zeros(rt, Shape{256}, DType::F32));
      }
      state_[i] = std::move(state);
    }
    // optimizer_update_8bit_blockwise / optimizer_update_32bit: in place.
    p.bump_version();
    rt.add_flops(10.0 * static_cast<double>(p.numel()));
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, std::vector<Tensor> params) {
  switch (config.kind) {
    case OptimizerKind::Adam8bit: return std::make_unique<Adam8bit>(std::move(params));
    case OptimizerKind::SGD: return std::make_unique<SGD>(std::move(params), config);
    case OptimizerKind::Adam: return std::make_unique<Adam>(std::move(params), config);
    case OptimizerKind::None: return nullptr;
  }
  return nullptr;
}

}  // namespace mem::nn
