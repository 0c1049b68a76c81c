// hook_node.hpp — an identity node that runs a function when the gradient passes through it
// (internal): what FSDP's RegisterPreBackwardFunction / RegisterPostBackwardFunction and
// DeepSpeed's PreBackwardFunctionForModule / PostBackwardFunctionModule put on a module's
// outputs and inputs, so that a hook runs as backward reaches the module and leaves it.
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include "engine/detail.hpp"

namespace mem::nn::detail {

class HookNode final : public Node {
 public:
  HookNode(std::function<void()> fn, const char* name) : fn_(std::move(fn)), name_(name) {}
  TensorList apply(TensorList& grads) override {
    fn_();
    return {std::move(grads[0])};
  }
  std::string_view name() const noexcept override { return name_; }

 private:
  std::function<void()> fn_;
  const char* name_;
};

/// `t` through a HookNode named `name`: the same storage, a new autograd identity whose
/// gradient runs `fn` on its way back to `t`.
inline Tensor with_backward_hook(const Tensor& t, std::function<void()> fn, const char* name) {
  auto node = std::make_shared<HookNode>(std::move(fn), name);
  node->add_input(t);
  auto impl = std::make_shared<TensorImpl>(*t.impl());
  impl->grad.reset();
  impl->grad_accumulator.reset();
  Tensor out(std::move(impl));
  set_history(out, node);
  return out;
}

}  // namespace mem::nn::detail
