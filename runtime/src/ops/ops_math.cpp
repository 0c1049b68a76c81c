// ops_math.cpp — the pointwise math and reductions that Hugging Face's modules are
// written in (RMSNorm is pow, mean, add, rsqrt and mul; rotary embeddings are mul, neg,
// narrow and cat), each saving what derivatives.yaml saves and allocating in backward
// what its formula in FunctionsManual.cpp allocates.
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;
using detail::unary;

/// out[i] = f(a[i], b[i]) for same-shape a and b, in a's layout.
template <class F>
Tensor zip(const Tensor& a, const Tensor& b, F f) {
  Runtime& rt = a.runtime();
  Tensor out = detail::empty_following(a, a.shape(), a.dtype());
  rt.add_flops(static_cast<double>(a.numel()));
  if (rt.computing()) {
    detail::dispatch(a.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> A(a), B(b);
      std::vector<T> y(static_cast<std::size_t>(a.numel()));
      for (std::size_t i = 0; i < y.size(); ++i) {
        y[i] = f(A[static_cast<std::int64_t>(i)], B[static_cast<std::int64_t>(i)]);
      }
      detail::store_logical(out, y);
    });
  }
  return out;
}

/// PowBackward0 for exponent 2: pow_backward is grad * (2 * self.pow(1)); self.pow(1) and
/// 2 * it are temporaries of that one expression, so three allocations, two freed.
class SquareBackward final : public Node {
 public:
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    const Tensor x = self_.unpack();
    const Tensor pow1 = unary(x, [](auto v) { return v; });
    const Tensor twice = unary(pow1, [](auto v) { return v + v; });
    return {zip(grads[0], twice, [](auto g, auto t) { return g * t; })};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override { return "PowBackward0"; }
};

/// PowBackward0 of pow(self, exponent): grad * (exponent * self.pow(exponent - 1))
/// (FunctionsManual.cpp's pow_backward): three allocations, two freed.
class PowScalarBackward final : public Node {
 public:
  explicit PowScalarBackward(double exponent) : exponent_(exponent) {}
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    const Tensor x = self_.unpack();
    const double e = exponent_;
    const Tensor lower = unary(x, [e](auto v) { return static_cast<decltype(v)>(std::pow(v, e - 1)); });
    const Tensor scaled = unary(lower, [e](auto v) { return static_cast<decltype(v)>(e * v); });
    return {zip(grads[0], scaled, [](auto g, auto t) { return g * t; })};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override { return "PowBackward0"; }

 private:
  double exponent_;
};

/// RsqrtBackward0: -0.5 * grad * result.pow(3); three allocations, two freed.
class RsqrtBackward final : public Node {
 public:
  SavedTensor result_;
  TensorList apply(TensorList& grads) override {
    const Tensor r = result_.unpack();
    const Tensor scaled = unary(grads[0], [](auto g) { return g * static_cast<decltype(g)>(-0.5); });
    const Tensor cube = unary(r, [](auto v) { return v * v * v; });
    return {zip(scaled, cube, [](auto a, auto b) { return a * b; })};
  }
  void release_variables() noexcept override { result_.reset(); }
  std::string_view name() const noexcept override { return "RsqrtBackward0"; }
};

class NegBackward final : public Node {
 public:
  TensorList apply(TensorList& grads) override { return {unary(grads[0], [](auto g) { return -g; })}; }
  std::string_view name() const noexcept override { return "NegBackward0"; }
};

/// MeanBackward1: sum_backward(grad, sizes, dim, keepdim) / n, the expand being a view and
/// the division one allocation of the input's shape. Saves nothing.
class MeanBackward final : public Node {
 public:
  explicit MeanBackward(Shape in_shape) : in_shape_(in_shape) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const std::int64_t inner = g.numel() > 0 ? in_shape_.numel() / g.numel() : 0;  // averaged per output
    Tensor gx = empty(g.runtime(), in_shape_, g.dtype());
    g.runtime().add_flops(static_cast<double>(gx.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(g.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g);
        HostOut<T> GX(gx);
        for (std::int64_t i = 0, n = gx.numel(); i < n; ++i) GX[i] = G[i / inner] / static_cast<T>(inner);
      });
    }
    return {gx};
  }
  std::string_view name() const noexcept override { return "MeanBackward1"; }

 private:
  Shape in_shape_;
};

}  // namespace

Tensor square(const Tensor& x_in) {
  const Tensor x = detail::autocast_f32(x_in);  // pow is on autocast's fp32 list
  Tensor out = unary(x, [](auto v) { return v * v; });
  if (needs_grad({&x})) {
    auto node = detail::make_node<SquareBackward>({&x});
    node->self_.save(x);
    set_history(out, node);
  }
  return out;
}

Tensor pow_scalar(const Tensor& x_in, double exponent) {
  const Tensor x = detail::autocast_f32(x_in);  // pow is on autocast's fp32 list
  Tensor out = unary(x, [exponent](auto v) { return static_cast<decltype(v)>(std::pow(v, exponent)); });
  if (needs_grad({&x})) {
    auto node = detail::make_node<PowScalarBackward>({&x}, exponent);
    node->self_.save(x);
    set_history(out, node);
  }
  return out;
}

Tensor rsqrt(const Tensor& x_in) {
  const Tensor x = detail::autocast_f32(x_in);  // rsqrt is on autocast's fp32 list
  Tensor out = unary(x, [](auto v) { return decltype(v){1} / std::sqrt(v); });
  if (needs_grad({&x})) {
    auto node = detail::make_node<RsqrtBackward>({&x});
    set_history(out, node);
    node->result_.save_output(out);
  }
  return out;
}

Tensor neg(const Tensor& x) {
  Tensor out = unary(x, [](auto v) { return -v; });
  if (needs_grad({&x})) set_history(out, detail::make_node<NegBackward>({&x}));
  return out;
}

Tensor add_scalar(const Tensor& x, double s) {
  Tensor out = unary(x, [s](auto v) { return v + static_cast<decltype(v)>(s); });
  if (needs_grad({&x})) set_history(out, detail::make_node<detail::PassThroughBackward>({&x}, "AddBackward1"));
  return out;
}

Tensor mean_last(const Tensor& x) {
  if (x.dim() == 0) throw Error("mean_last: needs at least one dimension");
  Shape shape = x.shape();
  shape[shape.size() - 1] = 1;
  return detail::mean_trailing(x, shape);
}

namespace detail {

Tensor mean_trailing(const Tensor& x, const Shape& out_shape) {
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, out_shape, x.dtype());
  const std::int64_t inner = out.numel() > 0 ? x.numel() / out.numel() : 0;
  rt.add_flops(static_cast<double>(x.numel()));
  if (rt.computing()) {
    dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      for (std::int64_t r = 0, rows = out.numel(); r < rows; ++r) {
        T s{0};
        for (std::int64_t j = 0; j < inner; ++j) s += X[r * inner + j];
        Y[r] = s / static_cast<T>(inner);
      }
    });
  }
  if (needs_grad({&x})) set_history(out, make_node<MeanBackward>({&x}, x.shape()));
  return out;
}

}  // namespace detail

}  // namespace mem::nn
