// event_ring.hpp — the allocator's cheapest recording hook: a bounded ring of
// raw events that the allocator writes itself, inline, under its lock.
//
// An AllocatorObserver costs a TraceEvent on the stack and a virtual call per
// event; a ring costs ten plain stores (and a clock read with timestamps).
// mem::History (instrumentation/) owns one, attaches it with
// CachingAllocator::attach_ring and turns what it reads into HistoryEntry
// values; other code has no reason to include this header.
//
// One writer at a time (the allocator's lock serialises record()); readers on
// any thread, without stopping the writer: a sequence lock over the ring.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vramscope/allocator/clock.hpp"
#include "vramscope/allocator/observer.hpp"

namespace mem {

/// One event read back from a ring, with its raw clock reading (0 without timestamps).
struct RingEvent {
  TraceEvent event;
  std::uint64_t ticks = 0;
};

class EventRing {
 public:
  /// Keeps the newest `capacity` events (at least 1; mem::Error otherwise).
  EventRing(std::size_t capacity, bool timestamps);
  EventRing(const EventRing&) = delete;
  EventRing& operator=(const EventRing&) = delete;

  /// Appends one event; a FreeRequested with `completed` stands for itself
  /// and the FreeCompleted that followed at once (PyTorch's two entries).
  /// One writer at a time.
  void record(const TraceEvent& e) noexcept;

  /// The retained events, oldest first, folded frees expanded: at most
  /// capacity() of them, none torn by a concurrent record().
  std::vector<RingEvent> read() const;
  /// Events recorded since construction or clear(), dropped ones included.
  std::uint64_t recorded() const noexcept;
  std::size_t capacity() const noexcept { return capacity_; }
  bool timestamps() const noexcept { return timestamps_; }
  /// Forgets every event. Not while a writer may record.
  void clear() noexcept;

 private:
  // An event as 64-bit words, each stored with a plain relaxed store (a mov).
  enum Word : std::size_t {
    kSequence, kTicks, kAddress, kSize, kRequested, kStream, kAllocated, kReserved, kDeviceUsed,
    kPacked,  // context << 32 | folded << 9 | small_pool << 8 | action
    kWords
  };
  static constexpr std::uint64_t kFoldedBit = std::uint64_t{1} << 9;
  struct Slot {
    std::atomic<std::uint64_t> word[kWords];
  };

  std::size_t capacity_;
  bool timestamps_;
  std::unique_ptr<Slot[]> slots_;
  // Slot (i % capacity_) holds the i-th slot written; slots [head_ -
  // min(head_, capacity_), head_) are readable. A slot holds one event, or two
  // when a free_completed was folded into it. Only the writer advances head_.
  std::atomic<std::uint64_t> head_{0};
  std::atomic<std::uint64_t> writing_{0};  ///< index + 1 of the slot being written
  std::atomic<std::uint64_t> folded_{0};   ///< free_completed events folded into a slot
  std::size_t next_slot_ = 0;              ///< head_ % capacity_, writer-only
};

inline void EventRing::record(const TraceEvent& e) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  // A sequence lock with one writer: announce the slot, write it, publish it.
  const std::uint64_t index = head_.load(relaxed);
  writing_.store(index + 1, relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // no instruction on x86
  Slot& slot = slots_[next_slot_];
  // A wrapping index, not index % capacity_: a 64-bit division would cost
  // more than the rest of this function.
  next_slot_ = next_slot_ + 1 == capacity_ ? 0 : next_slot_ + 1;
  slot.word[kSequence].store(e.sequence, relaxed);
  slot.word[kTicks].store(timestamps_ ? detail::ticks() : 0, relaxed);
  slot.word[kAddress].store(e.address, relaxed);
  slot.word[kSize].store(e.size, relaxed);
  slot.word[kRequested].store(e.requested_size, relaxed);
  slot.word[kStream].store(e.stream, relaxed);
  slot.word[kAllocated].store(e.allocated_bytes, relaxed);
  slot.word[kReserved].store(e.reserved_bytes, relaxed);
  slot.word[kDeviceUsed].store(e.device_used_bytes, relaxed);
  slot.word[kPacked].store(std::uint64_t{e.context} << 32 | (e.completed ? kFoldedBit : 0) |
                               std::uint64_t{e.small_pool} << 8 |
                               static_cast<std::uint64_t>(e.action),
                           relaxed);
  head_.store(index + 1, std::memory_order_release);
  if (e.completed) folded_.store(folded_.load(relaxed) + 1, std::memory_order_release);
}

}  // namespace mem
