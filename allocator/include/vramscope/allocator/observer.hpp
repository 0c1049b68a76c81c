// observer.hpp — the allocator's hooks for instrumentation.
//
// The allocator knows nothing about modules or history: it calls observers
// with one TraceEvent per action (PyTorch's TraceEntry actions) and stamps each
// block with a 32-bit context id taken from an optional context source.
// With no observer registered an allocation pays one predictable branch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "vramscope/allocator/device.hpp"

namespace mem {

/// PyTorch's TraceEntry::Action, same meanings.
enum class TraceAction : std::uint8_t {
  Alloc,          ///< a block was handed out
  FreeRequested,  ///< the caller freed it; see TraceEvent::completed
  FreeCompleted,  ///< a deferred free finished: the block is back in its pool
  SegmentAlloc,   ///< cudaMalloc of a new segment
  SegmentFree,    ///< cudaFree of a segment
  Oom,            ///< an allocation failed after freeing the cache
  /// A live block changed owner (CachingAllocator::relabel: AccumulateGrad made a
  /// gradient a parameter's .grad): `address` and the new `context`; no total changes.
  /// History applies it to the block's alloc entry and never exports it.
  Relabel,
  SegmentMap,     ///< expandable segments: pages mapped (address, size), reserved grows
  SegmentUnmap,   ///< expandable segments: pages unmapped, reserved shrinks
};

/// PyTorch's action names: "alloc", "free_requested", ..., "oom".
std::string_view trace_action_name(TraceAction action) noexcept;

struct TraceEvent {
  TraceAction action;
  std::uintptr_t address = 0;      ///< block or segment address (0 for oom)
  std::size_t size = 0;            ///< block or segment size; for oom the rounded request
  std::size_t requested_size = 0;  ///< caller's size for alloc/free events
  StreamId stream = 0;
  std::uint32_t context = 0;       ///< context id stamped on the block at allocation
  bool small_pool = false;
  /// FreeRequested only: the block went back to its pool at once, so no
  /// FreeCompleted event follows (one call instead of two on the hot path).
  /// A free deferred by record_stream reports FreeCompleted later.
  bool completed = false;
  // Allocator totals right after the action, so recorders need no bookkeeping.
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t device_used_bytes = 0;  ///< nvidia-smi view
  std::uint64_t sequence = 0;         ///< per-allocator event counter
};

/// Receives every event. Called with the allocator's lock held: it must be
/// fast and must not call back into the allocator.
class AllocatorObserver {
 public:
  virtual ~AllocatorObserver() = default;
  virtual void on_event(const TraceEvent& event) noexcept = 0;
};

/// Returns the context id to stamp on a new allocation (e.g. the innermost
/// module scope of the calling thread). Called with the lock held.
using ContextSource = std::uint32_t (*)() noexcept;

}  // namespace mem
