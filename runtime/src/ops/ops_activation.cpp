// ops_activation.cpp — relu, leaky_relu, hardtanh (ReLU6), silu (each also in place),
// sigmoid, tanh, gelu, dropout,
// softmax and log_softmax, each saving what derivatives.yaml saves.
#include <algorithm>
#include <limits>
#include <numbers>

#include <optional>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

/// out = f(x) elementwise, in a fresh tensor (or in place into `out`).
template <class F>
void map_into(const Tensor& x, const Tensor& out, double flops_per_element, F f) {
  Runtime& rt = x.runtime();
  rt.add_flops(flops_per_element * static_cast<double>(x.numel()));
  if (!rt.computing()) return;
  detail::dispatch(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> X(x);
    const std::vector<T> copy = out.is_same(x) || same_storage(out, x)
                                    ? std::vector<T>(X.data(), X.data() + x.numel())
                                    : std::vector<T>{};
    const T* src = copy.empty() ? X.data() : copy.data();
    // Through store_logical: `out` may follow a permuted or strided input's layout.
    std::vector<T> y(static_cast<std::size_t>(x.numel()));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = f(src[i]);
    detail::store_logical(out, y);
  });
}

/// Gradient of an elementwise op from (grad, saved) -> grad_input, one allocation.
template <class F>
Tensor map_grad(const Tensor& g, const Tensor& saved, double flops_per_element, F f) {
  Runtime& rt = g.runtime();
  Tensor gx = empty(rt, saved.shape(), saved.dtype());
  rt.add_flops(flops_per_element * static_cast<double>(g.numel()));
  if (rt.computing()) {
    detail::dispatch(saved.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> G(g), S(saved);
      HostOut<T> GX(gx);
      for (std::int64_t i = 0, n_ = g.numel(); i < n_; ++i) GX[i] = f(G[i], S[i]);
    });
  }
  return gx;
}

class ReluBackward final : public Node {
 public:
  SavedTensor result_;
  TensorList apply(TensorList& grads) override {
    return {map_grad(grads[0], result_.unpack(), 1, [](auto g, auto r) { return r > 0 ? g : decltype(g){0}; })};
  }
  void release_variables() noexcept override { result_.reset(); }
  std::string_view name() const noexcept override { return "ReluBackward0"; }
};

class SigmoidBackward final : public Node {
 public:
  SavedTensor result_;
  TensorList apply(TensorList& grads) override {
    return {map_grad(grads[0], result_.unpack(), 3, [](auto g, auto r) { return g * r * (decltype(r){1} - r); })};
  }
  void release_variables() noexcept override { result_.reset(); }
  std::string_view name() const noexcept override { return "SigmoidBackward0"; }
};

class TanhBackward final : public Node {
 public:
  SavedTensor result_;
  TensorList apply(TensorList& grads) override {
    return {map_grad(grads[0], result_.unpack(), 3, [](auto g, auto r) { return g * (decltype(r){1} - r * r); })};
  }
  void release_variables() noexcept override { result_.reset(); }
  std::string_view name() const noexcept override { return "TanhBackward0"; }
};

/// LeakyReluBackward0 (saves self) and LeakyReluBackward1 (leaky_relu_: saves result);
/// either sign tells the slope, as leaky_relu_backward's self_is_result does.
class LeakyReluBackward final : public Node {
 public:
  LeakyReluBackward(double slope, bool in_place) : slope_(slope), in_place_(in_place) {}
  SavedTensor self_, result_;  ///< one of them: self out of place, result in place
  TensorList apply(TensorList& grads) override {
    const double k = slope_;
    return {map_grad(grads[0], (in_place_ ? result_ : self_).unpack(), 1, [k](auto g, auto v) {
      return v > 0 ? g : static_cast<decltype(g)>(g * static_cast<decltype(g)>(k));
    })};
  }
  void release_variables() noexcept override {
    self_.reset();
    result_.reset();
  }
  std::string_view name() const noexcept override { return in_place_ ? "LeakyReluBackward1" : "LeakyReluBackward0"; }

 private:
  double slope_;
  bool in_place_;
};

/// HardtanhBackward0: saves self (the input; for hardtanh_, a copy of it, see hardtanh_).
class HardtanhBackward final : public Node {
 public:
  HardtanhBackward(double lo, double hi) : lo_(lo), hi_(hi) {}
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    const double lo = lo_, hi = hi_;
    return {map_grad(grads[0], self_.unpack(), 1, [lo, hi](auto g, auto v) {
      return (v <= lo || v >= hi) ? decltype(g){0} : g;
    })};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override { return "HardtanhBackward0"; }

 private:
  double lo_, hi_;
};

/// SiluBackward0: saves self.
class SiluBackward final : public Node {
 public:
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    return {map_grad(grads[0], self_.unpack(), 6, [](auto g, auto x) {
      using T = decltype(x);
      const T s = T{1} / (T{1} + std::exp(-x));
      return g * s * (T{1} + x * (T{1} - s));
    })};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override { return "SiluBackward0"; }
};

/// An out-of-place elementwise op whose backward node saves its input.
template <class N, class F, class... Args>
Tensor activation_saving_input(const Tensor& x, double flops, F f, Args... node_args) {
  Tensor out = empty(x.runtime(), x.shape(), x.dtype());
  map_into(x, out, flops, f);
  if (needs_grad({&x})) {
    auto node = detail::make_node<N>({&x}, node_args...);
    node->self_.save(x);
    set_history(out, node);
  }
  return out;
}

/// An alias of x's storage: the result of an in-place op on x.
Tensor alias_of(const Tensor& x) { return detail::alias_of(x, x.shape(), x.strides(), x.offset()); }

/// What an in-place elementwise op's node keeps: its output (ReLU, LeakyReLU: derivatives.yaml
/// formulas over `result`), or a copy of the input taken before the write, where the formula
/// reads self (measured with PyTorch 1.13's saved_tensors_hooks: the tensor HardtanhBackward0
/// of hardtanh_ and SiluBackward0 of silu(inplace=True) save is a new storage, not the input's).
enum class InplaceSaves : std::uint8_t { Result, CopyOfInput };

/// An in-place elementwise op: x's storage is written through an alias that becomes the
/// output, x's version counter is bumped, and the output is rebased onto the op's node.
template <class N, InplaceSaves Saves, class F, class... Args>
Tensor inplace_activation(const Tensor& x, double flops, F f, Args... node_args) {
  const bool record = needs_grad({&x});
  detail::check_inplace(x, record);
  Tensor original;
  if (record && Saves == InplaceSaves::CopyOfInput) {
    original = empty(x.runtime(), x.shape(), x.dtype());
    copy_(original, x);
  }
  Tensor out = alias_of(x);
  map_into(x, out, flops, f);
  out.bump_version();  // x, its views and this alias share the counter
  if (record) {
    auto node = detail::make_node<N>({&x}, node_args...);
    detail::rebase_history(out, node);
    if constexpr (Saves == InplaceSaves::Result) {
      node->result_.save_output(out);  // at the version after the op, as PyTorch saves it
    } else {
      node->self_.save(original);
    }
  }
  return out;
}

/// leaky_relu's forward: x where positive, slope * x elsewhere.
auto leaky(double slope) {
  return [slope](auto v) { return v > 0 ? v : static_cast<decltype(v)>(v * static_cast<decltype(v)>(slope)); };
}

template <class T>
T gelu_value(T x, bool tanh_approx) {
  if (tanh_approx) {
    const T k = static_cast<T>(std::sqrt(2.0 / std::numbers::pi));
    return T{0.5} * x * (T{1} + std::tanh(k * (x + T{0.044715} * x * x * x)));
  }
  return T{0.5} * x * (T{1} + std::erf(x / static_cast<T>(std::numbers::sqrt2)));
}

template <class T>
T gelu_grad(T x, bool tanh_approx) {
  if (tanh_approx) {
    const T k = static_cast<T>(std::sqrt(2.0 / std::numbers::pi));
    const T inner = k * (x + T{0.044715} * x * x * x);
    const T t = std::tanh(inner);
    return T{0.5} * (T{1} + t) + T{0.5} * x * (T{1} - t * t) * k * (T{1} + T{3} * T{0.044715} * x * x);
  }
  const T cdf = T{0.5} * (T{1} + std::erf(x / static_cast<T>(std::numbers::sqrt2)));
  const T pdf = std::exp(T{-0.5} * x * x) / static_cast<T>(std::sqrt(2.0 * std::numbers::pi));
  return cdf + x * pdf;
}

class GeluBackward final : public Node {
 public:
  explicit GeluBackward(bool tanh_approx) : tanh_approx_(tanh_approx) {}
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    const bool t = tanh_approx_;
    return {map_grad(grads[0], self_.unpack(), 10, [t](auto g, auto x) { return g * gelu_grad(x, t); })};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override { return "GeluBackward0"; }

 private:
  bool tanh_approx_;
};

class DropoutBackward final : public Node {
 public:
  explicit DropoutBackward(double scale) : scale_(scale) {}
  SavedTensor mask_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor mask = mask_.unpack();
    Tensor gx = empty(g.runtime(), g.shape(), g.dtype());
    g.runtime().add_flops(2.0 * static_cast<double>(g.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(g.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g);
        HostOut<T> GX(gx);
        const std::uint8_t* m = mask.data<std::uint8_t>();
        for (std::int64_t i = 0, n_ = g.numel(); i < n_; ++i) GX[i] = m[i] ? G[i] * static_cast<T>(scale_) : T{0};
      });
    }
    return {gx};
  }
  void release_variables() noexcept override { mask_.reset(); }
  std::string_view name() const noexcept override { return "NativeDropoutBackward0"; }

 private:
  double scale_;
};

class SoftmaxBackward final : public Node {
 public:
  SoftmaxBackward(bool log, DType input_dtype) : log_(log), input_dtype_(input_dtype) {}
  SavedTensor result_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor r = result_.unpack();
    // The gradient has the input's dtype: f16 after a half_to_float forward.
    Tensor gx = empty(g.runtime(), r.shape(), input_dtype_);
    g.runtime().add_flops(4.0 * static_cast<double>(g.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(r.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g), R(r);
        HostOut<T> GX(gx);
        const std::int64_t d = r.size(-1), rows = r.numel() / d;
        for (std::int64_t row = 0; row < rows; ++row) {
          const std::int64_t b = row * d;
          T s{0};
          for (std::int64_t j = 0; j < d; ++j) s += log_ ? G[b + j] : G[b + j] * R[b + j];
          for (std::int64_t j = 0; j < d; ++j) {
            GX[b + j] = log_ ? G[b + j] - std::exp(R[b + j]) * s : R[b + j] * (G[b + j] - s);
          }
        }
      });
    }
    return {gx};
  }
  void release_variables() noexcept override { result_.reset(); }
  std::string_view name() const noexcept override { return log_ ? "LogSoftmaxBackward0" : "SoftmaxBackward0"; }

 private:
  bool log_;
  DType input_dtype_;
};

/// Elementwise activation saving its result.
template <class N, class F>
Tensor activation_saving_result(const Tensor& x, double flops, F f) {
  Tensor out = empty(x.runtime(), x.shape(), x.dtype());
  map_into(x, out, flops, f);
  if (needs_grad({&x})) {
    auto node = detail::make_node<N>({&x});
    set_history(out, node);
    node->result_.save_output(out);
  }
  return out;
}

Tensor softmax_impl(const Tensor& x_in, bool log, std::optional<DType> dtype = std::nullopt) {
  // Autocast runs softmax in f32. A half input is not copied to f32 first: PyTorch passes
  // half_to_float to the CUDA kernel (SoftMax.cpp), which reads f16 / bf16 and writes f32,
  // and its backward returns a half gradient (measured with PyTorch 2.11 on an H100: gpt2
  // under f16 and bf16 autocast peaks at the same bytes, both without the copy).
  // An explicit dtype=f32 takes the fused path for f16 only; a bf16 input is copied to f32
  // first (SoftMax.cpp, softmax(input, dim, dtype): `input_.scalar_type() == ScalarType::Half`).
  const bool half_to_float = x_in.defined() && is_half(x_in.dtype()) &&
                             (dtype ? *dtype == DType::F32 && x_in.dtype() == DType::F16
                                    : x_in.runtime().autocast().has_value());
  const Tensor x = half_to_float ? x_in : dtype ? to_dtype(x_in, *dtype) : detail::autocast_f32(x_in);
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, x.shape(), half_to_float ? DType::F32 : x.dtype());
  rt.add_flops(4.0 * static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(out.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      const std::int64_t d = x.size(-1), rows = x.numel() / d;
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t b = row * d;
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < d; ++j) mx = std::max(mx, X[b + j]);
        T s{0};
        for (std::int64_t j = 0; j < d; ++j) s += std::exp(X[b + j] - mx);
        const T lse = mx + std::log(s);
        for (std::int64_t j = 0; j < d; ++j) Y[b + j] = log ? X[b + j] - lse : std::exp(X[b + j] - lse);
      }
    });
  }
  if (needs_grad({&x})) {
    auto node = detail::make_node<SoftmaxBackward>({&x}, log, x.dtype());
    set_history(out, node);
    node->result_.save_output(out);
  }
  return out;
}

}  // namespace

Tensor relu(const Tensor& x) {
  return activation_saving_result<ReluBackward>(x, 1, [](auto v) { return v > 0 ? v : decltype(v){0}; });
}

Tensor relu_(const Tensor& x) {
  return inplace_activation<ReluBackward, InplaceSaves::Result>(x, 1, [](auto v) { return v > 0 ? v : decltype(v){0}; });
}

Tensor sigmoid(const Tensor& x) {
  return activation_saving_result<SigmoidBackward>(x, 4, [](auto v) {
    using T = decltype(v);
    return T{1} / (T{1} + std::exp(-v));
  });
}

Tensor tanh(const Tensor& x) {
  return activation_saving_result<TanhBackward>(x, 4, [](auto v) { return std::tanh(v); });
}

Tensor leaky_relu(const Tensor& x, double slope) {
  return activation_saving_input<LeakyReluBackward>(x, 1, leaky(slope), slope, false);
}

Tensor leaky_relu_(const Tensor& x, double slope) {
  // derivatives.yaml: leaky_relu_ saves result (leaky_relu_backward(..., self_is_result=true)),
  // which needs a positive slope to tell the sign from the output.
  if (slope <= 0) throw Error("leaky_relu_: in-place leaky_relu needs a positive negative_slope (PyTorch's rule)");
  return inplace_activation<LeakyReluBackward, InplaceSaves::Result>(x, 1, leaky(slope), slope, true);
}

Tensor hardtanh(const Tensor& x, double lo, double hi) {
  return activation_saving_input<HardtanhBackward>(
      x, 1, [lo, hi](auto v) { return std::clamp(v, static_cast<decltype(v)>(lo), static_cast<decltype(v)>(hi)); }, lo,
      hi);
}

Tensor hardtanh_(const Tensor& x, double lo, double hi) {
  return inplace_activation<HardtanhBackward, InplaceSaves::CopyOfInput>(
      x, 1, [lo, hi](auto v) { return std::clamp(v, static_cast<decltype(v)>(lo), static_cast<decltype(v)>(hi)); }, lo,
      hi);
}

Tensor silu(const Tensor& x) {
  return activation_saving_input<SiluBackward>(x, 5, [](auto v) {
    using T = decltype(v);
    return v / (T{1} + std::exp(-v));
  });
}

Tensor silu_(const Tensor& x) {
  return inplace_activation<SiluBackward, InplaceSaves::CopyOfInput>(x, 5, [](auto v) {
    using T = decltype(v);
    return v / (T{1} + std::exp(-v));
  });
}

Tensor gelu(const Tensor& x, bool tanh_approx) {
  Tensor out = empty(x.runtime(), x.shape(), x.dtype());
  map_into(x, out, 10, [tanh_approx](auto v) { return gelu_value(v, tanh_approx); });
  if (needs_grad({&x})) {
    auto node = detail::make_node<GeluBackward>({&x}, tanh_approx);
    node->self_.save(x);
    set_history(out, node);
  }
  return out;
}

Tensor dropout(const Tensor& x, double p, bool training) {
  if (!training || p == 0.0) return x;
  if (p < 0.0 || p > 1.0) throw Error("dropout: probability " + std::to_string(p) + " outside [0, 1]");
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, x.shape(), x.dtype());
  Tensor mask = empty(rt, x.shape(), DType::Bool);
  const RngState rng = rt.take_rng(static_cast<std::uint64_t>(x.numel()));
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  rt.add_flops(2.0 * static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      std::uint8_t* m = mask.data<std::uint8_t>();
      for (std::int64_t i = 0, n_ = x.numel(); i < n_; ++i) {
        const bool keep = detail::uniform01(rng.seed, rng.offset + static_cast<std::uint64_t>(i)) >= p;
        m[i] = keep ? 1 : 0;
        Y[i] = keep ? X[i] * static_cast<T>(scale) : T{0};
      }
    });
  }
  if (needs_grad({&x})) {
    auto node = detail::make_node<DropoutBackward>({&x}, scale);
    node->mask_.save(mask);
    set_history(out, node);
  }
  return out;
}

Tensor softmax(const Tensor& x) { return softmax_impl(x, false); }
Tensor softmax(const Tensor& x, DType dtype) { return softmax_impl(x, false, dtype); }
Tensor log_softmax(const Tensor& x) { return softmax_impl(x, true); }

}  // namespace mem::nn
