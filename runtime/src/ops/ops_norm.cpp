// ops_norm.cpp — native_batch_norm and native_layer_norm with their saved
// statistics (f32 per channel / per row for 16-bit inputs, as CUDA's acc type).
#include <optional>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

DType acc_type(DType dtype) noexcept { return dtype == DType::F64 ? DType::F64 : DType::F32; }

/// NativeBatchNormBackward0: saves input, weight, save_mean, save_invstd (training)
/// or input, weight, running_mean, running_var (eval).
class BatchNormBackward final : public Node {
 public:
  explicit BatchNormBackward(bool training) : training_(training) {}
  SavedTensor x_, w_, mean_, invstd_;
  double eps_ = 1e-5;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack(), w = w_.unpack(), mean = mean_.unpack(), stat = invstd_.unpack();
    Runtime& rt = gy.runtime();
    const std::int64_t n = x.size(0), c = x.size(1), hw = x.numel() / (n * c);
    Tensor gx, gw, gb;
    if (needs_input_grad(0)) gx = empty(rt, x.shape(), x.dtype());
    if (needs_input_grad(1)) gw = empty(rt, Shape{c}, w.dtype());
    if (needs_input_grad(2)) gb = empty(rt, Shape{c}, w.dtype());
    rt.add_flops(8.0 * static_cast<double>(x.numel()));
    if (rt.computing()) {
      detail::dispatch(acc_type(x.dtype()), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy), X(x), W(w), M(mean), S(stat);
        const T count = static_cast<T>(n * hw);
        std::vector<T> sum_g(static_cast<std::size_t>(c), T{0}), sum_gx(static_cast<std::size_t>(c), T{0});
        std::vector<T> invstd(static_cast<std::size_t>(c));
        for (std::int64_t ch = 0; ch < c; ++ch) {
          invstd[ch] = training_ ? S[ch] : T{1} / std::sqrt(S[ch] + static_cast<T>(eps_));
        }
        for (std::int64_t s = 0; s < n; ++s) {
          for (std::int64_t ch = 0; ch < c; ++ch) {
            const std::int64_t base = (s * c + ch) * hw;
            for (std::int64_t i = 0; i < hw; ++i) {
              sum_g[ch] += G[base + i];
              sum_gx[ch] += G[base + i] * (X[base + i] - M[ch]) * invstd[ch];
            }
          }
        }
        if (gx.defined()) {
          HostOut<T> GX(gx);
          for (std::int64_t s = 0; s < n; ++s) {
            for (std::int64_t ch = 0; ch < c; ++ch) {
              const std::int64_t base = (s * c + ch) * hw;
              const T wv = w.defined() ? W[ch] : T{1};
              for (std::int64_t i = 0; i < hw; ++i) {
                const T xhat = (X[base + i] - M[ch]) * invstd[ch];
                GX[base + i] = training_
                                   ? wv * invstd[ch] / count * (count * G[base + i] - sum_g[ch] - xhat * sum_gx[ch])
                                   : G[base + i] * wv * invstd[ch];
              }
            }
          }
        }
        if (gw.defined()) {
          HostOut<T> GW(gw);
          for (std::int64_t ch = 0; ch < c; ++ch) GW[ch] = sum_gx[ch];
        }
        if (gb.defined()) {
          HostOut<T> GB(gb);
          for (std::int64_t ch = 0; ch < c; ++ch) GB[ch] = sum_g[ch];
        }
      });
    }
    return {gx, gw, gb};
  }
  void release_variables() noexcept override {
    x_.reset();
    w_.reset();
    mean_.reset();
    invstd_.reset();
  }
  std::string_view name() const noexcept override { return "NativeBatchNormBackward0"; }

 private:
  bool training_;
};

/// NativeLayerNormBackward0: saves input, weight, bias, mean, rstd.
class LayerNormBackward final : public Node {
 public:
  SavedTensor x_, w_, b_, mean_, rstd_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack(), w = w_.unpack(), mean = mean_.unpack(), rstd = rstd_.unpack();
    Runtime& rt = gy.runtime();
    const std::int64_t d = x.size(-1), m = x.numel() / d;
    Tensor gx, gw, gb;
    if (needs_input_grad(0)) gx = empty(rt, x.shape(), x.dtype());
    if (needs_input_grad(1)) gw = empty(rt, Shape{d}, w.dtype());
    if (needs_input_grad(2)) gb = empty(rt, Shape{d}, w.dtype());
    rt.add_flops(8.0 * static_cast<double>(x.numel()));
    if (rt.computing()) {
      detail::dispatch(acc_type(x.dtype()), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy), X(x), W(w), M(mean), R(rstd);
        std::vector<T> sgw(static_cast<std::size_t>(d), T{0}), sgb(static_cast<std::size_t>(d), T{0});
        std::optional<HostOut<T>> GX;
        if (gx.defined()) GX.emplace(gx);
        for (std::int64_t r = 0; r < m; ++r) {
          T a{0}, b{0};
          for (std::int64_t j = 0; j < d; ++j) {
            const T xhat = (X[r * d + j] - M[r]) * R[r];
            const T gh = G[r * d + j] * (w.defined() ? W[j] : T{1});
            a += gh;
            b += gh * xhat;
            sgw[j] += G[r * d + j] * xhat;
            sgb[j] += G[r * d + j];
          }
          if (GX) {
            for (std::int64_t j = 0; j < d; ++j) {
              const T xhat = (X[r * d + j] - M[r]) * R[r];
              const T gh = G[r * d + j] * (w.defined() ? W[j] : T{1});
              (*GX)[r * d + j] = R[r] * (gh - a / static_cast<T>(d) - xhat * b / static_cast<T>(d));
            }
          }
        }
        if (gw.defined()) {
          HostOut<T> GW(gw);
          for (std::int64_t j = 0; j < d; ++j) GW[j] = sgw[j];
        }
        if (gb.defined()) {
          HostOut<T> GB(gb);
          for (std::int64_t j = 0; j < d; ++j) GB[j] = sgb[j];
        }
      });
    }
    return {gx, gw, gb};
  }
  void release_variables() noexcept override {
    x_.reset();
    w_.reset();
    b_.reset();
    mean_.reset();
    rstd_.reset();
  }
  std::string_view name() const noexcept override { return "NativeLayerNormBackward0"; }
};

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, double momentum, double eps) {
  detail::OutputCache cache = detail::take_output_cache();  // a selective checkpoint's kept outputs
  if (x.dim() < 2) throw Error("batch_norm: input must be [N, C, ...], got " + x.shape().str());
  Runtime& rt = x.runtime();
  const std::int64_t n = x.size(0), c = x.size(1), hw = x.numel() / (n * c);
  Tensor out = cache.output(0, [&] { return empty(rt, x.shape(), x.dtype()); });
  // native_batch_norm's save_mean and save_invstd: its outputs 1 and 2.
  const auto stat = [&] { return training ? empty(rt, Shape{c}, acc_type(x.dtype())) : Tensor{}; };
  Tensor save_mean = cache.output(1, stat);
  Tensor save_invstd = cache.output(2, stat);
  if (!cache.reused()) rt.add_flops(5.0 * static_cast<double>(x.numel()));
  rt.uses_cudnn();  // cudnn_batch_norm (Normalization.cpp picks it on CUDA with cuDNN enabled)
  // A kept call is not run again: its running statistics move once.
  if (training && running_mean.defined() && recomputing() && !cache.reused()) {
    // Memory does not move (the statistics update in place), the model's state does: say so
    // wherever a step's warnings are shown (trace, sweep's JSON, plan and its --code).
    rt.warn("checkpointed modules contain BatchNorm layers in training mode: the recompute in backward "
            "updates their running statistics a second time each step, as PyTorch's torch.utils.checkpoint "
            "does (num_batches_tracked counts 2 a step, the running mean and variance take the momentum "
            "twice); the loss and gradients are unchanged, evaluation with those statistics is not");
  }
  if (rt.computing() && !cache.reused()) {
    detail::dispatch(acc_type(x.dtype()), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(weight), B(bias);
      HostOut<T> Y(out);
      std::vector<T> mean(static_cast<std::size_t>(c)), invstd(static_cast<std::size_t>(c));
      if (training) {
        const T count = static_cast<T>(n * hw);
        std::vector<T> var(static_cast<std::size_t>(c));
        for (std::int64_t ch = 0; ch < c; ++ch) {
          T s{0};
          for (std::int64_t b = 0; b < n; ++b) {
            for (std::int64_t i = 0; i < hw; ++i) s += X[(b * c + ch) * hw + i];
          }
          mean[ch] = s / count;
          T v{0};
          for (std::int64_t b = 0; b < n; ++b) {
            for (std::int64_t i = 0; i < hw; ++i) {
              const T dlt = X[(b * c + ch) * hw + i] - mean[ch];
              v += dlt * dlt;
            }
          }
          var[ch] = v / count;
          invstd[ch] = T{1} / std::sqrt(var[ch] + static_cast<T>(eps));
        }
        HostOut<T> SM(save_mean), SI(save_invstd);
        for (std::int64_t ch = 0; ch < c; ++ch) {
          SM[ch] = mean[ch];
          SI[ch] = invstd[ch];
        }
        // Running statistics move at every training-mode call, the recompute of a checkpointed
        // module's forward too: torch.utils.checkpoint reruns the forward as it is, and
        // F.batch_norm updates running_mean / running_var in place each time (so a checkpointed
        // BatchNorm takes the momentum twice per step, as on PyTorch).
        if (running_mean.defined()) {
          HostOut<T> RM(running_mean, true), RV(running_var, true);
          const T mom = static_cast<T>(momentum);
          for (std::int64_t ch = 0; ch < c; ++ch) {
            RM[ch] = (T{1} - mom) * RM[ch] + mom * mean[ch];
            const T unbiased = count > 1 ? var[ch] * count / (count - 1) : var[ch];
            RV[ch] = (T{1} - mom) * RV[ch] + mom * unbiased;
          }
        }
      } else {
        HostIn<T> RM(running_mean), RV(running_var);
        for (std::int64_t ch = 0; ch < c; ++ch) {
          mean[ch] = RM[ch];
          invstd[ch] = T{1} / std::sqrt(RV[ch] + static_cast<T>(eps));
        }
      }
      for (std::int64_t b = 0; b < n; ++b) {
        for (std::int64_t ch = 0; ch < c; ++ch) {
          const T wv = weight.defined() ? W[ch] : T{1};
          const T bv = bias.defined() ? B[ch] : T{0};
          for (std::int64_t i = 0; i < hw; ++i) {
            const std::int64_t k = (b * c + ch) * hw + i;
            Y[k] = (X[k] - mean[ch]) * invstd[ch] * wv + bv;
          }
        }
      }
    });
  }
  if (needs_grad({&x, &weight, &bias})) {
    auto node = detail::make_node<BatchNormBackward>({&x, &weight, &bias}, training);
    node->eps_ = eps;
    node->x_.save(x);
    node->w_.save(weight);
    node->mean_.save(training ? save_mean : running_mean);
    node->invstd_.save(training ? save_invstd : running_var);
    set_history(out, node);
  }
  return out;
}

Tensor layer_norm(const Tensor& x_in, const Tensor& weight, const Tensor& bias, double eps) {
  const Tensor x = detail::autocast_f32(x_in);
  Runtime& rt = x.runtime();
  const std::int64_t d = x.size(-1), m = x.numel() / d;
  Tensor out = empty(rt, x.shape(), x.dtype());
  Shape stat_shape = x.shape();
  stat_shape[stat_shape.size() - 1] = 1;
  Tensor mean = empty(rt, stat_shape, acc_type(x.dtype()));
  Tensor rstd = empty(rt, stat_shape, acc_type(x.dtype()));
  rt.add_flops(5.0 * static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(acc_type(x.dtype()), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(weight), B(bias);
      HostOut<T> Y(out), MU(mean), RS(rstd);
      for (std::int64_t r = 0; r < m; ++r) {
        T s{0};
        for (std::int64_t j = 0; j < d; ++j) s += X[r * d + j];
        const T mu = s / static_cast<T>(d);
        T v{0};
        for (std::int64_t j = 0; j < d; ++j) v += (X[r * d + j] - mu) * (X[r * d + j] - mu);
        const T rs = T{1} / std::sqrt(v / static_cast<T>(d) + static_cast<T>(eps));
        MU[r] = mu;
        RS[r] = rs;
        for (std::int64_t j = 0; j < d; ++j) {
          Y[r * d + j] = (X[r * d + j] - mu) * rs * (weight.defined() ? W[j] : T{1}) + (bias.defined() ? B[j] : T{0});
        }
      }
    });
  }
  if (needs_grad({&x, &weight, &bias})) {
    auto node = detail::make_node<LayerNormBackward>({&x, &weight, &bias});
    node->x_.save(x);
    node->w_.save(weight);
    node->b_.save(bias);
    node->mean_.save(mean);
    node->rstd_.save(rstd);
    set_history(out, node);
  }
  return out;
}

namespace {

/// NativeGroupNormBackward0: saves input, weight, mean and rstd (result1, result2).
class GroupNormBackward final : public Node {
 public:
  explicit GroupNormBackward(std::int64_t groups) : groups_(groups) {}
  SavedTensor x_, w_, mean_, rstd_;
  TensorList apply(TensorList& grads) override {
    const Tensor& gy = grads[0];
    const Tensor x = x_.unpack(), w = w_.unpack(), mean = mean_.unpack(), rstd = rstd_.unpack();
    Runtime& rt = gy.runtime();
    const std::int64_t n = x.size(0), c = x.size(1), hw = x.numel() / (n * c), cg = c / groups_;
    Tensor gx, gw, gb;
    if (needs_input_grad(0)) gx = empty(rt, x.shape(), x.dtype());
    if (needs_input_grad(1)) gw = empty(rt, Shape{c}, w.dtype());
    if (needs_input_grad(2)) gb = empty(rt, Shape{c}, w.dtype());
    // The CUDA kernel's accumulators (aten/src/ATen/native/cuda/group_norm_kernel.cu,
    // GroupNormBackwardKernelImplInternal): ds and db [N, C], and for dX c1 [N, C] and c2,
    // c3 [N, G], all in the accumulator type, freed when it returns.
    const DType acc = acc_type(x.dtype());
    Tensor ds = empty(rt, Shape{n, c}, acc), db = empty(rt, Shape{n, c}, acc);
    Tensor c1, c2, c3;
    if (gx.defined()) {
      c1 = empty(rt, Shape{n, c}, acc);
      c2 = empty(rt, Shape{n, groups_}, acc);
      c3 = empty(rt, Shape{n, groups_}, acc);
    }
    rt.add_flops(8.0 * static_cast<double>(x.numel()));
    if (rt.computing()) {
      detail::dispatch(acc, [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(gy), X(x), W(w), M(mean), R(rstd);
        std::vector<T> sgw(static_cast<std::size_t>(c), T{0}), sgb(static_cast<std::size_t>(c), T{0});
        std::optional<HostOut<T>> GX;
        if (gx.defined()) GX.emplace(gx);
        for (std::int64_t i = 0; i < n; ++i) {
          for (std::int64_t q = 0; q < groups_; ++q) {
            const std::int64_t first = (i * c + q * cg) * hw, count = cg * hw, stat = i * groups_ + q;
            T a{0}, b{0};
            for (std::int64_t e = 0; e < count; ++e) {
              const std::int64_t ch = q * cg + e / hw;
              const T xhat = (X[first + e] - M[stat]) * R[stat];
              const T gh = G[first + e] * (w.defined() ? W[ch] : T{1});
              a += gh;
              b += gh * xhat;
              sgw[static_cast<std::size_t>(ch)] += G[first + e] * xhat;
              sgb[static_cast<std::size_t>(ch)] += G[first + e];
            }
            if (!GX) continue;
            for (std::int64_t e = 0; e < count; ++e) {
              const std::int64_t ch = q * cg + e / hw;
              const T xhat = (X[first + e] - M[stat]) * R[stat];
              const T gh = G[first + e] * (w.defined() ? W[ch] : T{1});
              (*GX)[first + e] = R[stat] * (gh - a / static_cast<T>(count) - xhat * b / static_cast<T>(count));
            }
          }
        }
        if (gw.defined()) {
          HostOut<T> GW(gw);
          for (std::int64_t j = 0; j < c; ++j) GW[j] = sgw[static_cast<std::size_t>(j)];
        }
        if (gb.defined()) {
          HostOut<T> GB(gb);
          for (std::int64_t j = 0; j < c; ++j) GB[j] = sgb[static_cast<std::size_t>(j)];
        }
      });
    }
    return {gx, gw, gb};
  }
  void release_variables() noexcept override {
    x_.reset();
    w_.reset();
    mean_.reset();
    rstd_.reset();
  }
  std::string_view name() const noexcept override { return "NativeGroupNormBackward0"; }

 private:
  std::int64_t groups_;
};

}  // namespace

Tensor group_norm(const Tensor& x_in, const Tensor& weight, const Tensor& bias, std::int64_t groups, double eps) {
  // Autocast runs group_norm in f32 (its fp32 list), as layer_norm.
  const Tensor x = detail::autocast_f32(x_in);
  if (x.dim() < 2 || groups < 1 || x.size(1) % groups != 0) {
    throw Error("group_norm: input " + x.shape().str() + " cannot be split into " + std::to_string(groups) +
                " groups of channels");
  }
  Runtime& rt = x.runtime();
  const std::int64_t n = x.size(0), c = x.size(1), hw = x.numel() / (n * c), cg = c / groups;
  Tensor out = empty(rt, x.shape(), x.dtype());
  // native_group_norm (aten/src/ATen/native/group_norm.cpp): mean and rstd [N, G] in the
  // parameters' type when input and parameters differ (a half input, f32 weights), else in
  // the input's type.
  const DType stat_dtype = weight.defined() && weight.dtype() != x.dtype() ? acc_type(x.dtype()) : x.dtype();
  Tensor mean = empty(rt, Shape{n, groups}, stat_dtype), rstd = empty(rt, Shape{n, groups}, stat_dtype);
  rt.add_flops(5.0 * static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(acc_type(x.dtype()), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x), W(weight), B(bias);
      HostOut<T> Y(out), MU(mean), RS(rstd);
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t q = 0; q < groups; ++q) {
          const std::int64_t first = (i * c + q * cg) * hw, count = cg * hw;
          T sum{0};
          for (std::int64_t e = 0; e < count; ++e) sum += X[first + e];
          const T mu = sum / static_cast<T>(count);
          T var{0};
          for (std::int64_t e = 0; e < count; ++e) var += (X[first + e] - mu) * (X[first + e] - mu);
          const T rs = T{1} / std::sqrt(var / static_cast<T>(count) + static_cast<T>(eps));
          MU[i * groups + q] = mu;
          RS[i * groups + q] = rs;
          for (std::int64_t e = 0; e < count; ++e) {
            const std::int64_t ch = q * cg + e / hw;
            Y[first + e] = (X[first + e] - mu) * rs * (weight.defined() ? W[ch] : T{1}) + (bias.defined() ? B[ch] : T{0});
          }
        }
      }
    });
  }
  if (needs_grad({&x, &weight, &bias})) {
    auto node = detail::make_node<GroupNormBackward>({&x, &weight, &bias}, groups);
    node->x_.save(x);
    node->w_.save(weight);
    node->mean_.save(mean);
    node->rstd_.save(rstd);
    set_history(out, node);
  }
  return out;
}

}  // namespace mem::nn
