// replay_test.cpp — the replay engine on traces this project records itself:
// peaks reproduced exactly, a mid-run snapshot rebuilt, other settings, OOM on
// a small device, divergences reported, unsupported traces refused.
#include "vramscope/replay/replay.hpp"

#include <gtest/gtest.h>

#include <random>
#include <sstream>

#include "replay_test_pickles.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

// A training-like mix on two streams: small and large tensors, random frees.
void run_workload(CachingAllocator& alloc, std::size_t ops, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const StreamId side = alloc.device().create_stream();
  std::vector<void*> live;
  for (std::size_t i = 0; i < ops; ++i) {
    if (live.empty() || rng() % 100 < 55) {
      const bool large = rng() % 4 == 0;
      const std::size_t size = large ? 1 * MiB + rng() % (40 * MiB) : 1 + rng() % (1 * MiB);
      live.push_back(alloc.allocate(size, rng() % 5 == 0 ? side : 0));
    } else {
      const std::size_t k = rng() % live.size();
      alloc.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
}

TEST(Replay, RecordedRunReproducesItsPeaksExactly) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 100000};
  run_workload(alloc, 4000, 7);
  const DeviceStats recorded = alloc.stats();

  std::istringstream csv(history_csv(history.entries()));
  const AllocationTrace trace = read_history_trace(csv, "run.csv");
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  const ReplayResult r = replay(trace, opt);
  ASSERT_TRUE(r.supported);
  EXPECT_EQ(r.peak_allocated, recorded.allocated_bytes[0].peak);
  EXPECT_EQ(r.peak_reserved, recorded.reserved_bytes[0].peak);
  EXPECT_EQ(r.peak_requested, recorded.requested_bytes[0].peak);
  EXPECT_EQ(r.peak_device_used, recorded.device_used_bytes.peak);
  EXPECT_EQ(r.segment_allocs, recorded.num_device_alloc);
  EXPECT_EQ(r.unknown_frees, 0u);
  EXPECT_TRUE(r.conformance_checked);
  EXPECT_EQ(r.segment_allocs_reproduced, r.segment_allocs_recorded);
  EXPECT_EQ(r.blocks_placed, r.allocs_checked);
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
  EXPECT_GT(r.reserved_per_requested, 1.0);
}

// Issue 20: an empty_cache() whose segment frees are followed directly by an alloc (served
// from a segment that stayed) was replayed without releasing the cache.
TEST(Replay, AnEmptyCacheFollowedDirectlyByAnAllocReleasesTheCache) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 1000};
  void* b = alloc.allocate(2 * MiB);    // a 20 MiB large segment that stays
  void* a = alloc.allocate(512);        // a 2 MiB small segment
  alloc.deallocate(a);
  alloc.empty_cache();                  // frees the small segment only
  void* c = alloc.allocate(4 * MiB);    // from the large segment's cache: no segment_alloc
  const DeviceStats recorded = alloc.stats();
  alloc.deallocate(c);
  alloc.deallocate(b);

  std::istringstream csv(history_csv(history.entries()));
  const AllocationTrace trace = read_history_trace(csv, "run.csv");
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  const ReplayResult r = replay(trace, opt);
  EXPECT_EQ(r.empty_cache_calls, 1u);
  EXPECT_EQ(r.segment_frees_reproduced, r.segment_frees_recorded);
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
  EXPECT_EQ(r.peak_reserved, recorded.reserved_bytes[0].peak);
  // At the end only the large segment is held, as recorded (its blocks cached).
  EXPECT_EQ(r.final_stats.reserved_bytes[0].current, 20 * static_cast<std::int64_t>(MiB));
}

// Issue 20: the smallest GPU that fits. The capacity found replays with no OOM, one driver
// granule less runs out, and it lies between the context plus the peak of live bytes and
// the nvidia-smi view of the replay without a limit.
TEST(Replay, TheSmallestCapacityFitsAndOneGranuleLessDoesNot) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 100000};
  run_workload(alloc, 3000, 11);
  std::istringstream csv(history_csv(history.entries()));
  const AllocationTrace trace = read_history_trace(csv, "run.csv");
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  const CapacitySearch found = smallest_capacity(trace, opt);
  ASSERT_TRUE(found.supported) << found.unsupported_reason;
  const std::size_t context = device->info().context_bytes, g = 2 * MiB;
  EXPECT_EQ(found.capacity % g, 0u);
  EXPECT_GE(found.capacity, context + static_cast<std::size_t>(found.at_capacity.peak_allocated));
  EXPECT_LE(found.capacity, (found.unlimited_device_used + g - 1) / g * g);
  EXPECT_EQ(found.at_capacity.ooms, 0u);
  const auto at = [&](std::size_t capacity) {
    ReplayOptions o = opt;
    o.device = "sim:capacity=" + std::to_string(capacity) + ",context=" + std::to_string(context);
    o.trace_addresses = false;
    o.replay_driver_refusals = false;
    o.stop_at_oom = true;
    return replay(trace, o);
  };
  EXPECT_EQ(at(found.capacity).ooms, 0u);
  EXPECT_GT(at(found.capacity - g).ooms, 0u);
  EXPECT_LT(found.replays, 40u);  // bisection: a log of the range in granules
  EXPECT_THROW(smallest_capacity(trace, ReplayOptions{.device = "sim:nosuch"}), Error);
}

// Blocks live at the start and freed during the trace are known only by their
// request (the pickle records requests, as PyTorch does); their size is
// inferred, here exactly (see StartingBlockEndsWhereALaterAllocationBegins).
TEST(Replay, MidRunSnapshotRebuildsItsStartingState) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 1500};  // a ring: the first events are dropped
  run_workload(alloc, 4000, 11);
  ASSERT_GT(history.dropped(), 0u);
  const Snapshot snap = snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
  const AllocationTrace trace =
      read_pytorch_snapshot(read_pickle(memory_snapshot_pickle(snap)), -1, "own.pickle");
  ASSERT_FALSE(trace.events.empty());

  const ReplayResult r = replay(trace);
  ASSERT_TRUE(r.supported);
  EXPECT_TRUE(r.rebuilt_exactly);
  EXPECT_GT(r.initial_segments, 0u);
  EXPECT_EQ(r.initial_blocks_misplaced, 0u);
  EXPECT_TRUE(r.conformance_checked);
  EXPECT_EQ(r.segment_allocs_reproduced, r.segment_allocs_recorded);
  EXPECT_EQ(r.allocs_checked, r.allocs);
  EXPECT_EQ(r.blocks_placed, r.allocs_checked);
  EXPECT_EQ(r.final_segments_matched, r.final_segments_recorded);
  EXPECT_EQ(r.final_segments_recorded, snap.segments.size());
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
}

// Our pickle records requests for alloc/free entries, as PyTorch does, so a
// block live at the start and freed during the trace is known only by its
// request: here 11 MiB in an 11.5 MiB block (a 0.5 MiB tail is not split off).
// The free space after it reaches the segment's end, so only the block
// allocated right after it, while it lived, tells where it ends.
TEST(Replay, StartingBlockEndsWhereALaterAllocationBegins) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  void* p = alloc.allocate(4 * MiB);  // a 20 MiB segment: [p 4][free 16]
  void* c = alloc.allocate(11 * MiB + MiB / 2);
  void* d = alloc.allocate(4 * MiB + MiB / 2);  // [p 4][c 11.5][d 4.5]
  alloc.deallocate(c);
  void* a = alloc.allocate(11 * MiB);  // takes c's 11.5 MiB whole
  alloc.deallocate(d);                 // [p 4][a 11.5][free 4.5]
  History history{alloc, 100};         // the trace starts here
  void* b = alloc.allocate(4 * MiB + MiB / 2);
  ASSERT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 11 * MiB + MiB / 2);
  alloc.deallocate(a);
  const Snapshot snap =
      snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
  const AllocationTrace trace =
      read_pytorch_snapshot(read_pickle(memory_snapshot_pickle(snap)), -1, "own.pickle");
  ASSERT_EQ(trace.events.size(), 3u);  // alloc b, free_requested a, free_completed a
  EXPECT_EQ(trace.events[1].action, RecordedAction::FreeRequested);
  EXPECT_EQ(trace.events[1].size, 11 * MiB);  // the request, not the block

  const ReplayResult r = replay(trace);
  ASSERT_TRUE(r.conformance_checked);
  EXPECT_EQ(r.initial_blocks, 2u);  // p and a
  EXPECT_EQ(r.initial_blocks_misplaced, 0u);
  EXPECT_EQ(r.blocks_placed, 1u);  // b where it was recorded
  EXPECT_EQ(r.final_segments_matched, 1u);
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
  alloc.deallocate(b);
  alloc.deallocate(p);
}

TEST(Replay, OtherSettingsReplayWithoutConformance) {
  const AllocationTrace trace = read_pytorch_snapshot(read_pickle(test::kSnapshot));
  ReplayOptions opt;
  opt.config = AllocatorConfig::parse("roundup_power2_divisions:4,max_split_size_mb:64");
  const ReplayResult r = replay(trace, opt);
  ASSERT_TRUE(r.supported);
  EXPECT_TRUE(r.rebuilt_exactly);  // every setting starts from the recorded state
  EXPECT_FALSE(r.conformance_checked);
  EXPECT_EQ(r.allocs, 2u);
  EXPECT_EQ(r.frees, 1u);
  EXPECT_EQ(r.config, opt.config.to_string());
}

TEST(Replay, SmallDeviceReportsTheFirstOom) {
  std::ostringstream csv;
  csv << "Thread,Time,Action,Pointer,Size,Stream\n";
  for (int i = 0; i < 8; ++i) csv << "1," << i << ",allocate,0x" << std::hex << (0x1000000 * (i + 1)) << std::dec << "," << 20 * MiB << ",0\n";
  std::istringstream in(csv.str());
  const AllocationTrace trace = read_rmm_log(in);
  ReplayOptions opt;
  opt.device = "sim:capacity=64MiB,context=0";
  ReplayResult r = replay(trace, opt);
  ASSERT_TRUE(r.first_oom.has_value());
  EXPECT_EQ(r.first_oom->event_index, 3u);  // three 20 MiB segments fit, not a fourth
  EXPECT_EQ(r.first_oom->requested, 20 * MiB);
  EXPECT_FALSE(r.first_oom->message.empty());
  EXPECT_EQ(r.ooms, 5u);
  EXPECT_EQ(r.peak_reserved, static_cast<std::int64_t>(60 * MiB));
  opt.stop_at_oom = true;
  r = replay(trace, opt);
  EXPECT_EQ(r.ooms, 1u);
}

// Issue 20: OOM forensics. Three 20 MiB segments each hold two 8 MiB blocks; freeing the
// first of each leaves 36 MiB free, but in 8 and 4 MiB pieces, each segment pinned by its
// live second block: a 16 MiB request finds no block, no room for a fourth segment, and no
// whole segment to release.
TEST(Replay, TheFirstOomSaysWhatWasFreeAndWhatPinsIt) {
  std::ostringstream csv;
  csv << "Thread,Time,Action,Pointer,Size,Stream\n";
  for (int i = 0; i < 6; ++i) csv << "1," << i << ",allocate,0x" << std::hex << (0x1000000 * (i + 1)) << std::dec << "," << 8 * MiB << ",0\n";
  for (int i = 0; i < 6; i += 2) csv << "1," << 6 + i << ",free,0x" << std::hex << (0x1000000 * (i + 1)) << std::dec << "," << 8 * MiB << ",0\n";
  csv << "1,20,allocate,0x9000000," << 16 * MiB << ",0\n";
  std::istringstream in(csv.str());
  const AllocationTrace trace = read_rmm_log(in);
  ReplayOptions opt;
  opt.device = "sim:capacity=64MiB,context=0";
  const ReplayResult r = replay(trace, opt);
  ASSERT_TRUE(r.first_oom.has_value());
  const ReplayOom& o = *r.first_oom;
  EXPECT_EQ(o.requested, 16 * MiB);
  EXPECT_EQ(o.free_bytes, 36 * MiB);
  EXPECT_EQ(o.largest_free_block, 8 * MiB);
  ASSERT_EQ(o.fragmented.size(), 3u);
  for (const ReplayOom::Segment& seg : o.fragmented) {
    EXPECT_EQ(seg.size, 20 * MiB);
    EXPECT_EQ(seg.free_bytes, 12 * MiB);
    EXPECT_EQ(seg.largest_free, 8 * MiB);
    EXPECT_EQ(seg.live_blocks, 1u);
    EXPECT_EQ(seg.live_bytes, 8 * MiB);
    ASSERT_EQ(seg.pins.size(), 1u);  // the live second block, at 8 MiB into its segment
    EXPECT_EQ(seg.pins[0].offset, 8 * MiB);
    EXPECT_EQ(seg.pins[0].size, 8 * MiB);
    EXPECT_EQ(seg.pins[0].stack, "");  // RMM's log records no frames
  }

  // With frames (a snapshot's), each pinning block says where it was allocated.
  AllocationTrace framed = trace;
  framed.stacks = {"embed (model.py:10)", "attention (model.py:42) <- forward (model.py:80)"};
  for (std::size_t i = 0; i < 6; ++i) framed.events[i].stack = i % 2 == 0 ? 1 : 2;  // the kept ones: 2
  const ReplayResult f = replay(framed, opt);
  ASSERT_TRUE(f.first_oom.has_value());
  for (const ReplayOom::Segment& seg : f.first_oom->fragmented) {
    ASSERT_EQ(seg.pins.size(), 1u);
    EXPECT_EQ(seg.pins[0].stack, "attention (model.py:42) <- forward (model.py:80)");
  }
}

TEST(Replay, SnapshotFramesAreReadOncePerDistinctStack) {
  // vramscope's own snapshot writes one frame per module context, shared by the events of
  // that context as PyTorch's pickler shares them: the reader interns each once.
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  attach(alloc);
  History history{alloc, 1000};
  std::vector<void*> blocks;
  {
    ModuleScope scope{"layer1.conv", Phase::Forward};
    for (int i = 0; i < 3; ++i) blocks.push_back(alloc.allocate(MiB));
  }
  {
    ModuleScope scope{"fc", Phase::Forward};
    blocks.push_back(alloc.allocate(MiB));
  }
  for (void* b : blocks) alloc.deallocate(b);
  const Snapshot snap = snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
  const AllocationTrace trace = read_pytorch_snapshot(read_pickle(memory_snapshot_pickle(snap)), -1, "own.pickle");
  std::vector<std::uint32_t> alloc_stacks;
  for (const RecordedEvent& e : trace.events)
    if (e.action == RecordedAction::Alloc) alloc_stacks.push_back(e.stack);
  ASSERT_EQ(alloc_stacks.size(), 4u);
  EXPECT_NE(alloc_stacks[0], 0u);
  EXPECT_EQ(alloc_stacks[1], alloc_stacks[0]);
  EXPECT_EQ(alloc_stacks[2], alloc_stacks[0]);
  EXPECT_NE(alloc_stacks[3], alloc_stacks[0]);
  EXPECT_NE(trace.stacks[alloc_stacks[0] - 1].find("layer1.conv"), std::string::npos) << trace.stacks[alloc_stacks[0] - 1];
  EXPECT_NE(trace.stacks[alloc_stacks[3] - 1].find("fc"), std::string::npos);
}

TEST(Replay, DivergenceFromTheRecordingIsReported) {
  AllocationTrace trace = read_pytorch_snapshot(read_pickle(test::kSnapshot));
  trace.events[2].size = 3 * MiB;  // recorded as a small block next to the first
  const ReplayResult r = replay(trace);
  ASSERT_TRUE(r.conformance_checked);
  EXPECT_GT(r.divergence_count, 0u);
  EXPECT_LT(r.blocks_placed, r.allocs_checked);
  ASSERT_FALSE(r.divergences.empty());
  EXPECT_EQ(r.divergences[0].event_index, 2u);
  EXPECT_NE(r.divergences[0].what.find("segment_alloc"), std::string::npos) << r.divergences[0].what;
}

// Issue 20: a recording made with expandable segments, written as PyTorch's snapshot and read
// back, replays with its segment_map and segment_unmap events, block addresses and final
// mapped ranges reproduced.
TEST(Replay, ExpandableRecordingReplaysItsMapsUnmapsAndBlocks) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device, AllocatorConfig::parse("expandable_segments:True")};
  History history{alloc, 100000};
  run_workload(alloc, 3000, 11);
  void* keep = alloc.allocate(MiB);
  alloc.empty_cache();  // unmaps the whole free pages
  alloc.deallocate(keep);
  run_workload(alloc, 1000, 12);
  const DeviceStats recorded = alloc.stats();
  const Snapshot snap = snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
  const AllocationTrace trace = read_pytorch_snapshot(read_pickle(memory_snapshot_pickle(snap)), -1, "own.pickle");
  ASSERT_TRUE(trace.expandable_segments);
  ASSERT_FALSE(trace.final_segments.empty());
  for (const RecordedSegment& seg : trace.final_segments) EXPECT_TRUE(seg.expandable);  // is_expandable
  EXPECT_EQ(trace.allocator_conf, "expandable_segments:True");
  ReplayOptions opt;
  opt.config = AllocatorConfig::parse(trace.allocator_conf);
  opt.device = "sim:a100-80g";
  const ReplayResult r = replay(trace, opt);
  ASSERT_TRUE(r.conformance_checked);
  EXPECT_GT(r.segment_allocs_recorded, 10u);
  EXPECT_GT(r.segment_frees_recorded, 0u);
  EXPECT_EQ(r.empty_cache_calls, 1u);
  EXPECT_EQ(r.segment_allocs_reproduced, r.segment_allocs_recorded);
  EXPECT_EQ(r.segment_frees_reproduced, r.segment_frees_recorded);
  EXPECT_EQ(r.blocks_placed, r.allocs_checked);
  EXPECT_EQ(r.final_segments_matched, r.final_segments_recorded);
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
  EXPECT_EQ(r.peak_reserved, recorded.reserved_bytes[0].peak);
  EXPECT_EQ(r.segment_allocs, recorded.num_device_alloc);

  // What-if in both directions from the same starting state: without expandable segments
  // the same trace needs cudaMalloc segments (and reserves at least as much).
  ReplayOptions plain = opt;
  plain.config = AllocatorConfig{};
  const ReplayResult without = replay(trace, plain);
  EXPECT_FALSE(without.conformance_checked);
  EXPECT_EQ(without.peak_requested, r.peak_requested);
  EXPECT_GE(without.peak_reserved, r.peak_reserved);
  EXPECT_EQ(without.final_stats.segment[0].peak > 0, true);
}

TEST(Replay, APlainRecordingReplaysWithExpandableSegments) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 100000};
  run_workload(alloc, 3000, 13);
  std::istringstream csv(history_csv(history.entries()));
  const AllocationTrace trace = read_history_trace(csv, "run.csv");
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  const ReplayResult recorded = replay(trace, opt);
  opt.config = AllocatorConfig::parse("expandable_segments:True");
  const ReplayResult r = replay(trace, opt);
  EXPECT_EQ(r.peak_requested, recorded.peak_requested);
  EXPECT_LE(r.peak_reserved, recorded.peak_reserved);  // grown in place: no segment left half empty
  EXPECT_EQ(r.final_stats.segment[0].peak, 0);         // pages mapped, never a cudaMalloc segment
  EXPECT_GT(r.segment_allocs, 0);
}

// Issue 20: segment frees followed directly by a segment_alloc are PyTorch's
// free-cache-and-retry only when the device was too full for the new segment; with room
// to spare (less reserved than the recording's peak), they were an empty_cache().
TEST(Replay, AnEmptyCacheFollowedDirectlyByASegmentAllocReleasesTheCache) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 1000};
  void* x = alloc.allocate(512);
  std::vector<void*> big;
  for (int i = 0; i < 6; ++i) big.push_back(alloc.allocate(30 * MiB));  // the peak: 182 MiB
  for (void* p : big) alloc.deallocate(p);
  alloc.empty_cache();  // six segment_frees, then a free: plainly an empty_cache()
  alloc.deallocate(x);
  void* y = alloc.allocate(30 * MiB);
  void* z = alloc.allocate(30 * MiB);
  alloc.deallocate(y);
  alloc.deallocate(z);
  alloc.empty_cache();                 // three segment_frees at 62 MiB reserved...
  void* c = alloc.allocate(30 * MiB);  // ...then directly a segment_alloc: 92 MiB fits under the peak
  alloc.deallocate(c);
  std::istringstream csv(history_csv(history.entries()));
  const AllocationTrace trace = read_history_trace(csv, "run.csv");
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  const ReplayResult r = replay(trace, opt);
  EXPECT_EQ(r.empty_cache_calls, 2u);
  EXPECT_EQ(r.driver_refusals, 0u);
  EXPECT_EQ(r.segment_frees_reproduced, 9u);  // six, then two and x's small segment
  EXPECT_EQ(r.divergence_count, 0u) << (r.divergences.empty() ? "" : r.divergences[0].what);
}

TEST(Replay, FreesOfUnknownBlocksAreCounted) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1.0,allocate,0x10,1024,0\n"
      "1,2.0,free,0x20,1024,0\n"
      "1,3.0,free,0x10,1024,0\n");
  const ReplayResult r = replay(read_rmm_log(in));
  EXPECT_EQ(r.allocs, 1u);
  EXPECT_EQ(r.frees, 1u);
  EXPECT_EQ(r.unknown_frees, 1u);
  EXPECT_EQ(r.peak_allocated, 1024);
  EXPECT_EQ(r.peak_reserved, static_cast<std::int64_t>(2 * MiB));
}

// A malloc-backed target: replay_on drives any allocator.
class HostTarget final : public ReplayTarget {
 public:
  std::string name() const override { return "host"; }
  void* allocate(std::size_t bytes, std::uint64_t) override {
    reserved_ += bytes;
    ++allocs_;
    return ::operator new(bytes);
  }
  void deallocate(void* p, std::size_t bytes, std::uint64_t) noexcept override {
    reserved_ -= bytes;
    ::operator delete(p);
  }
  std::size_t reserved_bytes() const override { return reserved_; }
  std::size_t device_used_bytes() const override { return reserved_; }
  std::uint64_t device_allocs() const override { return allocs_; }

 private:
  std::size_t reserved_ = 0;
  std::uint64_t allocs_ = 0;
};

TEST(Replay, ReplayOnDrivesAnyTarget) {
  const AllocationTrace trace = read_pytorch_snapshot(read_pickle(test::kSnapshot));
  HostTarget target;
  const ReplayResult r = replay_on(trace, target);
  EXPECT_EQ(r.allocs, 2u);
  EXPECT_EQ(r.frees, 1u);
  EXPECT_EQ(r.peak_requested, 1100);
  EXPECT_EQ(r.peak_reserved, 1100);
  EXPECT_EQ(r.segment_allocs, 2);
  EXPECT_EQ(target.reserved_bytes(), 0u);  // what was still live is returned
}

// The flattened plan: slots in allocation order, a reused address gets a new
// slot, unknown frees and recorded ooms are counted, what the trace leaves
// allocated is freed at the end in slot order.
TEST(Replay, PlanFlattensATraceIntoSlots) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1.0,allocate,0x10,1024,0\n"
      "1,2.0,allocate,0x20,2048,7\n"
      "1,3.0,free,0x10,1024,0\n"
      "1,4.0,free,0x30,64,0\n"
      "1,5.0,allocate,0x10,512,0\n");
  const ReplayPlan plan = plan_replay(read_rmm_log(in));

  EXPECT_EQ(plan.slots, 3u);
  EXPECT_EQ(plan.unknown_frees, 1u);
  EXPECT_EQ(plan.first_event_op, 0u);
  ASSERT_EQ(plan.first_cleanup_op, 4u);
  ASSERT_EQ(plan.ops.size(), 6u);
  struct Want { bool allocate; std::uint32_t slot; std::size_t size; std::uint64_t stream; };
  const Want want[] = {{true, 0, 1024, 0}, {true, 1, 2048, 7}, {false, 0, 1024, 0},
                       {true, 2, 512, 0},  {false, 1, 2048, 7}, {false, 2, 512, 0}};
  for (std::size_t i = 0; i < plan.ops.size(); ++i) {
    EXPECT_EQ(plan.ops[i].allocate, want[i].allocate) << i;
    EXPECT_EQ(plan.ops[i].slot, want[i].slot) << i;
    EXPECT_EQ(plan.ops[i].size, want[i].size) << i;
    EXPECT_EQ(plan.ops[i].stream, want[i].stream) << i;
  }
  EXPECT_EQ(plan.ops[3].event, 4u);  // index of the event in the trace
}

// A free gives back what was allocated, whatever size its record says, as
// replay_on always did (the peer's books and the allocated figure stay exact).
TEST(Replay, PlanFreesCarryTheAllocationsSizeAndStream) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1.0,allocate,0x40,4096,3\n"
      "1,2.0,free,0x40,100,0\n");
  const ReplayPlan plan = plan_replay(read_rmm_log(in));
  ASSERT_EQ(plan.ops.size(), 2u);
  EXPECT_FALSE(plan.ops[1].allocate);
  EXPECT_EQ(plan.ops[1].size, 4096u);
  EXPECT_EQ(plan.ops[1].stream, 3u);
  HostTarget target;
  std::istringstream again(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1.0,allocate,0x40,4096,3\n"
      "1,2.0,free,0x40,100,0\n");
  const ReplayResult r = replay_on(read_rmm_log(again), target);
  EXPECT_EQ(r.frees, 1u);
  EXPECT_EQ(target.reserved_bytes(), 0u);  // freed with the 4096 it was allocated with
}

TEST(Replay, PlanStartsWithTheSnapshotsLiveBlocks) {
  const AllocationTrace trace = read_pytorch_snapshot(read_pickle(test::kSnapshot));
  const ReplayPlan plan = plan_replay(trace);
  HostTarget target;
  const ReplayResult r = replay_on(trace, target);
  EXPECT_EQ(plan.first_event_op, r.initial_blocks);
  std::size_t allocs = 0;
  for (std::size_t i = plan.first_event_op; i < plan.first_cleanup_op; ++i) allocs += plan.ops[i].allocate;
  EXPECT_EQ(allocs, r.allocs);
  // Every slot is allocated once and freed once.
  std::vector<int> balance(plan.slots, 0);
  for (const ReplayOp& op : plan.ops) balance[op.slot] += op.allocate ? 1 : -1;
  for (int b : balance) EXPECT_EQ(b, 0);
}

}  // namespace
}  // namespace mem
