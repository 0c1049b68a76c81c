// snapshot_test.cpp — mem::snapshot(): block sums equal the statistics, owners
// resolve, the device view matches, fragmentation is exact.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "test_support.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

TEST(Snapshot, StatisticsOnlyHasDeviceViewButNoSegments) {
  auto alloc = test::make_allocator();
  void* p = alloc->allocate(5 * MiB);
  const Snapshot s = snapshot(*alloc);
  EXPECT_FALSE(s.has_segments);
  EXPECT_TRUE(s.segments.empty());
  EXPECT_FALSE(s.has_history);
  ASSERT_NE(s.device.info, nullptr);
  EXPECT_EQ(s.device.info->name, alloc->device().info().name);
  EXPECT_EQ(s.allocated_bytes(), 5 * MiB);
  EXPECT_EQ(s.reserved_bytes(), 20 * MiB);
  EXPECT_EQ(s.device.used_bytes, static_cast<std::size_t>(s.stats.device_used_bytes.current));
  EXPECT_EQ(s.device.context_bytes, alloc->device().info().context_bytes);
  EXPECT_GE(s.device.used_bytes, s.device.context_bytes + 20 * MiB);
  EXPECT_EQ(s.device.total_bytes, alloc->device().info().total_bytes);
  EXPECT_EQ(s.device.free_bytes, s.device.total_bytes - s.device.used_bytes);
  const Snapshot queried = snapshot(*alloc, {.query_device = true});
  EXPECT_TRUE(queried.device.free_from_device);
  EXPECT_EQ(queried.device.free_bytes, alloc->device().mem_get_info().free_bytes);
  alloc->deallocate(p);
}

TEST(Snapshot, BlockSumsEqualStatistics) {
  auto alloc = test::make_allocator();
  std::mt19937_64 rng(42);
  std::vector<void*> live;
  for (int i = 0; i < 400; ++i) {
    // Mix of small-pool and large-pool sizes, with frees in between to split and coalesce.
    const std::size_t size = (rng() % 3 == 0) ? 1 + rng() % (24 * MiB) : 1 + rng() % (512 * KiB);
    live.push_back(alloc->allocate(size));
    if (rng() % 3 == 0 && !live.empty()) {
      const std::size_t victim = rng() % live.size();
      alloc->deallocate(live[victim]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
    }
  }
  const Snapshot s = snapshot(*alloc, {.segments = true});
  ASSERT_TRUE(s.has_segments);
  std::array<std::int64_t, 3> allocated{}, reserved{}, active{}, requested{}, blocks{}, segments{};
  for (const SegmentInfo& seg : s.segments) {
    const std::size_t pool = seg.small_pool ? 1 : 2;  // StatType order
    std::size_t tiled = 0, seg_allocated = 0;
    for (const BlockInfo& b : seg.blocks) {
      tiled += b.size;
      if (b.state == BlockState::ActiveAllocated) {
        for (std::size_t t : {std::size_t{0}, pool}) {
          allocated[t] += static_cast<std::int64_t>(b.size);
          blocks[t] += 1;
        }
        seg_allocated += b.size;
      }
      if (b.state != BlockState::Inactive) {
        for (std::size_t t : {std::size_t{0}, pool}) {
          active[t] += static_cast<std::int64_t>(b.size);
          requested[t] += static_cast<std::int64_t>(b.requested_size);
        }
      }
    }
    EXPECT_EQ(tiled, seg.total_size);
    EXPECT_EQ(seg_allocated, seg.allocated_size);
    for (std::size_t t : {std::size_t{0}, pool}) {
      reserved[t] += static_cast<std::int64_t>(seg.total_size);
      segments[t] += 1;
    }
  }
  for (std::size_t t = 0; t < 3; ++t) {
    SCOPED_TRACE(kStatTypeNames[t]);
    EXPECT_EQ(allocated[t], s.stats.allocated_bytes[t].current);
    EXPECT_EQ(reserved[t], s.stats.reserved_bytes[t].current);
    EXPECT_EQ(active[t], s.stats.active_bytes[t].current);
    EXPECT_EQ(requested[t], s.stats.requested_bytes[t].current);
    EXPECT_EQ(blocks[t], s.stats.allocation[t].current);
    EXPECT_EQ(segments[t], s.stats.segment[t].current);
  }
  for (void* p : live) alloc->deallocate(p);
}

TEST(Snapshot, BlocksNameTheirOwnerModuleAndPhase) {
  auto alloc = test::make_allocator();
  attach(*alloc);
  attach(*alloc);  // idempotent
  void* outside = alloc->allocate(3 * MiB);
  void* inside = nullptr;
  {
    ModuleScope scope{"encoder.layers.0.attn", Phase::Recompute};
    inside = alloc->allocate(3 * MiB);
  }
  const Snapshot s = snapshot(*alloc, {.segments = true});
  int found = 0;
  for (const SegmentInfo& seg : s.segments) {
    for (const BlockInfo& b : seg.blocks) {
      if (b.address == reinterpret_cast<std::uintptr_t>(inside)) {
        EXPECT_EQ(block_owner(b).path, "encoder.layers.0.attn");
        EXPECT_EQ(block_owner(b).phase, Phase::Recompute);
        ++found;
      }
      if (b.address == reinterpret_cast<std::uintptr_t>(outside)) {
        EXPECT_EQ(block_owner(b).path, "");
        EXPECT_EQ(block_owner(b).phase, Phase::None);
        ++found;
      }
    }
  }
  EXPECT_EQ(found, 2);
  alloc->deallocate(inside);
  alloc->deallocate(outside);
}

TEST(Snapshot, HistoryComesFromRecordHistory) {
  auto alloc = test::make_allocator();
  EXPECT_EQ(recorded_history(*alloc), nullptr);  // off by default
  record_history(*alloc, 100);
  void* p = alloc->allocate(MiB);
  alloc->deallocate(p);
  const Snapshot s = snapshot(*alloc, {.history = true});
  ASSERT_TRUE(s.has_history);
  ASSERT_EQ(s.history.size(), 4u);  // segment_alloc, alloc, free_requested, free_completed
  EXPECT_EQ(s.history[0].action, TraceAction::SegmentAlloc);
  EXPECT_EQ(s.history[1].action, TraceAction::Alloc);
  EXPECT_EQ(s.history[3].action, TraceAction::FreeCompleted);
  record_history(*alloc, 0);
  EXPECT_EQ(recorded_history(*alloc), nullptr);
}

TEST(Snapshot, FragmentationCountsFreeSpaceInsideSegments) {
  auto alloc = test::make_allocator();
  // Three 2 MiB blocks carved from one 20 MiB large-pool segment; freeing the
  // middle one leaves a 2 MiB hole and the 14 MiB tail.
  void* a = alloc->allocate(2 * MiB);
  void* b = alloc->allocate(2 * MiB);
  void* c = alloc->allocate(2 * MiB);
  alloc->deallocate(b);
  const Snapshot s = snapshot(*alloc, {.segments = true});
  const Fragmentation f = fragmentation(s);
  EXPECT_EQ(f.reserved_unallocated_bytes, 16 * MiB);
  EXPECT_EQ(f.largest_free_block, 14 * MiB);
  EXPECT_EQ(f.free_blocks, 2u);
  EXPECT_DOUBLE_EQ(f.ratio(), 1.0 - 14.0 / 16.0);
  alloc->deallocate(a);
  alloc->deallocate(c);
}

TEST(ModuleScopeTest, NestingRestoresTheOuterContext) {
  EXPECT_EQ(current_context(), kNoContext);
  EXPECT_EQ(current_scope_depth(), 0u);
  {
    ModuleScope outer{"net", Phase::Forward};
    const ContextId outer_id = current_context();
    EXPECT_EQ(context_info(outer_id).path, "net");
    {
      ModuleScope inner{"net.fc", Phase::Forward};
      EXPECT_EQ(current_scope_depth(), 2u);
      EXPECT_EQ(context_info(current_context()).path, "net.fc");
    }
    EXPECT_EQ(current_context(), outer_id);
  }
  EXPECT_EQ(current_context(), kNoContext);
  EXPECT_EQ(intern_context("net", Phase::Forward), intern_context("net", Phase::Forward));
  EXPECT_NE(intern_context("net", Phase::Forward), intern_context("net", Phase::Backward));
  EXPECT_EQ(phase_name(Phase::Optimizer), "optimizer");
  EXPECT_EQ(parse_phase("recompute"), Phase::Recompute);
  EXPECT_THROW(parse_phase("sideways"), Error);
}

}  // namespace
}  // namespace mem
