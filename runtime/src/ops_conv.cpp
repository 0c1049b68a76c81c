// ops_conv.cpp — conv2d as im2col + GEMM (columns workspace through the
// allocator), max_pool2d with i64 indices, and global average pooling.
#include <limits>
#include <optional>

#include "detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

struct ConvGeom {
  std::int64_t n, c, h, w, o, kh, kw, stride, pad, ho, wo;
  std::int64_t ckk() const noexcept { return c * kh * kw; }
  std::int64_t hw_out() const noexcept { return ho * wo; }
  /// 1x1, stride 1, no padding: the input already is the column matrix.
  bool direct() const noexcept { return kh == 1 && kw == 1 && stride == 1 && pad == 0; }
};

ConvGeom conv_geom(const Shape& x, const Shape& w, std::int64_t stride, std::int64_t pad) {
  if (x.size() != 4 || w.size() != 4 || x[1] != w[1]) {
    throw Error("conv2d: input " + x.str() + " and weight " + w.str() + " do not match (NCHW, OCkk)");
  }
  ConvGeom g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], stride, pad, 0, 0};
  g.ho = (g.h + 2 * pad - g.kh) / stride + 1;
  g.wo = (g.w + 2 * pad - g.kw) / stride + 1;
  if (g.ho <= 0 || g.wo <= 0) throw Error("conv2d: kernel larger than padded input " + x.str());
  return g;
}

template <class T>
void im2col(const T* x, const ConvGeom& g, T* cols) {
  for (std::int64_t c = 0; c < g.c; ++c) {
    for (std::int64_t i = 0; i < g.kh; ++i) {
      for (std::int64_t j = 0; j < g.kw; ++j) {
        T* row = cols + ((c * g.kh + i) * g.kw + j) * g.hw_out();
        for (std::int64_t oh = 0; oh < g.ho; ++oh) {
          const std::int64_t ih = oh * g.stride - g.pad + i;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.stride - g.pad + j;
            row[oh * g.wo + ow] =
                (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) ? x[(c * g.h + ih) * g.w + iw] : T{0};
          }
        }
      }
    }
  }
}

template <class T>
void col2im(const T* cols, const ConvGeom& g, T* x) {
  for (std::int64_t i = 0; i < g.c * g.h * g.w; ++i) x[i] = T{0};
  for (std::int64_t c = 0; c < g.c; ++c) {
    for (std::int64_t i = 0; i < g.kh; ++i) {
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const T* row = cols + ((c * g.kh + i) * g.kw + j) * g.hw_out();
        for (std::int64_t oh = 0; oh < g.ho; ++oh) {
          const std::int64_t ih = oh * g.stride - g.pad + i;
          if (ih < 0 || ih >= g.h) continue;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.stride - g.pad + j;
            if (iw >= 0 && iw < g.w) x[(c * g.h + ih) * g.w + iw] += row[oh * g.wo + ow];
          }
        }
      }
    }
  }
}

/// ConvolutionBackward0: inputs (x, weight, bias); saves x and weight.
class ConvBackward final : public Node {
 public:
  ConvBackward(std::int64_t stride, std::int64_t pad, bool has_bias) : stride_(stride), pad_(pad), has_bias_(has_bias) {}
  SavedTensor x_, w_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack();
    const Tensor w = w_.unpack();
    const ConvGeom g = conv_geom(x.shape(), w.shape(), stride_, pad_);
    Runtime& rt = gy.runtime();
    Tensor gx, gw, gb;
    const bool need_x = needs_input_grad(0), need_w = needs_input_grad(1), need_b = has_bias_ && needs_input_grad(2);
    if (need_x) gx = empty(rt, x.shape(), x.dtype());
    if (need_w) gw = empty(rt, w.shape(), w.dtype());
    if (need_b) gb = empty(rt, Shape{g.o}, gy.dtype());
    Tensor cols;
    if ((need_x || need_w) && !g.direct()) cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());
    const double gemm = linear_flops(g.o, g.hw_out(), g.ckk()) * static_cast<double>(g.n);
    rt.add_flops((need_x ? gemm : 0.0) + (need_w ? gemm : 0.0) +
                 (need_b ? static_cast<double>(gy.numel()) : 0.0));
    if (rt.computing()) {
      detail::dispatch(gy.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy), X(x), W(w);
        // The columns live in the workspace block itself.
        std::optional<HostOut<T>> COL;
        if (cols.defined()) COL.emplace(cols);
        T* col = COL ? COL->data() : nullptr;
        const std::int64_t in_sz = g.c * g.h * g.w, out_sz = g.o * g.hw_out();
        if (need_x) {
          HostOut<T> GX(gx);
          for (std::int64_t s = 0; s < g.n; ++s) {
            if (g.direct()) {
              detail::gemm(true, false, g.ckk(), g.hw_out(), g.o, T{1}, W.data(), g.ckk(), G.data() + s * out_sz,
                           g.hw_out(), T{0}, GX.data() + s * in_sz, g.hw_out());
            } else {
              detail::gemm(true, false, g.ckk(), g.hw_out(), g.o, T{1}, W.data(), g.ckk(), G.data() + s * out_sz,
                           g.hw_out(), T{0}, col, g.hw_out());
              col2im(col, g, GX.data() + s * in_sz);
            }
          }
        }
        if (need_w) {
          HostOut<T> GW(gw);
          for (std::int64_t s = 0; s < g.n; ++s) {
            const T* src = X.data() + s * in_sz;
            if (!g.direct()) {
              im2col(src, g, col);
              src = col;
            }
            detail::gemm(false, true, g.o, g.ckk(), g.hw_out(), T{1}, G.data() + s * out_sz, g.hw_out(), src,
                         g.hw_out(), s == 0 ? T{0} : T{1}, GW.data(), g.ckk());
          }
        }
        if (need_b) {
          HostOut<T> GB(gb);
          for (std::int64_t o = 0; o < g.o; ++o) {
            T acc{0};
            for (std::int64_t s = 0; s < g.n; ++s) {
              const T* p = G.data() + s * out_sz + o * g.hw_out();
              for (std::int64_t i = 0; i < g.hw_out(); ++i) acc += p[i];
            }
            GB[o] = acc;
          }
        }
      });
    }
    return {gx, gw, gb};
  }
  void release_variables() noexcept override {
    x_.reset();
    w_.reset();
  }
  std::string_view name() const noexcept override { return "ConvolutionBackward0"; }

 private:
  std::int64_t stride_, pad_;
  bool has_bias_;
};

/// MaxPool2DWithIndicesBackward0: saves input and indices.
class MaxPoolBackward final : public Node {
 public:
  SavedTensor x_, indices_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack();
    const Tensor idx = indices_.unpack();
    Tensor gx = empty(gy.runtime(), x.shape(), x.dtype());
    gy.runtime().add_flops(static_cast<double>(gy.numel()));
    if (gy.runtime().computing()) {
      detail::dispatch(gy.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy);
        HostOut<T> GX(gx);
        const std::int64_t* I = idx.data<std::int64_t>();
        const std::int64_t planes = x.size(0) * x.size(1), in_sz = x.size(2) * x.size(3);
        const std::int64_t out_sz = gy.size(2) * gy.size(3);
        for (std::int64_t i = 0, n_ = gx.numel(); i < n_; ++i) GX[i] = T{0};
        for (std::int64_t p = 0; p < planes; ++p) {
          for (std::int64_t i = 0; i < out_sz; ++i) GX[p * in_sz + I[p * out_sz + i]] += G[p * out_sz + i];
        }
      });
    }
    return {gx};
  }
  void release_variables() noexcept override {
    x_.reset();
    indices_.reset();
  }
  std::string_view name() const noexcept override { return "MaxPool2DWithIndicesBackward0"; }
};

/// MeanBackward1: nothing saved; the gradient expanded and divided (one allocation).
class MeanHWBackward final : public Node {
 public:
  explicit MeanHWBackward(Shape in_shape) : in_shape_(in_shape) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    Tensor gx = empty(gy.runtime(), in_shape_, gy.dtype());
    gy.runtime().add_flops(static_cast<double>(gx.numel()));
    if (gy.runtime().computing()) {
      detail::dispatch(gy.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy);
        HostOut<T> GX(gx);
        const std::int64_t planes = in_shape_[0] * in_shape_[1], hw = in_shape_[2] * in_shape_[3];
        for (std::int64_t p = 0; p < planes; ++p) {
          const T v = G[p] / static_cast<T>(hw);
          for (std::int64_t i = 0; i < hw; ++i) GX[p * hw + i] = v;
        }
      });
    }
    return {gx};
  }
  std::string_view name() const noexcept override { return "MeanBackward1"; }

 private:
  Shape in_shape_;
};

}  // namespace

double conv2d_flops(const Shape& input, const Shape& weight, std::int64_t stride, std::int64_t padding) noexcept {
  const std::int64_t ho = (input[2] + 2 * padding - weight[2]) / stride + 1;
  const std::int64_t wo = (input[3] + 2 * padding - weight[3]) / stride + 1;
  return linear_flops(weight[0], ho * wo, weight[1] * weight[2] * weight[3]) * static_cast<double>(input[0]);
}

Tensor conv2d(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, std::int64_t stride, std::int64_t padding) {
  const Tensor x = detail::autocast_half(x_in);
  const Tensor w = detail::autocast_half(w_in);
  const Tensor b = detail::autocast_half(b_in);
  const ConvGeom g = conv_geom(x.shape(), w.shape(), stride, padding);
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, Shape{g.n, g.o, g.ho, g.wo}, x.dtype());
  Tensor cols;
  if (!g.direct()) cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());  // workspace
  rt.add_flops(conv2d_flops(x.shape(), w.shape(), stride, padding) +
               (b.defined() ? static_cast<double>(out.numel()) : 0.0));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(w), B(b);
      HostOut<T> Y(out);
      std::optional<HostOut<T>> COL;  // the columns live in the workspace block itself
      if (cols.defined()) COL.emplace(cols);
      const std::int64_t in_sz = g.c * g.h * g.w, out_sz = g.o * g.hw_out();
      for (std::int64_t s = 0; s < g.n; ++s) {
        const T* src = X.data() + s * in_sz;
        if (!g.direct()) {
          im2col(src, g, COL->data());
          src = COL->data();
        }
        detail::gemm(false, false, g.o, g.hw_out(), g.ckk(), T{1}, W.data(), g.ckk(), src, g.hw_out(), T{0},
                     Y.data() + s * out_sz, g.hw_out());
        if (b.defined()) {
          for (std::int64_t o = 0; o < g.o; ++o) {
            T* p = Y.data() + s * out_sz + o * g.hw_out();
            for (std::int64_t i = 0; i < g.hw_out(); ++i) p[i] += B[o];
          }
        }
      }
    });
  }
  cols = Tensor{};  // workspace back to the allocator before anything else happens
  if (needs_grad({&x, &w, &b})) {
    auto node = detail::make_node<ConvBackward>({&x, &w, &b}, stride, padding, b.defined());
    node->x_.save(x);
    node->w_.save(w);
    set_history(out, node);
  }
  return out;
}

Tensor max_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride, std::int64_t padding) {
  if (x.dim() != 4) throw Error("max_pool2d: NCHW input expected, got " + x.shape().str());
  const std::int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const std::int64_t ho = (h + 2 * padding - kernel) / stride + 1;
  const std::int64_t wo = (w + 2 * padding - kernel) / stride + 1;
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, Shape{n, c, ho, wo}, x.dtype());
  Tensor indices = empty(rt, Shape{n, c, ho, wo}, DType::I64);
  rt.add_flops(static_cast<double>(out.numel() * kernel * kernel));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      std::int64_t* I = indices.data<std::int64_t>();
      for (std::int64_t p = 0; p < n * c; ++p) {
        for (std::int64_t oh = 0; oh < ho; ++oh) {
          for (std::int64_t ow = 0; ow < wo; ++ow) {
            T best = -std::numeric_limits<T>::infinity();
            std::int64_t arg = 0;
            for (std::int64_t i = 0; i < kernel; ++i) {
              const std::int64_t ih = oh * stride - padding + i;
              if (ih < 0 || ih >= h) continue;
              for (std::int64_t j = 0; j < kernel; ++j) {
                const std::int64_t iw = ow * stride - padding + j;
                if (iw < 0 || iw >= w) continue;
                const T v = X[p * h * w + ih * w + iw];
                if (v > best || std::isnan(v)) {
                  best = v;
                  arg = ih * w + iw;
                }
              }
            }
            Y[(p * ho + oh) * wo + ow] = best;
            I[(p * ho + oh) * wo + ow] = arg;
          }
        }
      }
    });
  }
  if (needs_grad({&x})) {
    auto node = detail::make_node<MaxPoolBackward>({&x});
    node->x_.save(x);
    node->indices_.save(indices);
    set_history(out, node);
  }
  return out;
}

Tensor adaptive_avg_pool2d(const Tensor& x) {
  if (x.dim() != 4) throw Error("adaptive_avg_pool2d: NCHW input expected, got " + x.shape().str());
  const std::int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, Shape{n, c, 1, 1}, x.dtype());
  rt.add_flops(static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      for (std::int64_t p = 0; p < n * c; ++p) {
        T acc{0};
        for (std::int64_t i = 0; i < hw; ++i) acc += X[p * hw + i];
        Y[p] = acc / static_cast<T>(hw);
      }
    });
  }
  if (needs_grad({&x})) {
    auto node = detail::make_node<MeanHWBackward>({&x}, x.shape());
    set_history(out, node);
  }
  return out;
}

}  // namespace mem::nn
