// replay.hpp — replays a recorded allocation trace through the caching
// allocator (any settings, any device) or through any other allocator.
//
//   mem::AllocationTrace trace = mem::load_trace("snapshot.pickle");
//   mem::ReplayOptions opt;
//   opt.config = mem::AllocatorConfig::parse("max_split_size_mb:128");
//   opt.device = "sim:a100-40g";
//   mem::ReplayResult r = mem::replay(trace, opt);
//   r.peak_reserved; r.first_oom; r.segment_allocs_reproduced;
//
// This answers "would a setting have helped my real run?" without a GPU.
//
// Where a snapshot starts mid-run (its trace is a ring buffer) the starting
// state is rebuilt from the final segments minus the trace's effects: segments
// allocated during the trace did not exist yet, segments freed during it did,
// blocks freed without being allocated in the trace were live. Every setting
// starts from that same state (segments reserved at their recorded addresses,
// live blocks at their recorded offsets: CachingAllocator::restore_segment), so
// a what-if differs from the recorded setting's run only by what the trace's
// events do under it.
//
// Conformance (replaying a snapshot with the settings it was recorded with):
// each segment is handed the address the trace recorded for it, cudaMalloc
// refusals the trace shows (segment frees before a segment alloc, PyTorch's
// free-cache-and-retry) are replayed, and every segment_alloc and block
// placement is compared with the recording.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/stats.hpp"
#include "vramscope/replay/trace_reader.hpp"

namespace mem {

struct ReplayOptions {
  AllocatorConfig config{};  ///< settings to replay under
  /// Device spec as for make_device(). Conformance replays want one large
  /// enough never to refuse on its own ("sim:capacity=1TiB").
  std::string device = "sim:capacity=1TiB,context=0";
  /// Rebuild the starting state of a snapshot that begins mid-run.
  bool rebuild_initial_state = true;
  /// Hand each new segment the address the trace recorded for it (when the
  /// size matches), so best fit breaks ties between segments as on the GPU.
  bool trace_addresses = true;
  /// Replay the driver refusals the trace shows (free-cache-and-retry).
  bool replay_driver_refusals = true;
  /// Compare segment allocs and block placements with the recording.
  bool check_conformance = true;
  /// Track reserved-but-unallocated and the largest free block at the peak
  /// (one segments() walk per new peak; off for timing).
  bool track_fragmentation = true;
  /// set_per_process_memory_fraction for the replay (0: none). PyTorch's
  /// garbage_collection_threshold acts only with a fraction set.
  double memory_fraction = 0;
  /// Stop at the first allocation the device cannot satisfy.
  bool stop_at_oom = false;
  std::size_t max_divergences = 16;  ///< divergences kept in the result
};

/// The first allocation the replayed device could not satisfy.
struct ReplayOom {
  std::size_t event_index = 0;  ///< index into trace.events
  std::size_t requested = 0;
  std::string message;          ///< the allocator's OutOfMemoryError text
  /// Forensics, the allocator's state at the failure (vramscope's own replay only):
  /// whether fragmentation or plain lack of memory refused the request.
  std::size_t largest_free_block = 0;  ///< the largest cached block that could be split
  std::size_t free_bytes = 0;          ///< reserved but not allocated, over every segment
  /// The segments with the most free bytes, most first (at most 8): the live blocks in
  /// them pin them, so the cache cannot release them for a larger segment.
  /// A live block that pins a segment: where, how large, and (a snapshot with frames) the
  /// call stack that allocated it.
  struct Pin {
    std::size_t offset = 0;  ///< in its segment
    std::size_t size = 0;
    std::string stack;       ///< "" when the trace has no frames for it
  };
  struct Segment {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::size_t free_bytes = 0;
    std::size_t largest_free = 0;
    std::size_t live_blocks = 0;
    std::size_t live_bytes = 0;
    std::vector<Pin> pins;  ///< its largest live blocks, largest first (at most 4)
  };
  std::vector<Segment> fragmented;
};

/// A difference from the recording: "event 812 (alloc 1048576 B): expected
/// segment_alloc 20971520 B, got none".
struct ReplayDivergence {
  std::size_t event_index = 0;
  std::string what;
};

struct ReplayResult {
  std::string device;       ///< device name
  std::string assumptions;  ///< the simulated device's assumptions, to print beside figures
  std::string config;       ///< settings replayed under (canonical string)
  bool supported = true;    ///< false: not replayed (see unsupported_reason)
  std::string unsupported_reason;

  // What was replayed.
  std::size_t events = 0;          ///< trace events
  std::size_t allocs = 0;          ///< alloc events replayed
  std::size_t frees = 0;           ///< frees replayed
  std::size_t unknown_frees = 0;   ///< frees of blocks the trace never allocated (no rebuild)
  std::size_t failed_allocs = 0;   ///< allocs the device could not satisfy
  std::size_t recorded_ooms = 0;   ///< oom events in the trace itself
  std::size_t empty_cache_calls = 0;  ///< segment frees replayed as empty_cache()
  std::size_t driver_refusals = 0;    ///< cudaMalloc refusals replayed from the trace

  // Starting state.
  bool rebuilt_exactly = false;    ///< segments reserved at recorded addresses
  std::size_t initial_segments = 0;
  std::size_t initial_blocks = 0;
  std::size_t initial_reserved = 0;
  std::size_t initial_allocated = 0;
  std::size_t initial_blocks_misplaced = 0;

  // Peaks over the replay (starting state included).
  std::int64_t peak_allocated = 0;
  std::int64_t peak_reserved = 0;
  std::int64_t peak_requested = 0;
  std::int64_t peak_device_used = 0;  ///< nvidia-smi view
  std::int64_t reserved_unallocated_at_peak = 0;  ///< reserved - allocated when allocated peaked
  std::size_t largest_free_block_at_peak = 0;     ///< largest inactive block then
  /// At the allocated peak: (reserved - allocated - largest free block) / reserved, the
  /// share of reserved memory that was free but no single request could have used (0
  /// when not tracked). A healthy run reads a few percent; a cache split into many small
  /// free pieces reads high. Checkable by hand from a snapshot taken at the peak.
  double fragmentation = 0;
  /// peak reserved / peak requested: what the cache costs over what was asked.
  double reserved_per_requested = 0;
  std::int64_t segment_allocs = 0;  ///< cudaMalloc calls during the replay
  std::int64_t segment_frees = 0;
  double driver_time_us = 0;        ///< simulated driver time of the replay
  std::optional<ReplayOom> first_oom;
  std::size_t ooms = 0;
  DeviceStats final_stats;

  // Conformance with the recording.
  bool conformance_checked = false;
  std::size_t segment_allocs_recorded = 0;
  std::size_t segment_allocs_reproduced = 0;  ///< same size, stream and order
  std::size_t segment_frees_recorded = 0;
  std::size_t segment_frees_reproduced = 0;
  std::size_t allocs_checked = 0;
  std::size_t blocks_placed = 0;              ///< same segment, same offset
  /// Final state (snapshots): recorded segments, and how many the replay ended
  /// with at the same address and size, tiled by blocks of the same sizes and
  /// states (allocated and pending-free both count as active).
  std::size_t final_segments_recorded = 0;
  std::size_t final_segments_matched = 0;
  std::size_t divergence_count = 0;
  std::vector<ReplayDivergence> divergences;  ///< the first max_divergences
};

/// Replays `trace` through a new CachingAllocator on a new device.
/// Throws mem::Error for a malformed device spec; never for trace contents
/// (inconsistencies are counted in the result).
ReplayResult replay(const AllocationTrace& trace, const ReplayOptions& options = {});

/// The smallest GPU that fits: the smallest capacity, in steps of the device's driver
/// granularity, of a simulated device like options.device (same CUDA context and
/// granularity) on which the trace replays under options.config without running out of
/// memory. Found by bisection between the replay's peak allocated (less can never fit)
/// and its unlimited nvidia-smi view (enough, with the cache never released), each probe
/// a replay stopping at its first OOM. Memory grows with capacity almost, not strictly,
/// monotonically, so this is a capacity that fits whose one-step-smaller neighbour does not.
struct CapacitySearch {
  bool supported = true;           ///< false: the trace cannot be replayed (see reason)
  std::string unsupported_reason;
  std::size_t capacity = 0;        ///< the smallest capacity found (context included)
  std::size_t unlimited_device_used = 0;  ///< nvidia-smi view of the replay without a limit
  ReplayResult at_capacity;        ///< the replay at `capacity`
  std::size_t replays = 0;         ///< probes run
};
/// Throws mem::Error for a device spec that is not a simulated device.
CapacitySearch smallest_capacity(const AllocationTrace& trace, const ReplayOptions& options);

/// Any allocator the generic replay can drive (the CUB peer implements it).
class ReplayTarget {
 public:
  virtual ~ReplayTarget() = default;
  virtual std::string name() const = 0;
  /// nullptr when out of memory.
  virtual void* allocate(std::size_t bytes, std::uint64_t stream) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, std::uint64_t stream) noexcept = 0;
  virtual std::size_t reserved_bytes() const = 0;     ///< bytes held from the device now
  virtual std::size_t device_used_bytes() const = 0;  ///< nvidia-smi view now
  virtual std::uint64_t device_allocs() const = 0;    ///< cudaMalloc calls so far
};

/// A trace flattened into allocate/free operations on numbered slots, the form
/// in which any allocator can replay it without looking addresses up:
///   std::vector<void*> slot(plan.slots);
///   for (const ReplayOp& op : plan.ops)
///     if (op.allocate) slot[op.slot] = alloc.allocate(op.size, op.stream);
///     else if (slot[op.slot]) alloc.deallocate(slot[op.slot]);
/// ops[0, first_event_op) allocate the blocks live when a snapshot began;
/// [first_event_op, first_cleanup_op) are the trace's allocs and frees in
/// order; the rest free what the trace left allocated.
struct ReplayOp {
  bool allocate = true;
  std::uint32_t slot = 0;
  std::size_t size = 0;        ///< the caller's size (a free: its allocation's)
  std::uint64_t stream = 0;    ///< the recorder's stream handle (a free: its allocation's)
  std::size_t event = 0;       ///< index in trace.events (trace ops only)
};
struct ReplayPlan {
  std::vector<ReplayOp> ops;
  std::size_t slots = 0;
  std::size_t first_event_op = 0;
  std::size_t first_cleanup_op = 0;
  std::size_t initial_segments = 0;
  std::size_t unknown_frees = 0;   ///< frees of addresses the trace never allocated
  std::size_t recorded_ooms = 0;
};
/// Throws nothing for trace contents: inconsistencies are counted.
ReplayPlan plan_replay(const AllocationTrace& trace);

/// Replays the trace's allocs and frees (the starting state's live blocks
/// first, no conformance) through `target`; peaks are sampled after every event.
ReplayResult replay_on(const AllocationTrace& trace, ReplayTarget& target);

}  // namespace mem
