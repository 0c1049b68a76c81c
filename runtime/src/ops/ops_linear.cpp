// ops_linear.cpp — linear (addmm / mm), HF's Conv1D layout, bmm and matmul.
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

/// AddmmBackward0 (with bias) / MmBackward0: inputs (bias, x [M,K], weight), addmm's
/// (self, mat1, mat2) order, so the bias's gradient is ready before the weight's (which in
/// PyTorch passes through weight.t()'s TBackward0 first): the order DDP's buckets follow.
/// Under ZeRO-3 it is DeepSpeed's LinearFunctionForZeroStage3Backward: inputs (x, weight,
/// bias), the gradients made and handed out in that order (zero/linear.py:121-142).
class LinearBackward final : public Node {
 public:
  LinearBackward(Shape x_shape, bool kn, bool has_bias, bool zero3)
      : x_shape_(x_shape), kn_(kn), has_bias_(has_bias), zero3_(zero3) {
    if (zero3) ib_ = 2, ix_ = 0, iw_ = 1;
  }
  SavedTensor x_, w_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const std::int64_t n = g.size(-1);
    const std::int64_t m = g.numel() / n;
    Tensor gx, gw, gb;
    const Tensor w = needs_input_grad(ix_) ? w_.unpack() : Tensor{};
    const Tensor x = needs_input_grad(iw_) ? x_.unpack() : Tensor{};
    Runtime& rt = g.runtime();
    if (needs_input_grad(ix_)) {
      const std::int64_t k = kn_ ? w.size(0) : w.size(1);
      gx = empty(rt, x_shape_, g.dtype());
      rt.gemm_workspace(false);
      rt.add_flops(linear_flops(m, k, n));
      if (rt.computing()) {
        detail::dispatch(g.dtype(), [&](auto tag) {
          using T = decltype(tag);
          HostIn<T> G(g), W(w);
          HostOut<T> X(gx);
          // gx = g @ W (W [N,K]) or g @ W^T (W [K,N])
          detail::gemm(false, kn_, m, k, n, T{1}, G.data(), n, W.data(), kn_ ? n : k, T{0}, X.data(), k);
        });
      }
    }
    if (needs_input_grad(iw_)) {
      const std::int64_t k = x.size(-1);
      gw = empty(rt, kn_ ? Shape{k, n} : Shape{n, k}, g.dtype());
      rt.gemm_workspace(false);
      rt.add_flops(linear_flops(n, k, m));
      if (rt.computing()) {
        detail::dispatch(g.dtype(), [&](auto tag) {
          using T = decltype(tag);
          HostIn<T> G(g), X(x);
          HostOut<T> W(gw);
          if (kn_) {  // [K,N] = x^T @ g
            detail::gemm(true, false, k, n, m, T{1}, X.data(), k, G.data(), n, T{0}, W.data(), n);
          } else {    // [N,K] = g^T @ x (mm_mat2_backward on a transposed weight)
            detail::gemm(true, false, n, k, m, T{1}, G.data(), n, X.data(), k, T{0}, W.data(), k);
          }
        });
      }
    }
    if (has_bias_ && needs_input_grad(ib_)) {
      gb = empty(rt, Shape{n}, g.dtype());
      rt.add_flops(static_cast<double>(m * n));
      if (rt.computing()) {
        detail::dispatch(g.dtype(), [&](auto tag) {
          using T = decltype(tag);
          HostIn<T> G(g);
          HostOut<T> B(gb);
          for (std::int64_t j = 0; j < n; ++j) B[j] = T{0};
          for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < n; ++j) B[j] += G[i * n + j];
          }
        });
      }
    }
    if (zero3_) return {gx, gw, gb};
    return {gb, gx, gw};
  }
  void release_variables() noexcept override {
    x_.reset();
    w_.reset();
  }
  std::string_view name() const noexcept override {
    return zero3_ ? "LinearFunctionForZeroStage3Backward" : has_bias_ ? "AddmmBackward0" : "MmBackward0";
  }

 private:
  Shape x_shape_;
  bool kn_, has_bias_, zero3_;
  std::size_t ib_ = 0, ix_ = 1, iw_ = 2;  // where the bias, x and weight sit among the inputs
};

Tensor linear_impl(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, bool kn) {
  const Tensor xc = detail::autocast_half(x_in);
  const Tensor w = detail::autocast_half(w_in);
  const Tensor b = detail::autocast_half(b_in);
  const std::int64_t k = xc.size(-1);
  const std::int64_t wk = kn ? w.size(0) : w.size(1);
  const std::int64_t n = kn ? w.size(1) : w.size(0);
  if (wk != k) {
    throw Error("linear: input " + x_in.shape().str() + " does not match weight " + w_in.shape().str());
  }
  // addmm on input.reshape(-1, K): a view for contiguous inputs, else a copy.
  const Tensor x = xc.is_contiguous() ? xc : xc.reshape(Shape{xc.numel() / k, k});
  const std::int64_t m = x.numel() / k;
  Shape out_shape = xc.shape();
  out_shape[out_shape.size() - 1] = n;
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, out_shape, x.dtype());
  rt.gemm_workspace(/*lt=*/b.defined());  // addmm with a bias runs through cublasLt
  rt.add_flops(linear_flops(m, n, k) + (b.defined() ? static_cast<double>(m * n) : 0.0));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(w), B(b);
      HostOut<T> Y(out);
      detail::gemm(false, !kn, m, n, k, T{1}, X.data(), k, W.data(), kn ? n : k, T{0}, Y.data(), n);
      if (b.defined()) {
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) Y[i * n + j] += B[j];
        }
      }
    });
  }
  if (needs_grad({&x, &w, &b})) {
    const bool zero3 = rt.zero3_linear() && !kn;
    auto node = zero3 ? detail::make_node<LinearBackward>({&x, &w, &b}, x.shape(), kn, b.defined(), true)
                      : detail::make_node<LinearBackward>({&b, &x, &w}, x.shape(), kn, b.defined(), false);
    // derivatives.yaml: mat1's formula uses mat2 and vice versa. DeepSpeed's function saves
    // the input and weight whatever needs a gradient (ctx.save_for_backward, linear.py:89).
    if (w.requires_grad() || zero3) node->x_.save(x);
    if (x.requires_grad() || zero3) node->w_.save(w);
    set_history(out, node);
  }
  return out;
}

/// BmmBackward0: inputs (a [B,M,K], b [B,K,N]).
class BmmBackward final : public Node {
 public:
  SavedTensor a_, b_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    Runtime& rt = g.runtime();
    const std::int64_t bs = g.size(0), m = g.size(1), n = g.size(2);
    Tensor ga, gb;
    if (needs_input_grad(0)) {
      const Tensor b = b_.unpack();
      const std::int64_t k = b.size(1);
      ga = empty(rt, Shape{bs, m, k}, g.dtype());
      rt.gemm_workspace(false);
      rt.add_flops(static_cast<double>(bs) * linear_flops(m, k, n));
      if (rt.computing()) {
        detail::dispatch(g.dtype(), [&](auto tag) {
          using T = decltype(tag);
          HostIn<T> G(g), B(b);
          HostOut<T> A(ga);
          for (std::int64_t i = 0; i < bs; ++i) {
            detail::gemm(false, true, m, k, n, T{1}, G.data() + i * m * n, n, B.data() + i * k * n, n, T{0},
                         A.data() + i * m * k, k);
          }
        });
      }
    }
    if (needs_input_grad(1)) {
      const Tensor a = a_.unpack();
      const std::int64_t k = a.size(2);
      gb = empty(rt, Shape{bs, k, n}, g.dtype());
      rt.gemm_workspace(false);
      rt.add_flops(static_cast<double>(bs) * linear_flops(k, n, m));
      if (rt.computing()) {
        detail::dispatch(g.dtype(), [&](auto tag) {
          using T = decltype(tag);
          HostIn<T> G(g), A(a);
          HostOut<T> B(gb);
          for (std::int64_t i = 0; i < bs; ++i) {
            detail::gemm(true, false, k, n, m, T{1}, A.data() + i * m * k, k, G.data() + i * m * n, n, T{0},
                         B.data() + i * k * n, n);
          }
        });
      }
    }
    return {ga, gb};
  }
  void release_variables() noexcept override {
    a_.reset();
    b_.reset();
  }
  std::string_view name() const noexcept override { return "BmmBackward0"; }
};

}  // namespace

double linear_flops(std::int64_t m, std::int64_t n, std::int64_t k) noexcept {
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return linear_impl(x, weight, bias, false);
}

Tensor linear_kn(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return linear_impl(x, weight, bias, true);
}

Tensor bmm(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = detail::autocast_half(a_in);
  const Tensor b = detail::autocast_half(b_in);
  if (a.dim() != 3 || b.dim() != 3 || a.size(0) != b.size(0) || a.size(2) != b.size(1)) {
    throw Error("bmm: incompatible operands " + a.shape().str() + " and " + b.shape().str());
  }
  const std::int64_t bs = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  Runtime& rt = a.runtime();
  Tensor out = empty(rt, Shape{bs, m, n}, detail::promote(a.dtype(), b.dtype()));
  rt.gemm_workspace(false);
  rt.add_flops(static_cast<double>(bs) * linear_flops(m, n, k));
  if (rt.computing()) {
    detail::dispatch(out.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> A(a), B(b);
      HostOut<T> C(out);
      for (std::int64_t i = 0; i < bs; ++i) {
        detail::gemm(false, false, m, n, k, T{1}, A.data() + i * m * k, k, B.data() + i * k * n, n, T{0},
                     C.data() + i * m * n, n);
      }
    });
  }
  if (needs_grad({&a, &b})) {
    auto node = detail::make_node<BmmBackward>({&a, &b});
    if (b.requires_grad()) node->a_.save(a);
    if (a.requires_grad()) node->b_.save(b);
    set_history(out, node);
  }
  return out;
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = detail::autocast_half(a_in);
  const Tensor b = detail::autocast_half(b_in);
  if (a.dim() < 3 || a.dim() != b.dim()) {
    throw Error("matmul: operands of equal rank >= 3 expected, got " + a.shape().str() + " and " + b.shape().str());
  }
  const std::int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const std::int64_t batch = a.numel() / (m * k);
  Tensor out = bmm(a.reshape(Shape{batch, m, k}), b.reshape(Shape{batch, k, n}));
  Shape out_shape = a.shape();
  out_shape[out_shape.size() - 1] = n;
  return out.view(out_shape);
}

}  // namespace mem::nn
