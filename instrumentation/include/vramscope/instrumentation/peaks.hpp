// peaks.hpp — peaks of the allocator's totals over a stretch of events, read
// from the totals every TraceEvent carries: what an observer uses to measure a
// phase or a run without resetting the allocator's own peak statistics (and
// without calling back into the allocator, which observers must not do).
//
//   struct Watcher : mem::AllocatorObserver {
//     mem::PeakTotals peaks;
//     void on_event(const mem::TraceEvent& e) noexcept override { peaks.update(e); }
//   };
//   watcher.peaks.start(alloc.stats());  // the stretch begins at the current totals
#pragma once

#include <algorithm>
#include <cstdint>

#include "vramscope/allocator/observer.hpp"
#include "vramscope/allocator/stats.hpp"

namespace mem {

struct PeakTotals {
  std::int64_t allocated = 0;    ///< max allocated_bytes
  std::int64_t reserved = 0;     ///< max reserved_bytes
  std::int64_t device_used = 0;  ///< max of the nvidia-smi view
  /// reserved - allocated at the moment allocated peaked (cache and fragmentation).
  std::int64_t unallocated_at_peak = 0;

  /// Begins a stretch at the allocator's current totals.
  void start(const DeviceStats& s) noexcept {
    allocated = s.allocated_bytes[0].current;
    reserved = s.reserved_bytes[0].current;
    device_used = s.device_used_bytes.current;
    unallocated_at_peak = reserved - allocated;
  }

  /// Takes in one event's totals; true when allocated reached a new peak.
  bool update(const TraceEvent& e) noexcept {
    const auto now_allocated = static_cast<std::int64_t>(e.allocated_bytes);
    const auto now_reserved = static_cast<std::int64_t>(e.reserved_bytes);
    reserved = std::max(reserved, now_reserved);
    device_used = std::max(device_used, static_cast<std::int64_t>(e.device_used_bytes));
    if (now_allocated <= allocated) return false;
    allocated = now_allocated;
    unallocated_at_peak = now_reserved - now_allocated;
    return true;
  }
};

}  // namespace mem
