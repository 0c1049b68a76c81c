// reference_model.hpp — an independent model of the caching allocator's
// contract, written from the documented policy rather than from allocator/src:
// which pointers are live or waiting for stream events, what each must cost,
// and what the statistics and the device must then say.
//
//   ReferenceModel model{config, device_config};
//   void* p = alloc.allocate(n, s);
//   model.on_allocate(p, n, alloc.block_size(p), s);
//   model.check(alloc, device);  // throws ReferenceViolation naming the first mismatch
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"

namespace mem::reliability {

/// The allocator broke its contract; the message names the first violation.
class ReferenceViolation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class ReferenceModel {
 public:
  ReferenceModel(AllocatorConfig config, SimDeviceConfig device);

  /// A successful allocate(requested, stream) returned `ptr` with a block of
  /// `block_size` bytes. Checks the block's size against round_size and the
  /// split rules, and that it overlaps no live or pending block.
  void on_allocate(const void* ptr, std::size_t requested, std::size_t block_size, StreamId stream);
  /// An allocate() that reached the allocator (not rejected as misuse) ran its
  /// event processing; `synchronized` when it also synchronized every stream
  /// (the free-everything retry), which completes every pending block.
  void on_allocate_attempt(bool synchronized);
  void on_free(const void* ptr);
  void on_record_stream(const void* ptr, StreamId stream);
  /// The stream was destroyed. A block used on it frees by waiting for the whole
  /// device (no event can follow a destroyed stream's work) instead of an event.
  void on_destroy_stream(StreamId stream) { destroyed_.insert(stream); }
  void on_hold_events(bool hold) { held_ = hold; }
  void on_release_events();
  void on_empty_cache();

  /// Compares the allocator and the device with the model; throws
  /// ReferenceViolation naming the first difference.
  void check(const CachingAllocator& alloc, const SimDevice& device) const;

  std::size_t live_count() const noexcept { return live_count_; }
  std::size_t pending_count() const noexcept { return blocks_.size() - live_count_; }
  /// Reserved bytes the allocator cannot give back even after emptying its cache:
  /// segments holding a live block (pending blocks complete when it synchronizes).
  static std::size_t pinned_reserved(const std::vector<SegmentInfo>& segments);
  std::size_t device_pages_bytes(std::size_t bytes) const noexcept;

 private:
  struct Block {
    std::size_t requested = 0;
    std::size_t rounded = 0;  ///< round_size(requested, config)
    std::size_t size = 0;     ///< the block handed out (>= rounded)
    StreamId stream = 0;
    bool live = true;  ///< false: freed, waiting for its streams' events
    int pending_events = 0;
    std::vector<StreamId> uses;  ///< record_stream streams other than its own, in order
  };
  struct Event {
    std::uintptr_t block;
    bool complete;
  };

  Block& live_block(const void* ptr, const char* what);
  void complete_block(std::uintptr_t address);
  void process_events();
  void synchronize_all();

  AllocatorConfig config_;
  SimDeviceConfig device_;
  std::map<std::uintptr_t, Block> blocks_;  ///< live and pending blocks by address
  std::size_t live_count_ = 0;
  /// Per-stream FIFO of recorded events, as CUDA (and the allocator) see them: a
  /// completed event behind an incomplete one on the same stream is not seen.
  std::map<StreamId, std::deque<Event>> events_;
  bool held_ = false;
  std::set<StreamId> destroyed_;
};

}  // namespace mem::reliability
