// stats.cpp — resets of DeviceStats and the names PyTorch gives actions and states.
#include "vramscope/allocator/stats.hpp"

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/observer.hpp"

namespace mem {

void DeviceStats::reset_peaks() noexcept {
  for_each_stat_array(*this, [](std::string_view, StatArray& a) {
    for (Stat& s : a) s.reset_peak();
  });
  oversize_allocations.reset_peak();
  oversize_segments.reset_peak();
  device_used_bytes.reset_peak();
}

void DeviceStats::reset_accumulated() noexcept {
  for_each_stat_array(*this, [](std::string_view, StatArray& a) {
    for (Stat& s : a) s.reset_accumulated();
  });
  for_each_stat_counter(*this, [](std::string_view, std::int64_t& c) { c = 0; });
  oversize_allocations.reset_accumulated();
  oversize_segments.reset_accumulated();
  device_used_bytes.reset_accumulated();
}

std::string_view trace_action_name(TraceAction action) noexcept {
  switch (action) {
    case TraceAction::Alloc: return "alloc";
    case TraceAction::FreeRequested: return "free_requested";
    case TraceAction::FreeCompleted: return "free_completed";
    case TraceAction::SegmentAlloc: return "segment_alloc";
    case TraceAction::SegmentFree: return "segment_free";
    case TraceAction::Oom: return "oom";
    case TraceAction::Relabel: return "relabel";
    case TraceAction::SegmentMap: return "segment_map";
    case TraceAction::SegmentUnmap: return "segment_unmap";
  }
  return "unknown";
}

std::string_view block_state_name(BlockState state) noexcept {
  switch (state) {
    case BlockState::ActiveAllocated: return "active_allocated";
    case BlockState::ActivePendingFree: return "active_pending_free";
    case BlockState::Inactive: return "inactive";
  }
  return "unknown";
}

}  // namespace mem
