// event_ring_test.cpp — the allocator's own recording hook: exactly the
// events of a known sequence, with the totals after each, folded frees
// expanded, the bound, several rings at once, and detach.
#include <gtest/gtest.h>

#include "test_device.hpp"
#include "vramscope/allocator/event_ring.hpp"

namespace mem {
namespace {

TEST(EventRing, RecordsExactlyTheEventsOfAKnownSequence) {
  CachingAllocator alloc{testing::small_device()};
  EventRing ring{16, /*timestamps=*/true};
  alloc.attach_ring(&ring);
  void* a = alloc.allocate(3 * MiB + 100, 0);  // a 20 MiB segment, split
  void* b = alloc.allocate(1000, 0);           // a 2 MiB small segment, split
  alloc.deallocate(a);
  alloc.deallocate(b);
  alloc.empty_cache();
  alloc.detach_ring(&ring);
  alloc.deallocate(alloc.allocate(KiB));  // not recorded

  const std::vector<RingEvent> got = ring.read();
  struct Want {
    TraceAction action;
    std::size_t size, requested, allocated, reserved;
  };
  const std::size_t big = 3 * MiB + 512;
  const Want want[] = {
      {TraceAction::SegmentAlloc, 20 * MiB, 0, 0, 20 * MiB},
      {TraceAction::Alloc, big, 3 * MiB + 100, big, 20 * MiB},
      {TraceAction::SegmentAlloc, 2 * MiB, 0, big, 22 * MiB},
      {TraceAction::Alloc, 1024, 1000, big + 1024, 22 * MiB},
      {TraceAction::FreeRequested, big, 3 * MiB + 100, 1024, 22 * MiB},
      {TraceAction::FreeCompleted, big, 3 * MiB + 100, 1024, 22 * MiB},
      {TraceAction::FreeRequested, 1024, 1000, 0, 22 * MiB},
      {TraceAction::FreeCompleted, 1024, 1000, 0, 22 * MiB},
      {TraceAction::SegmentFree, 20 * MiB, 0, 0, 2 * MiB},
      {TraceAction::SegmentFree, 2 * MiB, 0, 0, 0},
  };
  ASSERT_EQ(got.size(), std::size(want));
  EXPECT_EQ(ring.recorded(), std::size(want));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const TraceEvent& e = got[i].event;
    EXPECT_EQ(e.action, want[i].action) << i;
    EXPECT_EQ(e.size, want[i].size) << i;
    EXPECT_EQ(e.requested_size, want[i].requested) << i;
    EXPECT_EQ(e.allocated_bytes, want[i].allocated) << i;
    EXPECT_EQ(e.reserved_bytes, want[i].reserved) << i;
    EXPECT_EQ(e.sequence, got[0].event.sequence + i) << i;  // consecutive, folded ones included
    EXPECT_EQ(e.small_pool, want[i].size <= 2 * MiB) << i;
    if (i > 0) {
      EXPECT_GE(got[i].ticks, got[i - 1].ticks) << i;
    }
  }
  EXPECT_EQ(got[1].event.address, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(got[3].event.address, reinterpret_cast<std::uintptr_t>(b));
  EXPECT_GT(got[0].ticks, 0u);
}

TEST(EventRing, KeepsTheNewestEventsAtItsBoundAndRingsAreIndependent) {
  CachingAllocator alloc{testing::small_device()};
  EventRing small{5, false};
  EventRing large{1000, false};
  alloc.attach_ring(&small);
  alloc.attach_ring(&large);
  alloc.attach_ring(&small);  // a second attach is a no-op
  for (int i = 0; i < 4; ++i) alloc.deallocate(alloc.allocate(KiB));
  // segment_alloc, then 4 x (alloc, free_requested, free_completed)
  EXPECT_EQ(large.recorded(), 13u);
  EXPECT_EQ(small.recorded(), 13u);
  const auto all = large.read();
  const auto newest = small.read();
  ASSERT_EQ(all.size(), 13u);
  ASSERT_EQ(newest.size(), 5u);
  for (std::size_t i = 0; i < newest.size(); ++i) {
    EXPECT_EQ(newest[i].event.sequence, all[8 + i].event.sequence);
    EXPECT_EQ(newest[i].event.action, all[8 + i].event.action);
    EXPECT_EQ(newest[i].ticks, 0u);  // no timestamps
  }
  small.clear();
  EXPECT_TRUE(small.read().empty());
  alloc.detach_ring(&small);
  alloc.detach_ring(&large);
  alloc.validate();
}

}  // namespace
}  // namespace mem
