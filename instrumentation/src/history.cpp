// history.cpp — the history: an event ring the allocator writes, read back as
// HistoryEntry values with times in microseconds.
#include "vramscope/instrumentation/history.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem {

namespace {
std::size_t checked_bound(std::size_t max_entries) {
  if (max_entries == 0) throw Error("mem::History: max_entries must be at least 1");
  return max_entries;
}
}  // namespace

History::History(std::size_t max_entries, HistoryOptions options)
    : ring_(checked_bound(max_entries), options.timestamps), start_ticks_(detail::ticks()) {}

History::History(CachingAllocator& allocator, std::size_t max_entries, HistoryOptions options)
    : History(max_entries, options) {
  attach_to(allocator);
}

History::~History() { detach(); }

void History::attach_to(CachingAllocator& allocator) {
  if (allocator_ != nullptr) {
    throw Error("mem::History::attach_to: already recording an allocator; detach() first");
  }
  allocator.attach_ring(&ring_);
  allocator_ = &allocator;
}

void History::detach() noexcept {
  if (allocator_ == nullptr) return;
  allocator_->detach_ring(&ring_);
  allocator_ = nullptr;
}

std::vector<HistoryEntry> History::entries() const {
  const std::uint64_t start = start_ticks_.load(std::memory_order_relaxed);
  const std::vector<RingEvent> events = ring_.read();
  std::vector<HistoryEntry> out;
  out.reserve(events.size());
  // A relabel names the new owner of a live block: it applies to the block's latest alloc
  // entry (if still in the window) and is not an entry of its own.
  std::unordered_map<std::uintptr_t, std::size_t> last_alloc;
  for (const RingEvent& r : events) {
    const TraceEvent& e = r.event;
    if (e.action == TraceAction::Relabel) {
      if (const auto it = last_alloc.find(e.address); it != last_alloc.end()) out[it->second].context = e.context;
      continue;
    }
    if (e.action == TraceAction::Alloc) last_alloc[e.address] = out.size();
    HistoryEntry h;
    h.sequence = e.sequence;
    h.time_us = ring_.timestamps() ? detail::ticks_to_us(start, r.ticks) : 0.0;
    h.action = e.action;
    h.address = e.address;
    h.size = e.size;
    h.requested_size = e.requested_size;
    h.stream = e.stream;
    h.small_pool = e.small_pool;
    h.context = e.context;
    h.allocated_bytes = e.allocated_bytes;
    h.reserved_bytes = e.reserved_bytes;
    h.device_used_bytes = e.device_used_bytes;
    out.push_back(h);
  }
  return out;
}

std::size_t History::size() const noexcept {
  const std::uint64_t n = recorded();
  return static_cast<std::size_t>(n < capacity() ? n : capacity());
}

std::uint64_t History::dropped() const noexcept {
  const std::uint64_t n = recorded();
  return n > capacity() ? n - capacity() : 0;
}

void History::clear() noexcept {
  ring_.clear();
  start_ticks_.store(detail::ticks(), std::memory_order_relaxed);
}

// --- record_history: the process-wide switch --------------------------------

namespace {
std::mutex recorded_mutex;
std::map<const CachingAllocator*, std::shared_ptr<History>>& recorded() {
  static auto* table = new std::map<const CachingAllocator*, std::shared_ptr<History>>();
  return *table;
}
}  // namespace

void record_history(CachingAllocator& allocator, std::size_t max_entries) {
  std::lock_guard lock(recorded_mutex);
  auto& table = recorded();
  if (auto it = table.find(&allocator); it != table.end()) {
    it->second->detach();
    table.erase(it);
  }
  if (max_entries == 0) return;
  auto history = std::make_shared<History>(allocator, max_entries);
  table.emplace(&allocator, std::move(history));
}

std::shared_ptr<const History> recorded_history(const CachingAllocator& allocator) {
  std::lock_guard lock(recorded_mutex);
  auto& table = recorded();
  auto it = table.find(&allocator);
  return it == table.end() ? nullptr : it->second;
}

}  // namespace mem
