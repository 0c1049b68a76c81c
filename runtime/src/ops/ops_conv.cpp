// ops_conv.cpp — conv2d as im2col + GEMM per group (columns workspace through the
// allocator), max_pool2d with i64 indices, avg_pool2d and adaptive average pooling.
#include <limits>
#include <optional>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

struct ConvGeom {
  std::int64_t n, c, h, w, o, kh, kw;
  std::int64_t sh, sw, ph, pw, dh, dw;  ///< stride, padding and dilation per axis
  std::int64_t groups, ho, wo;
  /// Rows of the column matrix: every input channel's kernel window.
  std::int64_t ckk() const noexcept { return c * kh * kw; }
  /// One group's share: its input channels' rows, its output channels.
  std::int64_t group_ckk() const noexcept { return ckk() / groups; }
  std::int64_t group_o() const noexcept { return o / groups; }
  std::int64_t hw_out() const noexcept { return ho * wo; }
  /// 1x1, stride 1, no padding: the input already is the column matrix.
  bool direct() const noexcept { return kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0; }
};

/// Output side of a convolution: PyTorch's (in + 2p - d(k - 1) - 1) / s + 1.
std::int64_t conv_out(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad, std::int64_t dil) {
  return (in + 2 * pad - dil * (k - 1) - 1) / stride + 1;
}

/// A convolution's settings; `one_d`: the height axis is Conv1d's unit axis (stride 1, no
/// padding, no dilation), as at::conv1d's [N, C, 1, L] view convolves.
struct ConvParams {
  std::int64_t stride = 1, pad = 0, dil = 1, groups = 1;
  bool one_d = false;
};

ConvGeom conv_geom(const Shape& x, const Shape& w, const ConvParams& p) {
  const std::int64_t stride = p.stride, pad = p.pad, dil = p.dil, groups = p.groups;
  if (groups < 1 || dil < 1 || stride < 1 || pad < 0) {
    throw Error("conv2d: stride, dilation and groups must be positive and padding not negative");
  }
  if (x.size() != 4 || w.size() != 4 || x[1] != w[1] * groups || w[0] % groups != 0) {
    throw Error("conv2d: input " + x.str() + " and weight " + w.str() + " do not match (NCHW, O x C/groups x k x k, " +
                std::to_string(groups) + " groups)");
  }
  ConvGeom g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], p.one_d ? 1 : stride, stride, p.one_d ? 0 : pad, pad,
             p.one_d ? 1 : dil, dil, groups, 0, 0};
  g.ho = conv_out(g.h, g.kh, g.sh, g.ph, g.dh);
  g.wo = conv_out(g.w, g.kw, g.sw, g.pw, g.dw);
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
          const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.sw - g.pw + j * g.dw;
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
          const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
          if (ih < 0 || ih >= g.h) continue;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.sw - g.pw + j * g.dw;
            if (iw >= 0 && iw < g.w) x[(c * g.h + ih) * g.w + iw] += row[oh * g.wo + ow];
          }
        }
      }
    }
  }
}

/// One sample's [channels, plane] output block plus a bias per channel.
template <class T, class Bias>
void add_channel_bias(T* y, std::int64_t channels, std::int64_t plane, const Bias& b) {
  for (std::int64_t c = 0; c < channels; ++c) {
    for (std::int64_t i = 0; i < plane; ++i) y[c * plane + i] += b[c];
  }
}

/// The bias gradient: g [n, channels, plane] summed over samples and the plane.
template <class T, class Out>
void channel_sums(const T* g, std::int64_t n, std::int64_t channels, std::int64_t plane, Out& out) {
  for (std::int64_t c = 0; c < channels; ++c) {
    T acc{0};
    for (std::int64_t s = 0; s < n; ++s) {
      const T* p = g + (s * channels + c) * plane;
      for (std::int64_t i = 0; i < plane; ++i) acc += p[i];
    }
    out[c] = acc;
  }
}

/// ConvolutionBackward0: inputs (x, weight, bias); saves x and weight.
class ConvBackward final : public Node {
 public:
  ConvBackward(const ConvParams& params, bool has_bias) : params_(params), has_bias_(has_bias) {}
  SavedTensor x_, w_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack();
    const Tensor w = w_.unpack();
    const ConvGeom g = conv_geom(x.shape(), w.shape(), params_);
    Runtime& rt = gy.runtime();
    Tensor gx, gw, gb;
    const bool need_x = needs_input_grad(0), need_w = needs_input_grad(1), need_b = has_bias_ && needs_input_grad(2);
    if (need_x) gx = empty(rt, x.shape(), x.dtype());
    if (need_w) gw = empty(rt, w.shape(), w.dtype());
    if (need_b) gb = empty(rt, Shape{g.o}, gy.dtype());
    Tensor cols;
    if ((need_x || need_w) && !g.direct()) cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());
    const double gemm = linear_flops(g.o, g.hw_out(), g.group_ckk()) * static_cast<double>(g.n);
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
        // Group q: weight rows [q og, (q+1) og), column rows [q gckk, (q+1) gckk).
        const std::int64_t og = g.group_o(), gckk = g.group_ckk(), hw = g.hw_out();
        if (need_x) {
          HostOut<T> GX(gx);
          for (std::int64_t s = 0; s < g.n; ++s) {
            T* dst = g.direct() ? GX.data() + s * in_sz : col;
            for (std::int64_t q = 0; q < g.groups; ++q) {
              detail::gemm(true, false, gckk, hw, og, T{1}, W.data() + q * og * gckk, gckk,
                           G.data() + s * out_sz + q * og * hw, hw, T{0}, dst + q * gckk * hw, hw);
            }
            if (!g.direct()) col2im(col, g, GX.data() + s * in_sz);
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
            for (std::int64_t q = 0; q < g.groups; ++q) {
              detail::gemm(false, true, og, gckk, hw, T{1}, G.data() + s * out_sz + q * og * hw, hw,
                           src + q * gckk * hw, hw, s == 0 ? T{0} : T{1}, GW.data() + q * og * gckk, gckk);
            }
          }
        }
        if (need_b) {
          HostOut<T> GB(gb);
          channel_sums(G.data(), g.n, g.o, g.hw_out(), GB);
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
  ConvParams params_;
  bool has_bias_;
};

/// ConvolutionBackward0 of a transposed convolution: saves input and weight. Its geometry is
/// that of the ordinary convolution it inverts (from the output's shape to the input's):
/// grad_input is that convolution of the gradient, grad_weight the input against its columns.
class ConvTransposeBackward final : public Node {
 public:
  ConvTransposeBackward(ConvGeom geom, bool has_bias) : g_(geom), has_bias_(has_bias) {}
  SavedTensor x_, w_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack(), w = w_.unpack();
    Runtime& rt = gy.runtime();
    const ConvGeom& g = g_;
    Tensor gx, gw, gb;
    const bool need_x = needs_input_grad(0), need_w = needs_input_grad(1), need_b = has_bias_ && needs_input_grad(2);
    if (need_x) gx = empty(rt, x.shape(), x.dtype());
    if (need_w) gw = empty(rt, w.shape(), w.dtype());
    if (need_b) gb = empty(rt, Shape{g.c}, gy.dtype());
    Tensor cols;
    if (need_x || need_w) cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());
    const double gemm = linear_flops(g.o, g.hw_out(), g.ckk()) * static_cast<double>(g.n);
    rt.add_flops((need_x ? gemm : 0.0) + (need_w ? gemm : 0.0) + (need_b ? static_cast<double>(gy.numel()) : 0.0));
    if (rt.computing()) {
      detail::dispatch(gy.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy), X(x), W(w);
        std::optional<HostOut<T>> COL;
        if (cols.defined()) COL.emplace(cols);
        const std::int64_t big = g.c * g.h * g.w, small = g.o * g.hw_out();
        std::optional<HostOut<T>> GX, GW;
        if (need_x) GX.emplace(gx);
        if (need_w) GW.emplace(gw);
        for (std::int64_t s = 0; cols.defined() && s < g.n; ++s) {
          im2col(G.data() + s * big, g, COL->data());
          if (GX) {
            detail::gemm(false, false, g.o, g.hw_out(), g.ckk(), T{1}, W.data(), g.ckk(), COL->data(), g.hw_out(), T{0},
                         GX->data() + s * small, g.hw_out());
          }
          if (GW) {
            detail::gemm(false, true, g.o, g.ckk(), g.hw_out(), T{1}, X.data() + s * small, g.hw_out(), COL->data(),
                         g.hw_out(), s == 0 ? T{0} : T{1}, GW->data(), g.ckk());
          }
        }
        if (need_b) {
          HostOut<T> GB(gb);
          channel_sums(G.data(), g.n, g.c, g.h * g.w, GB);
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
  ConvGeom g_;
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

/// One output cell's input window along one axis: avg_pool2d's [o s - p, o s - p + k)
/// clipped to the input, and the divisor (count_include_pad counts the padding, not
/// what lies past it, as PyTorch's AvgPool2d kernel does).
struct Window {
  std::int64_t begin, end, divisor;
};
Window avg_window(std::int64_t o, std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad,
                  bool count_include_pad) {
  const std::int64_t start = o * stride - pad;
  const std::int64_t stop = std::min(start + k, in + pad);
  const std::int64_t begin = std::max<std::int64_t>(start, 0), end = std::min(stop, in);
  return {begin, end, count_include_pad ? stop - start : end - begin};
}
/// adaptive_avg_pool2d's bins: [floor(o in / out), ceil((o + 1) in / out)).
Window adaptive_window(std::int64_t o, std::int64_t in, std::int64_t out) {
  const std::int64_t begin = (o * in) / out;
  const std::int64_t end = ((o + 1) * in + out - 1) / out;
  return {begin, end, end - begin};
}

/// Average pooling of every plane through `window(axis, o)`: forward (scatter = false)
/// or the gradient spread back over each window (scatter = true).
template <class T, class WindowOf>
void avg_pool_planes(const T* in, T* out, std::int64_t planes, std::int64_t h, std::int64_t w, std::int64_t ho,
                     std::int64_t wo, WindowOf window, bool scatter) {
  if (scatter) std::fill(out, out + planes * h * w, T{0});
  for (std::int64_t p = 0; p < planes; ++p) {
    for (std::int64_t oh = 0; oh < ho; ++oh) {
      const Window r = window(0, oh);
      for (std::int64_t ow = 0; ow < wo; ++ow) {
        const Window c = window(1, ow);
        const T div = static_cast<T>(r.divisor * c.divisor);
        if (scatter) {
          const T g = in[(p * ho + oh) * wo + ow] / div;
          for (std::int64_t i = r.begin; i < r.end; ++i) {
            for (std::int64_t j = c.begin; j < c.end; ++j) out[(p * h + i) * w + j] += g;
          }
        } else {
          T acc{0};
          for (std::int64_t i = r.begin; i < r.end; ++i) {
            for (std::int64_t j = c.begin; j < c.end; ++j) acc += in[(p * h + i) * w + j];
          }
          out[(p * ho + oh) * wo + ow] = acc / div;
        }
      }
    }
  }
}

/// AvgPool2DBackward0 and AdaptiveAvgPool2DBackward0: both save self (the input), though
/// only its shape is read (derivatives.yaml: avg_pool2d_backward(grad, self, ...)).
class AvgPoolBackward final : public Node {
 public:
  AvgPoolBackward(std::int64_t kernel, std::int64_t stride, std::int64_t pad, bool count_include_pad, bool adaptive)
      : kernel_(kernel), stride_(stride), pad_(pad), count_include_pad_(count_include_pad), adaptive_(adaptive) {}
  SavedTensor self_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = self_.unpack();
    Tensor gx = empty(gy.runtime(), x.shape(), gy.dtype());
    gy.runtime().add_flops(static_cast<double>(gx.numel()));
    if (gy.runtime().computing()) {
      const std::int64_t h = x.size(2), w = x.size(3), ho = gy.size(2), wo = gy.size(3);
      const auto window = [&](int axis, std::int64_t o) {
        const std::int64_t in = axis == 0 ? h : w, out = axis == 0 ? ho : wo;
        return adaptive_ ? adaptive_window(o, in, out) : avg_window(o, in, kernel_, stride_, pad_, count_include_pad_);
      };
      detail::dispatch(gy.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy);
        HostOut<T> GX(gx);
        avg_pool_planes(G.data(), GX.data(), x.size(0) * x.size(1), h, w, ho, wo, window, true);
      });
    }
    return {gx};
  }
  void release_variables() noexcept override { self_.reset(); }
  std::string_view name() const noexcept override {
    return adaptive_ ? "AdaptiveAvgPool2DBackward0" : "AvgPool2DBackward0";
  }

 private:
  std::int64_t kernel_, stride_, pad_;
  bool count_include_pad_, adaptive_;
};

/// Forward of both average poolings: out [n, c, ho, wo], the node saving x.
template <class WindowOf, class MakeNode>
Tensor avg_pool_forward(const Tensor& x, std::int64_t ho, std::int64_t wo, WindowOf window, MakeNode make) {
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, Shape{x.size(0), x.size(1), ho, wo}, x.dtype());
  rt.add_flops(static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      avg_pool_planes(X.data(), Y.data(), x.size(0) * x.size(1), x.size(2), x.size(3), ho, wo, window, false);
    });
  }
  if (needs_grad({&x})) {
    auto node = make(x);
    node->self_.save(x);
    set_history(out, node);
  }
  return out;
}

}  // namespace

double conv2d_flops(const Shape& input, const Shape& weight, std::int64_t stride, std::int64_t padding,
                    std::int64_t dilation) noexcept {
  const std::int64_t ho = conv_out(input[2], weight[2], stride, padding, dilation);
  const std::int64_t wo = conv_out(input[3], weight[3], stride, padding, dilation);
  // weight[1] is the channels of one group: each output sees only its group's inputs.
  return linear_flops(weight[0], ho * wo, weight[1] * weight[2] * weight[3]) * static_cast<double>(input[0]);
}

namespace {

Tensor convolution(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, const ConvParams& p) {
  detail::OutputCache cache = detail::take_output_cache();  // a selective checkpoint's kept output
  const Tensor x = detail::autocast_half(x_in);
  const Tensor w = detail::autocast_half(w_in);
  const Tensor b = detail::autocast_half(b_in);
  const ConvGeom g = conv_geom(x.shape(), w.shape(), p);
  Runtime& rt = x.runtime();
  Tensor out = cache.output(0, [&] { return empty(rt, Shape{g.n, g.o, g.ho, g.wo}, x.dtype()); });
  rt.uses_cudnn();
  Tensor cols;
  if (!g.direct() && !cache.reused()) cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());  // workspace
  if (!cache.reused()) {
    rt.add_flops(linear_flops(g.o, g.hw_out(), g.group_ckk()) * static_cast<double>(g.n) +
                 (b.defined() ? static_cast<double>(out.numel()) : 0.0));
  }
  if (rt.computing() && !cache.reused()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(w), B(b);
      HostOut<T> Y(out);
      std::optional<HostOut<T>> COL;  // the columns live in the workspace block itself
      if (cols.defined()) COL.emplace(cols);
      const std::int64_t in_sz = g.c * g.h * g.w, out_sz = g.o * g.hw_out();
      const std::int64_t og = g.group_o(), gckk = g.group_ckk(), hw = g.hw_out();
      for (std::int64_t s = 0; s < g.n; ++s) {
        const T* src = X.data() + s * in_sz;
        if (!g.direct()) {
          im2col(src, g, COL->data());
          src = COL->data();
        }
        for (std::int64_t q = 0; q < g.groups; ++q) {
          detail::gemm(false, false, og, hw, gckk, T{1}, W.data() + q * og * gckk, gckk, src + q * gckk * hw, hw,
                       T{0}, Y.data() + s * out_sz + q * og * hw, hw);
        }
        if (b.defined()) add_channel_bias(Y.data() + s * out_sz, g.o, g.hw_out(), B);
      }
    });
  }
  cols = Tensor{};  // workspace back to the allocator before anything else happens
  if (needs_grad({&x, &w, &b})) {
    auto node = detail::make_node<ConvBackward>({&x, &w, &b}, p, b.defined());
    node->x_.save(x);
    node->w_.save(w);
    set_history(out, node);
  }
  return out;
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, std::int64_t stride, std::int64_t padding,
              std::int64_t dilation, std::int64_t groups) {
  return convolution(x, weight, bias, ConvParams{stride, padding, dilation, groups, false});
}

Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias, std::int64_t stride, std::int64_t padding,
              std::int64_t dilation, std::int64_t groups) {
  if (x.dim() != 3 || weight.dim() != 3) {
    throw Error("conv1d: input [N, C, L] and weight [O, C/groups, k] expected, got " + x.shape().str() + " and " +
                weight.shape().str());
  }
  const Tensor out = convolution(x.view(Shape{x.size(0), x.size(1), 1, x.size(2)}),
                                 weight.view(Shape{weight.size(0), weight.size(1), 1, weight.size(2)}), bias,
                                 ConvParams{stride, padding, dilation, groups, true});
  return out.view(Shape{out.size(0), out.size(1), out.size(3)});
}

Tensor conv_transpose2d(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, std::int64_t stride,
                        std::int64_t padding, std::int64_t output_padding, std::int64_t dilation) {
  const Tensor x = detail::autocast_half(x_in);
  const Tensor w = detail::autocast_half(w_in);
  const Tensor b = detail::autocast_half(b_in);
  if (x.dim() != 4 || w.dim() != 4 || x.size(1) != w.size(0)) {
    throw Error("conv_transpose2d: input " + x.shape().str() + " and weight " + w.shape().str() +
                " do not match (NCHW, C x O x k x k)");
  }
  if (output_padding < 0 || (output_padding >= stride && output_padding >= dilation)) {
    throw Error("conv_transpose2d: output_padding must be smaller than stride or dilation");
  }
  // PyTorch's output size: (in - 1) stride - 2 padding + dilation (k - 1) + output_padding + 1.
  const auto side = [&](std::int64_t in, std::int64_t k) {
    return (in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1;
  };
  const Shape out_shape{x.size(0), w.size(1), side(x.size(2), w.size(2)), side(x.size(3), w.size(3))};
  if (out_shape[2] <= 0 || out_shape[3] <= 0) throw Error("conv_transpose2d: the output would be empty");
  // The convolution this one inverts: from the output's shape (channels O) to the input's (C).
  const ConvGeom g = conv_geom(out_shape, w.shape(), ConvParams{stride, padding, dilation, 1, false});
  if (g.ho != x.size(2) || g.wo != x.size(3)) {
    throw Error("conv_transpose2d: output_padding " + std::to_string(output_padding) + " is not below the stride " +
                std::to_string(stride));
  }
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, out_shape, x.dtype());
  rt.uses_cudnn();
  // THNN's slow_conv_transpose2d (and the analogue here of conv2d's im2col columns): one
  // sample's columns [O k k, H_in W_in] as workspace while the op runs.
  Tensor cols = empty(rt, Shape{g.ckk(), g.hw_out()}, x.dtype());
  rt.add_flops(linear_flops(g.o, g.hw_out(), g.ckk()) * static_cast<double>(g.n) +
               (b.defined() ? static_cast<double>(out.numel()) : 0.0));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(w), B(b);
      HostOut<T> Y(out), COL(cols);
      const std::int64_t big = g.c * g.h * g.w, small = g.o * g.hw_out();
      for (std::int64_t s = 0; s < g.n; ++s) {
        detail::gemm(true, false, g.ckk(), g.hw_out(), g.o, T{1}, W.data(), g.ckk(), X.data() + s * small, g.hw_out(),
                     T{0}, COL.data(), g.hw_out());
        col2im(COL.data(), g, Y.data() + s * big);
        if (b.defined()) add_channel_bias(Y.data() + s * big, g.c, g.h * g.w, B);
      }
    });
  }
  cols = Tensor{};
  if (needs_grad({&x, &w, &b})) {
    auto node = detail::make_node<ConvTransposeBackward>({&x, &w, &b}, g, b.defined());
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

Tensor avg_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
                  bool count_include_pad) {
  if (x.dim() != 4) throw Error("avg_pool2d: NCHW input expected, got " + x.shape().str());
  if (kernel < 1 || stride < 1 || padding < 0 || 2 * padding > kernel) {
    throw Error("avg_pool2d: kernel and stride must be positive and padding at most half the kernel");
  }
  const std::int64_t ho = (x.size(2) + 2 * padding - kernel) / stride + 1;
  const std::int64_t wo = (x.size(3) + 2 * padding - kernel) / stride + 1;
  if (ho <= 0 || wo <= 0) throw Error("avg_pool2d: kernel larger than padded input " + x.shape().str());
  const std::int64_t h = x.size(2), w = x.size(3);
  return avg_pool_forward(
      x, ho, wo,
      [&](int axis, std::int64_t o) { return avg_window(o, axis == 0 ? h : w, kernel, stride, padding, count_include_pad); },
      [&](const Tensor& in) {
        return detail::make_node<AvgPoolBackward>({&in}, kernel, stride, padding, count_include_pad, false);
      });
}

Tensor adaptive_avg_pool2d(const Tensor& x, std::int64_t out_h, std::int64_t out_w) {
  if (x.dim() != 4) throw Error("adaptive_avg_pool2d: NCHW input expected, got " + x.shape().str());
  if (out_h < 1 || out_w < 1) throw Error("adaptive_avg_pool2d: output size must be positive");
  // ATen's adaptive_avg_pool2d computes a 1x1 output as mean over H and W (saving only
  // sizes); any other size goes to _adaptive_avg_pool2d, which saves self
  // (aten/src/ATen/native/AdaptiveAveragePooling.cpp; PyTorch 1.13 measured:
  // MeanBackward1 for 1x1, AdaptiveAvgPool2DBackward0 with _saved_self otherwise).
  if (out_h == 1 && out_w == 1) return adaptive_avg_pool2d(x);
  const std::int64_t h = x.size(2), w = x.size(3);
  return avg_pool_forward(
      x, out_h, out_w,
      [&](int axis, std::int64_t o) { return adaptive_window(o, axis == 0 ? h : w, axis == 0 ? out_h : out_w); },
      [](const Tensor& in) { return detail::make_node<AvgPoolBackward>({&in}, 0, 0, 0, false, true); });
}

Tensor adaptive_avg_pool2d(const Tensor& x) {
  if (x.dim() != 4) throw Error("adaptive_avg_pool2d: NCHW input expected, got " + x.shape().str());
  return detail::mean_trailing(x, Shape{x.size(0), x.size(1), 1, 1});
}

}  // namespace mem::nn
