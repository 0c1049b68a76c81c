// peak_composition.hpp — what the live bytes are made of when they peak: weights,
// gradients, optimizer state, activations, logits and loss, and the rest. Read from the
// context each block was stamped with (mem::attach), so it needs no model knowledge:
//
//   mem::attach(alloc);                     // blocks carry their module and phase
//   mem::PeakComposition composition;
//   alloc.add_observer(&composition);
//   ... train ...
//   composition.at_peak().bytes(mem::MemoryKind::Activations);
//
// A block's kind: allocated with no phase (materialize) under a module: weights and
// buffers; relabelled as "<param>.grad" by AccumulateGrad: gradients; allocated in the
// optimizer phase: optimizer state (and its step's temporaries); allocated under lm_head or
// loss: logits and loss; allocated by a data-parallel engine (DistributedDataParallel's
// gradient buckets and broadcast copies): communication buffers; any other forward, recompute or backward allocation:
// activations (and the gradients flowing back through them, and the cuBLAS workspaces
// the first matmul of each thread takes, attributed to its module as PyTorch's snapshots
// attribute them); the batch ("input") and blocks with no scope: other.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

/// One definition shared by every command. Workspaces are the cuBLAS / cublasLt workspaces
/// PyTorch keeps per thread (named after the module whose product took them first);
/// optimizer temporaries are what a step allocates and frees (Adam's foreach sqrt, ZeRO's
/// checks), apart from the state it keeps.
enum class MemoryKind : std::uint8_t {
  Weights,
  Gradients,
  OptimizerState,
  OptimizerTemporaries,
  Activations,
  Workspaces,
  Logits,
  Communication,
  Other
};
inline constexpr std::size_t kNumMemoryKinds = 9;

/// "weights", "gradients", "optimizer state", "optimizer temporaries", "activations",
/// "workspaces", "logits and loss", "communication buffers", "other".
std::string_view memory_kind_name(MemoryKind kind) noexcept;
/// Short keys for files: "weights", "gradients", "optimizer_state", "optimizer_temporaries",
/// "activations", "workspaces", "logits", "communication", "other".
std::string_view memory_kind_key(MemoryKind kind) noexcept;
/// The kind of a block stamped with `context` (see above).
MemoryKind memory_kind(ContextId context) noexcept;

/// Live bytes by kind.
struct MemoryComposition {
  std::array<std::int64_t, kNumMemoryKinds> bytes{};
  /// Where the step was when these bytes were live: the context (module and phase) of the
  /// last allocation (kNoContext before any).
  ContextId context = kNoContext;
  std::int64_t of(MemoryKind kind) const noexcept { return bytes[static_cast<std::size_t>(kind)]; }
  std::int64_t total() const noexcept;
  /// Weights, gradients and the optimizer's state and temporaries: what neither checkpointing
  /// nor the batch size changes.
  std::int64_t model_states() const noexcept;
};

/// Follows the live blocks of an allocator and keeps their composition at the highest
/// total since the last restart(). Blocks allocated before it was added are not counted.
class PeakComposition final : public AllocatorObserver {
 public:
  /// `unscoped`: what a block made outside every module is ("other" by default; a model that
  /// computes its own loss in its forward, outside its modules, says logits and loss).
  explicit PeakComposition(MemoryKind unscoped = MemoryKind::Other) noexcept : unscoped_(unscoped) {}
  void on_event(const TraceEvent& event) noexcept override;
  /// Begins a new stretch: the peak is the present composition.
  void restart() noexcept { peak_ = now_; }
  const MemoryComposition& now() const noexcept { return now_; }
  const MemoryComposition& at_peak() const noexcept { return peak_; }

 private:
  struct Live {
    std::int64_t size;
    MemoryKind kind;
  };
  void add(MemoryKind kind, std::int64_t bytes) noexcept { now_.bytes[static_cast<std::size_t>(kind)] += bytes; }
  std::unordered_map<std::uintptr_t, Live> live_;
  MemoryComposition now_, peak_;
  MemoryKind unscoped_ = MemoryKind::Other;
};

}  // namespace mem
