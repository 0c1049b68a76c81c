// streams_test.cpp — per-stream pools and record_stream's deferred reuse.
#include <gtest/gtest.h>

#include "test_device.hpp"

namespace mem {
namespace {

using testing::small_device;

TEST(Streams, BlocksAreNotSharedAcrossStreams) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId s1 = dev->create_stream();
  const StreamId s2 = dev->create_stream();
  void* p = a.allocate(KiB, s1);
  a.deallocate(p);
  void* q = a.allocate(KiB, s2);  // s1's cached segment is not eligible
  EXPECT_NE(q, p);
  EXPECT_EQ(a.stats().segment[0].current, 2);
  void* r = a.allocate(KiB, s1);  // s1 reuses its own
  EXPECT_EQ(r, p);
  a.deallocate(q);
  a.deallocate(r);
  a.validate();
}

TEST(Streams, RecordStreamDefersReuseUntilTheEventCompletes) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId side = dev->create_stream();
  dev->hold_events(true);
  void* p = a.allocate(64 * KiB);
  a.record_stream(p, side);
  a.deallocate(p);
  // Freed but pending: still active, not reusable.
  DeviceStats s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.active_bytes[0].current, static_cast<std::int64_t>(64 * KiB));
  auto segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].blocks[0].state, BlockState::ActivePendingFree);
  a.validate();
  void* q = a.allocate(64 * KiB);
  EXPECT_NE(q, p);
  a.deallocate(q);
  // Once the side stream's work completes, the next allocation reclaims it.
  dev->release_events();
  void* r = a.allocate(64 * KiB);
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.stats().active_bytes[0].current, static_cast<std::int64_t>(64 * KiB));
  a.deallocate(r);
  a.validate();
}

// Until a block waits for events, active is allocation in every figure (the allocator
// updates only allocation then); from the first wait on, active is kept apart.
TEST(Streams, ActiveFollowsAllocationUntilABlockWaitsThenHasItsOwnPeaks) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId side = dev->create_stream();
  const auto same = [](const StatArray& x, const StatArray& y) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (x[i].current != y[i].current || x[i].peak != y[i].peak || x[i].allocated != y[i].allocated ||
          x[i].freed != y[i].freed) {
        return false;
      }
    }
    return true;
  };
  void* big = a.allocate(3 * MiB);  // large pool
  void* p = a.allocate(64 * KiB);
  a.deallocate(big);
  a.reset_peak_stats();
  void* q = a.allocate(32 * KiB);
  DeviceStats s = a.stats();
  EXPECT_TRUE(same(s.active, s.allocation));
  EXPECT_TRUE(same(s.active_bytes, s.allocated_bytes));
  EXPECT_EQ(s.active_bytes[0].peak, static_cast<std::int64_t>(96 * KiB));

  dev->hold_events(true);
  a.record_stream(p, side);
  a.deallocate(p);  // waits: allocated 32 KiB, active 96 KiB
  void* r = a.allocate(64 * KiB);
  s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(96 * KiB));
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(96 * KiB));
  EXPECT_EQ(s.active_bytes[0].current, static_cast<std::int64_t>(160 * KiB));
  EXPECT_EQ(s.active_bytes[0].peak, static_cast<std::int64_t>(160 * KiB));
  EXPECT_EQ(s.active[0].current, 3);
  EXPECT_EQ(s.allocation[0].current, 2);
  EXPECT_EQ(s.active[0].allocated, s.allocation[0].allocated);  // both count every allocation: 4
  EXPECT_EQ(s.active[0].allocated, 4);
  EXPECT_EQ(s.active[0].freed, 1);      // big's free; p's has not completed
  EXPECT_EQ(s.allocation[0].freed, 2);  // big and p
  a.validate();
  dev->release_events();
  a.deallocate(q);
  a.deallocate(r);
  void* t = a.allocate(KiB);  // processes p's event: its free completes
  a.deallocate(t);
  s = a.stats();
  EXPECT_EQ(s.active_bytes[0].current, 0);
  EXPECT_EQ(s.active[0].freed, s.allocation[0].freed);
  EXPECT_EQ(s.active_bytes[0].peak, static_cast<std::int64_t>(160 * KiB));
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(96 * KiB));
  a.validate();
}

TEST(Streams, RecordingTheOwnStreamIsANoOp) {
  auto dev = small_device();
  CachingAllocator a{dev};
  dev->hold_events(true);
  void* p = a.allocate(KiB);
  a.record_stream(p, 0);
  a.deallocate(p);
  EXPECT_EQ(a.stats().active_bytes[0].current, 0);
  a.validate();
}

TEST(Streams, EmptyCacheSynchronizesPendingEvents) {
  auto dev = small_device();
  CachingAllocator a{dev};
  dev->hold_events(true);
  void* p = a.allocate(5 * MiB);
  a.record_stream(p, dev->create_stream());
  a.deallocate(p);
  a.empty_cache();
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  a.validate();
}

TEST(Streams, RecordStreamRejectsForeignPointers) {
  auto dev = small_device();
  CachingAllocator a{dev};
  int x = 0;
  EXPECT_THROW(a.record_stream(&x, 1), Error);
}

}  // namespace
}  // namespace mem
