// ops_activation.cpp — relu (and in place), sigmoid, tanh, gelu, dropout,
// softmax and log_softmax, each saving what derivatives.yaml saves.
#include <algorithm>
#include <limits>
#include <numbers>

#include "detail.hpp"

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
    HostOut<T> Y(out);
    for (std::int64_t i = 0, n_ = x.numel(); i < n_; ++i) Y[i] = f(src[i]);
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

Tensor softmax_impl(const Tensor& x_in, bool log) {
  // Autocast runs softmax in f32. A half input is not copied to f32 first: PyTorch passes
  // half_to_float to the CUDA kernel (SoftMax.cpp), which reads f16 / bf16 and writes f32,
  // and its backward returns a half gradient (measured with PyTorch 2.11 on an H100: gpt2
  // under f16 and bf16 autocast peaks at the same bytes, both without the copy).
  const bool half_to_float = x_in.defined() && x_in.runtime().autocast() && is_half(x_in.dtype());
  const Tensor x = half_to_float ? x_in : detail::autocast_f32(x_in);
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
  const bool record = needs_grad({&x});
  detail::check_inplace(x, record);
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = x.storage();
  impl->shape = x.shape();
  impl->strides = x.strides();
  impl->offset = x.offset();
  impl->dtype = x.dtype();
  Tensor out(std::move(impl));
  map_into(x, out, 1, [](auto v) { return v > 0 ? v : decltype(v){0}; });
  out.bump_version();  // x, its views and this alias share the counter
  if (record) {
    auto node = detail::make_node<ReluBackward>({&x});
    detail::rebase_history(out, node);
    node->result_.save_output(out);  // at the version after the op, as PyTorch saves it
  }
  return out;
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
Tensor log_softmax(const Tensor& x) { return softmax_impl(x, true); }

}  // namespace mem::nn
