// snapshot.cpp — mem::snapshot() and the fragmentation figure.
#include "vramscope/instrumentation/snapshot.hpp"

#include <algorithm>

namespace mem {
namespace {

std::size_t nonneg(std::int64_t v) noexcept { return v < 0 ? 0 : static_cast<std::size_t>(v); }

}  // namespace

Snapshot snapshot(const CachingAllocator& allocator, SnapshotOptions options) {
  Snapshot s;
  // With segments, statistics and blocks come from one instant (one lock).
  if (options.segments) {
    s.segments = allocator.segments(s.stats);
    s.has_segments = true;
  } else {
    s.stats = allocator.stats();
  }
  s.config = allocator.config();

  // The device view comes from the statistics the allocator keeps anyway; the
  // DeviceInfo is shared with the device instead of copied (no allocation).
  std::shared_ptr<Device> device = allocator.device_ptr();
  s.device.info = std::shared_ptr<const DeviceInfo>(device, &device->info());
  s.device.used_bytes = nonneg(s.stats.device_used_bytes.current);
  s.device.peak_used_bytes = nonneg(s.stats.device_used_bytes.peak);
  s.device.context_bytes = nonneg(s.stats.context_bytes);
  s.device.total_bytes = s.stats.device_total_bytes > 0 ? nonneg(s.stats.device_total_bytes)
                                                         : device->info().total_bytes;
  s.device.free_bytes =
      s.device.total_bytes > s.device.used_bytes ? s.device.total_bytes - s.device.used_bytes : 0;
  if (options.query_device) {
    const DeviceMemInfo info = device->mem_get_info();
    s.device.free_bytes = info.free_bytes;
    s.device.free_from_device = true;
  }

  if (options.history) {
    if (options.history_source != nullptr) {
      s.history = options.history_source->entries();
    } else if (auto recorded = recorded_history(allocator)) {
      s.history = recorded->entries();
    }
    s.has_history = true;
  }
  return s;
}

Snapshot snapshot(SnapshotOptions options) { return snapshot(process_allocator(), options); }

Fragmentation fragmentation(const Snapshot& snapshot) noexcept {
  Fragmentation f;
  const std::size_t reserved = snapshot.reserved_bytes();
  const std::size_t allocated = snapshot.allocated_bytes();
  f.reserved_unallocated_bytes = reserved > allocated ? reserved - allocated : 0;
  for (const SegmentInfo& segment : snapshot.segments) {
    for (const BlockInfo& block : segment.blocks) {
      if (block.state != BlockState::Inactive) continue;
      ++f.free_blocks;
      f.largest_free_block = std::max(f.largest_free_block, block.size);
    }
  }
  return f;
}

}  // namespace mem
