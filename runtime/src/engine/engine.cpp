// engine.cpp — the backward pass: dependency counting, a ready queue ordered by
// decreasing sequence number (PyTorch's CPU/GPU ready-queue order), input buffers
// that accumulate gradients in place when they hold the last reference, and
// PyTorch's freeing order per node: outputs computed, incoming gradients freed,
// saved tensors released, outputs routed.
#include <algorithm>
#include <exception>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "engine/checkpoint_frame.hpp"
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

struct Task {
  std::shared_ptr<Node> node;
  std::uint64_t order;  ///< FIFO among equal sequence numbers (AccumulateGrad)
};
struct TaskLess {
  bool operator()(const Task& a, const Task& b) const noexcept {
    if (a.node->sequence_nr() != b.node->sequence_nr()) return a.node->sequence_nr() < b.node->sequence_nr();
    return a.order > b.order;
  }
};

struct NodeState {
  int dependencies = 0;
  TensorList buffer;
};

/// InputBuffer::accumulate: reuse the old gradient in place when this buffer holds
/// the only reference to it and to its storage, else allocate old + new.
void accumulate(Tensor& slot, Tensor&& grad) {
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  if (!grad.defined()) return;
  const bool inplace = slot.use_count() == 1 && slot.storage().use_count() == 1 && slot.is_contiguous() &&
                       slot.dtype() == detail::promote(slot.dtype(), grad.dtype());
  if (inplace) {
    add_(slot, grad);
  } else {
    slot = add(slot, grad);
  }
}

using RootEdges = std::vector<std::pair<std::shared_ptr<Node>, std::uint32_t>>;

/// The nodes torch.autograd.grad runs (exec_info's needed_): those with a path to one of
/// `inputs`, found depth first from the roots.
std::unordered_set<const Node*> needed_nodes(const RootEdges& roots, const std::unordered_set<const Node*>& inputs) {
  std::unordered_set<const Node*> needed;
  std::unordered_map<const Node*, bool> done;  // false: on the stack
  std::vector<std::pair<const Node*, std::size_t>> stack;
  for (const auto& [start, nr] : roots) {
    if (done.count(start.get()) != 0) continue;
    done[start.get()] = false;
    stack.emplace_back(start.get(), 0);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const auto& edges = node->next_edges();
      if (next < edges.size()) {
        const Node* child = edges[next++].fn.get();
        if (child != nullptr && done.count(child) == 0) {
          done[child] = false;
          stack.emplace_back(child, 0);
        }
        continue;
      }
      bool reaches = false;
      for (const Edge& edge : edges) {
        const Node* child = edge.fn.get();
        reaches = reaches || (child != nullptr && (inputs.count(child) != 0 || needed.count(child) != 0));
      }
      if (reaches) needed.insert(node);
      done[node] = true;
      stack.pop_back();
    }
  }
  return needed;
}

/// What needs_input_grad asks inside a grad() run: the nodes whose gradients are wanted.
thread_local const std::unordered_set<const Node*>* tls_wanted = nullptr;
/// The graph task running (GraphTask's id), and the last id given.
thread_local std::uint64_t tls_graph_task = 0;
thread_local std::uint64_t tls_graph_tasks = 0;
thread_local bool tls_retain_graph = false;

/// The engine: runs the graph behind `root_edges` seeded with `seeds_in` (one per root, moved
/// in). Returns the gradients captured for `options.inputs`.
TensorList run_graph(Runtime& runtime, const RootEdges& root_edges, TensorList seeds_in, const GradOptions& options) {
  NoGradGuard no_grad;  // backward itself records nothing (create_graph=False)
  struct DropCallbacksOnThrow {  // a failed backward leaves no callback for the next one
    Runtime& runtime;
    ~DropCallbacksOnThrow() {
      if (std::uncaught_exceptions() > 0) runtime.clear_backward_callbacks();
    }
  } drop_callbacks{runtime};
  struct TaskGuard {  // a graph task of its own (a nested one inside a reentrant checkpoint too)
    std::uint64_t previous = std::exchange(tls_graph_task, ++tls_graph_tasks);
    bool retaining;
    ~TaskGuard() {
      tls_graph_task = previous;
      tls_retain_graph = retaining;
    }
  } task{.retaining = std::exchange(tls_retain_graph, options.retain_graph)};
  std::unordered_map<Node*, NodeState> state;

  // Count dependencies over the graph reachable from the roots.
  std::vector<Node*> stack;
  for (const auto& [fn, nr] : root_edges) {
    if (state.emplace(fn.get(), NodeState{}).second) stack.push_back(fn.get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& edge : node->next_edges()) {
      if (!edge.valid()) continue;
      auto [it, inserted] = state.try_emplace(edge.fn.get());
      ++it->second.dependencies;
      if (inserted) stack.push_back(edge.fn.get());
    }
  }

  // autograd.grad: capture what reaches the inputs, run only what leads there.
  const bool filtered = !options.inputs.empty();
  std::unordered_set<const Node*> inputs, needed, wanted;
  if (filtered) {
    for (const auto& in : options.inputs) inputs.insert(in.get());
    needed = needed_nodes(root_edges, inputs);
    wanted = needed;
    wanted.insert(inputs.begin(), inputs.end());
    // Only what runs is waited for (a needed node's predecessors are all needed).
    for (auto& [node, st] : state) st.dependencies = 0;
    for (const Node* node : needed) {
      for (const Edge& edge : node->next_edges()) {
        if (edge.valid() && wanted.count(edge.fn.get()) != 0) ++state[edge.fn.get()].dependencies;
      }
    }
  }
  TensorList captured(options.inputs.size());

  for (std::size_t i = 0; i < root_edges.size(); ++i) {
    NodeState& st = state[root_edges[i].first.get()];
    if (st.buffer.size() < root_edges[i].first->num_outputs()) st.buffer.resize(root_edges[i].first->num_outputs());
    accumulate(st.buffer[root_edges[i].second], std::move(seeds_in[i]));
  }

  std::priority_queue<Task, std::vector<Task>, TaskLess> ready;
  std::uint64_t order = 0;
  for (const auto& [fn, nr] : root_edges) {
    NodeState& st = state[fn.get()];
    if (st.dependencies == 0 && !st.buffer.empty()) {
      st.dependencies = -1;  // queued
      ready.push(Task{fn, order++});
    }
  }

  struct WantedGuard {
    const std::unordered_set<const Node*>* previous = tls_wanted;
    ~WantedGuard() { tls_wanted = previous; }
  } wanted_guard;
  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top().node;
    ready.pop();
    NodeState& st = state[node.get()];
    TensorList inputs_now = std::move(st.buffer);
    inputs_now.resize(node->num_outputs());
    if (filtered) {
      // A captured input takes the gradient that reached it (GraphTask's captured_vars_).
      for (std::size_t k = 0; k < options.inputs.size(); ++k) {
        if (options.inputs[k].get() == node.get() && !inputs_now.empty()) captured[k] = inputs_now[0];
      }
      if (needed.count(node.get()) == 0) continue;
    }
    if (options.pre_hook) options.pre_hook(*node, inputs_now);
    TensorList outputs;
    {
      ModuleScope scope(node->backward_context());
      bool any = false;
      for (const Tensor& g : inputs_now) any = any || g.defined();
      tls_wanted = filtered ? &wanted : nullptr;
      if (any) outputs = node->apply(inputs_now);  // no gradient arrived: nothing to compute
      tls_wanted = wanted_guard.previous;
      inputs_now.clear();                                       // incoming gradients die here (end of call_function)
      if (!options.retain_graph) node->release_variables();   // then the saved tensors
    }
    auto& edges = node->next_edges();
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const Edge& edge = edges[i];
      if (!edge.valid() || (filtered && wanted.count(edge.fn.get()) == 0)) continue;
      NodeState& next = state[edge.fn.get()];
      if (next.buffer.size() < edge.fn->num_outputs()) next.buffer.resize(edge.fn->num_outputs());
      if (i < outputs.size() && outputs[i].defined()) {
        ModuleScope scope(node->backward_context());
        accumulate(next.buffer[edge.input_nr], std::move(outputs[i]));
      }
      if (--next.dependencies == 0) ready.push(Task{edge.fn, order++});
    }
  }
  // The graph is done: queued callbacks (FSDP's root post-backward) run before the seeds die.
  runtime.run_backward_callbacks();
  return captured;
}

}  // namespace

namespace detail {
std::uint64_t current_graph_task() noexcept { return tls_graph_task; }
bool inside_grad_with_inputs() noexcept { return tls_wanted != nullptr; }
bool retaining_graph() noexcept { return tls_retain_graph; }
}  // namespace detail

bool Node::needs_input_grad(std::size_t i) const noexcept {
  if (i >= next_edges_.size() || !next_edges_[i].valid()) return false;
  return tls_wanted == nullptr || tls_wanted->count(next_edges_[i].fn.get()) != 0;
}

void backward(const TensorList& roots, TensorList grads) {
  RootEdges root_edges;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    if (!root.defined() || !root.requires_grad()) {
      // PyTorch's RuntimeError (torch/csrc/autograd/engine.cpp): what a step with every
      // segment reentrant-checkpointed and an input that needs no grad runs into. An
      // AutogradError, so a sweep shows the configuration as an error row.
      throw AutogradError("element " + std::to_string(i) +
                          " of tensors does not require grad and does not have a grad_fn");
    }
    std::shared_ptr<Node> fn = root.grad_fn() ? root.grad_fn() : grad_accumulator(root);
    root_edges.emplace_back(fn, root.grad_fn() ? root.output_nr() : 0);
  }
  if (roots.empty()) return;

  // Seed the root gradients (ones for an implicit scalar gradient). The implicit seeds
  // live until backward returns: torch.autograd.backward keeps them in its local
  // grad_tensors_ (and the engine's GraphRoot holds them) for the whole engine run.
  TensorList seeds, kept;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    // Taken from the list: a gradient handed over (moved in) is the engine's alone, freed once
    // its node has run, as a Function's output is inside a larger run.
    Tensor g = i < grads.size() ? std::move(grads[i]) : Tensor{};
    if (!g.defined()) {
      if (root.numel() != 1) throw Error("backward: grad can be implicitly created only for scalar outputs");
      g = full(root.runtime(), root.shape(), 1.0, root.dtype());
      kept.push_back(g);
    }
    seeds.push_back(std::move(g));
  }
  run_graph(roots.front().runtime(), root_edges, std::move(seeds), GradOptions{});
}

TensorList grad(const std::vector<GradientRoot>& roots, const GradOptions& options) {
  RootEdges root_edges;
  TensorList seeds;
  for (const GradientRoot& root : roots) {
    if (!root.edge.valid() || !root.grad.defined()) throw Error("grad: a root without a node or a gradient");
    root_edges.emplace_back(root.edge.fn, root.edge.input_nr);
    seeds.push_back(root.grad);  // the caller keeps its own reference until this returns
  }
  if (roots.empty()) return TensorList(options.inputs.size());
  return run_graph(roots.front().grad.runtime(), root_edges, std::move(seeds), options);
}

void backward(const Tensor& root, Tensor grad) {
  TensorList grads;  // not an initializer list, whose copy would live until the call returns
  grads.push_back(std::move(grad));
  backward(TensorList{root}, std::move(grads));
}

}  // namespace mem::nn
