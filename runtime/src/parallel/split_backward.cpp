// split_backward.cpp — stage_backward_input and stage_backward_weight (see split_backward.hpp;
// torch 2.15 torch/distributed/pipelining/_backward.py).
#include "parallel/split_backward.hpp"

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "engine/detail.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {
namespace {

using NodeSet = std::unordered_set<const Node*>;
using Reverse = std::unordered_map<const Node*, std::vector<std::shared_ptr<Node>>>;

/// construct_reverse_graph: each node reachable from the roots, with the nodes pointing at it.
Reverse reverse_graph(const std::vector<std::shared_ptr<Node>>& roots) {
  Reverse reverse;
  std::deque<Node*> queue;
  NodeSet seen;
  for (const auto& root : roots) {
    if (root && seen.insert(root.get()).second) queue.push_back(root.get());
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const Edge& edge : node->next_edges()) {
      if (!edge.valid()) continue;
      auto& parents = reverse[edge.fn.get()];
      if (parents.empty()) queue.push_back(edge.fn.get());
      parents.push_back(node->shared_from_this());
    }
  }
  return reverse;
}

/// reverse_closure: the nodes reached from `roots` along the reverse edges, stopping at (and
/// collecting, in the order met) those in `targets`.
std::pair<NodeSet, std::vector<std::shared_ptr<Node>>> reverse_closure(const std::vector<std::shared_ptr<Node>>& roots,
                                                                       const NodeSet& targets, const Reverse& reverse) {
  NodeSet closure, met;
  std::vector<std::shared_ptr<Node>> intersected;
  std::deque<const Node*> queue;
  for (const auto& root : roots) {
    if (root && closure.insert(root.get()).second) queue.push_back(root.get());
  }
  while (!queue.empty()) {
    const Node* node = queue.front();
    queue.pop_front();
    const auto it = reverse.find(node);
    if (it == reverse.end()) continue;
    for (const auto& parent : it->second) {
      if (closure.count(parent.get()) != 0) continue;
      if (targets.count(parent.get()) != 0) {
        if (met.insert(parent.get()).second) intersected.push_back(parent);
        continue;
      }
      closure.insert(parent.get());
      queue.push_back(parent.get());
    }
  }
  return {closure, intersected};
}

/// get_param_groups, merging as it merges: a weight meeting an intermediate of an earlier group
/// joins that group.
std::vector<ParamGroup> param_groups(const std::vector<std::shared_ptr<Node>>& roots, const std::shared_ptr<Node>& input,
                                     const std::vector<Tensor>& weights) {
  const Reverse reverse = reverse_graph(roots);
  const NodeSet inputs = reverse_closure({input}, {}, reverse).first;
  std::vector<ParamGroup> groups;
  std::unordered_map<const Node*, std::size_t> group_of;  // the dict keyed on intermediates
  std::vector<std::size_t> order;                          // its values, in insertion order
  for (const Tensor& weight : weights) {
    const auto intersected = reverse_closure({grad_accumulator(weight)}, inputs, reverse).second;
    groups.push_back(ParamGroup{intersected, {}, {weight}});
    std::size_t current = groups.size() - 1;
    for (const auto& node : intersected) {
      const auto found = group_of.find(node.get());
      if (found == group_of.end()) {
        group_of[node.get()] = current;
        order.push_back(current);
        continue;
      }
      if (found->second == current) continue;
      ParamGroup& existing = groups[found->second];
      for (const Tensor& p : groups[current].params) {
        if (std::none_of(existing.params.begin(), existing.params.end(),
                         [&](const Tensor& q) { return q.impl() == p.impl(); })) {
          existing.params.push_back(p);
        }
      }
      for (const auto& n : groups[current].intermediates) {
        if (std::find(existing.intermediates.begin(), existing.intermediates.end(), n) == existing.intermediates.end()) {
          existing.intermediates.push_back(n);
        }
      }
      current = found->second;
    }
  }
  std::vector<ParamGroup> out;
  std::vector<bool> taken(groups.size());
  for (std::size_t g : order) {
    if (taken[g]) continue;
    taken[g] = true;
    out.push_back(std::move(groups[g]));
  }
  return out;
}

/// `tensor.grad = grad`, or `tensor.grad += grad` in place when it has one (what _backward.py
/// does with each gradient autograd.grad returned); nothing for an undefined one.
void add_to_grad(Tensor& tensor, const Tensor& grad) {
  if (!grad.defined()) return;
  if (tensor.grad().defined()) {
    add_(tensor.grad(), grad);
  } else {
    tensor.set_grad(grad);
  }
}

}  // namespace

InputBackward backward_input(const std::vector<GradientRoot>& roots, Tensor& input, const std::vector<Tensor>& weights) {
  InputBackward out;
  std::vector<std::shared_ptr<Node>> root_nodes;
  for (const GradientRoot& root : roots) root_nodes.push_back(root.edge.fn);
  const std::shared_ptr<Node> sink = grad_accumulator(input);
  out.groups = param_groups(root_nodes, sink, weights);
  // The pre-hooks: each intermediate's incoming gradients, stashed in its group.
  std::unordered_map<const Node*, std::vector<std::pair<std::size_t, std::size_t>>> hooks;
  for (std::size_t g = 0; g < out.groups.size(); ++g) {
    ParamGroup& group = out.groups[g];
    group.grads.resize(group.intermediates.size());
    for (std::size_t i = 0; i < group.intermediates.size(); ++i) hooks[group.intermediates[i].get()].emplace_back(g, i);
  }
  GradOptions options;
  options.inputs = {sink};
  options.retain_graph = true;
  options.pre_hook = [&](Node& node, TensorList& grads) {
    const auto it = hooks.find(&node);
    if (it == hooks.end()) return;
    for (const auto& [g, i] : it->second) out.groups[g].grads[i] = grads;
  };
  out.input_grad = grad(roots, options).front();
  add_to_grad(input, out.input_grad);  // inp.grad = dinput
  return out;
}

void backward_weight(std::vector<ParamGroup>& groups) {
  for (ParamGroup& group : groups) {
    std::vector<GradientRoot> roots;
    for (std::size_t i = 0; i < group.intermediates.size(); ++i) {
      const TensorList& grads = group.grads[i];
      for (std::size_t k = 0; k < grads.size(); ++k) {
        if (grads[k].defined()) roots.push_back({Edge{group.intermediates[i], static_cast<std::uint32_t>(k)}, grads[k]});
      }
    }
    GradOptions options;
    for (const Tensor& p : group.params) options.inputs.push_back(grad_accumulator(p));
    // del param_group["intermediates"]: the roots hold them now.
    const std::vector<std::shared_ptr<Node>> nodes = std::move(group.intermediates);
    group.intermediates.clear();
    if (nodes.size() > 1) {
      // Clamp each intermediate's gradients to the stashed ones: a descendant intermediate must
      // not count again what flows into it from another.
      options.pre_hook = [&](Node& node, TensorList& grads) {
        for (std::size_t i = 0; i < nodes.size(); ++i) {
          if (nodes[i].get() == &node) grads = group.grads[i];
        }
      };
    }
    if (!roots.empty()) {
      const TensorList dweights = grad(roots, options);
      group.grads.clear();  // del param_group["grads"]
      for (std::size_t k = 0; k < group.params.size(); ++k) {
        add_to_grad(group.params[k], dweights[k]);  // weight.grad = dw
      }
    }
  }
}

}  // namespace mem::nn::detail
