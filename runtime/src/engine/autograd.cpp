// autograd.cpp — graph nodes, saved tensors, grad mode and AccumulateGrad.
#include "vramscope/runtime/autograd.hpp"

#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/checkpoint_frame.hpp"
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

thread_local bool tls_grad_enabled = true;
thread_local ContextId tls_backward_context = kNoContext;
thread_local std::uint64_t tls_sequence_nr = 0;
thread_local const SavedTensorsObserver::Fn* tls_saved_observer = nullptr;
thread_local bool tls_save_on_cpu = false;  ///< a SaveOnCpu is alive on this thread

/// AccumulateGrad: the sink of a leaf's gradient. Keeps the leaf alive, as
/// PyTorch's does; the leaf only holds a weak reference back.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<detail::TensorImpl> variable) : variable_(std::move(variable)) {
    // Runs as soon as it is ready, like PyTorch's UINT64_MAX sequence number.
    set_sequence_nr(std::numeric_limits<std::uint64_t>::max());
    set_backward_context(variable_->grad_context);
  }

  TensorList apply(TensorList& grads) override {
    if (!grads[0].defined()) return {};
    const auto& hook = Tensor(variable_).runtime().grad_ready_hook();
    // With post hooks PyTorch's engine keeps its own reference to the incoming gradient until
    // they have run (call_function's inputs_copy), which AccumulateGrad discounts when it
    // decides to steal (accumulate_grad.cpp: num_expected_refs = 1 + !post_hooks().empty()):
    // stolen or not, the incoming gradient lives through the hooks.
    Tensor incoming = std::move(grads[0]);
    accumulate(incoming);
    if (const auto& post = Tensor(variable_).runtime().post_accumulate_grad_hook()) {
      incoming = Tensor{};  // a tensor hook: the engine keeps no copy of its input
      post(*variable_);
    }
    if (hook) hook(*variable_);
    return {};
  }
  std::string_view name() const noexcept override { return "AccumulateGrad"; }

 private:
  /// `incoming` is held here alone while AccumulateGrad decides, then handed back.
  void accumulate(Tensor& incoming) {
    Tensor new_grad = std::move(incoming);
    struct GiveBack {
      Tensor& to;
      Tensor& from;
      ~GiveBack() { to = std::move(from); }
    } give_back{incoming, new_grad};
    Tensor variable(variable_);
    if (!variable_->grad) {
      // Steal the gradient when nothing else references it and its layout matches
      // the parameter's (accumulateGrad's use_count / layout-contract test), in the dtype the
      // gradient is kept in (grad_dtype: a cast copy otherwise).
      const DType kept = variable_->grad_dtype.value_or(variable.dtype());
      if (new_grad.use_count() == 1 && new_grad.is_contiguous() && new_grad.dtype() == kept &&
          (new_grad.shape() == variable.shape() || variable_->redistributed_grad)) {
        variable_->grad = new_grad.detach().impl_ptr();
      } else {
        // A redistributed gradient keeps the shape it arrives in (the whole embedding table).
        Tensor copy = empty(variable.runtime(), variable_->redistributed_grad ? new_grad.shape() : variable.shape(), kept);
        detail::copy_raw(copy, new_grad);
        variable_->grad = copy.impl_ptr();
      }
      // Allocated by the consumer's backward (or copied here); from now on it is this
      // parameter's .grad, and snapshots say so.
      Tensor grad(variable_->grad);
      if (variable_->grad_label != 0 && grad.offset() == 0 && grad.storage()) {
        (void)variable.runtime().allocator().relabel(grad.storage()->data(), variable_->grad_label);
      }
    } else {
      // variable.grad += new_grad, in place: no allocation (bumps the grad's version).
      Tensor grad(variable_->grad);
      grad.bump_version();
      if (grad.runtime().computing()) {
        void* base = grad.storage()->data();
        const std::vector<double> add = to_values(new_grad);
        detail::for_each_offset(grad.shape(), grad.strides(), grad.offset(), [&](std::int64_t i, std::int64_t off) {
          detail::store(base, grad.dtype(), off, detail::load(base, grad.dtype(), off) + add[static_cast<std::size_t>(i)]);
        });
      }
      grad.runtime().add_flops(static_cast<double>(grad.numel()));
    }
  }

  std::shared_ptr<detail::TensorImpl> variable_;
};

}  // namespace

Node::Node() noexcept : sequence_nr_(tls_sequence_nr++), backward_context_(tls_backward_context) {}

Node::~Node() {
  // Each node owns the next ones through its edges, so dropping the head of a deep graph
  // (a 200,000-module mlp) would destroy the chain recursively and overflow the stack.
  // Like PyTorch's deleteNode (torch/csrc/autograd/function.cpp), take the edges that are
  // the last owners of their node onto a heap stack and release them one at a time, each
  // with its own edges already taken.
  std::vector<std::shared_ptr<Node>> last_owners;
  const auto take = [&](std::vector<Edge>& edges) {
    for (Edge& e : edges) {
      if (e.fn && e.fn.use_count() == 1) last_owners.push_back(std::move(e.fn));
    }
  };
  take(next_edges_);
  while (!last_owners.empty()) {
    std::shared_ptr<Node> node = std::move(last_owners.back());
    last_owners.pop_back();
    take(node->next_edges_);
  }  // `node` is destroyed at the end of each iteration, with no owned edges left to recurse into
}

void Node::add_input(const Tensor& input) {
  if (!input.defined() || !input.requires_grad()) {
    next_edges_.push_back(Edge{});
  } else if (input.grad_fn()) {
    next_edges_.push_back(Edge{input.grad_fn(), input.output_nr()});
  } else {
    next_edges_.push_back(Edge{grad_accumulator(input), 0});
  }
}

AutogradError::AutogradError(const std::string& message)
    : Error(message), phase_(current_phase()), context_(current_context()) {}

std::string InplaceModifiedError::torch_type(DType dtype) {
  const char* name = "Float";
  switch (dtype) {
    case DType::F32: name = "Float"; break;
    case DType::F64: name = "Double"; break;
    case DType::F16: name = "Half"; break;
    case DType::BF16: name = "BFloat16"; break;
    case DType::I64: name = "Long"; break;
    case DType::U8: name = "Byte"; break;
    case DType::Bool: name = "Bool"; break;
    case DType::I32: name = "Int"; break;
  }
  return std::string("torch.cuda.") + name + "Tensor";
}

std::string InplaceModifiedError::pytorch_message(const Details& d) {
  std::string m = "one of the variables needed for gradient computation has been modified by an inplace "
                  "operation: [" + torch_type(d.dtype) + " " + d.shape.str() + "]";
  if (!d.grad_fn.empty()) m += ", which is output " + std::to_string(d.output_nr) + " of " + d.grad_fn + ",";
  m += " is at version " + std::to_string(d.version) + "; expected version " + std::to_string(d.expected) +
       " instead.";
  return m;
}

namespace {
std::string inplace_message(const InplaceModifiedError::Details& d) {
  std::string m = InplaceModifiedError::pytorch_message(d);
  if (d.checkpoint_input) {
    m += " Hint: a checkpointed segment modified its own input, which the checkpoint saved (the segment "
         "begins with an in-place op such as ReLU(inplace=True)); choose a segment count at which no "
         "checkpointed segment begins with an in-place op, or make that op out of place.";
  } else {
    m += " Hint: a tensor kept for backward was modified in place after it was saved (by an in-place op "
         "such as ReLU(inplace=True), += or an optimizer step); make that op out of place or run it "
         "after the backward.";
  }
  return m;
}
}  // namespace

InplaceModifiedError::InplaceModifiedError(Details details)
    : AutogradError(inplace_message(details)), details_(std::move(details)) {}

namespace detail {

/// save_on_cpu's packed tensor: the elements in a pinned host block (their bytes too in compute
/// mode), the block given back to the runtime's host cache when the last saver lets go.
struct HostCopy {
  Runtime* runtime = nullptr;
  Shape shape;
  DType dtype = DType::F32;
  bool requires_grad = false;
  std::size_t block = 0;
  std::vector<std::byte> bytes;  ///< compute mode: the values, contiguous

  HostCopy() = default;
  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;
  ~HostCopy() {
    if (runtime != nullptr && block > 0) runtime->unpin_host(block);
  }

  /// pack_to_cpu: torch.empty(tensor.size(), pin_memory=True).copy_(tensor).
  static std::shared_ptr<const HostCopy> of(const Tensor& t) {
    auto copy = std::make_shared<HostCopy>();
    copy->shape = t.shape();
    copy->dtype = t.dtype();
    copy->requires_grad = t.requires_grad();
    copy->block = t.runtime().pin_host(t.nbytes());
    copy->runtime = &t.runtime();
    if (t.runtime().computing() && t.numel() > 0) {
      const std::size_t es = dtype_size(t.dtype());
      copy->bytes.resize(t.nbytes());
      const auto* base = static_cast<const std::byte*>(t.storage()->data());
      std::byte* dst = copy->bytes.data();
      for_each_offset(t.shape(), t.strides(), t.offset(), [&](std::int64_t i, std::int64_t off) {
        std::memcpy(dst + static_cast<std::size_t>(i) * es, base + static_cast<std::size_t>(off) * es, es);
      });
    }
    return copy;
  }

  /// unpack_from_cpu: tensor.to(device): a new device tensor each time.
  Tensor to_device() const {
    Tensor t = empty(*runtime, shape, dtype);
    if (runtime->computing() && !bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
    t.impl()->requires_grad = requires_grad;
    return t;
  }
};

}  // namespace detail

SaveOnCpu::SaveOnCpu() noexcept : previous_(tls_save_on_cpu) { tls_save_on_cpu = true; }
SaveOnCpu::~SaveOnCpu() { tls_save_on_cpu = previous_; }

void SavedTensor::save(const Tensor& tensor) { save_impl(tensor, false); }
void SavedTensor::save_output(const Tensor& tensor) { save_impl(tensor, true); }

void SavedTensor::save_impl(const Tensor& tensor, bool is_output) {
  if (!tensor.defined()) return;
  detail::SaveHook& hook = detail::save_hook();
  if (hook.mode == detail::SaveMode::Pack) {
    frame_ = hook.frame->shared_from_this();
    index_ = hook.frame->add_placeholder();
    return;
  }
  if (hook.mode == detail::SaveMode::Recompute) {
    // The rerun's own graph keeps nothing: the frame holds the rebuilt tensor
    // for the original node.
    hook.frame->store_recomputed(tensor);
    return;
  }
  if (tls_save_on_cpu) {
    // save_on_cpu's pack hook: the device tensor is not kept (it goes when nothing else holds it).
    host_ = detail::HostCopy::of(tensor);
    detail::observe_saved(tensor);
    return;
  }
  // A history-free alias: same storage (so no extra memory), no reference cycle
  // when a node saves its own output.
  data_ = tensor.detach();
  data_.impl()->requires_grad = tensor.requires_grad();
  saved_version_ = tensor.version();
  is_output_ = is_output;
  output_nr_ = is_output ? tensor.output_nr() : 0;
  grad_fn_ = tensor.grad_fn();
  detail::observe_saved(data_);
}

namespace detail {
void observe_saved(const Tensor& tensor) {
  if (tls_saved_observer != nullptr && tensor.defined()) (*tls_saved_observer)(tensor);
}
}  // namespace detail

SavedTensorsObserver::SavedTensorsObserver(Fn fn) : fn_(std::move(fn)), previous_(tls_saved_observer) {
  tls_saved_observer = &fn_;
}
SavedTensorsObserver::~SavedTensorsObserver() { tls_saved_observer = previous_; }

Tensor SavedTensor::unpack() const {
  if (frame_) return frame_->unpack(index_);
  if (host_) return host_->to_device();
  if (data_.defined() && data_.version() != saved_version_) {
    // SavedVariable::unpack: an output names the node that saved it; any other tensor
    // its grad_fn now, which an in-place op recorded since the save has replaced.
    std::shared_ptr<Node> fn;
    if (!is_output_) fn = data_.storage()->inplace_fn_since(saved_version_);
    if (!fn) fn = grad_fn_.lock();
    InplaceModifiedError::Details d;
    d.shape = data_.shape();
    d.dtype = data_.dtype();
    d.grad_fn = fn ? std::string(fn->name()) : std::string();
    d.output_nr = output_nr_;
    d.version = data_.version();
    d.expected = saved_version_;
    d.checkpoint_input = checkpoint_input_;
    throw InplaceModifiedError(std::move(d));
  }
  return data_;
}

void SavedTensor::reset() noexcept {
  data_ = Tensor{};
  frame_.reset();
  host_.reset();
  grad_fn_.reset();
}

bool grad_enabled() noexcept { return tls_grad_enabled; }
NoGradGuard::NoGradGuard() noexcept : previous_(tls_grad_enabled) { tls_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { tls_grad_enabled = previous_; }
EnableGradGuard::EnableGradGuard() noexcept : previous_(tls_grad_enabled) { tls_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { tls_grad_enabled = previous_; }

bool needs_grad(std::initializer_list<const Tensor*> inputs) noexcept {
  if (!tls_grad_enabled) return false;
  for (const Tensor* t : inputs) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

void set_history(Tensor& output, const std::shared_ptr<Node>& node, std::uint32_t output_nr) {
  detail::TensorImpl* impl = output.impl();
  impl->grad_fn = node;
  impl->output_nr = output_nr;
  impl->requires_grad = true;
}

void init_node(Node& node) noexcept { (void)node; }

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  detail::TensorImpl* impl = leaf.impl();
  if (auto existing = impl->grad_accumulator.lock()) return existing;
  auto node = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  impl->grad_accumulator = node;
  return node;
}

ContextId current_backward_context() noexcept { return tls_backward_context; }
BackwardContextGuard::BackwardContextGuard(ContextId ctx) noexcept : previous_(tls_backward_context) {
  tls_backward_context = ctx;
}
BackwardContextGuard::~BackwardContextGuard() { tls_backward_context = previous_; }

namespace detail {
void check_inplace(const Tensor& self, bool records_history) {
  if (records_history && self.requires_grad() && self.is_leaf()) {
    throw AutogradError("a leaf Variable that requires grad is being used in an in-place operation.");
  }
}

void rebase_history(Tensor& out, const std::shared_ptr<Node>& node) {
  set_history(out, node);
  out.storage()->set_inplace_fn(node);
}

SaveHook& save_hook() noexcept {
  thread_local SaveHook hook;
  return hook;
}
}  // namespace detail

}  // namespace mem::nn
