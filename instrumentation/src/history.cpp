// history.cpp — the history ring: a fixed array of word-sized slots written by
// the allocator's observer call and read under a sequence check.
#include "vramscope/instrumentation/history.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include "clock.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

// Word layout of a slot (see History::Slot): the event's fields as 64-bit words
// so that each store is a plain relaxed atomic store (a mov on x86).
enum Word : std::size_t {
  kSequence, kTicks, kAddress, kSize, kRequested, kStream, kAllocated, kReserved, kDeviceUsed,
  kPacked,  // context << 32 | folded << 9 | small_pool << 8 | action
};
// Set on a free_requested slot whose free_completed followed at once.
constexpr std::uint64_t kFoldedBit = std::uint64_t{1} << 9;

}  // namespace

History::History(std::size_t max_entries, HistoryOptions options)
    : capacity_(max_entries), start_ticks_(detail::ticks()), timestamps_(options.timestamps) {
  if (max_entries == 0) throw Error("mem::History: max_entries must be at least 1");
  slots_ = std::make_unique<Slot[]>(capacity_);
  (void)detail::ticks_per_us();  // calibrate now, not on the first read
}

History::History(CachingAllocator& allocator, std::size_t max_entries, HistoryOptions options)
    : History(max_entries, options) {
  attach_to(allocator);
}

History::~History() { detach(); }

void History::attach_to(CachingAllocator& allocator) {
  if (allocator_ != nullptr) {
    throw Error("mem::History::attach_to: already recording an allocator; detach() first");
  }
  allocator.add_observer(this);
  allocator_ = &allocator;
}

void History::detach() noexcept {
  if (allocator_ == nullptr) return;
  allocator_->remove_observer(this);
  allocator_ = nullptr;
}

void History::on_event(const TraceEvent& event) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  // Single writer (the allocator lock serialises on_event): a sequence lock.
  const std::uint64_t index = head_.load(relaxed);
  writing_.store(index + 1, relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // free on x86
  Slot& slot = slots_[next_slot_];
  // A wrapping index instead of index % capacity_: a 64-bit division would
  // cost more than the rest of this function.
  next_slot_ = next_slot_ + 1 == capacity_ ? 0 : next_slot_ + 1;
  slot.word[kSequence].store(event.sequence, relaxed);
  slot.word[kTicks].store(timestamps_ ? detail::ticks() : 0, relaxed);
  slot.word[kAddress].store(event.address, relaxed);
  slot.word[kSize].store(event.size, relaxed);
  slot.word[kRequested].store(event.requested_size, relaxed);
  slot.word[kStream].store(event.stream, relaxed);
  slot.word[kAllocated].store(event.allocated_bytes, relaxed);
  slot.word[kReserved].store(event.reserved_bytes, relaxed);
  slot.word[kDeviceUsed].store(event.device_used_bytes, relaxed);
  // Segment events and ooms carry no block context: they belong to whatever
  // the calling thread is running (observers run on the allocating thread).
  const bool block_event = event.action == TraceAction::Alloc ||
                           event.action == TraceAction::FreeRequested ||
                           event.action == TraceAction::FreeCompleted;
  const ContextId context = block_event ? event.context : current_context();
  // A free that completed at once is one event from the allocator; it is
  // stored as one slot with a bit and expanded to PyTorch's two entries
  // (free_requested, free_completed) when read.
  const std::uint64_t packed = std::uint64_t{context} << 32 |
                               std::uint64_t{event.small_pool} << 8 |
                               static_cast<std::uint64_t>(event.action) |
                               (event.completed ? kFoldedBit : 0);
  slot.word[kPacked].store(packed, relaxed);
  head_.store(index + 1, std::memory_order_release);

  if (event.completed) folded_.store(folded_.load(relaxed) + 1, std::memory_order_release);
}

std::vector<HistoryEntry> History::entries() const {
  const std::uint64_t head = head_.load(std::memory_order_acquire);
  const std::uint64_t first = head > capacity_ ? head - capacity_ : 0;
  std::vector<HistoryEntry> out;
  out.reserve(static_cast<std::size_t>(head - first) + 16);
  std::vector<std::uint64_t> tick_values;
  tick_values.reserve(out.capacity());
  std::vector<std::size_t> slot_start;  // first entry of each copied slot
  slot_start.reserve(static_cast<std::size_t>(head - first));
  constexpr auto relaxed = std::memory_order_relaxed;
  for (std::uint64_t i = first; i < head; ++i) {
    const Slot& slot = slots_[i % capacity_];
    slot_start.push_back(out.size());
    HistoryEntry e;
    e.sequence = slot.word[kSequence].load(relaxed);
    const std::uint64_t ticks = slot.word[kTicks].load(relaxed);
    e.address = static_cast<std::uintptr_t>(slot.word[kAddress].load(relaxed));
    e.size = static_cast<std::size_t>(slot.word[kSize].load(relaxed));
    e.requested_size = static_cast<std::size_t>(slot.word[kRequested].load(relaxed));
    e.stream = slot.word[kStream].load(relaxed);
    e.allocated_bytes = static_cast<std::size_t>(slot.word[kAllocated].load(relaxed));
    e.reserved_bytes = static_cast<std::size_t>(slot.word[kReserved].load(relaxed));
    e.device_used_bytes = static_cast<std::size_t>(slot.word[kDeviceUsed].load(relaxed));
    const std::uint64_t packed = slot.word[kPacked].load(relaxed);
    e.context = static_cast<ContextId>(packed >> 32);
    e.small_pool = ((packed >> 8) & 1) != 0;
    e.action = static_cast<TraceAction>(packed & 0xff);
    out.push_back(e);
    tick_values.push_back(ticks);
    if ((packed & kFoldedBit) != 0) {
      // The folded free_completed: same block and totals, the next event number.
      e.action = TraceAction::FreeCompleted;
      e.sequence += 1;
      out.push_back(e);
      tick_values.push_back(ticks);
    }
  }
  // The writer announces event k in writing_ (k + 1) before touching slot
  // k % capacity, so slot j may have been overwritten while we copied iff
  // j + capacity < writing_now: keep only j >= writing_now - capacity.
  std::atomic_thread_fence(std::memory_order_acquire);
  const std::uint64_t writing_now = writing_.load(relaxed);
  std::size_t skip = 0;
  if (writing_now > capacity_ && writing_now - capacity_ > first) {
    const auto slots_lost =
        static_cast<std::size_t>(std::min<std::uint64_t>(writing_now - capacity_ - first, head - first));
    skip = slots_lost < slot_start.size() ? slot_start[slots_lost] : out.size();
  }
  // A slot may hold two entries, so the ring can hold more than capacity_:
  // keep exactly the newest capacity_ of them.
  if (out.size() - skip > capacity_) skip = out.size() - capacity_;
  out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(skip));
  tick_values.erase(tick_values.begin(), tick_values.begin() + static_cast<std::ptrdiff_t>(skip));
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i].time_us = timestamps_ ? detail::ticks_to_us(start_ticks_, tick_values[i]) : 0.0;
  }
  return out;
}

std::uint64_t History::recorded() const noexcept {
  return head_.load(std::memory_order_acquire) + folded_.load(std::memory_order_acquire);
}

std::size_t History::size() const noexcept {
  const std::uint64_t n = recorded();
  return static_cast<std::size_t>(n < capacity_ ? n : capacity_);
}

std::uint64_t History::dropped() const noexcept {
  const std::uint64_t n = recorded();
  return n > capacity_ ? n - capacity_ : 0;
}

void History::clear() noexcept {
  head_.store(0, std::memory_order_release);
  writing_.store(0, std::memory_order_release);
  folded_.store(0, std::memory_order_release);
  next_slot_ = 0;
  start_ticks_ = detail::ticks();
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
