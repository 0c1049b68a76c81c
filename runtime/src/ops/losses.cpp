// losses.cpp — mse_loss, cross_entropy (log_softmax + nll_loss) and
// binary_cross_entropy_with_logits, mean reduction.
#include "vramscope/runtime/losses.hpp"

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

}  // namespace mem::nn
