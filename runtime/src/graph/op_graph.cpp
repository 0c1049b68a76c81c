// op_graph.cpp — running a recorded operator graph (op_graph.hpp): the module calls as
// modules, the operators through the caching allocator, a node per operator that keeps
// what PyTorch's node kept.
#include "vramscope/runtime/op_graph.hpp"

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "engine/checkpoint_frame.hpp"
#include "engine/detail.hpp"
#include "graph/op_kernels.hpp"
#include "graph/op_rules.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn {

namespace {

using Kind = OpGraph::Kind;

/// What a saved tensor is to its op: input k, output k, or a parameter or buffer.
struct SaveRef {
  enum class From : std::uint8_t { Input, Output, Value } from = From::Input;
  std::int32_t index = 0;  ///< input or output index, or the graph index of another value
};

class OpCall;

/// One step of a call: one of its operators, or a child call.
struct Item {
  std::int32_t op = -1;  ///< the operator, or -1 for a child call
  OpCall* child = nullptr;
  const detail::OpRule* rule = nullptr;  ///< the operator's, looked up once
  std::vector<SaveRef> saves;
  std::vector<std::int32_t> frees;  ///< dropped after this step (OpSpec::frees and frees_after)
};

/// What the calls of one graph share.
struct GraphState {
  std::shared_ptr<const OpGraph> graph;
  Runtime* runtime = nullptr;
  DType run_dtype = DType::F32;
  /// Per graph tensor: the call whose slot holds it, and the slot (persistent tensors only).
  std::vector<std::pair<OpCall*, std::size_t>> owners;
  /// The values of the forward running now, by graph index: what the program's variables
  /// hold. An entry is dropped where the recording saw the last reference go (OpSpec::frees).
  /// A checkpointed call's recompute runs in an environment of its own.
  std::vector<Tensor>* env = nullptr;

  DType dtype_of(const OpGraph::TensorSpec& t) const noexcept { return t.follows_run_dtype ? run_dtype : t.dtype; }
};

/// Makes `env` the environment while it lives.
class EnvGuard {
 public:
  EnvGuard(GraphState& state, std::vector<Tensor>& env) noexcept : state_(state), previous_(state.env) {
    state.env = &env;
  }
  ~EnvGuard() { state_.env = previous_; }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  GraphState& state_;
  std::vector<Tensor>* previous_;
};

/// A tensor on `base`'s storage with `shape` (a view, an in-place result under another
/// shape): contiguous when it fits the storage, else a broadcast (stride 0), as expand makes.
Tensor view_on(const Tensor& base, const Shape& shape, DType dtype) {
  const std::size_t need = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  Shape strides = contiguous_strides(shape);
  if (need > base.storage()->nbytes()) {
    for (std::size_t d = 0; d < shape.size(); ++d) strides[d] = 0;
  }
  return detail::alias_of(base, shape, strides, 0, dtype);
}

/// A collective's outputs, each a buffer it received (Runtime::collectives).
void log_collective(Runtime& runtime, const std::string& op, const TensorList& made, bool backward) {
  for (const Tensor& t : made) {
    if (t.defined()) runtime.log_collective({op, t.nbytes(), backward});
  }
}

/// The node of a recorded operator: keeps the recorded tensors; backward hands each input
/// its gradient (op_rules.hpp).
class OpNode final : public Node {
 public:
  OpNode(std::shared_ptr<const OpGraph> graph, const OpGraph::OpSpec& spec, const detail::OpRule& rule,
         Runtime& runtime, const TensorList& inputs, double forward_flops)
      : graph_(std::move(graph)), spec_(spec), rule_(rule), runtime_(runtime), forward_flops_(forward_flops) {
    for (const Tensor& t : inputs) {
      shapes_.push_back(t.defined() ? t.shape() : Shape{});
      dtypes_.push_back(t.defined() ? t.dtype() : DType::F32);
    }
  }
  TensorList apply(TensorList& grads) override {
    // Unpacking rebuilds a checkpointed segment's tensors (or brings offloaded ones back), as
    // PyTorch's backward does when it first reads them; the formula's locals hold them until it
    // returns, after the gradients are made.
    TensorList unpacked;
    unpacked.reserve(saved_.size());
    for (const SavedTensor& s : saved_) unpacked.push_back(s.unpack());
    Tensor grad;
    for (const Tensor& g : grads) {
      if (g.defined()) {
        grad = g;
        break;
      }
    }
    TensorList result(shapes_.size());
    for (std::size_t i = 0; i < shapes_.size(); ++i) {
      if (!needs_input_grad(i)) continue;
      const bool passes = i < 32 && ((rule_.passes >> i) & 1u) != 0;
      if (passes && grad.defined() && grad.numel() == shapes_[i].numel() && grad.dtype() == dtypes_[i]) {
        result[i] = view_on(grad, shapes_[i], dtypes_[i]);
      } else {
        result[i] = empty(runtime_, shapes_[i], dtypes_[i]);
      }
    }
    detail::backward_effects(runtime_, rule_, forward_flops_, result);
    if (rule_.collective) log_collective(runtime_, spec_.op, result, true);
    return result;
  }
  void release_variables() noexcept override { saved_.clear(); }
  std::string_view name() const noexcept override { return spec_.node; }
  std::vector<SavedTensor>& saved() noexcept { return saved_; }

 private:
  std::shared_ptr<const OpGraph> graph_;  ///< keeps spec_ alive while the node is
  const OpGraph::OpSpec& spec_;
  const detail::OpRule& rule_;
  Runtime& runtime_;
  double forward_flops_;
  std::vector<Shape> shapes_;
  std::vector<DType> dtypes_;
  std::vector<SavedTensor> saved_;
};

class OpCall final : public Module {
 public:
  OpCall(std::shared_ptr<GraphState> state, std::int32_t call, std::string cls)
      : Module(std::move(cls)), state_(std::move(state)), call_(call) {}

  Tensor forward(const Tensor& input) override;

  OpCall& add_child(const std::string& name, std::unique_ptr<OpCall> child) {
    return add_module(name, std::move(child));
  }
  std::size_t declare(const OpGraph::TensorSpec& t, const std::string& name) {
    std::size_t slot;
    if (t.kind == Kind::Param) {
      slot = add_parameter(name, t.shape, 0, 0);
    } else {
      slot = t.follows_run_dtype ? add_buffer(name, t.shape, 0) : add_typed_buffer(name, t.shape, t.dtype);
    }
    configure_slot(slot, !t.follows_run_dtype, t.dtype, t.kind == Kind::Param && !t.requires_grad);
    return slot;
  }
  Tensor persistent(std::size_t slot) noexcept { return param(slot); }
  /// Under checkpoint(): the other tensors it reads from outside are checkpoint()'s inputs too.
  std::vector<Tensor> checkpoint_inputs() const override {
    std::vector<Tensor> extra;
    for (const std::int32_t t : saved_ins) extra.push_back(value(t));
    return extra;
  }
  void take_checkpoint_inputs(std::span<const Tensor> inputs) override { kept_.assign(inputs.begin(), inputs.end()); }
  // A call with keyword arguments only keeps no input under a non-reentrant checkpoint; the
  // reentrant one needs a tensor to hang its node on (PyTorch warns without one).
  bool checkpoint_saves_input() const override {
    return input_positional || (saved_ins.empty() && checkpoint_mark() == CheckpointMark::Reentrant);
  }

  std::vector<Item> items;
  /// The tensors it reads from outside (the first is the one it is called with) and the ones
  /// its caller reads after it (the first is the one it returns), as graph indices.
  std::vector<std::int32_t> ins, outs;
  /// Under checkpoint(): the inputs after the first that it keeps as its inputs (passed
  /// positionally), and those it holds as its closure does (keyword arguments).
  std::vector<std::int32_t> saved_ins, closure_ins;
  bool input_positional = true;  ///< its first input was passed positionally
  /// Set by the parent right before each call (a recompute runs without it).
  bool called = false;

 protected:
  void materialized(Runtime& runtime, DType dtype) override {
    state_->runtime = &runtime;
    state_->run_dtype = dtype;
  }

 private:
  Tensor value(std::int32_t t) const {
    if (state_->graph->tensors[static_cast<std::size_t>(t)].kind == Kind::Host) return Tensor{};
    const auto& owner = state_->owners[static_cast<std::size_t>(t)];
    if (owner.first != nullptr) return owner.first->persistent(owner.second);
    return (*state_->env)[static_cast<std::size_t>(t)];
  }
  void set(std::int32_t t, Tensor v) const { (*state_->env)[static_cast<std::size_t>(t)] = std::move(v); }
  void run_items();
  void run_op(const Item& item) const;

  std::shared_ptr<GraphState> state_;
  std::int32_t call_;
  TensorList kept_;     ///< under checkpoint(): its saved_ins, for the recompute
  TensorList closure_;  ///< and its closure_ins
};

Tensor OpCall::forward(const Tensor& input) {
  GraphState& st = *state_;
  if (st.runtime == nullptr) throw Error("internal: an operator graph ran before materialize()");
  const OpGraph& g = *st.graph;
  if (call_ == 0) {
    // Autocast's casts are operators of the recording: a graph runs under the autocast it was
    // recorded in, and only under it.
    const std::optional<DType> autocast = st.runtime->autocast();
    if (autocast != g.autocast) {
      const auto precision = [](std::optional<DType> a) {
        return !a ? std::string("f32, f16 or bf16") : *a == DType::BF16 ? std::string("amp-bf16") : std::string("amp");
      };
      const auto again = [](std::optional<DType> a) {
        if (!a) return std::string("without --amp");
        const std::string amp = "--amp " + std::string(dtype_name(*a));
        return "with " + amp + " (python -m vramscope.export ... " + amp + ")";
      };
      throw Error("this operator-level model was recorded " +
                  std::string(g.autocast ? "under autocast (" + std::string(dtype_name(*g.autocast)) + ")" : "without autocast") +
                  ", so it runs with --dtype " + precision(g.autocast) + "; for --dtype " + precision(autocast) +
                  ", export it again " + again(autocast));
    }
    // The step's forward. The batch's other tensors (labels, masks) come as the data loader's
    // copy to the device made them, before the forward.
    std::vector<Tensor> env(g.tensors.size());
    EnvGuard guard(st, env);
    env[static_cast<std::size_t>(g.inputs.front())] = input;
    for (std::size_t i = 1; i < g.inputs.size(); ++i) {
      const auto& t = g.tensors[static_cast<std::size_t>(g.inputs[i])];
      env[static_cast<std::size_t>(g.inputs[i])] = empty(*st.runtime, t.shape, st.dtype_of(t));
    }
    run_items();
    return env[static_cast<std::size_t>(g.output)];
  }
  if (called) {
    called = false;
    // The first run reads the caller's environment; checkpoint() hands the positional inputs
    // back (take_checkpoint_inputs) before a recompute, and the closure is captured here.
    kept_.clear();
    closure_.clear();
    if (checkpointed_call()) {
      for (const std::int32_t t : closure_ins) closure_.push_back(value(t));
    }
    // The input as hooks handed it on, for this call only: the caller's variable keeps the
    // tensor it passed.
    const Tensor passed = ins.empty() ? Tensor{} : value(ins.front());
    if (!ins.empty()) set(ins.front(), input);
    run_items();
    if (!ins.empty() && (*st.env)[static_cast<std::size_t>(ins.front())].is_same(input)) set(ins.front(), passed);
    return outs.empty() ? Tensor{} : value(outs.front());
  }
  // The recompute of a checkpointed call, in backward: in an environment of its own, from the
  // inputs checkpoint() kept.
  std::vector<Tensor> env(g.tensors.size());
  EnvGuard guard(st, env);
  TensorList kept = std::move(kept_), closure = std::move(closure_);
  kept_.clear();
  closure_.clear();
  if (ins.empty() || kept.size() != saved_ins.size() || closure.size() != closure_ins.size()) {
    throw Error("internal: " + path() + " recomputed without its inputs");
  }
  env[static_cast<std::size_t>(ins.front())] = input;
  for (std::size_t i = 0; i < saved_ins.size(); ++i) env[static_cast<std::size_t>(saved_ins[i])] = std::move(kept[i]);
  for (std::size_t i = 0; i < closure_ins.size(); ++i) env[static_cast<std::size_t>(closure_ins[i])] = std::move(closure[i]);
  run_items();
  return outs.empty() ? Tensor{} : value(outs.front());
}

void OpCall::run_items() {
  for (const Item& item : items) {
    if (item.child == nullptr) {
      run_op(item);
    } else {
      OpCall& child = *item.child;
      child.called = true;
      const Tensor out = child(child.ins.empty() ? Tensor{} : value(child.ins.front()));
      child.called = false;
      // What the caller holds is what the call returned (through hooks, or checkpoint()'s output).
      if (!child.outs.empty() && out.defined()) set(child.outs.front(), out);
    }
    for (const std::int32_t t : item.frees) set(t, Tensor{});
  }
}

void OpCall::run_op(const Item& item) const {
  const GraphState& st = *state_;
  const OpGraph::OpSpec& spec = st.graph->ops[static_cast<std::size_t>(item.op)];
  const detail::OpRule& rule = *item.rule;
  Runtime& rt = *st.runtime;
  TensorList in;
  in.reserve(spec.in.size());
  for (const std::int32_t t : spec.in) in.push_back(value(t));

  if (st.runtime->autocast() && spec.arg("autocast_cache") != 0 && spec.out.size() == 1 && in.size() == 1 &&
      in[0].defined()) {
    // Autocast's cast of a parameter: one per autocast region, held by its cache (rerun in
    // backward, a checkpointed call casts again in the rerun's own region).
    set(spec.out[0], rt.cached_cast(in[0], st.dtype_of(st.graph->tensors[static_cast<std::size_t>(spec.out[0])])));
    return;
  }
  if (rule.conversion && spec.out.size() == 1 && in.size() == 1 && in[0].defined() &&
      in[0].dtype() == st.dtype_of(st.graph->tensors[static_cast<std::size_t>(spec.out[0])])) {
    set(spec.out[0], in[0]);  // to() returns self without dispatching: nothing for a selective policy
    return;
  }
  // Selective checkpointing: a kept operator's outputs stay with the region's frame from the
  // forward, and its rerun takes them instead of running the operator (checkpoint.hpp).
  const detail::SaveHook hook = detail::selective_keeper(spec.op);
  const Runtime::OpObserver* observer = current_phase() == Phase::Forward ? rt.op_observer() : nullptr;
  const double flops_before = observer != nullptr ? rt.flops().forward : 0.0;
  detail::CheckpointFrame* keeper = hook.frame;
  std::optional<TensorList> reused;
  if (keeper != nullptr && hook.mode == detail::SaveMode::Recompute) reused = keeper->reuse_outputs(spec.op);
  const bool keeping = keeper != nullptr && hook.mode == detail::SaveMode::Pack;

  TensorList kept;
  detail::OutputCache cache{reused ? &*reused : nullptr, keeping ? &kept : nullptr};
  std::optional<TensorList> mapped;
  {
    detail::OutputCacheGuard guard(cache);
    mapped = detail::run_mapped(rule, spec, in);
  }
  if (mapped) {
    if (keeping) keeper->keep_outputs(spec.op, kept);
    if (observer != nullptr) (*observer)(spec.op, in, *mapped, spec.inplace, rt.flops().forward - flops_before);
    for (std::size_t k = 0; k < mapped->size() && k < spec.out.size(); ++k) set(spec.out[k], std::move((*mapped)[k]));
    return;
  }

  TensorList out(spec.out.size());
  for (std::size_t k = 0; k < spec.out.size(); ++k) {
    const auto& t = st.graph->tensors[static_cast<std::size_t>(spec.out[k])];
    const DType dtype = st.dtype_of(t);
    const std::int32_t a = k < spec.alias.size() ? spec.alias[k] : -1;
    if (reused) {
      if (k < reused->size()) out[k] = (*reused)[k];
    } else if (a >= 0 && in[static_cast<std::size_t>(a)].defined()) {
      const Tensor& src = in[static_cast<std::size_t>(a)];
      if (spec.inplace && spec.out[k] == spec.in[static_cast<std::size_t>(a)]) {
        out[k] = src;
        out[k].bump_version();
      } else {
        out[k] = view_on(src, t.shape, dtype);
      }
    } else if ((k < 32 && ((rule.host_outputs >> k) & 1u) != 0) || t.kind == Kind::Host) {
      // On the host: nothing on the device.
    } else if (rule.attention_logsumexp && k == 1 && !in.empty() && in[0].defined()) {
      out[k] = empty(rt, detail::attention_logsumexp_shape(in[0].shape(), in[0].dtype(), in.size() > 3), DType::F32);
    } else {
      out[k] = empty(rt, t.shape, dtype);
    }
  }

  const double flops = detail::device_effects(rt, rule, in, out, !reused);
  if (rule.collective && !reused) log_collective(rt, spec.op, out, false);

  bool records = !spec.node.empty() && grad_enabled();
  if (records) {
    records = false;
    for (const Tensor& t : in) records = records || (t.defined() && t.requires_grad());
  }
  if (records) {
    auto node = std::make_shared<OpNode>(st.graph, spec, rule, rt, in, flops);
    init_node(*node);
    for (const Tensor& t : in) node->add_input(t);
    node->set_num_outputs(static_cast<std::uint32_t>(out.size()));
    for (std::size_t k = 0; k < out.size(); ++k) {
      if (!out[k].defined() || !is_floating(out[k].dtype())) continue;
      if (spec.inplace && k < spec.alias.size() && spec.alias[k] >= 0) {
        detail::rebase_history(out[k], node);
      } else {
        set_history(out[k], node, static_cast<std::uint32_t>(k));
      }
    }
    for (const SaveRef& ref : item.saves) {
      SavedTensor& saved = node->saved().emplace_back();
      if (ref.from == SaveRef::From::Output) {
        saved.save_output(out[static_cast<std::size_t>(ref.index)]);
      } else if (ref.from == SaveRef::From::Input) {
        saved.save(in[static_cast<std::size_t>(ref.index)]);
      } else {
        saved.save(value(ref.index));
      }
    }
  }
  if (keeping) keeper->keep_outputs(spec.op, out);
  if (observer != nullptr) (*observer)(spec.op, in, out, spec.inplace, rt.flops().forward - flops_before);
  for (std::size_t k = 0; k < out.size(); ++k) set(spec.out[k], std::move(out[k]));
}

// --- building the calls --------------------------------------------------------------------

[[noreturn]] void bad(const std::string& what) { throw Error("operator graph: " + what); }

void check(const OpGraph& g) {
  const auto n = static_cast<std::int64_t>(g.tensors.size());
  const auto in_range = [&](std::int64_t i) { return i >= 0 && i < n; };
  if (g.calls.empty() || g.calls[0].parent != -1) bad("calls[0] must be the root call (parent -1)");
  // Module calls nest as modules do; the module tree is walked recursively (paths, materialize),
  // so a hostile depth is refused rather than run out of stack.
  constexpr std::size_t kMaxCallDepth = 256;
  std::vector<std::size_t> depth(g.calls.size(), 0);
  for (std::size_t c = 1; c < g.calls.size(); ++c) {
    if (g.calls[c].parent < 0 || static_cast<std::size_t>(g.calls[c].parent) >= c) {
      bad("calls[" + std::to_string(c) + "].parent must name an earlier call");
    }
    depth[c] = depth[static_cast<std::size_t>(g.calls[c].parent)] + 1;
    if (depth[c] > kMaxCallDepth) {
      bad("calls[" + std::to_string(c) + "]: module calls nest deeper than " + std::to_string(kMaxCallDepth));
    }
  }
  std::vector<char> defined(g.tensors.size(), 0);
  for (std::size_t t = 0; t < g.tensors.size(); ++t) {
    const auto& spec = g.tensors[t];
    if (spec.kind != Kind::Activation && spec.kind != Kind::Input) defined[t] = 1;  // persistent, host
    if (spec.base >= static_cast<std::int32_t>(t) || spec.base < -1) {
      bad("tensors[" + std::to_string(t) + "].base must name an earlier tensor");
    }
  }
  for (const std::int32_t i : g.inputs) {
    if (!in_range(i) || g.tensors[static_cast<std::size_t>(i)].kind != Kind::Input) bad("inputs must name input tensors");
    defined[static_cast<std::size_t>(i)] = 1;
  }
  for (std::size_t o = 0; o < g.ops.size(); ++o) {
    const auto& op = g.ops[o];
    const std::string where = "ops[" + std::to_string(o) + "] (" + op.op + ")";
    if (op.call < 0 || static_cast<std::size_t>(op.call) >= g.calls.size()) bad(where + ": call out of range");
    if (!op.alias.empty() && op.alias.size() != op.out.size()) bad(where + ": alias needs one entry per output");
    for (const std::int32_t i : op.in) {
      if (!in_range(i) || !defined[static_cast<std::size_t>(i)]) bad(where + ": reads a tensor no earlier op made");
    }
    for (std::size_t k = 0; k < op.out.size(); ++k) {
      const std::int32_t t = op.out[k];
      if (!in_range(t)) bad(where + ": output out of range");
      const std::int32_t a = op.alias.empty() ? -1 : op.alias[k];
      if (a < -1 || a >= static_cast<std::int32_t>(op.in.size())) bad(where + ": alias names no input");
      const bool rewrite = op.inplace && a >= 0 && op.in[static_cast<std::size_t>(a)] == t;
      const Kind kind = g.tensors[static_cast<std::size_t>(t)].kind;
      if (kind != Kind::Host && !rewrite && (defined[static_cast<std::size_t>(t)] || kind != Kind::Activation)) {
        bad(where + ": tensor " + std::to_string(t) + " is made twice");
      }
      defined[static_cast<std::size_t>(t)] = 1;
    }
    for (const std::int32_t s : op.saves) {
      if (!in_range(s) || !defined[static_cast<std::size_t>(s)]) bad(where + ": saves a tensor no op made");
    }
    for (const std::int32_t f : op.frees) {
      if (!in_range(f) || !defined[static_cast<std::size_t>(f)]) bad(where + ": frees a tensor no op made");
    }
    for (const auto& [call, f] : op.frees_after) {
      if (!in_range(f) || !defined[static_cast<std::size_t>(f)]) bad(where + ": frees a tensor no op made");
      if (call < 0 || static_cast<std::size_t>(call) >= g.calls.size()) bad(where + ": frees_after names no call");
    }
  }
  if (!in_range(g.output) || !defined[static_cast<std::size_t>(g.output)]) bad("output names no tensor the ops made");
  if (g.inputs.empty()) bad("the graph has no inputs");
}

/// Builds the calls' items, inputs, outputs, slots and frees.
class Planner {
 public:
  Planner(const OpGraph& g, std::vector<OpCall*>& calls) : g_(g), calls_(calls) {
    depth_.resize(g.calls.size());
    for (std::size_t c = 1; c < g.calls.size(); ++c) depth_[c] = depth_[static_cast<std::size_t>(g.calls[c].parent)] + 1;
    producer_.assign(g.tensors.size(), kAbove);
    for (const auto& op : g.ops) {
      for (std::size_t k = 0; k < op.out.size(); ++k) {
        const bool rewrite = op.inplace && !op.alias.empty() && op.alias[k] >= 0 &&
                             op.in[static_cast<std::size_t>(op.alias[k])] == op.out[k];
        if (!rewrite) producer_[static_cast<std::size_t>(op.out[k])] = op.call;
      }
    }
  }

  void plan() {
    const std::size_t nc = g_.calls.size();
    ins_.resize(nc);
    outs_.resize(nc);
    // The root's inputs are the graph's, in order (the trainer hands it the first).
    for (const std::int32_t i : g_.inputs) add_unique(ins_[0], i);
    for (const auto& op : g_.ops) {
      for (const std::int32_t t : op.in) flow(t, op.call);
    }
    flow(g_.output, kAbove);
    for (std::size_t c = 1; c < nc; ++c) order_inputs(c);
    // Items: each op in its call, and each call as an item of its parent where it starts.
    std::vector<std::int32_t> last_child(nc, -1);
    for (std::size_t o = 0; o < g_.ops.size(); ++o) {
      const std::int32_t c = g_.ops[o].call;
      std::vector<std::int32_t> chain;
      for (std::int32_t x = c; x > 0; x = g_.calls[static_cast<std::size_t>(x)].parent) chain.push_back(x);
      for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
        const std::int32_t parent = g_.calls[static_cast<std::size_t>(*it)].parent;
        auto& items = calls_[static_cast<std::size_t>(parent)]->items;
        if (items.empty() || items.back().child != calls_[static_cast<std::size_t>(*it)]) {
          Item child;
          child.child = calls_[static_cast<std::size_t>(*it)];
          items.push_back(std::move(child));
        }
      }
      Item item;
      item.op = static_cast<std::int32_t>(o);
      calls_[static_cast<std::size_t>(c)]->items.push_back(std::move(item));
    }
    for (std::size_t c = 0; c < nc; ++c) {
      calls_[c]->ins = ins_[c];
      calls_[c]->outs = outs_[c];
      const auto& positional = g_.calls[c].args;
      calls_[c]->input_positional =
          ins_[c].empty() || std::find(positional.begin(), positional.end(), ins_[c][0]) != positional.end();
      for (std::size_t i = 1; i < ins_[c].size(); ++i) {
        const bool kept = std::find(positional.begin(), positional.end(), ins_[c][i]) != positional.end();
        (kept ? calls_[c]->saved_ins : calls_[c]->closure_ins).push_back(ins_[c][i]);
      }
      for (Item& item : calls_[c]->items) {
        if (item.child != nullptr) continue;
        const auto& op = g_.ops[static_cast<std::size_t>(item.op)];
        item.rule = &detail::op_rule(op.op);
        for (const std::int32_t t : op.saves) item.saves.push_back(save_ref(op, t));
        item.frees.insert(item.frees.end(), op.frees.begin(), op.frees.end());
      }
    }
    // A free after a child call returned: on the item of the enclosing call that holds the op.
    for (std::size_t o = 0; o < g_.ops.size(); ++o) {
      for (const auto& [call, t] : g_.ops[o].frees_after) {
        std::int32_t x = g_.ops[o].call;
        while (x >= 0 && g_.calls[static_cast<std::size_t>(x)].parent != call) x = g_.calls[static_cast<std::size_t>(x)].parent;
        if (x < 0) bad("ops[" + std::to_string(o) + "].frees_after: call " + std::to_string(call) + " does not enclose the op");
        auto& items = calls_[static_cast<std::size_t>(call)]->items;
        for (auto it = items.rbegin(); it != items.rend(); ++it) {
          if (it->child == calls_[static_cast<std::size_t>(x)]) {
            it->frees.push_back(t);
            break;
          }
        }
      }
    }
  }

 private:
  static constexpr std::int32_t kAbove = -1;  ///< "made before the root" / "read after it"

  static void add_unique(std::vector<std::int32_t>& list, std::int32_t t) {
    if (std::find(list.begin(), list.end(), t) == list.end()) list.push_back(t);
  }
  bool persistent(std::int32_t t) const {
    const Kind k = g_.tensors[static_cast<std::size_t>(t)].kind;
    return k == Kind::Param || k == Kind::Buffer || k == Kind::Const || k == Kind::Host;
  }
  /// Tensor t, made in call `from`, read in call `to`: every call below their common
  /// ancestor takes it in (reader's side) or hands it out (maker's side).
  void flow(std::int32_t t, std::int32_t to) {
    if (persistent(t)) return;
    std::int32_t from = producer_[static_cast<std::size_t>(t)];
    std::int32_t a = from, b = to;
    const auto depth = [&](std::int32_t x) { return x == kAbove ? -1 : depth_[static_cast<std::size_t>(x)]; };
    const auto up = [&](std::int32_t x) { return x <= 0 ? kAbove : g_.calls[static_cast<std::size_t>(x)].parent; };
    while (depth(a) > depth(b)) {
      add_unique(outs_[static_cast<std::size_t>(a)], t);
      a = up(a);
    }
    while (depth(b) > depth(a)) {
      add_unique(ins_[static_cast<std::size_t>(b)], t);
      b = up(b);
    }
    while (a != b) {
      add_unique(outs_[static_cast<std::size_t>(a)], t);
      add_unique(ins_[static_cast<std::size_t>(b)], t);
      a = up(a);
      b = up(b);
    }
  }
  /// A call's first input is what hooks and checkpoint() see: a floating tensor that needs a
  /// gradient comes first where there is one (the hidden states, not the mask).
  void order_inputs(std::size_t c) {
    auto& ins = ins_[c];
    std::stable_partition(ins.begin(), ins.end(), [&](std::int32_t t) {
      const auto& spec = g_.tensors[static_cast<std::size_t>(t)];
      return spec.follows_run_dtype || is_floating(spec.dtype);
    });
  }
  SaveRef save_ref(const OpGraph::OpSpec& op, std::int32_t t) const {
    for (std::size_t k = 0; k < op.out.size(); ++k) {
      if (op.out[k] == t) return SaveRef{SaveRef::From::Output, static_cast<std::int32_t>(k)};
    }
    for (std::size_t k = 0; k < op.in.size(); ++k) {
      if (op.in[k] == t) return SaveRef{SaveRef::From::Input, static_cast<std::int32_t>(k)};
    }
    if (persistent(t)) return SaveRef{SaveRef::From::Value, t};
    // A view of one of the op's tensors (the recording names a saved view by its storage):
    // keeping that tensor keeps the same storage.
    const std::int32_t root = root_of(t);
    for (std::size_t k = 0; k < op.in.size(); ++k) {
      if (root_of(op.in[k]) == root) return SaveRef{SaveRef::From::Input, static_cast<std::int32_t>(k)};
    }
    for (std::size_t k = 0; k < op.out.size(); ++k) {
      if (root_of(op.out[k]) == root) return SaveRef{SaveRef::From::Output, static_cast<std::int32_t>(k)};
    }
    // A tensor an earlier op made for this one to keep (an in-place op's copy of its input,
    // made by autograd before the op: hardswish_'s original self).
    return SaveRef{SaveRef::From::Value, t};
  }
  std::int32_t root_of(std::int32_t t) const {
    while (g_.tensors[static_cast<std::size_t>(t)].base >= 0) t = g_.tensors[static_cast<std::size_t>(t)].base;
    return t;
  }
  std::size_t index_of(const OpCall* call) const {
    return static_cast<std::size_t>(std::find(calls_.begin(), calls_.end(), call) - calls_.begin());
  }

  const OpGraph& g_;
  std::vector<OpCall*>& calls_;
  std::vector<std::int32_t> depth_;
  std::vector<std::int32_t> producer_;
  std::vector<std::vector<std::int32_t>> ins_, outs_;
};

/// "model.layers.0" under "model" is "layers.0"; under the root, the whole path.
std::string relative(const std::string& path, const std::string& parent) {
  if (parent.empty()) return path;
  if (path.size() > parent.size() + 1 && path.starts_with(parent) && path[parent.size()] == '.') {
    return path.substr(parent.size() + 1);
  }
  return path;
}

}  // namespace

std::unique_ptr<Module> op_graph_module(std::shared_ptr<const OpGraph> graph) {
  if (graph == nullptr) bad("no graph");
  check(*graph);
  const OpGraph& g = *graph;
  auto state = std::make_shared<GraphState>();
  state->graph = graph;
  state->owners.resize(g.tensors.size(), {nullptr, 0});

  std::vector<std::unique_ptr<OpCall>> owned;
  std::vector<OpCall*> calls;
  for (std::size_t c = 0; c < g.calls.size(); ++c) {
    owned.push_back(std::make_unique<OpCall>(state, static_cast<std::int32_t>(c), g.calls[c].cls));
    calls.push_back(owned.back().get());
    owned.back()->set_checkpoint(g.calls[c].checkpoint);
    if (g.calls[c].inline_code) owned.back()->set_inline(true);
  }
  // Parameters, buffers and constants live in the first call of their module (or of its
  // nearest called ancestor); constants of no module in the root.
  std::unordered_map<std::string, std::size_t> first_call;
  for (std::size_t c = 0; c < g.calls.size(); ++c) {
    if (!g.calls[c].inline_code) first_call.try_emplace(g.calls[c].module, c);
  }
  std::size_t constants = 0;
  for (std::size_t t = 0; t < g.tensors.size(); ++t) {
    const auto& spec = g.tensors[t];
    if (spec.kind != Kind::Param && spec.kind != Kind::Buffer && spec.kind != Kind::Const) continue;
    std::string owner = spec.name, local = spec.name;
    std::size_t call = 0;
    if (spec.kind == Kind::Const || spec.name.empty()) {
      local = "constant" + std::to_string(constants++);
    } else {
      while (true) {
        const auto dot = owner.rfind('.');
        owner = dot == std::string::npos ? "" : owner.substr(0, dot);
        if (const auto it = first_call.find(owner); it != first_call.end()) {
          call = it->second;
          local = owner.empty() ? spec.name : spec.name.substr(owner.size() + 1);
          break;
        }
        if (owner.empty()) break;
      }
    }
    state->owners[t] = {calls[call], calls[call]->declare(spec, local)};
  }
  Planner(g, calls).plan();
  // The tree: children in the order of their calls.
  for (std::size_t c = 1; c < g.calls.size(); ++c) {
    const std::size_t parent = static_cast<std::size_t>(g.calls[c].parent);
    const std::string name = g.calls[c].inline_code ? "" : relative(g.calls[c].module, g.calls[parent].module);
    calls[parent]->add_child(name, std::move(owned[c]));
  }
  calls[0]->set_inline(true);
  return std::move(owned[0]);
}

}  // namespace mem::nn
