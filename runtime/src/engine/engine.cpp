// engine.cpp — the backward pass: dependency counting, a ready queue ordered by
// decreasing sequence number (PyTorch's CPU/GPU ready-queue order), input buffers
// that accumulate gradients in place when they hold the last reference, and
// PyTorch's freeing order per node: outputs computed, incoming gradients freed,
// saved tensors released, outputs routed.
#include <exception>
#include <queue>
#include <unordered_map>

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

}  // namespace

void backward(const TensorList& roots, TensorList grads) {
  NoGradGuard no_grad;  // backward itself records nothing (create_graph=False)
  struct DropCallbacksOnThrow {  // a failed backward leaves no callback for the next one
    const TensorList& roots;
    ~DropCallbacksOnThrow() {
      if (std::uncaught_exceptions() > 0 && !roots.empty() && roots.front().defined()) {
        roots.front().runtime().clear_backward_callbacks();
      }
    }
  } drop_callbacks{roots};
  std::unordered_map<Node*, NodeState> state;
  std::vector<std::pair<std::shared_ptr<Node>, std::uint32_t>> root_edges;

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

  // Count dependencies over the graph reachable from the roots.
  std::vector<Node*> stack;
  for (auto& [fn, nr] : root_edges) {
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

  // Seed the root gradients (ones for an implicit scalar gradient). The implicit seeds
  // live until backward returns: torch.autograd.backward keeps them in its local
  // grad_tensors_ (and the engine's GraphRoot holds them) for the whole engine run.
  TensorList seeds;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    // Taken from the list: a gradient handed over (moved in) is the engine's alone, freed once
    // its node has run, as a Function's output is inside a larger run.
    Tensor g = i < grads.size() ? std::move(grads[i]) : Tensor{};
    if (!g.defined()) {
      if (root.numel() != 1) throw Error("backward: grad can be implicitly created only for scalar outputs");
      g = full(root.runtime(), root.shape(), 1.0, root.dtype());
      seeds.push_back(g);
    }
    NodeState& st = state[root_edges[i].first.get()];
    if (st.buffer.size() < root_edges[i].first->num_outputs()) st.buffer.resize(root_edges[i].first->num_outputs());
    accumulate(st.buffer[root_edges[i].second], std::move(g));
  }

  std::priority_queue<Task, std::vector<Task>, TaskLess> ready;
  std::uint64_t order = 0;
  for (auto& [fn, nr] : root_edges) {
    NodeState& st = state[fn.get()];
    if (st.dependencies == 0 && !st.buffer.empty()) {
      st.dependencies = -1;  // queued
      ready.push(Task{fn, order++});
    }
  }

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top().node;
    ready.pop();
    NodeState& st = state[node.get()];
    TensorList inputs = std::move(st.buffer);
    inputs.resize(node->num_outputs());
    TensorList outputs;
    {
      ModuleScope scope(node->backward_context());
      bool any = false;
      for (const Tensor& g : inputs) any = any || g.defined();
      if (any) outputs = node->apply(inputs);  // no gradient arrived: nothing to compute
      inputs.clear();              // incoming gradients die here (end of call_function)
      node->release_variables();   // then the saved tensors (retain_graph=False)
    }
    auto& edges = node->next_edges();
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const Edge& edge = edges[i];
      if (!edge.valid()) continue;
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
  if (!roots.empty()) roots.front().runtime().run_backward_callbacks();
}

void backward(const Tensor& root, Tensor grad) {
  TensorList grads;  // not an initializer list, whose copy would live until the call returns
  grads.push_back(std::move(grad));
  backward(TensorList{root}, std::move(grads));
}

}  // namespace mem::nn
