// history.hpp — the allocation history: a bounded ring of allocator events.
//
//   mem::History history{allocator, 100'000};   // records from now until destroyed
//   ...
//   for (const mem::HistoryEntry& e : history.entries()) { ... }
//   mem::write_history_csv(history.entries(), "history.csv");
//
// Off by default: without a History the allocator pays one branch. With one,
// the allocator stores each event into a preallocated ring (event_ring.hpp)
// with a timestamp; module names are resolved only when read.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/event_ring.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

class CachingAllocator;

/// One recorded allocator event, as read back from a History.
struct HistoryEntry {
  std::uint64_t sequence = 0;        ///< the allocator's event counter
  double time_us = 0;                ///< microseconds since the History started (0 without timestamps)
  TraceAction action = TraceAction::Alloc;
  std::uintptr_t address = 0;        ///< block or segment (0 for oom)
  std::size_t size = 0;              ///< block or segment size; rounded request for oom
  std::size_t requested_size = 0;    ///< caller's size for alloc and free events
  StreamId stream = 0;
  bool small_pool = false;
  /// Module and phase (context_info(context)): the block's owner for alloc and
  /// free events; the calling thread's innermost scope for segment events and oom.
  ContextId context = kNoContext;
  std::size_t allocated_bytes = 0;   ///< allocator totals right after the event
  std::size_t reserved_bytes = 0;
  std::size_t device_used_bytes = 0; ///< nvidia-smi view

  std::string_view module() const noexcept { return context_info(context).path; }
  Phase phase() const noexcept { return context_info(context).phase; }
};

/// How a History records.
struct HistoryOptions {
  /// Read the CPU's time-stamp counter for every event. It is the dominant cost
  /// of recording (about 3.5 ns per event inside an allocation on the 2-vCPU
  /// AMD EPYC VMs we measure on); without it entries are ordered by `sequence`
  /// only and time_us is 0.
  bool timestamps = true;
};

/// A ring of at most `max_entries` events; when full, the oldest are dropped.
///
/// The allocator writes the ring itself (an EventRing: ten stores per event,
/// no observer call), so recording stays cheap enough to leave on. Read from
/// any thread at any time without stopping the allocator.
class History {
 public:
  /// A ring not attached to any allocator (call attach_to, or feed record()).
  explicit History(std::size_t max_entries, HistoryOptions options = {});
  /// A ring recording `allocator`'s events until destroyed.
  History(CachingAllocator& allocator, std::size_t max_entries, HistoryOptions options = {});
  ~History();
  History(const History&) = delete;
  History& operator=(const History&) = delete;

  /// Starts recording `allocator` (one at a time). Throws mem::Error if attached.
  void attach_to(CachingAllocator& allocator);
  /// Stops recording; entries stay readable.
  void detach() noexcept;

  /// Records one event by hand (a History not attached to an allocator).
  void record(const TraceEvent& event) noexcept { ring_.record(event); }

  /// The retained entries, oldest first.
  std::vector<HistoryEntry> entries() const;
  /// Entries retained now (at most capacity()).
  std::size_t size() const noexcept;
  std::size_t capacity() const noexcept { return ring_.capacity(); }
  /// Events seen since construction or clear(), including dropped ones.
  std::uint64_t recorded() const noexcept { return ring_.recorded(); }
  /// Events dropped because the ring was full.
  std::uint64_t dropped() const noexcept;
  /// Forgets every entry. Not to be called while the allocator may emit events.
  void clear() noexcept;

 private:
  EventRing ring_;
  std::atomic<std::uint64_t> start_ticks_;  ///< time zero of time_us
  CachingAllocator* allocator_ = nullptr;
};

/// Process-wide switch like torch.cuda.memory._record_memory_history: keeps a
/// History of `max_entries` for `allocator` (replacing any previous one);
/// 0 stops recording and discards it. The allocator must outlive the recording
/// (call record_history(allocator, 0) before destroying a non-process allocator).
void record_history(CachingAllocator& allocator, std::size_t max_entries);
/// The History record_history() keeps for `allocator`, or null.
std::shared_ptr<const History> recorded_history(const CachingAllocator& allocator);

}  // namespace mem
