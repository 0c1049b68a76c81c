// checkpoint.cpp — non-reentrant checkpointing (saved-tensor placeholders and one
// rerun in backward, stopping early) and reentrant checkpointing (a node that reruns
// the segment and backpropagates through it), of any function of tensors. Modules are
// checkpointed over these in nn/checkpoint_modules.cpp.
#include "vramscope/runtime/checkpoint.hpp"

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint_frame.hpp"
#include "engine/detail.hpp"

namespace mem::nn {
namespace detail {

/// Saves a checkpoint's inputs as ctx.save_for_backward does (_NoopSaveInputs), version-checked
/// at unpack. Inside an enclosing non-reentrant checkpoint they go through its hooks as any save
/// does (torch/utils/checkpoint.py saves them before entering the inner checkpoint's hooks): a
/// placeholder of the outer frame in its forward, the outer's rebuilt tensor in its rerun. So a
/// checkpoint nested in another keeps nothing past the outer's forward but the outer's inputs.
static std::vector<SavedTensor> save_inputs(const TensorList& inputs) {
  std::vector<SavedTensor> saved(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    saved[i].save(inputs[i]);
    saved[i].mark_checkpoint_input();
  }
  return saved;
}

/// ctx.saved_tensors: unpacks (and so checks) every saved input.
static TensorList unpack_inputs(const std::vector<SavedTensor>& saved) {
  TensorList inputs;
  inputs.reserve(saved.size());
  for (const SavedTensor& s : saved) inputs.push_back(s.unpack());
  return inputs;
}

/// The segment's inputs as new leaves for the rerun: same storage, no history,
/// requiring grad where the originals did (both checkpoint modes rerun on these).
static TensorList detach_for_rerun(const TensorList& inputs) {
  TensorList detached;
  detached.reserve(inputs.size());
  for (const Tensor& in : inputs) {
    if (!in.defined()) {
      detached.push_back(in);
      continue;
    }
    Tensor d = in.detach();
    if (in.requires_grad()) d.set_requires_grad(true);
    detached.push_back(d);
  }
  return detached;
}

/// The generator state of the original forward for the rerun (preserve_rng_state),
/// and the current one back afterwards, also when the rerun throws.
class RngForRerun {
 public:
  RngForRerun(Runtime& runtime, bool preserve, RngState forward_state) noexcept
      : runtime_(runtime), preserve_(preserve), current_(runtime.rng_state()) {
    if (preserve_) runtime_.set_rng_state(forward_state);
  }
  ~RngForRerun() {
    if (preserve_) runtime_.set_rng_state(current_);
  }
  RngForRerun(const RngForRerun&) = delete;
  RngForRerun& operator=(const RngForRerun&) = delete;

 private:
  Runtime& runtime_;
  bool preserve_;
  RngState current_;
};

CheckpointFrame::CheckpointFrame(SegmentFunction fn, TensorList inputs, Runtime& runtime, bool preserve_rng,
                                 std::shared_ptr<const SelectivePolicy> policy)
    : fn_(std::move(fn)),
      inputs_(save_inputs(inputs)),
      runtime_(&runtime),
      rng_(runtime.rng_state()),
      preserve_rng_(preserve_rng),
      autocast_(runtime.autocast()),
      policy_(std::move(policy)) {}

SaveHook selective_keeper(std::string_view op) {
  // Every region whose policy is in force sees the call (PyTorch's stacked modes each call
  // their policy function); the innermost that keeps it keeps it.
  SaveHook keeper;
  SaveHook hook = save_hook();
  while (hook.frame != nullptr && hook.mode != SaveMode::Normal) {
    if (hook.frame->keeps(op, hook.mode) && keeper.frame == nullptr) keeper = hook;
    if (hook.mode != SaveMode::Pack) break;
    hook = hook.frame->enclosing();
  }
  return keeper;
}

void CheckpointFrame::keep_outputs(std::string_view op, const TensorList& outputs) {
  KeptCall call;
  for (const Tensor& t : outputs) {
    // _detach_helper: the same storage without history (no reference cycle, and a view's
    // storage stays whole).
    call.outputs.push_back(t.defined() ? t.detach() : Tensor{});
    call.versions.push_back(t.defined() ? t.version() : 0);
    if (t.defined()) observe_saved(call.outputs.back());
  }
  kept_[std::string(op)].calls.push_back(std::move(call));
}

TensorList CheckpointFrame::reuse_outputs(std::string_view op) {
  const auto it = kept_.find(std::string(op));
  if (it == kept_.end() || it->second.next >= it->second.calls.size()) {
    throw Error("selective checkpoint: " + std::string(op) + " ran in the recompute more often than in the "
                "forward (PyTorch: \"encountered during backward but not found in storage\"); the region "
                "must run the same operators both times");
  }
  KeptCall call = std::move(it->second.calls[it->second.next++]);
  for (std::size_t k = 0; k < call.outputs.size(); ++k) {
    if (call.outputs[k].defined() && call.outputs[k].version() != call.versions[k]) {
      throw Error("Tensor cached during selective activation checkpoint has been mutated (" + std::string(op) +
                  "'s output, changed in place after the forward kept it; PyTorch raises the same unless "
                  "allow_cache_entry_mutation=True)");
    }
  }
  return std::move(call.outputs);
}

Tensor CheckpointFrame::unpack(std::uint32_t index) {
  const auto found = reruns_.find(current_graph_task());
  Rerun& rerun = found != reruns_.end() ? found->second : recompute();
  if (index >= rerun.rebuilt.size() || !rerun.rebuilt[index].defined()) {
    throw Error("checkpoint: a saved tensor was unpacked twice or never recomputed "
                "(the segment's rerun did not save the same tensors as its forward)");
  }
  Tensor t = std::move(rerun.rebuilt[index]);
  rerun.rebuilt[index] = Tensor{};
  return t;
}

void CheckpointFrame::store_recomputed(const Tensor& tensor) {
  Rerun& rerun = *rerun_;
  if (rerun.stored < rerun.rebuilt.size()) {
    // Unpacked as SavedVariable does: a history-free alias that keeps requires_grad (a
    // checkpoint nested in this one reruns on it and must build its graph).
    rerun.rebuilt[rerun.stored] = tensor.detach();
    rerun.rebuilt[rerun.stored].impl()->requires_grad = tensor.requires_grad();
  }
  ++rerun.stored;
  if (rerun.stored >= placeholders_) throw StopRecompute{};  // early stop: everything is rebuilt
}

CheckpointFrame::Rerun& CheckpointFrame::recompute() {
  // ctx.saved_tensors of _NoopSaveInputs: throws InplaceModifiedError when the segment
  // (or anything after it) changed an input in place since the forward saved it.
  const TensorList detached = detach_for_rerun(unpack_inputs(inputs_));
  Rerun& rerun = reruns_[current_graph_task()];
  rerun.rebuilt.assign(placeholders_, Tensor{});
  Runtime& rt = *runtime_;
  {
    struct Storing {
      Rerun*& slot;
      ~Storing() { slot = nullptr; }
    } storing{rerun_ = &rerun};
    RngForRerun rng(rt, preserve_rng_, rng_);
    AutocastRegion autocast(rt, autocast_);  // the rerun's own region
    PhaseGuard phase(Phase::Recompute);
    EnableGradGuard grad;
    SaveHookGuard hook(SaveMode::Recompute, this);
    try {
      (void)fn_(detached);
    } catch (const StopRecompute&) {
      // Everything the backward needs is rebuilt; the rest of the rerun is skipped.
    }
  }
  if (rerun.stored < placeholders_) {
    throw Error("checkpoint: the rerun saved " + std::to_string(rerun.stored) + " tensors, the forward " +
                std::to_string(placeholders_) + "; the segment must be deterministic in what it saves");
  }
  return rerun;
}

}  // namespace detail

namespace {

Runtime* runtime_of(const TensorList& inputs) {
  for (const Tensor& t : inputs) {
    if (t.defined()) return &t.runtime();
  }
  return nullptr;
}

/// CheckpointFunctionBackward: keeps the inputs; in backward reruns the segment with
/// grad and backpropagates through it (a nested backward), returning input grads.
class CheckpointReentrantBackward final : public Node {
 public:
  CheckpointReentrantBackward(SegmentFunction fn, const TensorList& inputs, Runtime& rt, bool preserve,
                              RngState rng, std::optional<DType> autocast)
      : fn_(std::move(fn)), inputs_(detail::save_inputs(inputs)), runtime_(&rt), rng_(rng),
        preserve_rng_(preserve), autocast_(autocast) {}

  TensorList apply(TensorList& grads) override {
    if (detail::inside_grad_with_inputs()) {
      // CheckpointFunction.backward's check (_is_checkpoint_valid): a zero-bubble schedule's I,
      // for one, is torch.autograd.grad with inputs.
      throw AutogradError("When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing "
                          "an `inputs` parameter to .backward(). To resolve this error, you can either set "
                          "use_reentrant=False, or call .backward() without passing the `inputs` argument.");
    }
    Runtime& rt = *runtime_;
    // ctx.saved_tensors (version-checked), then detach_variable.
    const TensorList detached = detail::detach_for_rerun(detail::unpack_inputs(inputs_));
    TensorList outputs;
    {
      detail::RngForRerun rng(rt, preserve_rng_, rng_);
      AutocastRegion autocast(rt, autocast_);
      PhaseGuard phase(Phase::Recompute);
      EnableGradGuard grad;
      outputs = fn_(detached);
    }
    TensorList roots, root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && i < grads.size() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    outputs.clear();
    if (!roots.empty()) backward(roots, root_grads);
    roots.clear();
    root_grads.clear();
    TensorList result;
    for (std::size_t i = 0; i < detached.size(); ++i) {
      result.push_back(needs_input_grad(i) ? detached[i].grad() : Tensor{});
    }
    return result;
  }
  void release_variables() noexcept override { inputs_.clear(); }
  std::string_view name() const noexcept override { return "CheckpointFunctionBackward"; }

 private:
  SegmentFunction fn_;
  std::vector<SavedTensor> inputs_;
  Runtime* runtime_;
  RngState rng_;
  bool preserve_rng_;
  std::optional<DType> autocast_;
};

TensorList checkpoint_reentrant(const SegmentFunction& fn, const TensorList& inputs, const CheckpointOptions& options) {
  Runtime* rt = runtime_of(inputs);
  bool any = false;
  for (const Tensor& in : inputs) any = any || (in.defined() && in.requires_grad());
  const RngState rng = rt->rng_state();
  const std::optional<DType> autocast = rt->autocast();
  TensorList outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  if (!grad_enabled()) return outputs;
  if (!any) {
    // PyTorch's pitfall: the outputs have no history, so the segment's parameters get
    // no gradient. Reproduced on purpose; callers report it as missing gradients.
    rt->warn("None of the inputs have requires_grad=True. Gradients will be None");
    return outputs;
  }
  // CheckpointFunction saves its inputs with ctx.save_for_backward, but PyTorch builds the
  // SavedVariables only once forward() returned (_save_variables): the versions recorded
  // are those after the segment ran, so an in-place op of the segment on its own input
  // passes this check. The rerun then fails instead: its detached inputs are leaves
  // requiring grad, and the in-place op on one throws AutogradError, as in PyTorch.
  auto node = std::make_shared<CheckpointReentrantBackward>(fn, inputs, *rt, options.preserve_rng_state, rng, autocast);
  init_node(*node);
  for (const Tensor& in : inputs) node->add_input(in);
  node->set_num_outputs(static_cast<std::uint32_t>(outputs.size()));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && is_floating(outputs[i].dtype())) set_history(outputs[i], node, static_cast<std::uint32_t>(i));
  }
  return outputs;
}

}  // namespace

std::string_view checkpoint_mode_name(CheckpointMode mode) noexcept {
  return mode == CheckpointMode::Reentrant ? "reentrant" : "non-reentrant";
}

CheckpointMode parse_checkpoint_mode(std::string_view name) {
  if (name == "non-reentrant" || name == "nonreentrant") return CheckpointMode::NonReentrant;
  if (name == "reentrant") return CheckpointMode::Reentrant;
  throw Error("unknown checkpoint mode '" + std::string(name) + "'; expected non-reentrant or reentrant");
}

TensorList checkpoint(const SegmentFunction& fn, const TensorList& inputs, const CheckpointOptions& options) {
  Runtime* rt = runtime_of(inputs);
  if (rt == nullptr && options.mode == CheckpointMode::NonReentrant) rt = options.runtime;
  if (rt == nullptr) throw Error("checkpoint: at least one defined input tensor is required");
  if (options.mode == CheckpointMode::Reentrant) {
    if (options.policy) {
      throw Error("selective checkpointing runs under non-reentrant checkpoints only (PyTorch: \"Passing "
                  "`context_fn` or `debug` is only supported when use_reentrant=False\")");
    }
    return checkpoint_reentrant(fn, inputs, options);
  }
  auto frame = std::make_shared<detail::CheckpointFrame>(fn, inputs, *rt, options.preserve_rng_state, options.policy);
  frame->set_enclosing(detail::save_hook());
  detail::SaveHookGuard hook(detail::SaveMode::Pack, frame.get());
  return fn(inputs);
}

}  // namespace mem::nn
