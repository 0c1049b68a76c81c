// event_ring.cpp — reading the event ring back under its sequence check.
#include "vramscope/allocator/event_ring.hpp"

#include <algorithm>

#include "vramscope/allocator/errors.hpp"

namespace mem {

EventRing::EventRing(std::size_t capacity, bool timestamps)
    : capacity_(capacity), timestamps_(timestamps) {
  if (capacity == 0) throw Error("mem::EventRing: capacity must be at least 1");
  slots_ = std::make_unique<Slot[]>(capacity_);
  if (timestamps_) (void)detail::ticks_per_us();  // calibrate now, not on the first read
}

std::vector<RingEvent> EventRing::read() const {
  constexpr auto relaxed = std::memory_order_relaxed;
  const std::uint64_t head = head_.load(std::memory_order_acquire);
  const std::uint64_t first = head > capacity_ ? head - capacity_ : 0;
  std::vector<RingEvent> out;
  out.reserve(static_cast<std::size_t>(head - first) + 16);
  std::vector<std::size_t> slot_start;  // first event of each copied slot
  slot_start.reserve(static_cast<std::size_t>(head - first));
  for (std::uint64_t i = first; i < head; ++i) {
    const Slot& slot = slots_[i % capacity_];
    slot_start.push_back(out.size());
    RingEvent r;
    TraceEvent& e = r.event;
    e.sequence = slot.word[kSequence].load(relaxed);
    r.ticks = slot.word[kTicks].load(relaxed);
    e.address = static_cast<std::uintptr_t>(slot.word[kAddress].load(relaxed));
    e.size = static_cast<std::size_t>(slot.word[kSize].load(relaxed));
    e.requested_size = static_cast<std::size_t>(slot.word[kRequested].load(relaxed));
    e.stream = slot.word[kStream].load(relaxed);
    e.allocated_bytes = static_cast<std::size_t>(slot.word[kAllocated].load(relaxed));
    e.reserved_bytes = static_cast<std::size_t>(slot.word[kReserved].load(relaxed));
    e.device_used_bytes = static_cast<std::size_t>(slot.word[kDeviceUsed].load(relaxed));
    const std::uint64_t packed = slot.word[kPacked].load(relaxed);
    e.context = static_cast<std::uint32_t>(packed >> 32);
    e.small_pool = ((packed >> 8) & 1) != 0;
    e.action = static_cast<TraceAction>(packed & 0xff);
    out.push_back(r);
    if ((packed & kFoldedBit) != 0) {
      // The folded free_completed: same block and totals, the next event number.
      e.action = TraceAction::FreeCompleted;
      e.sequence += 1;
      out.push_back(r);
    }
  }
  // The writer announces slot k in writing_ (k + 1) before touching slot
  // k % capacity, so slot j may have been overwritten while we copied iff
  // j + capacity < writing_now: keep only j >= writing_now - capacity.
  std::atomic_thread_fence(std::memory_order_acquire);
  const std::uint64_t writing_now = writing_.load(relaxed);
  std::size_t skip = 0;
  if (writing_now > capacity_ && writing_now - capacity_ > first) {
    const auto slots_lost = static_cast<std::size_t>(
        std::min<std::uint64_t>(writing_now - capacity_ - first, head - first));
    skip = slots_lost < slot_start.size() ? slot_start[slots_lost] : out.size();
  }
  // A slot may hold two events, so the ring can hold more than capacity_:
  // keep exactly the newest capacity_ of them.
  if (out.size() - skip > capacity_) skip = out.size() - capacity_;
  out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(skip));
  return out;
}

std::uint64_t EventRing::recorded() const noexcept {
  return head_.load(std::memory_order_acquire) + folded_.load(std::memory_order_acquire);
}

void EventRing::clear() noexcept {
  head_.store(0, std::memory_order_release);
  writing_.store(0, std::memory_order_release);
  folded_.store(0, std::memory_order_release);
  next_slot_ = 0;
}

}  // namespace mem
