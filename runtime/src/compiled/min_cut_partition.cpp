// min_cut_partition.cpp — which forward values a torch.compile'd step keeps for its backward.
//
// AOTAutograd's partitioner (torch/_functorch/partitioners.py, PyTorch 2.15) cuts the joint
// graph where saving costs the fewest bytes: every node is an edge X_in -> X_out weighted by
// its size (biased towards the backward by 1.1^distance, doubled when inductor would not
// materialize it anyway); what the backward needs is tied to the sink, and what must not be
// recomputed (matrix products, random ops, reductions, far-apart uses, long fusible chains) to
// the source. The cut's nodes are the saved values. Under an activation_memory_budget below 1,
// a 0-1 knapsack (float32, as PyTorch's dp_knapsack) picks which of the banned nodes may be
// recomputed after all, by their FLOPs per normalized byte. The cut itself is the one nearest
// the sink (networkx's minimum_cut takes the nodes that still reach the sink in the residual
// network), which every maximum flow gives, so this Dinic's flow finds the same set.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <queue>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/compiled.hpp"

namespace mem::nn {
namespace {

constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max() / 4;
constexpr std::int64_t kFar = 1000000000;  // partitioners.py's int(1e9): not needed by the backward

/// A maximum flow network (Dinic), with the residual reachability networkx's cut reads.
class FlowNetwork {
 public:
  explicit FlowNetwork(int vertices) : adjacency_(static_cast<std::size_t>(vertices)) {}

  /// networkx's DiGraph.add_edge: a second edge between the same vertices replaces the first.
  void set_edge(int from, int to, std::int64_t capacity) {
    for (int e : adjacency_[from]) {
      if (edges_[e].to == to && edges_[e].forward) {
        edges_[e].capacity = capacity;
        return;
      }
    }
    adjacency_[from].push_back(static_cast<int>(edges_.size()));
    edges_.push_back({to, capacity, 0, true});
    adjacency_[to].push_back(static_cast<int>(edges_.size()));
    edges_.push_back({from, 0, 0, false});
  }

  std::int64_t max_flow(int source, int sink) {
    std::int64_t total = 0;
    while (levels(source, sink)) {
      next_.assign(adjacency_.size(), 0);
      while (std::int64_t pushed = augment(source, sink)) {
        total += pushed;
        if (total >= kInf) return kInf;
      }
    }
    return total;
  }

  /// The vertices that still reach `sink` through edges with capacity left.
  std::vector<bool> reaching(int sink) const {
    std::vector<bool> seen(adjacency_.size(), false);
    std::vector<int> stack{sink};
    seen[sink] = true;
    while (!stack.empty()) {
      int v = stack.back();
      stack.pop_back();
      for (int e : adjacency_[v]) {
        // The edge into v is e's partner: from edges_[e].to to v.
        const Edge& back = edges_[e ^ 1];
        int u = edges_[e].to;
        if (!seen[u] && back.capacity - back.flow > 0) {
          seen[u] = true;
          stack.push_back(u);
        }
      }
    }
    return seen;
  }

  /// The saturated forward edges from `inside` to outside.
  template <typename F>
  void crossing(const std::vector<bool>& sink_side, F&& visit) const {
    for (std::size_t u = 0; u < adjacency_.size(); ++u) {
      if (sink_side[u]) continue;
      for (int e : adjacency_[u]) {
        if (edges_[e].forward && sink_side[edges_[e].to]) visit(static_cast<int>(u), edges_[e].to);
      }
    }
  }

 private:
  struct Edge {
    int to;
    std::int64_t capacity, flow;
    bool forward;
  };
  bool levels(int source, int sink) {
    level_.assign(adjacency_.size(), -1);
    std::queue<int> queue;
    queue.push(source);
    level_[source] = 0;
    while (!queue.empty()) {
      int v = queue.front();
      queue.pop();
      for (int e : adjacency_[v]) {
        if (level_[edges_[e].to] < 0 && edges_[e].capacity - edges_[e].flow > 0) {
          level_[edges_[e].to] = level_[v] + 1;
          queue.push(edges_[e].to);
        }
      }
    }
    return level_[sink] >= 0;
  }
  /// One augmenting path through the level graph, walked with an explicit stack (a deep model's
  /// chain of nodes would overflow a recursive walk): the flow it carries, 0 when none is left.
  std::int64_t augment(int source, int sink) {
    std::vector<int> path;  // the edges taken from the source
    int v = source;
    while (true) {
      if (v == sink) {
        std::int64_t pushed = kInf;
        for (int e : path) pushed = std::min(pushed, edges_[e].capacity - edges_[e].flow);
        for (int e : path) {
          edges_[e].flow += pushed;
          edges_[e ^ 1].flow -= pushed;
        }
        return pushed;
      }
      bool advanced = false;
      for (auto& i = next_[v]; i < adjacency_[v].size(); ++i) {
        const int e = adjacency_[v][i];
        if (level_[edges_[e].to] == level_[v] + 1 && edges_[e].capacity - edges_[e].flow > 0) {
          path.push_back(e);
          v = edges_[e].to;
          advanced = true;
          break;
        }
      }
      if (advanced) continue;
      // A dead end: no path through v at this level; back up and skip the edge that led here.
      level_[v] = -1;
      if (path.empty()) return 0;
      const int back = path.back();
      path.pop_back();
      v = edges_[back ^ 1].to;
      ++next_[v];
    }
  }
  std::vector<std::vector<int>> adjacency_;
  std::vector<Edge> edges_;
  std::vector<int> level_;
  std::vector<std::size_t> next_;
};

struct MinCutOptions {
  bool used_far_apart, long_fusible_chains, materialized_backward, not_in_allowlist, reduction;
};

/// partitioners.py's NodeInfo, with each node's dist_from_bw.
struct NodeInfo {
  std::vector<std::int32_t> inputs;  // primals, then forward seeds
  std::vector<bool> required_fw, required_bw, tangents_closure;
  std::vector<std::int64_t> fw_order, dist_from_bw;
  std::vector<std::int32_t> required_fw_nodes;  // by fw order
};

bool is_primal(const JointNode& n) { return n.op == JointNode::Op::Placeholder && n.input == JointNode::Input::Primal; }

NodeInfo classify(const JointGraph& g) {
  const std::size_t count = g.nodes.size();
  NodeInfo info;
  info.required_fw.assign(count, false);
  info.required_bw.assign(count, false);
  info.fw_order.assign(count, -1);
  info.dist_from_bw.assign(count, 0);
  // classify_nodes: the tangents and what must run in backward, closed over their users.
  for (std::size_t i = 0; i < count; ++i) {
    const JointNode& n = g.nodes[i];
    if (n.op == JointNode::Op::Placeholder && n.input == JointNode::Input::Tangent) info.required_bw[i] = true;
    if (n.has(JointNode::MustBeInBackward)) info.required_bw[i] = true;
    if (info.required_bw[i]) {
      for (std::int32_t u : n.users) info.required_bw[u] = true;
    }
  }
  info.tangents_closure = info.required_bw;
  for (std::size_t k = static_cast<std::size_t>(g.forward_outputs); k < g.outputs.size(); ++k) {
    info.required_bw[g.outputs[k]] = true;
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (is_primal(g.nodes[i])) info.inputs.push_back(static_cast<std::int32_t>(i));
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (g.nodes[i].op == JointNode::Op::Placeholder && g.nodes[i].input == JointNode::Input::FwdSeed) {
      info.inputs.push_back(static_cast<std::int32_t>(i));
    }
  }
  // The forward-only graph (_extract_graph_with_inputs_outputs, then dead-code elimination):
  // the nodes computable from the inputs alone (no tangent, nothing that must run in backward)
  // that the forward's outputs are made from, or that are impure (kept by the elimination).
  std::vector<bool> valid(count, false);
  for (std::size_t i = 0; i < count; ++i) {
    const JointNode& n = g.nodes[i];
    if (n.op == JointNode::Op::Placeholder) {
      valid[i] = n.input == JointNode::Input::Primal || n.input == JointNode::Input::FwdSeed;
    } else if (n.op != JointNode::Op::Output) {
      valid[i] = !n.has(JointNode::MustBeInBackward) &&
                 std::all_of(n.inputs.begin(), n.inputs.end(), [&](std::int32_t in) { return valid[in]; });
    }
  }
  for (std::int32_t i : info.inputs) info.required_fw[i] = true;
  std::vector<std::int32_t> stack(g.outputs.begin(), g.outputs.begin() + g.forward_outputs);
  for (std::size_t i = 0; i < count; ++i) {
    if (valid[i] && g.nodes[i].has(JointNode::Impure) && g.nodes[i].op == JointNode::Op::CallFunction) {
      stack.push_back(static_cast<std::int32_t>(i));
    }
  }
  std::vector<bool> seen(count, false);
  while (!stack.empty()) {
    const std::int32_t v = stack.back();
    stack.pop_back();
    if (seen[v] || !valid[v]) continue;
    seen[v] = true;
    info.required_fw[v] = true;
    for (std::int32_t in : g.nodes[v].inputs) stack.push_back(in);
  }
  std::int64_t order = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (info.required_fw[i]) {
      info.fw_order[i] = order++;
      info.required_fw_nodes.push_back(static_cast<std::int32_t>(i));
    }
  }
  for (std::size_t k = count; k-- > 0;) {
    const JointNode& n = g.nodes[k];
    if (n.op == JointNode::Op::Output) {
      info.dist_from_bw[k] = kFar;
    } else if (!info.required_fw[k]) {
      info.dist_from_bw[k] = 0;
    } else {
      std::int64_t d = kFar;
      for (std::int32_t u : n.users) d = std::min(d, info.dist_from_bw[u] + 1);
      info.dist_from_bw[k] = d;
    }
  }
  return info;
}

class MinCut {
 public:
  MinCut(const JointGraph& g, const NodeInfo& info, MinCutOptions options, const std::vector<bool>& dont_ban)
      : g_(g), info_(info), options_(options), dont_ban_(dont_ban),
        banned_(g.nodes.size(), false), network_(static_cast<int>(2 * g.nodes.size() + 2)) {}

  /// (saved values in graph order, banned nodes in the order they were banned)
  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> solve() {
    const int count = static_cast<int>(g_.nodes.size());
    for (int i = 0; i < count; ++i) {
      const JointNode& n = g_.nodes[i];
      if (n.op == JointNode::Op::Output) continue;
      if (info_.required_bw[i]) {
        if (!info_.tangents_closure[i]) {
          network_.set_edge(out(i), sink(), kInf);
        } else {
          network_.set_edge(in(i), sink(), kInf);
          continue;
        }
      }
      if (n.has(JointNode::MustRecompute)) {
        network_.set_edge(in(i), sink(), kInf);
        continue;
      }
      if (is_primal(n) || (n.op == JointNode::Op::Placeholder && n.input == JointNode::Input::FwdSeed)) ban(i);
      if (info_.required_fw[i] && should_ban(i)) ban(i);
      std::int64_t weight;
      if (n.value == JointNode::Value::Sym) {
        weight = n.sym_size;
      } else if (n.value == JointNode::Value::Opaque) {
        weight = 0;
      } else if (n.value == JointNode::Value::Other) {
        weight = kInf;
      } else {
        weight = node_weight(i);
      }
      network_.set_edge(in(i), out(i), weight);
      for (std::int32_t u : n.users) network_.set_edge(out(i), in(u), kInf);
    }
    if (options_.used_far_apart) ban_used_far_apart();
    if (options_.long_fusible_chains) ban_long_fusible_chains();

    if (network_.max_flow(source(), sink()) >= kInf) {
      throw Error("the compiled step's joint graph has a value the backward needs that can be neither saved nor "
                  "recomputed (PyTorch's partitioner fails on it too)");
    }
    std::vector<bool> sink_side = network_.reaching(sink());
    std::vector<bool> cut(g_.nodes.size(), false);
    network_.crossing(sink_side, [&](int from, int to) {
      if (from == source() || to == sink() || from % 2 != 0 || to != from + 1) {
        throw Error("the compiled step's partition cut a dependency instead of a value (a bug: please report it)");
      }
      cut[from / 2] = true;
    });
    std::vector<std::int32_t> saved;
    for (int i = 0; i < count; ++i) {
      if (cut[i]) saved.push_back(i);
    }
    return {saved, banned_order_};
  }

 private:
  int in(int i) const { return 2 * i; }
  int out(int i) const { return 2 * i + 1; }
  int source() const { return static_cast<int>(2 * g_.nodes.size()); }
  int sink() const { return source() + 1; }

  bool materialized(int i) const {
    if (g_.nodes[i].op == JointNode::Op::Placeholder) return true;
    for (std::int32_t u : g_.nodes[i].users) {
      if (!g_.fusible(i, u)) return true;
    }
    return false;
  }
  bool materialized_backwards(int i) const {
    if (g_.nodes[i].has(JointNode::View)) return false;
    std::vector<int> pending{i};
    while (!pending.empty()) {
      int cur = pending.back();
      pending.pop_back();
      for (std::int32_t u : g_.nodes[cur].users) {
        if (!info_.required_fw[u] && !g_.fusible(cur, u)) return true;
        if (g_.nodes[u].has(JointNode::View)) pending.push_back(u);
      }
    }
    return false;
  }
  bool should_ban(int i) const {
    const JointNode& n = g_.nodes[i];
    const PartitionerConfig& c = g_.config;
    if (n.op != JointNode::Op::CallFunction || n.has(JointNode::GetItem)) return false;
    if (n.has(JointNode::MustSave)) return true;
    if (c.recompute_views && n.has(JointNode::View)) return false;
    if (n.has(JointNode::LiftFresh) || n.has(JointNode::DeviceValue)) return false;
    if (options_.not_in_allowlist) {
      if (!n.has(JointNode::Recomputable)) return true;
    } else if (n.has(JointNode::Random) || n.has(JointNode::ComputeIntensive) || n.has(JointNode::NonBuiltin)) {
      return true;
    }
    if (options_.materialized_backward && materialized_backwards(i)) return true;
    std::int64_t dist = info_.dist_from_bw[i];
    if (dist < 1000 && dist > c.max_dist_from_bw) return true;
    if (options_.reduction) {
      std::int64_t inputs = 0;
      for (std::int32_t a : n.args) inputs += g_.nodes[a].bytes;
      if (n.bytes * 4 < inputs) return true;
    }
    return false;
  }
  std::int64_t node_weight(int i) const {
    const JointNode& n = g_.nodes[i];
    if (n.has(JointNode::EpilogueMutation)) return kInf;
    if (g_.config.treat_parameters_as_free_to_save && n.has(JointNode::Static)) return 0;
    if (g_.config.recompute_views && n.has(JointNode::View)) return kInf;
    std::int64_t bias = std::max<std::int64_t>(std::min<std::int64_t>(info_.dist_from_bw[i], 100), 1);
    // int(mem_sz * 1.1 ** k), in doubles as Python computes it.
    auto weight = static_cast<std::int64_t>(static_cast<double>(n.bytes) * std::pow(1.1, static_cast<double>(bias)));
    return materialized(i) ? weight : weight * 2;
  }
  void ban(int i) {
    const JointNode& n = g_.nodes[i];
    if (n.has(JointNode::View)) return;
    if (dont_ban_[i] && !n.has(JointNode::Collective)) return;
    if (n.has(JointNode::MustRecompute)) return;
    if (n.value == JointNode::Value::Sym && n.sym_size == 4) return;  // a SymFloat is never banned
    if (banned_[i]) return;  // its edge from the source is there already
    banned_[i] = true;
    banned_order_.push_back(i);
    network_.set_edge(source(), in(i), kInf);
  }
  std::int64_t first_unfusible(const std::vector<std::int32_t>& starts, std::int64_t max_range) const {
    // A heap of (fw order, fusible), the node being the one of that order.
    using Entry = std::tuple<std::int64_t, bool, std::int32_t>;
    std::vector<Entry> heap;
    auto cmp = [](const Entry& a, const Entry& b) { return a > b; };
    auto contains = [&](const Entry& e) { return std::find(heap.begin(), heap.end(), e) != heap.end(); };
    for (std::int32_t s : starts) {
      heap.emplace_back(info_.fw_order[s], true, s);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), cmp);
      auto [order, is_fusible, node] = heap.back();
      heap.pop_back();
      if (!is_fusible) return order;
      for (std::int32_t u : g_.nodes[node].users) {
        if (!info_.required_fw[u] || info_.fw_order[u] > max_range) continue;
        Entry e{info_.fw_order[u], g_.fusible(node, u), u};
        if (!contains(e)) {
          heap.push_back(e);
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
    }
    return max_range;
  }
  void ban_used_far_apart() {
    for (std::int32_t used : info_.required_fw_nodes) {
      std::vector<std::int32_t> fw_users;
      std::int64_t last = -1;
      for (std::int32_t u : g_.nodes[used].users) {
        if (info_.required_fw[u]) {
          fw_users.push_back(u);
          last = std::max(last, info_.fw_order[u]);
        }
      }
      if (fw_users.empty()) continue;
      std::int64_t first = first_unfusible(fw_users, last);
      for (std::int32_t u : g_.nodes[used].users) {
        if (info_.required_fw[u] && info_.fw_order[u] > first && g_.fusible(used, u) && !banned_[u]) ban(u);
      }
    }
  }
  void ban_long_fusible_chains() {
    std::vector<bool> visited(g_.nodes.size(), false);
    for (std::size_t start = 0; start < g_.nodes.size(); ++start) {
      if (!info_.required_fw[start]) continue;
      using Entry = std::pair<std::int64_t, std::int32_t>;
      std::priority_queue<Entry, std::vector<Entry>, std::greater<>> chain;
      const std::int64_t start_order = info_.fw_order[start];
      chain.emplace(start_order, static_cast<std::int32_t>(start));
      while (!chain.empty()) {
        std::int32_t cur = chain.top().second;
        chain.pop();
        if (visited[cur]) continue;
        visited[cur] = true;
        if (info_.fw_order[cur] > start_order + 100 && chain.empty()) {
          ban(cur);
          break;
        }
        for (std::int32_t u : g_.nodes[cur].users) {
          if (info_.required_fw[u] && g_.fusible(cur, u) && !banned_[u]) chain.emplace(info_.fw_order[u], u);
        }
      }
    }
  }

  const JointGraph& g_;
  const NodeInfo& info_;
  MinCutOptions options_;
  const std::vector<bool>& dont_ban_;
  std::vector<bool> banned_;
  std::vector<std::int32_t> banned_order_;
  FlowNetwork network_;
};

std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> solve_min_cut(
    const JointGraph& g, const NodeInfo& info, MinCutOptions options, const std::vector<bool>& dont_ban) {
  return MinCut(g, info, options, dont_ban).solve();
}

/// dp_knapsack (torch/_functorch/_activation_checkpointing/knapsack.py): memories quantized by
/// 10,000, runtimes summed in float32. Returns the items it recomputes.
std::vector<std::size_t> knapsack_recomputed(const std::vector<double>& memory, const std::vector<double>& runtime,
                                             double max_memory) {
  constexpr double kScale = 10000;
  const std::size_t n = memory.size();
  std::vector<std::int64_t> quantized(n);
  for (std::size_t i = 0; i < n; ++i) quantized[i] = static_cast<std::int64_t>(std::nearbyint(memory[i] * kScale));
  const auto capacity = static_cast<std::int64_t>(std::nearbyint(max_memory * kScale));
  if (capacity > 100000000) throw Error("the compiled step's memory budget knapsack is too large to solve");
  const std::size_t width = static_cast<std::size_t>(capacity) + 1;
  std::vector<float> dp((n + 1) * width, 0.0f);
  auto row = [&](std::size_t i) { return dp.begin() + static_cast<std::ptrdiff_t>(i * width); };
  for (std::size_t i = 1; i <= n; ++i) {
    const std::int64_t m = quantized[i - 1];
    const auto r = static_cast<float>(runtime[i - 1]);
    auto prev = row(i - 1);
    auto cur = row(i);
    for (std::size_t j = 0; j < width; ++j) {
      if (m == 0) {
        cur[j] = prev[j] + r;
      } else if (static_cast<std::int64_t>(j) >= m) {
        cur[j] = std::max(prev[j], prev[j - static_cast<std::size_t>(m)] + r);
      } else {
        cur[j] = prev[j];
      }
    }
  }
  std::vector<std::size_t> recomputed;
  std::int64_t j = capacity;
  for (std::size_t i = n; i > 0; --i) {
    if (row(i)[j] != row(i - 1)[j]) {
      j -= quantized[i - 1];
    } else {
      recomputed.push_back(i - 1);
    }
  }
  return recomputed;
}

}  // namespace

std::vector<std::int32_t> choose_saved_values(const JointGraph& g, double memory_budget) {
  if (!(memory_budget >= 0 && memory_budget <= 1)) {
    throw Error("activation memory budget " + std::to_string(memory_budget) +
                ": expected a share of the default partition's activations from 0 to 1");
  }
  const NodeInfo info = classify(g);
  if (std::none_of(info.required_bw.begin(), info.required_bw.end(), [](bool b) { return b; })) {
    // PyTorch hands such a graph to its default partition, which vramscope does not model.
    throw Error("the compiled step's joint graph has no backward (no tangent reaches a gradient)");
  }
  const PartitionerConfig& c = g.config;
  MinCutOptions options{c.ban_recompute_used_far_apart, c.ban_recompute_long_fusible_chains,
                        c.ban_recompute_materialized_backward, c.ban_recompute_not_in_allowlist,
                        c.ban_recompute_reductions};
  if (c.aggressive_recomputation) {
    options.used_far_apart = options.long_fusible_chains = options.materialized_backward = false;
    options.not_in_allowlist = false;
  }
  bool input_mutation = false;
  for (std::int32_t i : info.inputs) input_mutation = input_mutation || g.nodes[i].has(JointNode::EpilogueMutation);
  if (memory_budget == 0 && !input_mutation) return info.inputs;
  const std::vector<bool> none(g.nodes.size(), false);
  auto [default_saved, default_banned] = solve_min_cut(g, info, options, none);
  if (memory_budget == 1) return default_saved;

  auto gigabytes = [&](const std::vector<std::int32_t>& nodes) {
    double sum = 0;
    for (std::int32_t i : nodes) sum += static_cast<double>(g.nodes[i].bytes);
    return sum / 1e9;
  };
  const double least = gigabytes(info.inputs);
  const double most = gigabytes(default_saved);
  if (most <= least) return default_saved;
  auto ratio = [&](const std::vector<std::int32_t>& nodes) { return (gigabytes(nodes) - least) / (most - least); };

  MinCutOptions more = options;
  more.used_far_apart = more.long_fusible_chains = more.materialized_backward = false;
  auto more_saved = solve_min_cut(g, info, more, none).first;
  if (ratio(more_saved) < memory_budget) return more_saved;
  MinCutOptions aggressive = more;
  aggressive.not_in_allowlist = false;
  auto [aggressive_saved, banned] = solve_min_cut(g, info, aggressive, none);
  if (ratio(aggressive_saved) < memory_budget) return aggressive_saved;

  // The banned nodes the backward needs that are no view of an input: the knapsack's items,
  // largest first (a stable sort, as Python's).
  std::set<std::int32_t> input_storages;
  for (std::int32_t i : info.inputs) input_storages.insert(g.nodes[i].storage);
  std::vector<std::int32_t> items;
  for (std::int32_t b : banned) {
    const JointNode& n = g.nodes[b];
    if (info.dist_from_bw[b] >= kFar) continue;
    if (input_storages.count(n.storage) != 0 && !n.has(JointNode::NonBuiltin)) continue;
    if (n.has(JointNode::MustSave)) continue;
    items.push_back(b);
  }
  if (items.empty()) return aggressive_saved;
  std::stable_sort(items.begin(), items.end(),
                   [&](std::int32_t a, std::int32_t b) { return g.nodes[a].bytes > g.nodes[b].bytes; });
  std::vector<double> memory, runtime;
  for (std::int32_t b : items) {
    memory.push_back((static_cast<double>(g.nodes[b].bytes) / 1e9) / (most - least));
    if (g.nodes[b].flops < 0) {
      throw Error("the compiled step's node " + g.nodes[b].name + " has no FLOPs recorded (record the file again)");
    }
    runtime.push_back(static_cast<double>(std::max<std::int64_t>(g.nodes[b].flops, 1)));
  }
  std::vector<bool> dont_ban(g.nodes.size(), false);
  for (std::size_t k : knapsack_recomputed(memory, runtime, memory_budget)) dont_ban[items[k]] = true;
  return solve_min_cut(g, info, aggressive, dont_ban).first;
}

}  // namespace mem::nn
