// losses.cpp — mse_loss, cross_entropy (log_softmax + nll_loss) and
// binary_cross_entropy_with_logits, mean reduction.
#include "vramscope/runtime/losses.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

/// MseLossBackward0: saves input and target (derivatives.yaml: mse_loss_backward(grad, self,
/// target, reduction)); its gradient is one input-sized block (zeros_like(input) filled by
/// one TensorIterator kernel, no temporaries: Loss.cpp mse_loss_backward_out).
class MseLossBackward final : public Node {
 public:
  SavedTensor input_, target_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor x = input_.unpack(), t = target_.unpack();
    Tensor gx = empty(g.runtime(), x.shape(), x.dtype());
    g.runtime().add_flops(3.0 * static_cast<double>(x.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(x.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g), X(x), Y(t);
        HostOut<T> GX(gx);
        const T scale = T{2} * G[0] / static_cast<T>(x.numel());
        for (std::int64_t i = 0, n_ = x.numel(); i < n_; ++i) GX[i] = scale * (X[i] - Y[i]);
      });
    }
    return {gx, Tensor{}};
  }
  void release_variables() noexcept override {
    input_.reset();
    target_.reset();
  }
  std::string_view name() const noexcept override { return "MseLossBackward0"; }
};

/// NllLossBackward0: saves self (the log-probabilities), target and total_weight.
class NllLossBackward final : public Node {
 public:
  SavedTensor self_, target_, total_weight_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor self = self_.unpack(), target = target_.unpack(), total = total_weight_.unpack();
    Tensor gx = empty(g.runtime(), self.shape(), self.dtype());
    g.runtime().add_flops(static_cast<double>(target.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(self.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g), W(total);
        HostIn<double> I(target);
        HostOut<T> GX(gx);
        const std::int64_t c = self.size(-1);
        for (std::int64_t i = 0, n_ = gx.numel(); i < n_; ++i) GX[i] = T{0};
        for (std::int64_t r = 0, n_ = target.numel(); r < n_; ++r) {
          GX[r * c + static_cast<std::int64_t>(I[r])] = -G[0] / W[0];
        }
      });
    }
    return {gx, Tensor{}};
  }
  void release_variables() noexcept override {
    self_.reset();
    target_.reset();
    total_weight_.reset();
  }
  std::string_view name() const noexcept override { return "NllLossBackward0"; }
};

/// BinaryCrossEntropyWithLogitsBackward0: saves self and target (derivatives.yaml). Its
/// gradient, without weights, as FunctionsManual.cpp computes it under no_grad:
/// input.sigmoid().sub_(target), then .mul_(grad) and .div_(numel) in place: one block.
class BceWithLogitsBackward final : public Node {
 public:
  SavedTensor input_, target_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor x = input_.unpack(), t = target_.unpack();
    Tensor gx = empty(g.runtime(), x.shape(), x.dtype());
    g.runtime().add_flops(6.0 * static_cast<double>(x.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(x.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g), X(x), Y(t);
        HostOut<T> GX(gx);
        const T scale = G[0] / static_cast<T>(x.numel());
        for (std::int64_t i = 0, n_ = x.numel(); i < n_; ++i) {
          GX[i] = scale * (T{1} / (T{1} + std::exp(-X[i])) - Y[i]);
        }
      });
    }
    return {gx, Tensor{}};
  }
  void release_variables() noexcept override {
    input_.reset();
    target_.reset();
  }
  std::string_view name() const noexcept override { return "BinaryCrossEntropyWithLogitsBackward0"; }
};


/// One chunk of the fused linear cross entropy in compute mode: the rows' logits, their loss
/// (summed, returned) and the mean's gradients written into grad_input's rows and added into
/// grad_weight, as the Triton kernel and the matmuls after it do.
double fused_chunk(const Tensor& input, const Tensor& weight, const Tensor& target, std::int64_t start,
                   std::int64_t rows, std::int64_t bt, const Tensor& grad_input, const Tensor& grad_weight) {
  const std::int64_t h = input.size(1), v = weight.size(0);
  HostIn<double> X(input), W(weight), Y(target);
  double loss = 0;
  std::vector<double> logits(static_cast<std::size_t>(v)), gx(static_cast<std::size_t>(rows * h), 0.0);
  std::vector<double> gw(grad_weight.defined() ? static_cast<std::size_t>(v * h) : 0);
  for (std::int64_t r = start; r < start + rows; ++r) {
    double top = -std::numeric_limits<double>::infinity();
    for (std::int64_t c = 0; c < v; ++c) {
      double acc = 0;
      for (std::int64_t k = 0; k < h; ++k) acc += X[r * h + k] * W[c * h + k];
      logits[static_cast<std::size_t>(c)] = acc;
      top = std::max(top, acc);
    }
    double total = 0;
    for (const double z : logits) total += std::exp(z - top);
    const auto cls = static_cast<std::int64_t>(Y[r]);
    if (cls < 0 || cls >= v) throw Error("fused_linear_cross_entropy: target class out of range");
    loss += top + std::log(total) - logits[static_cast<std::size_t>(cls)];
    for (std::int64_t c = 0; c < v; ++c) {
      const double g = (std::exp(logits[static_cast<std::size_t>(c)] - top) / total - (c == cls ? 1.0 : 0.0)) /
                       static_cast<double>(bt);
      for (std::int64_t k = 0; k < h; ++k) {
        gx[static_cast<std::size_t>((r - start) * h + k)] += g * W[c * h + k];
        if (!gw.empty()) gw[static_cast<std::size_t>(c * h + k)] += g * X[r * h + k];
      }
    }
  }
  detail::dispatch(grad_input.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostOut<T> GX(grad_input, true);
    for (std::int64_t i = 0; i < rows * h; ++i) GX[start * h + i] = static_cast<T>(gx[static_cast<std::size_t>(i)]);
  });
  if (!gw.empty()) {
    detail::dispatch(grad_weight.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostOut<T> GW(grad_weight, true);
      // zeros_like at the first chunk, then addmm into it
      for (std::int64_t i = 0; i < v * h; ++i) {
        GW[i] = static_cast<T>((start == 0 ? 0.0 : static_cast<double>(GW[i])) + gw[static_cast<std::size_t>(i)]);
      }
    });
  }
  return loss;
}

/// LigerFusedLinearCrossEntropyFunction's backward (liger-kernel ops/fused_linear_cross_entropy.py,
/// reduction mean): the gradients were computed in the forward and saved; backward compares
/// grad_output with torch.tensor(1.0) (a scalar on the device) and scales them in place when
/// it differs (element_mul_kernel), allocating nothing else.
class FusedLinearCrossEntropyBackward final : public Node {
 public:
  SavedTensor grad_input_, grad_weight_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    Runtime& rt = g.runtime();
    { const Tensor one = empty(rt, Shape{}, DType::F32); }  // torch.equal(grad_output, torch.tensor(1.0))
    Tensor gi = grad_input_.unpack(), gw = grad_weight_.unpack();
    if (rt.computing()) {
      const double scale = HostIn<double>(g)[0];
      if (scale != 1.0) {
        for (Tensor* t : {&gi, &gw}) {
          if (!t->defined()) continue;
          detail::dispatch(t->dtype(), [&](auto tag) {
            using T = decltype(tag);
            HostOut<T> X(*t, true);
            for (std::int64_t i = 0, n_ = t->numel(); i < n_; ++i) X[i] = static_cast<T>(X[i] * scale);
          });
        }
      }
    }
    return {gi, gw, Tensor{}};
  }
  void release_variables() noexcept override {
    grad_input_.reset();
    grad_weight_.reset();
  }
  std::string_view name() const noexcept override { return "LigerFusedLinearCrossEntropyFunctionBackward"; }
};

}  // namespace

Tensor bce_with_logits(const Tensor& input_in, const Tensor& target_in) {
  // Autocast runs it in f32 (its fp32 list), as mse_loss.
  const Tensor input = detail::autocast_f32(input_in);
  const Tensor target = detail::autocast_f32(target_in);
  if (!(input.shape() == target.shape())) {
    throw Error("binary_cross_entropy_with_logits: input " + input.shape().str() + " and target " +
                target.shape().str() + " differ");
  }
  Runtime& rt = input.runtime();
  // aten/src/ATen/native/Loss.cpp: log_sigmoid_input = at::log_sigmoid(input) (one block; the
  // CUDA buffer is empty), loss = (1 - target).mul_(input).sub_(log_sigmoid_input) (one more),
  // then apply_loss_reduction's mean into the scalar; both temporaries die on return.
  Tensor out = empty(rt, Shape{}, input.dtype());
  {
    Tensor log_sigmoid = empty(rt, input.shape(), input.dtype());
    Tensor loss = empty(rt, input.shape(), input.dtype());
    rt.add_flops(6.0 * static_cast<double>(input.numel()));
    if (rt.computing()) {
      detail::dispatch(input.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> X(input), Y(target);
        HostOut<T> L(out);
        T acc{0};
        for (std::int64_t i = 0, n_ = input.numel(); i < n_; ++i) {
          const T x = X[i];
          // -log_sigmoid(x) = log(1 + exp(-x)), stably: max(-x, 0) + log1p(exp(-|x|)).
          const T softplus = std::max(-x, T{0}) + std::log1p(std::exp(-std::abs(x)));
          acc += (T{1} - Y[i]) * x + softplus;
        }
        L[0] = acc / static_cast<T>(input.numel());
      });
    }
  }
  if (needs_grad({&input})) {
    auto node = detail::make_node<BceWithLogitsBackward>({&input, &target});
    node->input_.save(input);
    node->target_.save(target);
    set_history(out, node);
  }
  return out;
}

Tensor mse_loss(const Tensor& input_in, const Tensor& target_in) {
  const Tensor input = detail::autocast_f32(input_in);
  const Tensor target = detail::autocast_f32(target_in);
  if (!(input.shape() == target.shape())) {
    throw Error("mse_loss: input " + input.shape().str() + " and target " + target.shape().str() + " differ");
  }
  Runtime& rt = input.runtime();
  // As PyTorch allocates it (aten/src/ATen/native/Loss.cpp, structured mse_loss since
  // PR #67489): the meta function sets an output of the input's full shape and then
  // resize_({})s it, which never shrinks the storage, so the 0-dim loss owns an input-sized
  // block for as long as it lives (pytorch/pytorch#185647, open as of 2.9, CPU and CUDA);
  // the kernel writes (input - target)^2 into an input-sized temporary, and mean_out
  // reduces it into the loss. Peak of the op: two input-sized blocks.
  Tensor full = empty(rt, input.shape(), input.dtype());
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = full.storage();
  impl->dtype = input.dtype();  // shape {}, strides {}: element 0 of the full-size block
  Tensor out(std::move(impl));
  full = Tensor{};
  rt.add_flops(3.0 * static_cast<double>(input.numel()));
  {
    Tensor squared = empty(rt, input.shape(), input.dtype());  // freed when the op returns
    if (rt.computing()) {
      detail::dispatch(input.dtype(), [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> X(input), Y(target);
        HostOut<T> L(out);
        T acc{0};
        for (std::int64_t i = 0, n_ = input.numel(); i < n_; ++i) acc += (X[i] - Y[i]) * (X[i] - Y[i]);
        L[0] = acc / static_cast<T>(input.numel());
      });
    }
  }
  if (needs_grad({&input, &target})) {
    auto node = detail::make_node<MseLossBackward>({&input, &target});
    node->input_.save(input);
    node->target_.save(target);
    set_history(out, node);
  }
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target) {
  if (target.dtype() != DType::I64 || target.numel() * logits.size(-1) != logits.numel()) {
    throw Error("cross_entropy: i64 targets of shape input.shape[:-1] expected, got " + target.shape().str() +
                " for logits " + logits.shape().str());
  }
  const Tensor lp = log_softmax(logits);
  Runtime& rt = lp.runtime();
  Tensor out = empty(rt, Shape{}, lp.dtype());
  Tensor total_weight = empty(rt, Shape{}, lp.dtype());
  rt.add_flops(static_cast<double>(target.numel()));
  if (rt.computing()) {
    detail::dispatch(lp.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> P(lp);
      HostIn<double> I(target);
      HostOut<T> L(out), W(total_weight);
      const std::int64_t c = lp.size(-1);
      T acc{0};
      for (std::int64_t r = 0, n_ = target.numel(); r < n_; ++r) {
        const auto cls = static_cast<std::int64_t>(I[r]);
        if (cls < 0 || cls >= c) throw Error("cross_entropy: target class out of range");
        acc -= P[r * c + cls];
      }
      W[0] = static_cast<T>(target.numel());
      L[0] = acc / W[0];
    });
  }
  if (needs_grad({&lp})) {
    auto node = detail::make_node<NllLossBackward>({&lp, &target});
    node->self_.save(lp);
    node->target_.save(target);
    node->total_weight_.save(total_weight);
    set_history(out, node);
  }
  return out;
}

Tensor fused_linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& target) {
  if (input.dim() != 2 || weight.dim() != 2 || input.size(1) != weight.size(1) || target.dtype() != DType::I64 ||
      target.numel() != input.size(0)) {
    throw Error("fused_linear_cross_entropy: input [BT, H], weight [V, H] and i64 target [BT] expected, got " +
                input.shape().str() + ", " + weight.shape().str() + " and " + target.shape().str());
  }
  Runtime& rt = input.runtime();
  const std::int64_t bt = input.size(0), h = input.size(1), v = weight.size(0);
  const std::optional<DType> half = rt.autocast();
  if (!half && input.dtype() != weight.dtype()) {
    throw Error("fused_linear_cross_entropy: input " + std::string(dtype_name(input.dtype())) + " and weight " +
                std::string(dtype_name(weight.dtype())) + " differ outside autocast");
  }
  const bool input_grad = input.requires_grad(), weight_grad = input_grad && weight.requires_grad();
  // fused_linear_cross_entropy_forward (liger-kernel ops/fused_linear_cross_entropy.py):
  // inc_factor = cdiv(V, H); chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT): the
  // chunk's logits take about BT x H elements, whatever the vocabulary.
  const std::int64_t inc = (v + h - 1) / h;
  std::int64_t chunk = 1;
  while (chunk < (bt + inc - 1) / inc) chunk *= 2;
  chunk = std::min(chunk, bt);
  // grad_input = zeros_like(_input); grad_weight = zeros_like(weight) when it requires grad;
  // loss_1d = zeros(BT, f32); target_mask = target != ignore_index, its .sum().item().
  Tensor grad_input = empty(rt, input.shape(), input.dtype());
  Tensor grad_weight = weight_grad ? empty(rt, weight.shape(), weight.dtype()) : Tensor{};
  Tensor loss_1d = empty(rt, Shape{bt}, DType::F32);
  const Tensor target_mask = empty(rt, Shape{bt}, DType::Bool);
  { const Tensor count = empty(rt, Shape{}, DType::I64); }
  // _can_use_mm_out: the forward runs without grad mode, so unless autocast changes the dtype the
  // chunks' logits go into one (chunk, V) buffer and grad_input's slices are written by mm(out=).
  const DType logits_dtype = half ? *half : input.dtype();
  const bool mm_out = input.dtype() == weight.dtype() && (!half || input.dtype() == *half);
  Tensor logits_storage = mm_out ? empty(rt, Shape{chunk, v}, logits_dtype) : Tensor{};
  // Under autocast the weight's half copy is the region's cached cast (a parameter): made here
  // if no op of the region made it before, then held by the cache.
  if (half) (void)detail::autocast_half(weight);
  const int sm = rt.allocator().device().info().compute_capability;  // 0: unknown, taken as Ampere or newer
  const bool addmm_in_place = sm == 0 || sm >= 80;
  double loss_sum = 0;
  for (std::int64_t start = 0; start < bt; start += chunk) {
    const std::int64_t rows = std::min(chunk, bt - start);
    Tensor logits = logits_storage;
    if (!mm_out) {
      // autocast's cast of _input_chunk for the matmul, when it is not the half type already
      const Tensor cast = input.dtype() != logits_dtype ? empty(rt, Shape{rows, h}, logits_dtype) : Tensor{};
      logits = empty(rt, Shape{rows, v}, logits_dtype);
    }
    rt.add_flops(2.0 * static_cast<double>(rows * h) * static_cast<double>(v) + 5.0 * static_cast<double>(rows * v));
    if (input_grad) {
      // grad_input[start:end] = grad_logits_chunk @ weight: written in place by mm(out=), or
      // under autocast a (rows, H) half result copied into the slice.
      if (!mm_out) { const Tensor result = empty(rt, Shape{rows, h}, logits_dtype); }
      rt.add_flops(2.0 * static_cast<double>(rows * v) * static_cast<double>(h));
    }
    if (weight_grad) {
      rt.add_flops(2.0 * static_cast<double>(rows * v) * static_cast<double>(h));
      if (half && weight.dtype() == DType::F32 && addmm_in_place) {
        // addmm(grad_weight, grad_logits.t(), input_chunk.to(half), out_dtype=float32, out=grad_weight)
        if (input.dtype() != *half) { const Tensor cast = empty(rt, Shape{rows, h}, *half); }
      } else if (is_half(weight.dtype()) && logits_dtype == weight.dtype() && addmm_in_place) {
        // addmm(grad_weight, grad_logits.t(), input_chunk, out=grad_weight): in place
      } else {
        // grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float(): the product, and
        // its f32 copy when it is not f32 already, both (V, H).
        const Tensor product = empty(rt, Shape{v, h}, logits_dtype);
        if (logits_dtype != DType::F32) const Tensor f32 = empty(rt, Shape{v, h}, DType::F32);
      }
    }
    if (rt.computing()) loss_sum += fused_chunk(input, weight, target, start, rows, bt, grad_input, grad_weight);
    logits = Tensor{};  // del logits_chunk (the chunk's own buffer under autocast)
  }
  logits_storage = Tensor{};  // del logits_storage
  // loss = torch.sum(loss_1d); loss_1d and target_mask go when the function returns.
  Tensor out = empty(rt, Shape{}, DType::F32);
  if (rt.computing()) {
    HostOut<float> L(out);
    L[0] = static_cast<float>(loss_sum / static_cast<double>(bt));
  }
  loss_1d = Tensor{};
  if (input_grad) {
    auto node = detail::make_node<FusedLinearCrossEntropyBackward>({&input, &weight, &target});
    node->grad_input_.save(grad_input);
    node->grad_weight_.save(grad_weight);
    set_history(out, node);
  }
  return out;
}

}  // namespace mem::nn
