// checkpoint_frame.hpp — the state of one non-reentrant checkpointed call,
// shared by the placeholders of the tensors its ops saved (internal).
//
// Forward: while a frame is the packing frame of the thread, SavedTensor::save()
// stores a placeholder (frame, index) instead of the tensor. Backward: the first
// unpack reruns the segment once with the frame as recomputing frame; each saved
// tensor is then stored at its index, in the same order, and the rerun stops
// early (an exception) once the last one is rebuilt. unpack() hands a rebuilt
// tensor over and forgets it, so it is freed when its node releases it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "vramscope/runtime/checkpoint.hpp"

namespace mem::nn::detail {

class CheckpointFrame : public std::enable_shared_from_this<CheckpointFrame> {
 public:
  CheckpointFrame(SegmentFunction fn, TensorList inputs, Runtime& runtime, bool preserve_rng);

  /// Forward: reserves the next placeholder index.
  std::uint32_t add_placeholder() noexcept { return placeholders_++; }
  /// Backward: the saved tensor at `index` (recomputes the segment on first use).
  Tensor unpack(std::uint32_t index);
  /// Recompute: stores the next saved tensor; throws StopRecompute after the last one.
  void store_recomputed(const Tensor& tensor);

 private:
  void recompute();

  SegmentFunction fn_;
  /// The only activations kept between forward and backward, saved before the segment
  /// runs (PyTorch's _NoopSaveInputs) and version-checked when the rerun unpacks them.
  std::vector<SavedTensor> inputs_;
  Runtime* runtime_;
  RngState rng_;       ///< RNG state at the forward, replayed by the rerun
  bool preserve_rng_;
  std::optional<DType> autocast_;  ///< autocast state of the forward, re-entered by the rerun
  std::uint32_t placeholders_ = 0;
  std::uint32_t stored_ = 0;
  bool recomputed_ = false;
  std::vector<Tensor> rebuilt_;
};

/// Thrown by store_recomputed() to end a rerun early; caught by recompute().
struct StopRecompute {};

/// How SavedTensor::save() behaves on this thread.
enum class SaveMode : std::uint8_t { Normal, Pack, Recompute };
struct SaveHook {
  SaveMode mode = SaveMode::Normal;
  CheckpointFrame* frame = nullptr;
};
SaveHook& save_hook() noexcept;

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
