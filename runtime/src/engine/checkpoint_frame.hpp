// checkpoint_frame.hpp — the state of one non-reentrant checkpointed call,
// shared by the placeholders of the tensors its ops saved (internal).
//
// Forward: while a frame is the packing frame of the thread, SavedTensor::save()
// stores a placeholder (frame, index) instead of the tensor. Backward: the first
// unpack of a graph task (one backward() or grad() run) reruns the segment once with
// the frame as recomputing frame; each saved tensor is then stored at its index, in the
// same order, and the rerun stops early (an exception) once the last one is rebuilt.
// unpack() hands a rebuilt tensor over and forgets it, so it is freed when its node
// releases it. Like torch.utils.checkpoint (frame.recomputed[gid]), each graph task
// reruns on its own: a pipeline's I and W are two torch.autograd.grad calls, and the
// tensors one rerun rebuilt and no node unpacked stay until the frame goes.
//
// Under a selective policy the frame is also _CachingTorchDispatchMode's storage: the
// forward hands it the outputs of each call of a kept operator (keep_outputs), the rerun
// takes them back in the same order (reuse_outputs) instead of running the operator.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "vramscope/runtime/checkpoint.hpp"

namespace mem::nn::detail {

/// How SavedTensor::save() behaves on this thread.
enum class SaveMode : std::uint8_t { Normal, Pack, Recompute };
class CheckpointFrame;
struct SaveHook {
  SaveMode mode = SaveMode::Normal;
  CheckpointFrame* frame = nullptr;
};

class CheckpointFrame : public std::enable_shared_from_this<CheckpointFrame> {
 public:
  CheckpointFrame(SegmentFunction fn, TensorList inputs, Runtime& runtime, bool preserve_rng,
                  std::shared_ptr<const SelectivePolicy> policy = nullptr);

  /// Selective checkpointing: whether this region keeps the outputs of this call of operator
  /// `op`, run in its forward (Pack) or its rerun (Recompute); each call is asked once, as
  /// PyTorch's policy function is called once per operator in each (ctx.is_recompute).
  bool keeps(std::string_view op, SaveMode mode) {
    return policy_ != nullptr && policy_->keeps_call(op, mode == SaveMode::Recompute ? rerun_calls_ : forward_calls_);
  }
  /// Forward: keeps one call's outputs of `op` until the rerun takes them (detached aliases,
  /// reported to the saved-tensor observer as saved_tensors_hooks' pack hook sees them with
  /// respect_saved_tensors_hooks=True).
  void keep_outputs(std::string_view op, const TensorList& outputs);
  /// Rerun: the outputs the forward kept for the next call of `op`. Throws mem::Error when
  /// there are none left, or when one was changed in place since (PyTorch's _VersionWrapper).
  TensorList reuse_outputs(std::string_view op);
  /// The region this one's forward runs in (a checkpoint nested in another's forward or rerun):
  /// its policy's dispatch mode stays in force for the nested forward, as PyTorch's modes stack.
  void set_enclosing(const SaveHook& hook) noexcept { enclosing_ = hook; }
  const SaveHook& enclosing() const noexcept { return enclosing_; }

  /// Forward: reserves the next placeholder index.
  std::uint32_t add_placeholder() noexcept { return placeholders_++; }
  /// Backward: the saved tensor at `index` (recomputes the segment on first use).
  Tensor unpack(std::uint32_t index);
  /// Recompute: stores the next saved tensor; throws StopRecompute after the last one.
  void store_recomputed(const Tensor& tensor);

 private:

  SegmentFunction fn_;
  /// The only activations kept between forward and backward, saved before the segment
  /// runs (PyTorch's _NoopSaveInputs) and version-checked when the rerun unpacks them.
  std::vector<SavedTensor> inputs_;
  Runtime* runtime_;
  RngState rng_;       ///< RNG state at the forward, replayed by the rerun
  bool preserve_rng_;
  std::optional<DType> autocast_;  ///< autocast state of the forward, re-entered by the rerun
  std::uint32_t placeholders_ = 0;
  /// One rerun per graph task (its id; 0 outside any backward).
  struct Rerun {
    std::vector<Tensor> rebuilt;
    std::uint32_t stored = 0;
  };
  std::unordered_map<std::uint64_t, Rerun> reruns_;
  Rerun* rerun_ = nullptr;  ///< the rerun being stored
  /// Reruns the segment for the graph task running now.
  Rerun& recompute();

  struct KeptCall {
    TensorList outputs;
    std::vector<std::uint32_t> versions;
  };
  struct KeptOp {
    std::vector<KeptCall> calls;  ///< in the forward's order; taken ones are emptied
    std::size_t next = 0;         ///< the rerun's next call
  };
  std::shared_ptr<const SelectivePolicy> policy_;
  SelectivePolicy::CallCounts forward_calls_, rerun_calls_;  ///< a policy's per-call counters
  SaveHook enclosing_;
  std::unordered_map<std::string, KeptOp> kept_;
};

/// Reports `tensor` to the thread's SavedTensorsObserver, if any (autograd.cpp).
void observe_saved(const Tensor& tensor);

/// The region whose selective policy keeps operator `op` here, with the way it runs now (Pack:
/// its forward keeps; Recompute: its rerun takes), or {Normal, null}. The innermost region
/// first, then those its forward runs in: a nested checkpoint's forward runs under every
/// enclosing policy; a rerun runs under its own only (backward is outside every forward).
SaveHook selective_keeper(std::string_view op);

/// Thrown by store_recomputed() to end a rerun early; caught by recompute().
struct StopRecompute {};

SaveHook& save_hook() noexcept;

/// The graph task running on this thread (torch._C._current_graph_task_id): a new id for each
/// backward() or grad() run, 0 outside them (engine.cpp).
std::uint64_t current_graph_task() noexcept;
/// Whether the node running now runs inside grad() with inputs (autograd.grad, not backward()).
bool inside_grad_with_inputs() noexcept;
/// Whether the backward running now keeps its graph (retain_graph=True).
bool retaining_graph() noexcept;

/// Sets the save hook for a scope.
class SaveHookGuard {
 public:
  SaveHookGuard(SaveMode mode, CheckpointFrame* frame) noexcept : previous_(save_hook()) {
    save_hook() = SaveHook{mode, frame};
  }
  ~SaveHookGuard() { save_hook() = previous_; }
  SaveHookGuard(const SaveHookGuard&) = delete;
  SaveHookGuard& operator=(const SaveHookGuard&) = delete;

 private:
  SaveHook previous_;
};

}  // namespace mem::nn::detail
