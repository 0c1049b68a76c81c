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
