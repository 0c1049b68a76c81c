// snapshot.hpp — mem::snapshot(): the allocator's state as a value, cheap enough for hooks.
//
//   mem::Snapshot s = mem::snapshot(allocator);                  // statistics + device view
//   s.allocated_bytes(); s.peak_allocated_bytes(); s.device.used_bytes;
//   auto full = mem::snapshot(allocator, {.segments = true, .history = true});
//   for (const mem::SegmentInfo& seg : full.segments)
//     for (const mem::BlockInfo& b : seg.blocks) mem::block_owner(b).path;
//
// A statistics-only snapshot copies the allocator's DeviceStats (which already
// carry the nvidia-smi view and the context assumption) and takes no device lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/stats.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

/// What to include beyond the statistics and the device view.
struct SnapshotOptions {
  bool segments = false;     ///< every segment with its blocks (linear in block count)
  bool history = false;      ///< the recorded history (history_source, else record_history's)
  bool query_device = false; ///< ask the device for cudaMemGetInfo's free (may take a lock)
  const History* history_source = nullptr;
};

/// The GPU as this process sees it.
struct DeviceView {
  /// Name, granularity, simulated flag and the assumptions line; shared with
  /// the device (never null in a snapshot taken from an allocator).
  std::shared_ptr<const DeviceInfo> info;
  std::size_t total_bytes = 0;      ///< device capacity
  /// total - used_bytes unless query_device was set, then cudaMemGetInfo's free
  /// (which also subtracts other processes).
  std::size_t free_bytes = 0;
  std::size_t used_bytes = 0;       ///< this process as nvidia-smi shows it
  std::size_t peak_used_bytes = 0;
  std::size_t context_bytes = 0;    ///< CUDA context assumption, included in used_bytes
  bool free_from_device = false;    ///< free_bytes came from the device
};

/// The allocator's state at one moment.
struct Snapshot {
  DeviceStats stats;
  DeviceView device;
  AllocatorConfig config;
  bool has_segments = false;
  std::vector<SegmentInfo> segments;  ///< in address order; empty unless requested
  bool has_history = false;
  std::vector<HistoryEntry> history;  ///< oldest first; empty unless requested

  // Shorthands for the figures people print (the "all" pool).
  std::size_t allocated_bytes() const noexcept { return as_size(stats.allocated_bytes[0].current); }
  std::size_t peak_allocated_bytes() const noexcept { return as_size(stats.allocated_bytes[0].peak); }
  std::size_t reserved_bytes() const noexcept { return as_size(stats.reserved_bytes[0].current); }
  std::size_t peak_reserved_bytes() const noexcept { return as_size(stats.reserved_bytes[0].peak); }
  std::size_t active_bytes() const noexcept { return as_size(stats.active_bytes[0].current); }
  std::size_t requested_bytes() const noexcept { return as_size(stats.requested_bytes[0].current); }

 private:
  static std::size_t as_size(std::int64_t v) noexcept { return v < 0 ? 0 : static_cast<std::size_t>(v); }
};

/// The state of `allocator`. Statistics-only by default (well under a microsecond).
Snapshot snapshot(const CachingAllocator& allocator, SnapshotOptions options = {});
/// The state of process_allocator().
Snapshot snapshot(SnapshotOptions options = {});

/// Owner of a block: module path and phase stamped at allocation.
inline const ContextInfo& block_owner(const BlockInfo& block) noexcept {
  return context_info(block.context);
}

/// Free space in the segments: bytes reserved but not allocated, and the
/// largest inactive block. Needs a snapshot with segments (else both are computed
/// from the statistics and largest_free_block is 0).
struct Fragmentation {
  std::size_t reserved_unallocated_bytes = 0;
  std::size_t largest_free_block = 0;
  std::size_t free_blocks = 0;
  /// 1 - largest_free_block / reserved_unallocated_bytes (0 when nothing is free).
  double ratio() const noexcept {
    return reserved_unallocated_bytes == 0
               ? 0.0
               : 1.0 - static_cast<double>(largest_free_block) /
                           static_cast<double>(reserved_unallocated_bytes);
  }
};
Fragmentation fragmentation(const Snapshot& snapshot) noexcept;

}  // namespace mem
