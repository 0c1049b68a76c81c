// autograd.hpp — reverse-mode autograd: graph nodes, saved tensors, the engine.
//
// Define-by-run as in PyTorch: every differentiable op that sees an input
// requiring grad creates a Node holding exactly the tensors PyTorch's
// derivatives.yaml saves, with edges to the nodes of its inputs (or to the
// AccumulateGrad node of a leaf). backward() runs nodes in PyTorch's order
// (ready nodes by decreasing sequence number), frees each node's saved tensors
// right after it ran, frees each incoming gradient once consumed, and
// accumulates into leaves like AccumulateGrad (the first gradient is stolen
// when nothing else holds it, later ones are added in place).
//
// Saved tensors carry PyTorch's version check: a tensor saved for backward
// records its version counter (see Tensor::version), and unpacking it after an
// in-place op changed it throws InplaceModifiedError with PyTorch's message —
// the configurations PyTorch refuses (a checkpointed segment that begins with
// ReLU(inplace=True) on its saved input) are refused here too. As in PyTorch,
// tensors saved inside a non-reentrant checkpoint (saved-tensor hooks) are not
// checked; the checkpoint's own saved inputs are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

class Node;
namespace detail {
class CheckpointFrame;
struct HostCopy;
}

using TensorList = std::vector<Tensor>;

/// Where a gradient flows: input `input_nr` of node `fn` (null: nowhere).
struct Edge {
  std::shared_ptr<Node> fn;
  std::uint32_t input_nr = 0;
  bool valid() const noexcept { return fn != nullptr; }
};

/// A backward function. Receives one gradient per forward output (undefined when
/// that output got none) and returns one per next edge (forward input).
class Node : public std::enable_shared_from_this<Node> {
 public:
  Node() noexcept;
  /// Releases the graph behind this node iteratively (see autograd.cpp).
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Computes input gradients. `grads` stays owned by the engine, which frees it
  /// right after this returns (like PyTorch's call_function).
  virtual TensorList apply(TensorList& grads) = 0;
  /// Drops saved tensors (called by the engine after apply()).
  virtual void release_variables() noexcept {}
  /// PyTorch's class name, e.g. "AddmmBackward0".
  virtual std::string_view name() const noexcept = 0;

  std::vector<Edge>& next_edges() noexcept { return next_edges_; }
  const std::vector<Edge>& next_edges() const noexcept { return next_edges_; }
  /// Whether input `i`'s gradient is needed: its edge leads somewhere and, inside
  /// torch.autograd.grad (mem::nn::grad with inputs), to one of them
  /// (PyTorch's task_should_compute_output).
  bool needs_input_grad(std::size_t i) const noexcept;
  std::uint32_t num_outputs() const noexcept { return num_outputs_; }
  void set_num_outputs(std::uint32_t n) noexcept { num_outputs_ = n; }
  /// Creation order; later nodes run first among ready ones.
  std::uint64_t sequence_nr() const noexcept { return sequence_nr_; }
  void set_sequence_nr(std::uint64_t nr) noexcept { sequence_nr_ = nr; }
  /// Module scope (Backward phase) that allocations of apply() are attributed to.
  ContextId backward_context() const noexcept { return backward_context_; }
  void set_backward_context(ContextId ctx) noexcept { backward_context_ = ctx; }

  /// Appends the edge for `input` (empty when it does not require grad).
  void add_input(const Tensor& input);

 private:
  std::vector<Edge> next_edges_;
  std::uint64_t sequence_nr_;
  ContextId backward_context_;
  std::uint32_t num_outputs_ = 1;
};

/// An error PyTorch's autograd raises for the same program: the training step
/// cannot run on PyTorch either, whatever the memory. Records where it was
/// raised (the runtime's phase and the innermost module scope).
class AutogradError : public Error {
 public:
  explicit AutogradError(const std::string& message);
  Phase phase() const noexcept { return phase_; }
  /// Module scope active when it was raised (kNoContext outside any).
  ContextId context() const noexcept { return context_; }

 private:
  Phase phase_;
  ContextId context_;
};

/// "one of the variables needed for gradient computation has been modified by an
/// inplace operation: [torch.cuda.FloatTensor [64, 64, 112, 112]], which is output 0
/// of ReluBackward0, is at version 1; expected version 0 instead." — PyTorch's
/// SavedVariable::unpack message, then a hint of ours.
class InplaceModifiedError : public AutogradError {
 public:
  struct Details {
    Shape shape;
    DType dtype = DType::F32;
    std::string grad_fn;          ///< the node it is an output of ("" for a leaf)
    std::uint32_t output_nr = 0;
    std::uint32_t version = 0;    ///< now
    std::uint32_t expected = 0;   ///< when saved
    bool checkpoint_input = false;  ///< saved by checkpoint() as a segment's input
  };
  explicit InplaceModifiedError(Details details);
  const Details& details() const noexcept { return details_; }
  /// PyTorch's text without our hint.
  static std::string pytorch_message(const Details& d);
  /// "torch.cuda.FloatTensor", as Tensor.toString() names a CUDA tensor's type.
  static std::string torch_type(DType dtype);

 private:
  Details details_;
};

/// A tensor kept for backward. Stores a history-free alias (same storage), or,
/// inside a non-reentrant checkpoint, only a placeholder to be recomputed.
/// Like PyTorch's SavedVariable it records the version counter when saved and
/// checks it when unpacked (placeholders are not checked: PyTorch does not check
/// tensors packed by saved-tensor hooks).
class SavedTensor {
 public:
  SavedTensor() = default;
  /// Saves `tensor` (no-op for an undefined one): an input of the node or any
  /// tensor other than its own output (SavedVariable(var, is_output=false)).
  void save(const Tensor& tensor);
  /// Saves an output of the node being built (is_output=true): call after
  /// set_history, and after the version bump of an in-place op.
  void save_output(const Tensor& tensor);
  /// The saved tensor; recomputes the checkpointed segment on first use.
  /// Throws InplaceModifiedError if an in-place op changed it since it was saved.
  Tensor unpack() const;
  void reset() noexcept;
  bool defined() const noexcept { return data_.defined() || frame_ != nullptr || host_ != nullptr; }
  /// Marks this as a checkpoint's saved input (its error message gets a hint saying so).
  void mark_checkpoint_input() noexcept { checkpoint_input_ = true; }

 private:
  void save_impl(const Tensor& tensor, bool is_output);

  Tensor data_;
  std::shared_ptr<detail::CheckpointFrame> frame_;
  std::shared_ptr<const detail::HostCopy> host_;  ///< save_on_cpu's copy (SaveOnCpu)
  std::uint32_t index_ = 0;
  std::uint32_t saved_version_ = 0;
  std::uint32_t output_nr_ = 0;     ///< outputs only (PyTorch prints 0 for the others)
  bool is_output_ = false;
  bool checkpoint_input_ = false;
  /// The node the message names: for an output the node that saved it; otherwise the
  /// tensor's grad_fn when saved (a later in-place op on the storage takes over, as
  /// PyTorch's rebase_history does). Weak: an output's node owns this SavedTensor.
  std::weak_ptr<Node> grad_fn_;
};

/// torch.autograd.graph.save_on_cpu(pin_memory=True) while alive, on this thread: every tensor
/// a node saves (outside a checkpoint's own hooks, which come first) is copied into pinned host
/// memory (Runtime::pin_host: the tensor's elements, a parameter's too) and autograd keeps only
/// that copy; each unpack in backward copies it back into a new device tensor, which its node
/// holds while it runs (torch/autograd/graph.py: pack_to_cpu, unpack_from_cpu). As with any
/// saved-tensor hooks, no version check.
class SaveOnCpu {
 public:
  SaveOnCpu() noexcept;
  ~SaveOnCpu();
  SaveOnCpu(const SaveOnCpu&) = delete;
  SaveOnCpu& operator=(const SaveOnCpu&) = delete;

 private:
  bool previous_;
};

/// Observes what autograd keeps: while alive, every tensor a node saves for backward
/// on this thread is passed to `fn` (after the save, under the saver's module scope),
/// as the pack hook of torch.autograd.graph.saved_tensors_hooks sees it. Placeholders
/// of a non-reentrant checkpoint keep nothing and are not reported. Observers nest;
/// the innermost one sees the saves.
class SavedTensorsObserver {
 public:
  using Fn = std::function<void(const Tensor&)>;
  explicit SavedTensorsObserver(Fn fn);
  ~SavedTensorsObserver();
  SavedTensorsObserver(const SavedTensorsObserver&) = delete;
  SavedTensorsObserver& operator=(const SavedTensorsObserver&) = delete;

 private:
  Fn fn_;
  const Fn* previous_;
};

// --- grad mode -------------------------------------------------------------------------
bool grad_enabled() noexcept;
/// torch.no_grad(): ops record no history and save nothing.
class NoGradGuard {
 public:
  NoGradGuard() noexcept;
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};
/// torch.enable_grad().
class EnableGradGuard {
 public:
  EnableGradGuard() noexcept;
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

// --- wiring helpers for ops ---------------------------------------------------------------
/// True when grad mode is on and any defined input requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs) noexcept;
/// Gives `output` the history (node, output index) and requires_grad.
void set_history(Tensor& output, const std::shared_ptr<Node>& node, std::uint32_t output_nr = 0);
/// Stamps a fresh node with a sequence number and the current module's backward scope.
void init_node(Node& node) noexcept;
/// The AccumulateGrad node of a leaf requiring grad (created on first use).
std::shared_ptr<Node> grad_accumulator(const Tensor& leaf);
/// Module scope the next created nodes attribute their backward to (set by Module calls).
ContextId current_backward_context() noexcept;
class BackwardContextGuard {
 public:
  explicit BackwardContextGuard(ContextId ctx) noexcept;
  ~BackwardContextGuard();
  BackwardContextGuard(const BackwardContextGuard&) = delete;
  BackwardContextGuard& operator=(const BackwardContextGuard&) = delete;

 private:
  ContextId previous_;
};

// --- the engine -------------------------------------------------------------------------
/// Backpropagates from `root`. `grad` defaults to ones (a scalar root allocates one
/// 512 B block, as torch.ones_like does). The graph is consumed: saved tensors are
/// freed as nodes run (retain_graph=False). A gradient moved in is freed once its node has
/// run; one the caller keeps lives until backward returns (torch.autograd.backward's).
void backward(const Tensor& root, Tensor grad = {});
/// Backpropagates several roots at once (used by reentrant checkpointing).
void backward(const TensorList& roots, TensorList grads);

/// Where a gradient enters the graph: input `edge.input_nr` of `edge.fn`
/// (torch.autograd.graph.GradientEdge), with the gradient it receives.
struct GradientRoot {
  Edge edge;
  Tensor grad;
};
struct GradOptions {
  /// autograd.grad's `inputs`: the gradient reaching each is captured, not applied, and
  /// only the nodes with a path to one of them run, each computing only the gradients
  /// that lead there. Empty: every node runs, as backward().
  std::vector<std::shared_ptr<Node>> inputs;
  /// retain_graph=True: the nodes keep their saved tensors after they ran.
  bool retain_graph = false;
  /// Node.register_prehook: called with a node's incoming gradients before it runs; may
  /// replace them.
  std::function<void(Node&, TensorList&)> pre_hook;
};
/// torch.autograd.grad from gradient edges: runs the graph behind `roots` and returns the
/// gradient that reached each of `options.inputs` (undefined where none did). The roots'
/// gradients live until it returns, as the caller's grad_outputs do.
TensorList grad(const std::vector<GradientRoot>& roots, const GradOptions& options);

}  // namespace mem::nn
