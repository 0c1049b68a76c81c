// compiled_step.cpp — the torch.compile'd step's two graphs on the caching allocator
// (compiled.hpp says what is modelled of inductor's buffers).
//
// The forward graph is every node the forward's outputs and the saved values are made from;
// the backward graph every node the gradients are made from, starting at the saved values and
// the loss's gradient: a forward node it reaches that was not saved is recomputed there
// (min_cut_rematerialization_partition's _extract_fwd_bwd_modules).
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {
namespace {

/// The nodes `roots` are made from, themselves included; a node `stop` says is reached but not
/// gone through (a graph's inputs).
template <typename Stop>
std::vector<bool> made_from(const JointGraph& g, std::vector<std::int32_t> pending, Stop&& stop) {
  std::vector<bool> reached(g.nodes.size(), false);
  while (!pending.empty()) {
    const std::int32_t v = pending.back();
    pending.pop_back();
    if (reached[v]) continue;
    reached[v] = true;
    if (stop(v)) continue;
    for (std::int32_t in : g.nodes[v].inputs) pending.push_back(in);
  }
  return reached;
}

/// The node whose buffer `n` shares, or -1: a view; `_unsafe_view`, `reshape` and `alias`, which
/// inductor lowers to views of their input; an element of `split`, `split_with_sizes`, `unbind`
/// or `chunk`, a view of the tensor split.
std::int32_t alias_of(const JointGraph& g, std::int32_t n) {
  static const char* const kViewLike[] = {"aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default"};
  static const char* const kSplits[] = {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int",
                                        "aten.chunk.default"};
  const JointNode& node = g.nodes[n];
  if (node.op != JointNode::Op::CallFunction || node.args.empty()) return -1;
  if (node.has(JointNode::View) ||
      std::find(std::begin(kViewLike), std::end(kViewLike), node.target) != std::end(kViewLike)) {
    return node.args.front();
  }
  if (node.has(JointNode::GetItem)) {
    const JointNode& producer = g.nodes[node.args.front()];
    if (!producer.args.empty() &&
        std::find(std::begin(kSplits), std::end(kSplits), producer.target) != std::end(kSplits)) {
      return producer.args.front();
    }
  }
  return -1;
}

/// Every parameter and buffer under `root` by its dotted name (PyTorch's named_parameters()).
void collect(Module& m, std::unordered_map<std::string, Tensor>& into) {
  for (const ParamSlot& slot : m.slots()) {
    into.emplace(m.path().empty() ? slot.name : m.path() + "." + slot.name, slot.tensor);
  }
  for (const auto& [name, child] : m.children()) collect(*child, into);
}

/// One graph of the step: its nodes in order, and how each one's buffer lives.
struct Schedule {
  std::vector<std::int32_t> nodes;          // in graph order
  std::vector<bool> member, buffer, output;
  std::vector<std::int32_t> last_reader;    // position in `nodes` after which a node's handle goes (-1: at once)
};

/// The backward graph's order (partitioners.py, reordering_to_mimic_autograd_engine): from the
/// first node that reads a tangent on, each node in turn, brought in with the ancestors it still
/// lacks (in graph order), so a recomputed forward value is made only when the backward needs
/// it rather than all at the graph's start. `inputs`: what the graph is given (placeholders).
std::vector<std::int32_t> mimic_autograd(const JointGraph& g, const std::vector<std::int32_t>& nodes,
                                         const std::vector<bool>& inputs) {
  std::vector<bool> placed(g.nodes.size(), false);
  std::vector<std::int32_t> out;
  std::size_t first = nodes.size();
  for (std::size_t pos = 0; pos < nodes.size(); ++pos) {
    const std::int32_t n = nodes[pos];
    if (inputs[n]) {
      placed[n] = true;
      out.push_back(n);
    }
    if (first == nodes.size() && !inputs[n]) {
      for (std::int32_t in : g.nodes[n].inputs) {
        if (g.nodes[in].op == JointNode::Op::Placeholder && g.nodes[in].input == JointNode::Input::Tangent) {
          first = pos;
        }
      }
    }
  }
  if (first == nodes.size()) return nodes;
  std::vector<bool> found_now(g.nodes.size(), false);
  auto insert = [&](std::int32_t node) {
    std::vector<std::int32_t> pending{node}, found;
    while (!pending.empty()) {
      const std::int32_t v = pending.back();
      pending.pop_back();
      if (placed[v] || found_now[v]) continue;
      found_now[v] = true;
      found.push_back(v);
      for (std::int32_t in : g.nodes[v].inputs) pending.push_back(in);
    }
    std::sort(found.begin(), found.end());
    for (std::int32_t v : found) {
      found_now[v] = false;
      placed[v] = true;
      out.push_back(v);
    }
  };
  for (std::size_t pos = 0; pos < first; ++pos) {
    if (g.nodes[nodes[pos]].target == "aten.copy_.default") insert(nodes[pos]);
  }
  for (std::size_t pos = first; pos < nodes.size(); ++pos) insert(nodes[pos]);
  // The output node comes last and brings in what is still missing (a gradient made before the
  // first tangent's reader), in graph order.
  for (std::int32_t n : nodes) {
    if (!placed[n]) out.push_back(n);
  }
  return out;
}

Schedule schedule(const JointGraph& g, const std::vector<bool>& member, const std::vector<bool>& output,
                  const std::vector<bool>* backward_inputs = nullptr) {
  const std::size_t count = g.nodes.size();
  Schedule s;
  s.member = member;
  s.output = output;
  s.buffer.assign(count, false);
  s.last_reader.assign(count, -1);
  for (std::size_t i = 0; i < count; ++i) {
    if (member[i]) s.nodes.push_back(static_cast<std::int32_t>(i));
  }
  if (backward_inputs) s.nodes = mimic_autograd(g, s.nodes, *backward_inputs);
  // Which values need memory, readers first so a view's need reaches its base.
  std::vector<bool> needed(count, false);
  for (auto it = s.nodes.rbegin(); it != s.nodes.rend(); ++it) {
    const std::int32_t n = *it;
    const JointNode& node = g.nodes[n];
    if (node.op != JointNode::Op::CallFunction) continue;
    if (node.value != JointNode::Value::Tensor) {
      // A split's elements view its input: the tuple needs that buffer when one of them does.
      for (std::int32_t u : node.users) needed[n] = needed[n] || (member[u] && needed[u] && alias_of(g, u) >= 0);
      continue;
    }
    bool need = output[n] || !node.has(JointNode::Fusible) || node.has(JointNode::Reduction) || node.has(JointNode::GetItem);
    for (std::int32_t u : node.users) {
      if (!member[u] || g.nodes[u].op == JointNode::Op::Output) continue;
      const bool split_of_n = g.nodes[u].value != JointNode::Value::Tensor && needed[u];
      if (!g.fusible(n, u) || (alias_of(g, u) == n && needed[u]) || split_of_n) need = true;
    }
    needed[n] = need;
    s.buffer[n] = need && alias_of(g, n) < 0;
  }
  for (std::size_t pos = 0; pos < s.nodes.size(); ++pos) {
    for (std::int32_t in : g.nodes[s.nodes[pos]].inputs) s.last_reader[in] = static_cast<std::int32_t>(pos);
  }
  return s;
}

/// The most bytes the schedule's buffers hold at once: each from its kernel to its last reader
/// (an output to the graph's end), with the activations the graph is given (the backward's saved
/// values and tangent) from its start to their last reader; parameters and the batch are not
/// counted.
/// `extra`: buffers made at the graph's start, each {bytes, position after which it goes}.
std::int64_t buffer_peak(const JointGraph& g, const Schedule& s, const std::vector<bool>* inputs = nullptr,
                         const std::vector<std::pair<std::int64_t, std::int32_t>>& extra = {}) {
  auto given = [&](std::int32_t n) {
    const JointNode& node = g.nodes[n];
    return inputs && (*inputs)[n] && node.value == JointNode::Value::Tensor &&
           (node.op != JointNode::Op::Placeholder || node.input == JointNode::Input::Tangent);
  };
  // A given view of a primal or of another given value holds no bytes of its own.
  auto counted = [&](std::int32_t n) {
    if (!given(n)) return false;
    const std::int32_t base = alias_of(g, n);
    if (base < 0) return true;
    return !(given(base) || g.nodes[base].op == JointNode::Op::Placeholder);
  };
  // A view's buffer is its base's: the bytes go when the last of them has been read.
  std::vector<std::int32_t> base(g.nodes.size());
  for (std::size_t i = 0; i < g.nodes.size(); ++i) base[i] = static_cast<std::int32_t>(i);
  std::vector<std::int32_t> last(g.nodes.size(), -1);
  const auto end = static_cast<std::int32_t>(s.nodes.size());
  for (std::int32_t pos = 0; pos < end; ++pos) {
    const std::int32_t n = s.nodes[static_cast<std::size_t>(pos)];
    if (const std::int32_t of = alias_of(g, n); of >= 0 && !s.buffer[n] && !given(n)) base[n] = base[of];
    last[base[n]] = std::max({last[base[n]], s.output[n] ? end : s.last_reader[n], pos});
  }
  std::vector<std::vector<std::int32_t>> frees(s.nodes.size() + 1);
  std::vector<std::int64_t> extra_frees(s.nodes.size() + 1, 0);
  std::int64_t live = 0, peak = 0;
  for (const auto& [bytes, last_pos] : extra) {
    live += bytes;
    if (last_pos >= 0 && last_pos < end) extra_frees[static_cast<std::size_t>(last_pos)] += bytes;
  }
  for (std::int32_t n : s.nodes) {
    if ((s.buffer[n] && !given(n)) || counted(n)) frees[static_cast<std::size_t>(std::max(last[n], 0))].push_back(n);
    if (counted(n)) live += g.nodes[n].bytes;
  }
  peak = live;
  for (std::size_t pos = 0; pos < s.nodes.size(); ++pos) {
    const std::int32_t n = s.nodes[pos];
    if (s.buffer[n] && !given(n)) {
      live += g.nodes[n].bytes;
      peak = std::max(peak, live);
    }
    for (std::int32_t f : frees[pos]) live -= g.nodes[f].bytes;
    live -= extra_frees[pos];
  }
  return peak;
}

}  // namespace

/// A channels-last copy inductor makes of a parameter or input a convolution reads.
struct LayoutCopy {
  std::int32_t primal = -1;
  std::int32_t forward_last = -1;  // the forward position of its last convolution
  bool keep = false;               // the backward reads it
};

namespace {

/// CUDA graphs (mode="reduce-overhead"): the tree manager's pool and side stream, and the pool's
/// users the step holds (the manager's empty capture, each recorded graph).
struct GraphTree {
  CachingAllocator* allocator = nullptr;
  PoolId pool = 0;
  StreamId stream = 0;
  int pool_users = 0;
};

}  // namespace

struct CompiledStep::State {
  std::shared_ptr<const CompiledModel> model;
  std::vector<Tensor> values;              // per node: its buffer (a view: its base's), while alive
  std::vector<Tensor> held;                // the primals: parameters, buffers, the batch
  std::unordered_map<std::string, Tensor> named;
  Schedule forward, backward;
  std::vector<bool> recomputed;
  std::vector<bool> backward_inputs;  // the saved values the backward reads, the tangents, the primals
  std::vector<LayoutCopy> copies;
  std::vector<Tensor> copy_tensors;
  GraphTree tree;
  std::vector<bool> input_copy;  // a batch tensor the recording copied into the pool (an activation now)
  int forward_calls = 0, backward_calls = 0;  // each graph's calls (0: the next is its warmup)
};

namespace {

/// One call of a graph under CUDA graph trees: on the manager's stream, its blocks from the
/// manager's pool (cudagraph_trees.py: CUDAWarmupNode.run and CUDAGraphNode._record run the
/// graph inside _use_cuda_memory_pool_manager / torch.cuda.graph(pool=...)), cuBLAS's
/// workspaces cleared around it (clear_cublas_manager). A replay allocates nothing on a GPU:
/// here it runs the recording's allocations again in the pool, into the memory they had.
class GraphCall {
 public:
  GraphCall(Runtime& rt, GraphTree& st, int call) : rt_(rt), st_(st), call_(call) {
    CachingAllocator& alloc = rt.allocator();
    if (st.pool == 0) {
      // CUDAGraphTreeManager.__init__: a side stream, a pool, and an empty capture into it whose
      // graph keeps the pool alive ("Keeps Memory Pool Alive").
      st.allocator = &alloc;
      st.stream = alloc.device().create_stream();
      st.pool = alloc.graph_pool_handle();
      alloc.begin_allocate_to_pool(st.pool, st.stream);
      alloc.end_allocate_to_pool(st.pool);
      st.pool_users = 1;
    }
    // torch.cuda.graph.__enter__ empties the cache before a capture (torch/cuda/graphs.py).
    if (call == 1) alloc.empty_cache();
    rt.clear_gemm_workspaces();
    stream_.emplace(rt, st.stream);
    alloc.begin_allocate_to_pool(st.pool, st.stream);
  }
  ~GraphCall() {
    rt_.clear_gemm_workspaces();  // their blocks go back to the pool
    try {
      CachingAllocator& alloc = rt_.allocator();
      alloc.end_allocate_to_pool(st_.pool);
      if (call_ == 1) {
        ++st_.pool_users;  // the recorded graph holds the pool
      } else {
        alloc.release_pool(st_.pool);
      }
    } catch (const Error&) {
      // The capture was begun in the constructor: ending it cannot fail.
    }
  }
  GraphCall(const GraphCall&) = delete;
  GraphCall& operator=(const GraphCall&) = delete;
  /// The recording and the replays copy the graph's inputs that are not static into the pool.
  bool copies_inputs() const noexcept { return call_ >= 1; }

 private:
  Runtime& rt_;
  GraphTree& st_;
  int call_;
  std::optional<StreamGuard> stream_;
};

}  // namespace

CompiledStep::CompiledStep(std::shared_ptr<const CompiledModel> model, CompileMode mode, Module& root)
    : state_(std::make_unique<State>()), mode_(mode) {
  const JointGraph& g = model->graph;
  saved_ = choose_saved_values(g, mode.memory_budget);
  state_->model = std::move(model);
  collect(root, state_->named);
  const std::size_t count = g.nodes.size();
  std::vector<bool> is_saved(count, false);
  for (std::int32_t v : saved_) is_saved[v] = true;
  // The backward: what the gradients are made from, down to the saved values and the tangents.
  const std::vector<std::int32_t> grads(g.outputs.begin() + g.forward_outputs, g.outputs.end());
  const std::vector<bool> in_backward = made_from(g, grads, [&](std::int32_t v) {
    return is_saved[v] || g.nodes[v].op == JointNode::Op::Placeholder;
  });
  std::vector<bool> backward_out(count, false);
  for (std::int32_t v : grads) backward_out[v] = true;
  // The forward: what its outputs and the saved values the backward reads are made from (a saved
  // value no backward node reads is dropped from the forward's outputs, _extract_fwd_bwd_modules).
  std::vector<std::int32_t> returned(g.outputs.begin(), g.outputs.begin() + g.forward_outputs);
  for (std::int32_t v : saved_) {
    if (!in_backward[v]) continue;
    returned.push_back(v);
    if (g.nodes[v].op != JointNode::Op::Placeholder) saved_bytes_ += g.nodes[v].bytes;
  }
  const std::vector<bool> in_forward = made_from(g, returned, [](std::int32_t) { return false; });
  std::vector<bool> forward_out(count, false);
  for (std::int32_t v : returned) forward_out[v] = true;
  // What the backward computes that the forward computed too: recomputed.
  state_->recomputed.assign(count, false);
  for (std::size_t i = 0; i < count; ++i) {
    const JointNode& n = g.nodes[i];
    if (in_backward[i] && in_forward[i] && !is_saved[i] && n.op != JointNode::Op::Placeholder) {
      state_->recomputed[i] = true;
      ++recomputed_;
    }
  }
  // The backward graph's inputs: the saved values it reads and the tangents.
  std::vector<bool>& backward_inputs = state_->backward_inputs;
  backward_inputs.assign(count, false);
  for (std::size_t i = 0; i < count; ++i) {
    backward_inputs[i] = in_backward[i] && (is_saved[i] || g.nodes[i].op == JointNode::Op::Placeholder);
  }
  state_->forward = schedule(g, in_forward, forward_out);
  state_->backward = schedule(g, in_backward, backward_out, &backward_inputs);
  plan_layout_copies(g, in_forward, in_backward);
  std::vector<std::pair<std::int64_t, std::int32_t>> copies;
  for (const LayoutCopy& c : state_->copies) {
    copies.emplace_back(g.nodes[c.primal].bytes, c.keep ? -1 : c.forward_last);
  }
  forward_peak_ = buffer_peak(g, state_->forward, nullptr, copies);
  backward_peak_ = buffer_peak(g, state_->backward, &backward_inputs);
  state_->values.resize(count);
  state_->input_copy.assign(count, false);
  for (std::size_t i = 0; i < count; ++i) {
    const JointNode& n = g.nodes[i];
    if (n.op != JointNode::Op::Placeholder) continue;
    if (in_forward[i] && (n.input == JointNode::Input::Tangent || n.input == JointNode::Input::BwdSeed)) {
      throw Error("the compiled step's forward reads " + n.name + ", which only the backward has");
    }
    if (n.input != JointNode::Input::Primal) continue;
    const auto colon = n.primal.find(": ");
    const std::string kind = n.primal.substr(0, colon), name = colon == std::string::npos ? "" : n.primal.substr(colon + 2);
    if (kind == "param" || kind == "buffer") {
      const auto it = state_->named.find(name);
      if (it == state_->named.end()) {
        throw Error("the compiled step reads " + n.primal + ", which the model does not have (record the file again)");
      }
      if (it->second.defined() && (!(it->second.shape() == n.shape) || it->second.dtype() != n.dtype)) {
        throw Error("the compiled step was recorded with " + name + " as " + n.shape.str() + " " +
                    std::string(dtype_name(n.dtype)) + "; this run has " + it->second.shape().str() + " " +
                    std::string(dtype_name(it->second.dtype())) + " (run it with --dtype " +
                    std::string(dtype_name(n.dtype)) + ")");
      }
    } else if (kind != "input") {
      throw Error("the compiled step's input " + n.name + " is " + (n.primal.empty() ? "unnamed" : n.primal) +
                  ": only parameters, buffers and the batch's tensors are modelled");
    }
  }
}

CompiledStep::~CompiledStep() {
  State& st = *state_;
  // The manager and the recorded graphs go: the pool has no user left, and empty_cache may give
  // its segments back once its blocks (the step's values, a parameter's .grad) are freed.
  for (; st.tree.pool_users > 0; --st.tree.pool_users) {
    try {
      st.tree.allocator->release_pool(st.tree.pool);
    } catch (const Error&) {
      break;
    }
  }
}

PoolId CompiledStep::graph_pool() const noexcept { return state_->tree.pool; }

void CompiledStep::plan_layout_copies(const JointGraph& g, const std::vector<bool>& in_forward,
                                      const std::vector<bool>& in_backward) {
  // torch/_inductor/graph.py, decide_layout_opt, for a training graph on a GPU: channels last
  // unless a convolution is grouped (over one input channel each), has half the output channels
  // of its input's or fewer (a spatial kernel), all are small (64 channels or fewer), or there
  // are 300 nodes per convolution or more.
  std::vector<std::int32_t> convs;
  std::size_t nodes = 1;  // the output node
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const JointNode& n = g.nodes[i];
    if (n.op == JointNode::Op::Placeholder && n.input != JointNode::Input::Tangent &&
        n.input != JointNode::Input::BwdSeed) {
      ++nodes;
    } else if (in_forward[i] && n.op == JointNode::Op::GetAttr) {
      ++nodes;
    } else if (in_forward[i] && n.op == JointNode::Op::CallFunction) {
      ++nodes;
      if (n.conv_groups > 0 && n.args.size() >= 2) convs.push_back(static_cast<std::int32_t>(i));
    }
  }
  if (convs.empty() || nodes >= 300 * convs.size()) return;
  bool all_small = true;
  for (std::int32_t c : convs) {
    const Shape& w = g.nodes[g.nodes[c].args[1]].shape;
    if (w.size() < 3) return;
    if (g.nodes[c].conv_groups > 1 && w[1] > 1) return;
    if (w[0] * 2 <= w[1] && w[2] > 1) return;
    all_small = all_small && w[0] <= 64 && w[1] <= 64;
  }
  if (all_small) return;
  channels_last_ = true;
  std::vector<std::int32_t> position(g.nodes.size(), -1);
  for (std::size_t pos = 0; pos < state_->forward.nodes.size(); ++pos) {
    position[state_->forward.nodes[pos]] = static_cast<std::int32_t>(pos);
  }
  for (std::int32_t c : convs) {
    for (std::size_t a = 0; a < 2; ++a) {
      const std::int32_t p = g.nodes[c].args[a];
      const JointNode& primal = g.nodes[p];
      if (primal.op != JointNode::Op::Placeholder || primal.shape.size() != 4) continue;
      auto it = std::find_if(state_->copies.begin(), state_->copies.end(),
                             [&](const LayoutCopy& copy) { return copy.primal == p; });
      if (it == state_->copies.end()) {
        state_->copies.push_back({p, -1, in_backward[p]});
        it = std::prev(state_->copies.end());
      }
      it->forward_last = std::max(it->forward_last, position[c]);
    }
  }
}

namespace {

/// The side effects of a kernel on the device beside its output: cuBLAS's workspace and
/// library, cuDNN's (the runtime's rules for the eager operators, op_kernels.cpp).
void kernel_effects(Runtime& rt, const JointNode& n) {
  const std::string& t = n.target;
  if (t == "aten.mm.default" || t == "aten.bmm.default" || t == "aten.baddbmm.default") {
    rt.gemm_workspace(false);
  } else if (t == "aten.addmm.default") {
    rt.gemm_workspace(true);
  } else if (t.rfind("aten.convolution", 0) == 0 || t.rfind("aten._scaled_dot_product", 0) == 0 ||
             t.rfind("aten.cudnn", 0) == 0) {
    rt.uses_cudnn();
  }
}

/// Runs operator node `n` of a graph: its kernel's effects and FLOPs, then its output, a buffer
/// of its own or its base's (a fused value has none).
void run_kernel(Runtime& rt, const JointGraph& g, const Schedule& s, std::int32_t n, std::vector<Tensor>& values) {
  const JointNode& node = g.nodes[n];
  // Inductor's wrapper allocates the output, then calls the kernel (extern_kernels.mm(..., out=buf)),
  // which takes its workspace.
  if (s.buffer[n]) {
    values[n] = empty(rt, node.shape, node.dtype);
  } else if (const std::int32_t of = alias_of(g, n); of >= 0) {
    values[n] = values[of];
  }
  kernel_effects(rt, node);
  if (node.flops > 0) rt.add_flops(static_cast<double>(node.flops));
}

}  // namespace

Tensor CompiledStep::forward(Runtime& rt) {
  State& st = *state_;
  const JointGraph& g = st.model->graph;
  static const ContextId batch_ctx = intern_context("input", Phase::Forward);
  static const ContextId forward_ctx = intern_context("compiled forward", Phase::Forward);
  st.held.clear();
  {
    ModuleScope scope(batch_ctx);
    for (std::int32_t n : st.forward.nodes) {
      const JointNode& node = g.nodes[n];
      // The philox seed and offset of a random operator stay on the host.
      if (node.op != JointNode::Op::Placeholder || node.input != JointNode::Input::Primal) continue;
      if (node.primal.rfind("input: ", 0) == 0) {
        st.values[n] = empty(rt, node.shape, node.dtype);  // the batch, uploaded
      } else {
        st.values[n] = st.named.at(node.primal.substr(node.primal.find(": ") + 2));
      }
      st.held.push_back(st.values[n]);
    }
  }
  ModuleScope scope(forward_ctx);
  std::optional<GraphCall> graph_call;
  if (mode_.cudagraphs) {
    graph_call.emplace(rt, st.tree, st.forward_calls++);
    if (graph_call->copies_inputs()) {
      // The batch's tensors are copied into the pool; the graph frees each copy after its last
      // reader (parameters and buffers are static inputs: read where they are).
      for (std::int32_t n : st.forward.nodes) {
        const JointNode& node = g.nodes[n];
        if (node.op == JointNode::Op::Placeholder && node.primal.rfind("input: ", 0) == 0) {
          st.values[n] = empty(rt, node.shape, node.dtype);
          st.input_copy[n] = true;
        }
      }
    }
  }
  // Layout optimization's channels-last copies come first, as inductor's wrapper makes them.
  st.copy_tensors.clear();
  for (const LayoutCopy& c : st.copies) st.copy_tensors.push_back(empty(rt, g.nodes[c.primal].shape, g.nodes[c.primal].dtype));
  const Schedule& s = st.forward;
  for (std::size_t pos = 0; pos < s.nodes.size(); ++pos) {
    for (std::size_t k = 0; k < st.copies.size(); ++k) {
      if (!st.copies[k].keep && st.copies[k].forward_last + 1 == static_cast<std::int32_t>(pos)) st.copy_tensors[k] = Tensor{};
    }
    const std::int32_t n = s.nodes[pos];
    const JointNode& node = g.nodes[n];
    if (node.op == JointNode::Op::CallFunction) run_kernel(rt, g, s, n, st.values);
    for (std::int32_t in : node.inputs) {
      if (s.last_reader[in] == static_cast<std::int32_t>(pos) && !s.output[in]) st.values[in] = Tensor{};
    }
    if (s.last_reader[n] < 0 && !s.output[n]) st.values[n] = Tensor{};
  }
  for (std::size_t k = 0; k < st.copies.size(); ++k) {
    if (!st.copies[k].keep) st.copy_tensors[k] = Tensor{};
  }
  Tensor loss = st.values[g.outputs.front()];
  graph_call.reset();
  // What leaves the forward is the loss and the saved values; the other outputs go with the
  // output object the training loop drops.
  std::vector<bool> keep(g.nodes.size(), false);
  for (std::int32_t v : saved_) keep[v] = st.backward.member[v];
  keep[g.outputs.front()] = true;
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    if (!keep[i] && (g.nodes[i].op != JointNode::Op::Placeholder || st.input_copy[i])) st.values[i] = Tensor{};
  }
  return loss;
}

void CompiledStep::backward(Runtime& rt) {
  State& st = *state_;
  const JointGraph& g = st.model->graph;
  static const ContextId backward_ctx = intern_context("compiled backward", Phase::Backward);
  ModuleScope scope(backward_ctx);
  const Schedule& s = st.backward;
  // The loss's gradient (torch.ones_like(loss), which the autograd engine makes before it calls
  // the compiled backward): with CUDA graphs, outside the pool, and copied into it from the
  // recording on.
  std::vector<Tensor> seeds;
  std::optional<GraphCall> graph_call;
  if (mode_.cudagraphs) {
    std::vector<std::int32_t> tangents;
    for (std::int32_t n : s.nodes) {
      const JointNode& node = g.nodes[n];
      if (node.op == JointNode::Op::Placeholder && node.input == JointNode::Input::Tangent) tangents.push_back(n);
    }
    for (std::int32_t n : tangents) seeds.push_back(st.values[n] = empty(rt, g.nodes[n].shape, g.nodes[n].dtype));
    graph_call.emplace(rt, st.tree, st.backward_calls++);
    if (graph_call->copies_inputs()) {
      for (std::int32_t n : tangents) st.values[n] = empty(rt, g.nodes[n].shape, g.nodes[n].dtype);
    }
  }
  // The layout copies go after their last reader in the backward (at once if it reads none).
  std::vector<std::int32_t> copy_last;
  for (std::size_t k = 0; k < st.copies.size(); ++k) {
    const std::int32_t last = s.member[st.copies[k].primal] ? s.last_reader[st.copies[k].primal] : -1;
    copy_last.push_back(last);
    if (last < 0) st.copy_tensors[k] = Tensor{};
  }
  // A saved value the backward holds but never reads goes first (inductor's wrapper frees its
  // inputs); one it does not hold left with the forward.
  for (std::int32_t v : saved_) {
    if (s.member[v] && s.last_reader[v] < 0 && g.nodes[v].op != JointNode::Op::Placeholder) st.values[v] = Tensor{};
  }
  for (std::size_t pos = 0; pos < s.nodes.size(); ++pos) {
    const std::int32_t n = s.nodes[pos];
    const JointNode& node = g.nodes[n];
    if (node.op == JointNode::Op::Placeholder && node.input == JointNode::Input::Tangent) {
      if (!mode_.cudagraphs) st.values[n] = empty(rt, node.shape, node.dtype);  // the loss's gradient: torch.ones_like(loss)
    } else if (node.op == JointNode::Op::CallFunction && !st.backward_inputs[n]) {
      std::optional<PhaseGuard> rerun;
      if (st.recomputed[n]) rerun.emplace(Phase::Recompute);
      run_kernel(rt, g, s, n, st.values);
    }
    // The graph's own values and the loss's gradient go after their last reader; parameters and
    // the batch stay with their owners, except a batch tensor copied into the CUDA graphs' pool,
    // which the backward frees as a saved value.
    auto freeable = [&](std::int32_t v) {
      return !s.output[v] && (g.nodes[v].op != JointNode::Op::Placeholder || g.nodes[v].input == JointNode::Input::Tangent ||
                              st.input_copy[v]);
    };
    for (std::int32_t in : node.inputs) {
      if (s.last_reader[in] == static_cast<std::int32_t>(pos) && freeable(in)) st.values[in] = Tensor{};
    }
    if (s.last_reader[n] < 0 && freeable(n)) st.values[n] = Tensor{};
    for (std::size_t k = 0; k < st.copies.size(); ++k) {
      if (copy_last[k] == static_cast<std::int32_t>(pos)) st.copy_tensors[k] = Tensor{};
    }
  }
  graph_call.reset();  // the graph returns its outputs; autograd hands them on
  // Each gradient to its parameter's AccumulateGrad, as the compiled backward's outputs go: stolen
  // when nothing else holds it (the graph's handle is handed over), added in place to one there,
  // and from then on the parameter's `.grad` in snapshots. A gradient the graph made as a view of
  // another shape is that view (the parameter's shape), as inductor returns it.
  for (const JointNode& node : g.nodes) {
    if (node.op != JointNode::Op::Placeholder || node.grad < 0 || node.primal.rfind("param: ", 0) != 0) continue;
    Tensor grad = std::move(st.values[node.grad]);
    const Tensor param = st.named.at(node.primal.substr(7));
    if (!grad.defined() || !param.requires_grad()) continue;
    if (!(grad.shape() == param.shape()) && grad.numel() == param.numel()) grad = grad.view(param.shape());
    TensorList incoming{std::move(grad)};
    grad_accumulator(param)->apply(incoming);
  }
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].op != JointNode::Op::Placeholder || g.nodes[i].input == JointNode::Input::Tangent || st.input_copy[i]) {
      st.values[i] = Tensor{};
    }
  }
  std::fill(st.input_copy.begin(), st.input_copy.end(), false);
}

void CompiledStep::end_step() {
  State& st = *state_;
  st.held.clear();
  st.copy_tensors.clear();
  for (std::size_t i = 0; i < st.values.size(); ++i) st.values[i] = Tensor{};
}

}  // namespace mem::nn
