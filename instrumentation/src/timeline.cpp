// timeline.cpp — counter samples from allocator events and slices from scopes.
#include "vramscope/instrumentation/timeline.hpp"

#include <algorithm>

#include "vramscope/allocator/clock.hpp"
#include "vramscope/allocator/caching_allocator.hpp"

namespace mem {

Timeline::Timeline(CachingAllocator& allocator, TimelineOptions options)
    : allocator_(&allocator), options_(options), start_ticks_(detail::ticks()) {
  if (options_.max_samples < 2) options_.max_samples = 2;
  std::shared_ptr<Device> device = allocator.device_ptr();
  device_info_ = std::shared_ptr<const DeviceInfo>(device, &device->info());
  const DeviceStats stats = allocator.stats();
  device_total_ = stats.device_total_bytes > 0 ? static_cast<std::size_t>(stats.device_total_bytes)
                                               : device->info().total_bytes;
  (void)detail::ticks_per_us();
  // The starting level, so the plot does not begin at zero when memory is in use.
  samples_.push_back(TimelineSample{
      0.0, static_cast<std::size_t>(std::max<std::int64_t>(0, stats.allocated_bytes[0].current)),
      static_cast<std::size_t>(std::max<std::int64_t>(0, stats.reserved_bytes[0].current)),
      static_cast<std::size_t>(std::max<std::int64_t>(0, stats.device_used_bytes.current))});
  attach(allocator);
  add_scope_listener(this);
  allocator.add_observer(this);
}

Timeline::~Timeline() { stop(); }

void Timeline::stop() noexcept {
  if (allocator_ == nullptr) return;
  allocator_->remove_observer(this);
  remove_scope_listener(this);
  allocator_ = nullptr;
}

double Timeline::now_us() const noexcept {
  if (options_.clock == TimelineClock::Events) {
    return static_cast<double>(events_.load(std::memory_order_relaxed));
  }
  return detail::ticks_to_us(start_ticks_, detail::ticks());
}

std::uint32_t Timeline::thread_number() {
  const auto id = std::this_thread::get_id();
  auto it = threads_.find(id);
  if (it != threads_.end()) return it->second;
  const auto n = static_cast<std::uint32_t>(threads_.size());
  threads_.emplace(id, n);
  return n;
}

void Timeline::on_event(const TraceEvent& event) noexcept {
  events_.fetch_add(1, std::memory_order_relaxed);
  if (event.action == TraceAction::Oom) {
    try {
      std::lock_guard lock(mutex_);
      ooms_.push_back(TimelineOom{now_us(), event.size, event.allocated_bytes, event.reserved_bytes});
    } catch (...) {
      // Recording must never fail the allocation.
    }
    return;
  }
  switch (event.action) {
    case TraceAction::Alloc:
    case TraceAction::FreeCompleted:
    case TraceAction::SegmentAlloc:
    case TraceAction::SegmentFree:
    case TraceAction::SegmentMap:
    case TraceAction::SegmentUnmap:
      break;
    case TraceAction::FreeRequested:
      if (event.completed) break;  // the block is back in its pool already
      return;
    default:
      return;  // a deferred free_requested and oom change no total
  }
  const TimelineSample sample{now_us(), event.allocated_bytes, event.reserved_bytes,
                              event.device_used_bytes};
  try {
    std::lock_guard lock(mutex_);
    if (++skipped_ < stride_) return;
    skipped_ = 0;
    if (samples_.size() >= options_.max_samples) {
      // Keep every second sample but always the highest of each pair, so the
      // peak survives decimation; then record half as often.
      std::size_t out = 1;
      for (std::size_t i = 1; i + 1 < samples_.size(); i += 2) {
        const TimelineSample& a = samples_[i];
        const TimelineSample& b = samples_[i + 1];
        samples_[out++] = a.allocated_bytes >= b.allocated_bytes ? a : b;
      }
      samples_.resize(out);
      stride_ *= 2;
    }
    samples_.push_back(sample);
  } catch (...) {
    // Recording must never fail the allocation.
  }
}

void Timeline::on_scope_enter(const ScopeEvent& event) {
  const double t = now_us();
  std::lock_guard lock(mutex_);
  auto& open = open_[std::this_thread::get_id()];
  if (slices_.size() >= options_.max_slices) {
    open.push_back(SIZE_MAX);  // keep the stack balanced, record nothing
    return;
  }
  slices_.push_back(TimelineSlice{t, -1, event.context, event.depth, thread_number()});
  open.push_back(slices_.size() - 1);
}

void Timeline::on_scope_exit(const ScopeEvent&) noexcept {
  const double t = now_us();
  std::lock_guard lock(mutex_);
  auto it = open_.find(std::this_thread::get_id());
  if (it == open_.end() || it->second.empty()) return;  // opened before the timeline
  const std::size_t index = it->second.back();
  it->second.pop_back();
  if (index != SIZE_MAX) slices_[index].end_us = t;
}

std::vector<TimelineSample> Timeline::samples() const {
  std::lock_guard lock(mutex_);
  return samples_;
}

std::vector<TimelineSlice> Timeline::slices() const {
  std::lock_guard lock(mutex_);
  return slices_;
}

std::vector<TimelineOom> Timeline::ooms() const {
  std::lock_guard lock(mutex_);
  return ooms_;
}

double Timeline::end_us() const {
  std::lock_guard lock(mutex_);
  double end = samples_.empty() ? 0.0 : samples_.back().time_us;
  for (const TimelineSlice& s : slices_) end = std::max({end, s.begin_us, s.end_us});
  for (const TimelineOom& o : ooms_) end = std::max(end, o.time_us);
  return end;
}

}  // namespace mem
