// replay.cpp — drives a CachingAllocator with a recorded trace: rebuilds the
// starting state, replays allocs and frees, the driver's refusals and
// empty_cache calls, and compares what happens with what was recorded.
#include "vramscope/replay/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory_resource>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {

namespace detail {

/// A device that hands out the addresses a trace recorded. Capacity, the
/// nvidia-smi view and latency come from the wrapped device; only the numbers
/// the allocator sees as segment addresses are the recorded ones, so best fit
/// orders segments as it did on the GPU. Sizes that were not recorded get
/// addresses from a range far above any real one.
class TraceAddressDevice final : public Device {
 public:
  struct Expected {
    std::uintptr_t address = 0;
    std::size_t size = 0;
  };

  explicit TraceAddressDevice(std::shared_ptr<Device> inner) : inner_(std::move(inner)) {}

  /// The next segment allocations should get these addresses; with
  /// `refuse_first` the first attempt fails as cudaMalloc did on the GPU.
  void expect(std::vector<Expected> expected, bool refuse_first) {
    std::lock_guard lock(mutex_);
    expected_ = std::move(expected);
    used_.assign(expected_.size(), false);
    refuse_next_ = refuse_first;
  }
  void clear_expectations() {
    std::lock_guard lock(mutex_);
    expected_.clear();
    used_.clear();
    refuse_next_ = false;
  }
  std::size_t refusals() const {
    std::lock_guard lock(mutex_);
    return refusals_;
  }

  const DeviceInfo& info() const override { return inner_->info(); }

  void* allocate_segment(std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    if (take_refusal()) return nullptr;
    void* real = inner_->allocate_segment(bytes);
    if (real == nullptr) return nullptr;
    std::uintptr_t address = 0;
    for (std::size_t i = 0; i < expected_.size(); ++i) {
      if (!used_[i] && expected_[i].size == bytes && !overlaps(expected_[i].address, bytes)) {
        used_[i] = true;
        address = expected_[i].address;
        break;
      }
    }
    if (address == 0) {
      address = next_fallback_;
      next_fallback_ += (bytes + kRoundLarge - 1) / kRoundLarge * kRoundLarge + kRoundLarge;
    }
    live_[address] = Live{real, bytes};
    return reinterpret_cast<void*>(address);
  }

  void free_segment(void* ptr, std::size_t bytes) noexcept override {
    std::lock_guard lock(mutex_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.end()) return;
    inner_->free_segment(it->second.real, it->second.bytes);
    (void)bytes;
    live_.erase(it);
  }

  // Expandable segments: a reservation can be given a recorded base; its pages are mapped
  // at the same offsets in the inner device's own range.
  bool supports_virtual_memory() const override { return inner_->supports_virtual_memory(); }
  /// The next reserve_address_range returns `base` (0: the inner device's address).
  void expect_reservation(std::uintptr_t base) {
    std::lock_guard lock(mutex_);
    expected_reservation_ = base;
  }
  void* reserve_address_range(std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    void* real = inner_->reserve_address_range(bytes);
    if (real == nullptr) return nullptr;
    const std::uintptr_t base = expected_reservation_ != 0 ? expected_reservation_ : reinterpret_cast<std::uintptr_t>(real);
    expected_reservation_ = 0;
    reservations_[base] = Live{real, bytes};
    return reinterpret_cast<void*>(base);
  }
  void release_address_range(void* base, std::size_t bytes) noexcept override {
    std::lock_guard lock(mutex_);
    auto it = reservations_.find(reinterpret_cast<std::uintptr_t>(base));
    if (it == reservations_.end()) return;
    inner_->release_address_range(it->second.real, bytes);
    reservations_.erase(it);
  }
  bool map_memory(void* address, std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    if (take_refusal()) return false;  // the recording's refused cuMemCreate
    return inner_->map_memory(inner_address(address), bytes);
  }
  void unmap_memory(void* address, std::size_t bytes) noexcept override {
    std::lock_guard lock(mutex_);
    inner_->unmap_memory(inner_address(address), bytes);
  }

  DeviceMemInfo mem_get_info() const override { return inner_->mem_get_info(); }
  std::size_t process_used_bytes() const override { return inner_->process_used_bytes(); }
  StreamId create_stream() override { return inner_->create_stream(); }
  void destroy_stream(StreamId stream) noexcept override { inner_->destroy_stream(stream); }
  bool has_stream(StreamId stream) const override { return inner_->has_stream(stream); }
  EventId create_event() override { return inner_->create_event(); }
  void destroy_event(EventId event) noexcept override { inner_->destroy_event(event); }
  void record_event(EventId event, StreamId stream) override { inner_->record_event(event, stream); }
  bool query_event(EventId event) override { return inner_->query_event(event); }
  void synchronize_event(EventId event) override { inner_->synchronize_event(event); }
  void synchronize() override { inner_->synchronize(); }
  double driver_time_us() const override { return inner_->driver_time_us(); }

 private:
  struct Live {
    void* real = nullptr;
    std::size_t bytes = 0;
  };
  bool overlaps(std::uintptr_t address, std::size_t bytes) const {
    auto next = live_.lower_bound(address);
    if (next != live_.end() && next->first < address + bytes) return true;
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.bytes > address) return true;
    }
    return false;
  }

  /// Whether this driver call is the refusal the recording showed (then counted, once).
  bool take_refusal() {
    if (!refuse_next_) return false;
    refuse_next_ = false;
    ++refusals_;
    return true;
  }
  /// The inner device's address for one inside a reservation (the one with the highest base
  /// at or below it: recorded bases never put one reservation's pages inside another's).
  void* inner_address(void* address) const {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    auto it = reservations_.upper_bound(at);
    if (it == reservations_.begin()) return address;
    --it;
    return static_cast<char*>(it->second.real) + (at - it->first);
  }

  std::shared_ptr<Device> inner_;
  mutable std::mutex mutex_;
  std::uintptr_t expected_reservation_ = 0;
  std::map<std::uintptr_t, Live> reservations_;  // base handed out -> the inner range
  std::vector<Expected> expected_;
  std::vector<bool> used_;
  bool refuse_next_ = false;
  std::size_t refusals_ = 0;
  std::map<std::uintptr_t, Live> live_;
  std::uintptr_t next_fallback_ = std::uintptr_t{1} << 56;
};

namespace {

/// Collects the allocator's segment events and the totals after each event.
class ReplayObserver final : public AllocatorObserver {
 public:
  void on_event(const TraceEvent& event) noexcept override {
    if (event.action == TraceAction::SegmentAlloc || event.action == TraceAction::SegmentMap) {
      segment_allocs.push_back(event);
      ++total_segment_allocs;
    } else if (event.action == TraceAction::SegmentFree || event.action == TraceAction::SegmentUnmap) {
      segment_frees.push_back(event);
      ++total_segment_frees;
    }
    allocated = event.allocated_bytes;
    reserved = event.reserved_bytes;
  }
  void begin() {
    segment_allocs.clear();
    segment_frees.clear();
  }

  std::vector<TraceEvent> segment_allocs;  // since begin()
  std::vector<TraceEvent> segment_frees;
  std::int64_t total_segment_allocs = 0;
  std::int64_t total_segment_frees = 0;
  std::size_t allocated = 0;
  std::size_t reserved = 0;
};

struct InitBlock {
  std::uintptr_t address = 0;
  std::size_t size = 0;       // 0 until known or inferred
  std::size_t requested = 0;
  /// Size 0 only: where the trace frees it, and the lowest address above it
  /// allocated before then (the block ends at or below that address).
  std::size_t freed_at = 0;
  std::uintptr_t end_bound = UINTPTR_MAX;
};

struct InitSegment {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::uint64_t stream = 0;
  bool small_pool = false;
  bool expandable = false;      // a mapped range of an expandable segment
  std::vector<InitBlock> live;  // address order
};

/// The expandable segments of a recording: one per stream and pool, each a reserved
/// address range. A segment event names no pool, so an address takes the pool of the
/// nearest known address at or below it on its stream (a final segment's, or an alloc's,
/// whose size gives its pool); a segment's recorded base is the lowest range start seen.
struct RecordedReservations {
  using Key = std::pair<std::uint64_t, bool>;  // (stream, small pool)
  std::map<std::pair<std::uint64_t, std::uintptr_t>, bool> known;  // (stream, address) -> small pool
  std::map<Key, std::uintptr_t> base;

  bool small_at(std::uint64_t stream, std::uintptr_t address) const {
    auto it = known.upper_bound({stream, address});
    if (it != known.begin() && std::prev(it)->first.first == stream) return std::prev(it)->second;
    return it != known.end() && it->first.first == stream && it->second;
  }
};

RecordedReservations find_reservations(const AllocationTrace& trace, const AllocatorConfig& recorded) {
  RecordedReservations r;
  for (const RecordedSegment& s : trace.final_segments) {
    if (s.expandable) r.known[{s.stream, s.address}] = s.small_pool;
  }
  for (const RecordedEvent& e : trace.events) {
    if (e.action == RecordedAction::Alloc && e.size > 0) {
      r.known.emplace(std::make_pair(e.stream, e.address), round_size(e.size, recorded) <= kSmallSize);
    }
  }
  const auto range_start = [&](std::uint64_t stream, std::uintptr_t address) {
    const RecordedReservations::Key key{stream, r.small_at(stream, address)};
    auto [it, fresh] = r.base.emplace(key, address);
    if (!fresh) it->second = std::min(it->second, address);
  };
  for (const RecordedSegment& s : trace.final_segments) {
    if (s.expandable) range_start(s.stream, s.address);
  }
  for (const RecordedEvent& e : trace.events) {
    if (e.action == RecordedAction::SegmentMap || e.action == RecordedAction::SegmentUnmap) {
      range_start(e.stream, e.address);
    }
  }
  return r;
}

struct InitialState {
  std::vector<InitSegment> segments;  // address order
  std::size_t orphan_blocks = 0;      // live blocks outside every segment (inconsistent trace)
};

/// Expandable recordings, undone backwards: a segment_map took [address, + size) out of
/// the mapped ranges, a segment_unmap put it back (joined to the ranges it touches).
void unmap_range(std::map<std::uintptr_t, InitSegment>& segs, std::uintptr_t address, std::size_t size) {
  auto it = segs.upper_bound(address);
  if (it != segs.begin()) --it;
  while (it != segs.end() && it->second.address < address + size) {
    InitSegment seg = it->second;
    const std::uintptr_t end = seg.address + seg.size;
    if (end <= address) {
      ++it;
      continue;
    }
    it = segs.erase(it);
    if (seg.address < address) segs[seg.address] = InitSegment{seg.address, address - seg.address, seg.stream,
                                                                seg.small_pool, seg.expandable, {}};
    if (end > address + size) segs[address + size] = InitSegment{address + size, end - address - size, seg.stream,
                                                                 seg.small_pool, seg.expandable, {}};
  }
}

void map_range(std::map<std::uintptr_t, InitSegment>& segs, InitSegment range) {
  unmap_range(segs, range.address, range.size);  // an inconsistent trace: never overlap
  auto next = segs.find(range.address + range.size);
  if (next != segs.end() && next->second.expandable && next->second.stream == range.stream &&
      next->second.small_pool == range.small_pool) {
    range.size += next->second.size;
    segs.erase(next);
  }
  auto prev = segs.lower_bound(range.address);
  if (prev != segs.begin()) {
    --prev;
    InitSegment& p = prev->second;
    if (p.expandable && p.address + p.size == range.address && p.stream == range.stream &&
        p.small_pool == range.small_pool) {
      p.size += range.size;
      return;
    }
  }
  segs[range.address] = range;
}

// The state when the trace began: the final state minus the trace's effects.
/// The recording's expandable segments (none for a recording without them).
RecordedReservations recorded_reservations(const AllocationTrace& trace, const AllocatorConfig& recorded) {
  return trace.expandable_segments ? find_reservations(trace, recorded) : RecordedReservations{};
}

/// What a segment event leaves reserved, from `reserved` before it.
std::size_t reserved_after(std::size_t reserved, const RecordedEvent& e) {
  if (e.action == RecordedAction::SegmentAlloc || e.action == RecordedAction::SegmentMap) return reserved + e.size;
  if (e.action == RecordedAction::SegmentFree || e.action == RecordedAction::SegmentUnmap)
    return reserved - std::min(reserved, e.size);
  return reserved;
}

InitialState derive_initial_state(const AllocationTrace& trace, const AllocatorConfig& recorded,
                                  const RecordedReservations& reservations) {
  std::map<std::uintptr_t, InitSegment> segs;
  std::pmr::unsynchronized_pool_resource nodes;  // one insert or erase per event: no malloc each
  std::pmr::unordered_map<std::uintptr_t, InitBlock> live{&nodes};  // sorted once the trace is undone
  for (const RecordedSegment& s : trace.final_segments) {
    segs[s.address] = InitSegment{s.address, s.total_size, s.stream, s.small_pool, s.expandable, {}};
    for (const RecordedBlock& b : s.blocks)
      if (b.state != BlockState::Inactive)
        live[b.address] = InitBlock{b.address, b.size, b.requested_size ? b.requested_size : b.size};
  }
  for (std::size_t i = trace.events.size(); i-- > 0;) {
    const RecordedEvent& e = trace.events[i];
    switch (e.action) {
      case RecordedAction::SegmentAlloc: segs.erase(e.address); break;
      case RecordedAction::SegmentFree:
        segs[e.address] = InitSegment{e.address, e.size, e.stream, e.size == kSmallBuffer, false, {}};
        break;
      case RecordedAction::SegmentMap: unmap_range(segs, e.address, e.size); break;
      case RecordedAction::SegmentUnmap:
        map_range(segs, InitSegment{e.address, e.size, e.stream, reservations.small_at(e.stream, e.address), true, {}});
        break;
      case RecordedAction::Alloc: live.erase(e.address); break;
      case RecordedAction::FreeRequested:
        if (!live.count(e.address)) live[e.address] = InitBlock{e.address, 0, e.size, i};
        break;
      default: break;
    }
  }
  std::vector<InitBlock> blocks;
  blocks.reserve(live.size());
  for (const auto& [address, block] : live) blocks.push_back(block);
  std::sort(blocks.begin(), blocks.end(), [](const InitBlock& a, const InitBlock& b) { return a.address < b.address; });
  // A trace's alloc/free sizes are requests (PyTorch's orig_size): a block
  // freed during the trace may be larger than its rounded request (a tail too
  // small to split). Blocks allocated above it while it lived bound its end.
  const bool any_unsized = std::any_of(blocks.begin(), blocks.end(), [](const InitBlock& b) { return b.size == 0; });
  for (std::size_t i = 0; any_unsized && i < trace.events.size(); ++i) {
    const RecordedEvent& e = trace.events[i];
    if (e.action != RecordedAction::Alloc) continue;
    auto below = std::lower_bound(blocks.begin(), blocks.end(), e.address,
                                  [](const InitBlock& b, std::uintptr_t a) { return b.address < a; });
    if (below == blocks.begin()) continue;
    InitBlock& b = *std::prev(below);
    if (b.size == 0 && i < b.freed_at) b.end_bound = std::min(b.end_bound, e.address);
  }
  InitialState state;
  for (const InitBlock& block : blocks) {
    const std::uintptr_t address = block.address;
    auto it = segs.upper_bound(address);
    if (it == segs.begin()) {
      ++state.orphan_blocks;
      continue;
    }
    --it;
    if (address >= it->second.address + it->second.size) {
      ++state.orphan_blocks;
      continue;
    }
    it->second.live.push_back(block);
  }
  for (auto& [address, seg] : segs) {
    const std::uintptr_t end = seg.address + seg.size;
    for (std::size_t i = 0; i < seg.live.size(); ++i) {
      InitBlock& b = seg.live[i];
      std::uintptr_t boundary = i + 1 < seg.live.size() ? seg.live[i + 1].address : end;
      if (b.size == 0) {
        boundary = std::min(boundary, b.end_bound);
        // Freed during the trace, allocated before it: only the request is
        // known. Small blocks are always split exactly; a large block keeps
        // a remainder of at most 1 MiB (PyTorch splits only above that), and
        // an oversize block keeps the whole free block it was cut from.
        std::size_t size = round_size(std::max<std::size_t>(b.requested, 1), recorded);
        const std::size_t room = boundary - b.address;
        // Expandable segments split every block exactly (PyTorch's should_split).
        if (!seg.small_pool && !seg.expandable && !recorded.expandable_segments) {
          if (size >= recorded.max_split_size) {
            size = room;
          } else if (room > size && room - size <= kSmallSize) {
            size = room;
          }
        }
        b.size = size;
      }
      b.size = std::min<std::size_t>(b.size, boundary - b.address);
    }
    state.segments.push_back(std::move(seg));
  }
  return state;
}

}  // namespace

bool is_free_event(const AllocationTrace& trace, RecordedAction action) {
  // Blocks return to the pool at free_completed where the format records it.
  return trace.has_free_completed ? action == RecordedAction::FreeCompleted
                                  : action == RecordedAction::FreeRequested;
}

namespace {

std::string describe_bytes(std::size_t bytes) {
  return std::to_string(bytes) + " B";
}

class Replayer {
 public:
  Replayer(const AllocationTrace& trace, const ReplayOptions& options, ReplayResult& result)
      : trace_(trace), opt_(options), r_(result) {}

  void run() {
    auto inner = make_device(opt_.device);
    r_.device = inner->info().name;
    r_.assumptions = inner->info().assumptions;
    r_.config = opt_.config.to_string();
    r_.events = trace_.events.size();
    device_ = std::make_shared<TraceAddressDevice>(inner);
    CachingAllocator alloc{device_, opt_.config};
    alloc_ = &alloc;
    if (opt_.memory_fraction > 0) alloc.set_memory_fraction(opt_.memory_fraction);
    map_streams();

    AllocatorConfig recorded{};
    bool recorded_known = true;
    if (trace_.allocator_conf_known && !trace_.allocator_conf.empty()) {
      try {
        recorded = AllocatorConfig::parse(trace_.allocator_conf);
      } catch (const Error&) {
        recorded_known = false;
      }
    }
    const bool exact = recorded_known && recorded == opt_.config && opt_.trace_addresses;
    reservations_ = recorded_reservations(trace_, recorded);
    if (exact && opt_.config.expandable_segments) {
      // Each expandable segment at its recorded base, lowest first, as the GPU placed them.
      std::vector<std::pair<std::uintptr_t, RecordedReservations::Key>> bases;
      for (const auto& [key, base] : reservations_.base) bases.emplace_back(base, key);
      std::sort(bases.begin(), bases.end());
      for (const auto& [base, key] : bases) {
        device_->expect_reservation(base);
        (void)alloc.expandable_segment_base(stream_of(key.first), key.second);
      }
      device_->expect_reservation(0);
    }
    if (opt_.rebuild_initial_state && trace_.has_final_state) rebuild(recorded);

    alloc.reset_peak_stats();
    alloc.reset_accumulated_stats();
    const double driver_start = device_->driver_time_us();
    alloc.add_observer(&observer_);
    r_.conformance_checked = opt_.check_conformance && opt_.trace_addresses && exact;
    observer_.allocated = r_.initial_allocated;
    observer_.reserved = r_.initial_reserved;
    track_peak();  // the starting state is the first peak
    recorded_reserved_ = r_.initial_reserved;
    recorded_peak_reserved_ = recorded_peak_reserved(r_.initial_reserved);

    for (std::size_t i = 0; i < trace_.events.size(); ++i) {
      const RecordedEvent& e = trace_.events[i];
      switch (e.action) {
        // Pages mapped and unmapped are read as segments allocated and freed.
        case RecordedAction::SegmentAlloc:
        case RecordedAction::SegmentMap:
          pending_allocs_.push_back(i);
          recorded_reserved_ = reserved_after(recorded_reserved_, e);
          break;
        case RecordedAction::SegmentFree:
        case RecordedAction::SegmentUnmap:
          if (pending_frees_.empty()) reserved_before_frees_ = recorded_reserved_;
          pending_frees_.push_back(i);
          recorded_reserved_ = reserved_after(recorded_reserved_, e);
          break;
        case RecordedAction::Alloc: do_alloc(i); break;
        case RecordedAction::FreeRequested:
        case RecordedAction::FreeCompleted:
          flush_pending(i);
          if (is_free_event(trace_, e.action)) do_free(e);
          break;
        case RecordedAction::Oom:
          ++r_.recorded_ooms;
          flush_pending(i);
          break;
        default: break;
      }
      if (stopped_) break;
    }
    flush_pending(trace_.events.size());
    alloc.remove_observer(&observer_);
    if (r_.conformance_checked && trace_.has_final_state) compare_final_state();

    r_.final_stats = alloc.stats();
    const DeviceStats& s = r_.final_stats;
    r_.peak_allocated = s.allocated_bytes[0].peak;
    r_.peak_reserved = s.reserved_bytes[0].peak;
    r_.peak_requested = s.requested_bytes[0].peak;
    r_.peak_device_used = s.device_used_bytes.peak;
    r_.reserved_per_requested = r_.peak_requested > 0 ? static_cast<double>(r_.peak_reserved) /
                                                            static_cast<double>(r_.peak_requested)
                                                      : 0.0;
    // The reserved memory no single request could have had when allocated memory peaked:
    // free, but outside the largest free block, as a share of what was reserved then.
    const std::int64_t reserved_at_peak =
        static_cast<std::int64_t>(peak_allocated_seen_) + r_.reserved_unallocated_at_peak;
    if (opt_.track_fragmentation && reserved_at_peak > 0) {
      const std::int64_t scattered =
          r_.reserved_unallocated_at_peak - static_cast<std::int64_t>(r_.largest_free_block_at_peak);
      r_.fragmentation = static_cast<double>(std::max<std::int64_t>(scattered, 0)) /
                         static_cast<double>(reserved_at_peak);
    }
    r_.segment_allocs = observer_.total_segment_allocs;
    r_.segment_frees = observer_.total_segment_frees;
    r_.driver_time_us = device_->driver_time_us() - driver_start;
    r_.driver_refusals = device_->refusals();
    alloc_ = nullptr;
  }

 private:
  StreamId stream_of(std::uint64_t recorded) const {
    auto it = streams_.find(recorded);
    return it == streams_.end() ? 0 : it->second;
  }

  // Recorded stream handles become device streams, in the same order (the
  // pools order blocks by stream first).
  void map_streams() {
    std::set<std::uint64_t> handles;
    for (const RecordedEvent& e : trace_.events) handles.insert(e.stream);
    for (const RecordedSegment& s : trace_.final_segments) handles.insert(s.stream);
    for (std::uint64_t h : handles) streams_[h] = h == 0 ? 0 : device_->create_stream();
  }

  // Every divergence is counted; only the first max_divergences are described, and only
  // those pay for their description (where_is walks every segment: building it for each
  // of a trace that diverges everywhere made the replay quadratic).
  template <class Describe>
  void divergence(std::size_t index, Describe&& describe) {
    ++r_.divergence_count;
    if (r_.divergences.size() < opt_.max_divergences) {
      r_.divergences.push_back(ReplayDivergence{index, std::string(describe())});
    }
  }
  void divergence(std::size_t index, std::string what) {
    divergence(index, [&] { return std::move(what); });
  }

  // The starting state, the same under every setting: the recorded segments at their
  // recorded addresses, the live blocks at their recorded offsets, the rest free. A what-if
  // then differs from the recorded setting's run only by what the trace's events do.
  void rebuild(const AllocatorConfig& recorded) {
    const InitialState state = derive_initial_state(trace_, recorded, reservations_);
    r_.rebuilt_exactly = opt_.trace_addresses;
    r_.initial_segments = state.segments.size();
    for (const InitSegment& seg : state.segments) {
      std::vector<CachingAllocator::RestoredBlock> live;
      live.reserve(seg.live.size());
      for (const InitBlock& b : seg.live) {
        live.push_back({b.address - seg.address, b.size, b.requested <= b.size ? b.requested : 0});
      }
      r_.initial_blocks += live.size();
      // A mapped range of an expandable segment is mapped at its offset in the replay's
      // segment; without expandable segments it is memory held all the same: a segment.
      const bool as_range = seg.expandable && opt_.config.expandable_segments;
      if (opt_.trace_addresses && !as_range) device_->expect({{seg.address, seg.size}}, false);
      std::vector<void*> ptrs;
      try {
        if (as_range) {
          const auto base = reservations_.base.find({seg.stream, seg.small_pool});
          const std::size_t offset = base == reservations_.base.end() ? 0 : seg.address - base->second;
          ptrs = alloc_->restore_expandable(offset, seg.size, stream_of(seg.stream), seg.small_pool, live);
        } else {
          ptrs = alloc_->restore_segment(seg.size, stream_of(seg.stream), seg.small_pool, live);
        }
      } catch (const std::exception& ex) {
        device_->clear_expectations();
        divergence(0, "starting state: cannot restore a segment of " + describe_bytes(seg.size) + ": " + ex.what());
        for (const InitBlock& b : seg.live) failed_.insert(b.address);
        r_.initial_blocks_misplaced += seg.live.size();
        continue;
      }
      device_->clear_expectations();
      for (std::size_t i = 0; i < ptrs.size(); ++i) {
        live_[seg.live[i].address] = Live{ptrs[i], 0};
        if (reinterpret_cast<std::uintptr_t>(ptrs[i]) != seg.live[i].address) ++r_.initial_blocks_misplaced;
      }
    }
    const DeviceStats s = alloc_->stats();
    r_.initial_reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
    r_.initial_allocated = static_cast<std::size_t>(s.allocated_bytes[0].current);
    if (r_.initial_blocks_misplaced > 0 && opt_.trace_addresses)
      divergence(0, "starting state: " + std::to_string(r_.initial_blocks_misplaced) +
                        " live blocks not at their recorded addresses");
  }

  // Segment frees the trace shows with no segment alloc after them were an
  // empty_cache() (or a failed allocation's cache release): replay them so.
  void flush_pending(std::size_t index) {
    if (!pending_frees_.empty() && pending_allocs_.empty()) {
      observer_.begin();
      alloc_->empty_cache();
      ++r_.empty_cache_calls;
      compare_frees(index);
    } else if (!pending_allocs_.empty()) {
      // segment_alloc with no alloc after it (a trace cut at the end): count only.
      if (r_.conformance_checked) {
        r_.segment_allocs_recorded += pending_allocs_.size();
        r_.segment_frees_recorded += pending_frees_.size();
        divergence(index, std::to_string(pending_allocs_.size()) +
                              " recorded segment_alloc(s) with no alloc after them");
      }
    }
    pending_allocs_.clear();
    pending_frees_.clear();
  }

  void compare_frees(std::size_t index) {
    if (!r_.conformance_checked) return;
    r_.segment_frees_recorded += pending_frees_.size();
    std::multiset<std::pair<std::uintptr_t, std::size_t>> ours;
    for (const TraceEvent& f : observer_.segment_frees) ours.insert({f.address, f.size});
    std::size_t matched = 0;
    for (std::size_t idx : pending_frees_) {
      const RecordedEvent& e = trace_.events[idx];
      auto it = ours.find({e.address, e.size});
      if (it != ours.end()) {
        ours.erase(it);
        ++matched;
      }
    }
    r_.segment_frees_reproduced += matched;
    if (matched != pending_frees_.size() || !ours.empty())
      divergence(index, "recorded " + std::to_string(pending_frees_.size()) + " segment_free(s), replay freed " +
                            std::to_string(observer_.segment_frees.size()) + " (" +
                            std::to_string(matched) + " the same)");
  }


  /// The first OOM with the allocator's state at that moment: the largest free block, the
  /// free bytes, and the segments whose live blocks keep the most free memory pinned.
  ReplayOom oom_forensics(std::size_t index, std::size_t requested, std::string message) const {
    ReplayOom o;
    o.event_index = index;
    o.requested = requested;
    o.message = std::move(message);
    std::unordered_map<std::uintptr_t, std::uint32_t> stack_at;  // replay block -> its alloc's stack
    for (const auto& [recorded, block] : live_) {
      if (block.stack != 0) stack_at[reinterpret_cast<std::uintptr_t>(block.ptr)] = block.stack;
    }
    const auto stack_of_block = [&](std::uintptr_t address) {
      const auto it = stack_at.find(address);
      return it == stack_at.end() || it->second > trace_.stacks.size() ? std::string() : trace_.stacks[it->second - 1];
    };
    std::vector<ReplayOom::Segment> segs;
    for (const SegmentInfo& seg : alloc_->segments()) {
      ReplayOom::Segment out;
      out.address = seg.address;
      out.size = seg.total_size;
      for (const BlockInfo& b : seg.blocks) {
        if (b.state == BlockState::Inactive) {
          out.free_bytes += b.size;
          out.largest_free = std::max(out.largest_free, b.size);
        } else {
          ++out.live_blocks;
          out.live_bytes += b.size;
          out.pins.push_back({b.address - seg.address, b.size, stack_of_block(b.address)});
        }
      }
      o.free_bytes += out.free_bytes;
      o.largest_free_block = std::max(o.largest_free_block, out.largest_free);
      if (out.free_bytes > 0) segs.push_back(out);
    }
    std::sort(segs.begin(), segs.end(), [](const ReplayOom::Segment& a, const ReplayOom::Segment& b) {
      return a.free_bytes != b.free_bytes ? a.free_bytes > b.free_bytes : a.address < b.address;
    });
    if (segs.size() > 8) segs.resize(8);
    for (ReplayOom::Segment& seg : segs) {
      std::stable_sort(seg.pins.begin(), seg.pins.end(),
                       [](const ReplayOom::Pin& a, const ReplayOom::Pin& b) { return a.size > b.size; });
      if (seg.pins.size() > 4) seg.pins.resize(4);
    }
    o.fragmented = std::move(segs);
    return o;
  }

  /// The most the recording ever reserved (starting state and segment events): memory the
  /// device did have for this process.
  std::size_t recorded_peak_reserved(std::size_t initial) const {
    std::size_t now = initial, peak = initial;
    for (const RecordedEvent& e : trace_.events) {
      now = reserved_after(now, e);
      peak = std::max(peak, now);
    }
    return peak;
  }

  /// Segment frees right before an alloc's segment_alloc: PyTorch's free-cache-and-retry
  /// after a refused cudaMalloc, or an empty_cache() the program called just before. A
  /// refusal needs a device too full for the new segment: when what was reserved before the
  /// frees plus the new segments stays within what the recording reserved at its peak, the
  /// device had room, so the frees were an empty_cache().
  bool frees_were_empty_cache() const {
    std::size_t wanted = 0;
    for (std::size_t idx : pending_allocs_) wanted += trace_.events[idx].size;
    return reserved_before_frees_ + wanted <= recorded_peak_reserved_;
  }

  void do_alloc(std::size_t index) {
    // Segment frees followed by an alloc with no segment_alloc between were an
    // empty_cache(): the free-and-retry path always mallocs a segment after them.
    if (!pending_frees_.empty() && pending_allocs_.empty()) flush_pending(index);
    if (!pending_frees_.empty() && pending_frees_.front() < pending_allocs_.front() && frees_were_empty_cache()) {
      // The empty_cache() first, then this alloc's segment_allocs.
      std::vector<std::size_t> allocs = std::move(pending_allocs_);
      pending_allocs_.clear();
      flush_pending(index);
      pending_allocs_ = std::move(allocs);
    }
    const RecordedEvent& e = trace_.events[index];
    ++r_.allocs;
    std::vector<TraceAddressDevice::Expected> expected;
    for (std::size_t idx : pending_allocs_)
      expected.push_back({trace_.events[idx].address, trace_.events[idx].size});
    const bool refuse = opt_.replay_driver_refusals && !pending_frees_.empty() && !expected.empty() &&
                        pending_frees_.front() < pending_allocs_.front();
    if (opt_.trace_addresses) device_->expect(std::move(expected), refuse);
    observer_.begin();
    void* ptr = nullptr;
    try {
      ptr = alloc_->allocate(e.size, stream_of(e.stream));
    } catch (const OutOfMemoryError& oom) {
      ++r_.failed_allocs;
      ++r_.ooms;
      if (!r_.first_oom) r_.first_oom = oom_forensics(index, e.size, oom.what());
      if (opt_.stop_at_oom) stopped_ = true;
    } catch (const Error& err) {
      ++r_.failed_allocs;
      divergence(index, "alloc of " + describe_bytes(e.size) + " rejected: " + err.what());
    }
    device_->clear_expectations();

    if (r_.conformance_checked) {
      r_.segment_allocs_recorded += pending_allocs_.size();
      const auto& ours = observer_.segment_allocs;
      std::size_t same = 0;
      for (std::size_t k = 0; k < pending_allocs_.size() && k < ours.size(); ++k) {
        const RecordedEvent& want = trace_.events[pending_allocs_[k]];
        if (ours[k].size == want.size && ours[k].stream == stream_of(want.stream)) ++same;
      }
      r_.segment_allocs_reproduced += same;
      if (same != pending_allocs_.size() || ours.size() != pending_allocs_.size()) {
        divergence(index, [&] {
          std::string want, got;
          for (std::size_t idx : pending_allocs_) want.append(" ").append(describe_bytes(trace_.events[idx].size));
          for (const TraceEvent& t : ours) got.append(" ").append(describe_bytes(t.size));
          return "alloc of " + describe_bytes(e.size) + ": recorded segment_alloc [" +
                 (want.empty() ? " none" : want) + " ], replay [" + (got.empty() ? " none" : got) + " ]";
        });
      }
      if (!pending_frees_.empty()) compare_frees(index);
      ++r_.allocs_checked;
      if (ptr != nullptr && reinterpret_cast<std::uintptr_t>(ptr) == e.address) {
        ++r_.blocks_placed;
      } else if (ptr != nullptr) {
        divergence(index, [&] {
          return "alloc of " + describe_bytes(e.size) + ": recorded at " + format_address(e.address) +
                 ", replay placed it at " + format_address(reinterpret_cast<std::uintptr_t>(ptr)) +
                 where_is(reinterpret_cast<std::uintptr_t>(ptr), e.address);
        });
      }
    }
    pending_allocs_.clear();
    pending_frees_.clear();

    if (ptr == nullptr) {
      failed_.insert(e.address);
      return;
    }
    failed_.erase(e.address);
    if (auto it = live_.find(e.address); it != live_.end()) {
      // Recorded twice without a free between: the earlier block leaked there.
      ++r_.unknown_frees;
    }
    live_[e.address] = Live{ptr, e.stack};
    track_peak();
  }

  void compare_final_state() {
    const std::vector<SegmentInfo> ours = alloc_->segments();
    std::map<std::uintptr_t, const SegmentInfo*> by_address;
    for (const SegmentInfo& s : ours) by_address[s.address] = &s;
    auto active = [](BlockState st) { return st != BlockState::Inactive; };
    r_.final_segments_recorded = trace_.final_segments.size();
    for (const RecordedSegment& want : trace_.final_segments) {
      auto it = by_address.find(want.address);
      bool same = it != by_address.end() && it->second->total_size == want.total_size &&
                  it->second->blocks.size() == want.blocks.size();
      for (std::size_t k = 0; same && k < want.blocks.size(); ++k) {
        const BlockInfo& got = it->second->blocks[k];
        same = got.address == want.blocks[k].address && got.size == want.blocks[k].size &&
               active(got.state) == active(want.blocks[k].state);
      }
      if (same) {
        ++r_.final_segments_matched;
      } else {
        divergence(trace_.events.size(), "final state: segment " + format_address(want.address) + " of " +
                                             describe_bytes(want.total_size) +
                                             (it == by_address.end() ? " is missing"
                                                                     : " differs in its blocks"));
      }
    }
    if (ours.size() != trace_.final_segments.size())
      divergence(trace_.events.size(), "final state: recorded " +
                                           std::to_string(trace_.final_segments.size()) +
                                           " segments, replay holds " + std::to_string(ours.size()));
  }

  void do_free(const RecordedEvent& e) {
    auto it = live_.find(e.address);
    if (it == live_.end()) {
      if (failed_.erase(e.address) == 0) ++r_.unknown_frees;
      return;
    }
    alloc_->deallocate(it->second.ptr);
    live_.erase(it);
    ++r_.frees;
  }

  void track_peak() {
    if (observer_.allocated <= peak_allocated_seen_) return;
    peak_allocated_seen_ = observer_.allocated;
    r_.reserved_unallocated_at_peak =
        static_cast<std::int64_t>(observer_.reserved) - static_cast<std::int64_t>(observer_.allocated);
    if (!opt_.track_fragmentation) return;
    r_.largest_free_block_at_peak = alloc_->largest_free_block();  // no walk: one look per pool
  }

  // "(segment 0x7f.. + 1048576 B)" for the replay's pointer, to read divergences.
  std::string where_is(std::uintptr_t got, std::uintptr_t want) const {
    std::string out;
    for (const SegmentInfo& s : alloc_->segments()) {
      if (got >= s.address && got < s.address + s.total_size)
        out += " (segment " + format_address(s.address) + " + " + std::to_string(got - s.address) + ")";
      if (want >= s.address && want < s.address + s.total_size)
        out += " (recorded: segment " + format_address(s.address) + " + " + std::to_string(want - s.address) + ")";
    }
    return out;
  }

  const AllocationTrace& trace_;
  const ReplayOptions& opt_;
  ReplayResult& r_;
  std::shared_ptr<TraceAddressDevice> device_;
  RecordedReservations reservations_;  // expandable recordings: each segment's base
  CachingAllocator* alloc_ = nullptr;
  ReplayObserver observer_;
  std::map<std::uint64_t, StreamId> streams_;
  struct Live {
    void* ptr = nullptr;      // the replay's block
    std::uint32_t stack = 0;  // its alloc's stack (1 + index in trace_.stacks; 0: none)
  };
  // Node maps whose nodes come from a pool: a replay inserts and erases one per event, and
  // malloc and free were a fifth of a 300k-live-block replay.
  std::pmr::unsynchronized_pool_resource nodes_;
  std::pmr::unordered_map<std::uintptr_t, Live> live_{&nodes_};  // recorded address -> replay block
  std::pmr::unordered_set<std::uintptr_t> failed_{&nodes_};      // recorded allocs the replay could not make
  std::vector<std::size_t> pending_allocs_;         // segment_alloc events since the last block event
  std::vector<std::size_t> pending_frees_;
  std::size_t peak_allocated_seen_ = 0;
  std::size_t recorded_reserved_ = 0;       // the recording's reserved bytes at this event
  std::size_t recorded_peak_reserved_ = 0;  // and at its peak
  std::size_t reserved_before_frees_ = 0;   // before the pending segment frees
  bool stopped_ = false;
};

}  // namespace
}  // namespace detail

ReplayResult replay(const AllocationTrace& trace, const ReplayOptions& options) {
  ReplayResult result;
  detail::Replayer replayer{trace, options, result};
  replayer.run();
  return result;
}

CapacitySearch smallest_capacity(const AllocationTrace& trace, const ReplayOptions& options) {
  const DeviceInfo like = make_device(options.device)->info();
  if (!like.simulated) {
    throw Error("the smallest capacity is searched on a simulated device; " + like.name + " is a real GPU");
  }
  const std::size_t g = like.granularity != 0 ? like.granularity : 2 * MiB;
  const std::size_t context = like.context_bytes;
  CapacitySearch out;
  // Probes ask what this allocator's policy needs, not what the recording did: no
  // recorded addresses or refusals, no conformance, stop at the first OOM.
  const auto probe = [&](std::size_t capacity) {
    ReplayOptions o = options;
    o.device = fmt::format("sim:capacity={},context={},granularity={}", capacity, context, g);
    o.trace_addresses = false;
    o.replay_driver_refusals = false;
    o.check_conformance = false;
    o.track_fragmentation = false;
    o.stop_at_oom = true;
    ++out.replays;
    return replay(trace, o);
  };
  const auto fits = [](const ReplayResult& r) { return r.supported && r.ooms == 0 && !r.first_oom; };
  constexpr std::size_t kUnlimited = std::size_t{1} << 50;
  const ReplayResult unlimited = probe(kUnlimited);
  if (!unlimited.supported) {
    out.supported = false;
    out.unsupported_reason = unlimited.unsupported_reason;
    return out;
  }
  out.unlimited_device_used = static_cast<std::size_t>(unlimited.peak_device_used);
  const auto round_up = [&](std::size_t n) { return (n + g - 1) / g * g; };
  std::size_t hi = round_up(std::max(out.unlimited_device_used, context + g));
  ReplayResult at_hi = probe(hi);
  while (!fits(at_hi) && hi < kUnlimited) {
    hi = std::min(hi * 2, kUnlimited);
    at_hi = probe(hi);
  }
  if (!fits(at_hi)) {
    out.supported = false;
    out.unsupported_reason = "the trace runs out of memory even on a device of " + format_bytes(hi);
    return out;
  }
  // Below the context plus the peak of live bytes nothing fits: the step under it is the floor.
  std::size_t lo = (context + static_cast<std::size_t>(unlimited.peak_allocated) - 1) / g * g;
  if (lo >= hi) lo = hi - g;
  out.at_capacity = std::move(at_hi);
  while (hi - lo > g) {
    const std::size_t mid = lo + (hi - lo) / g / 2 * g;
    ReplayResult r = probe(mid);
    if (fits(r)) {
      hi = mid;
      out.at_capacity = std::move(r);
    } else {
      lo = mid;
    }
  }
  out.capacity = hi;
  return out;
}

ReplayPlan plan_replay(const AllocationTrace& trace) {
  ReplayPlan plan;
  std::unordered_map<std::uintptr_t, std::uint32_t> live;  // recorded address -> slot
  std::vector<std::size_t> alloc_op;  // slot -> index of its allocate op
  std::vector<bool> freed;            // slot -> freed by the trace
  auto allocate = [&](std::uintptr_t address, std::size_t size, std::uint64_t stream,
                      std::size_t event) {
    const auto slot = static_cast<std::uint32_t>(plan.slots++);
    live[address] = slot;  // a repeated address leaves the older slot to the cleanup
    alloc_op.push_back(plan.ops.size());
    freed.push_back(false);
    plan.ops.push_back({true, slot, size, stream, event});
  };
  // A free gives back what was allocated: the allocation's size and stream.
  auto free_slot = [&](std::uint32_t slot, std::size_t event) {
    const ReplayOp a = plan.ops[alloc_op[slot]];  // a copy: push_back may move the ops
    freed[slot] = true;
    plan.ops.push_back({false, slot, a.size, a.stream, event});
  };
  // The blocks live when the trace began (snapshots): allocated first, so the
  // allocator starts from the same live data as the recording (not its cache).
  if (trace.has_final_state) {
    const detail::InitialState state =
        detail::derive_initial_state(trace, AllocatorConfig{}, detail::recorded_reservations(trace, AllocatorConfig{}));
    for (const detail::InitSegment& seg : state.segments) {
      for (const detail::InitBlock& b : seg.live) {
        allocate(b.address, b.requested ? b.requested : b.size, seg.stream, 0);
      }
    }
    plan.initial_segments = state.segments.size();
  }
  plan.first_event_op = plan.ops.size();
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const RecordedEvent& e = trace.events[i];
    if (e.action == RecordedAction::Alloc) {
      allocate(e.address, e.size, e.stream, i);
    } else if (detail::is_free_event(trace, e.action)) {
      auto it = live.find(e.address);
      if (it == live.end()) {
        ++plan.unknown_frees;
        continue;
      }
      free_slot(it->second, i);
      live.erase(it);
    } else if (e.action == RecordedAction::Oom) {
      ++plan.recorded_ooms;
    }
  }
  plan.first_cleanup_op = plan.ops.size();
  // Every slot the trace did not free, in slot order (deterministic).
  for (std::uint32_t slot = 0; slot < plan.slots; ++slot) {
    if (!freed[slot]) free_slot(slot, 0);
  }
  return plan;
}

ReplayResult replay_on(const AllocationTrace& trace, ReplayTarget& target) {
  ReplayResult r;
  r.device = target.name();
  r.config = "peer";
  r.events = trace.events.size();
  const ReplayPlan plan = plan_replay(trace);
  r.initial_segments = plan.initial_segments;
  r.unknown_frees = plan.unknown_frees;
  r.recorded_ooms = plan.recorded_ooms;
  std::vector<void*> slot(plan.slots, nullptr);
  const std::uint64_t allocs_before = target.device_allocs();
  std::int64_t allocated = 0;
  auto sample = [&] {
    r.peak_allocated = std::max(r.peak_allocated, allocated);
    r.peak_requested = r.peak_allocated;
    r.peak_reserved = std::max(r.peak_reserved, static_cast<std::int64_t>(target.reserved_bytes()));
    r.peak_device_used = std::max(r.peak_device_used, static_cast<std::int64_t>(target.device_used_bytes()));
  };
  // The starting state: blocks that do not fit are left out (not rebuilt).
  for (std::size_t k = 0; k < plan.first_event_op; ++k) {
    const ReplayOp& op = plan.ops[k];
    void* p = op.size > 0 ? target.allocate(op.size, op.stream) : nullptr;
    if (p == nullptr) continue;
    slot[op.slot] = p;
    ++r.initial_blocks;
    allocated += static_cast<std::int64_t>(op.size);
  }
  if (trace.has_final_state) {
    r.initial_allocated = static_cast<std::size_t>(allocated);
    sample();
  }
  for (std::size_t k = plan.first_event_op; k < plan.first_cleanup_op; ++k) {
    const ReplayOp& op = plan.ops[k];
    if (op.allocate) {
      ++r.allocs;
      void* p = op.size > 0 ? target.allocate(op.size, op.stream) : nullptr;
      if (p == nullptr) {
        ++r.failed_allocs;
        ++r.ooms;
        if (!r.first_oom) {
          ReplayOom oom;
          oom.event_index = op.event;
          oom.requested = op.size;
          oom.message = target.name() + " could not allocate " + format_bytes(op.size);
          r.first_oom = std::move(oom);
        }
        continue;
      }
      slot[op.slot] = p;
      allocated += static_cast<std::int64_t>(op.size);
      sample();
    } else if (slot[op.slot] != nullptr) {  // null: its allocation failed
      target.deallocate(slot[op.slot], op.size, op.stream);
      slot[op.slot] = nullptr;
      allocated -= static_cast<std::int64_t>(op.size);
      ++r.frees;
    }
  }
  r.segment_allocs = static_cast<std::int64_t>(target.device_allocs() - allocs_before);
  r.reserved_per_requested = r.peak_requested > 0 ? static_cast<double>(r.peak_reserved) /
                                                        static_cast<double>(r.peak_requested)
                                                  : 0.0;
  for (std::size_t k = plan.first_cleanup_op; k < plan.ops.size(); ++k) {
    const ReplayOp& op = plan.ops[k];
    if (slot[op.slot] != nullptr) target.deallocate(slot[op.slot], op.size, op.stream);
  }
  return r;
}

}  // namespace mem
