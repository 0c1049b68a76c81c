// private_pool_test.cpp — CUDA graphs' private pools (c10's beginAllocateToPool /
// endAllocateToPool / releasePool): which pool a block comes from, what empty_cache keeps,
// the statistics, the snapshot's pool ids, and bad calls that change nothing.
#include <gtest/gtest.h>

#include "test_device.hpp"

namespace mem {
namespace {

using testing::small_device;

constexpr auto kBytes = [](std::size_t n) { return static_cast<std::int64_t>(n); };

TEST(PrivatePool, CaptureStreamAllocatesInItsOwnSegments) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId graph = dev->create_stream();
  // The default pool caches a 20 MiB segment of the graph stream.
  a.deallocate(a.allocate(4 * MiB, graph));
  const PoolId pool = a.graph_pool_handle();
  EXPECT_EQ(pool, 1u);
  a.begin_allocate_to_pool(pool, graph);
  void* in_pool = a.allocate(4 * MiB, graph);  // not the cached block: a segment of the pool
  void* elsewhere = a.allocate(4 * MiB, 0);    // another stream: the default pools
  a.end_allocate_to_pool(pool);
  void* after = a.allocate(4 * MiB, graph);    // capture over: the default pool's cached block
  const auto segs = a.segments();
  ASSERT_EQ(segs.size(), 3u);
  std::size_t in_private = 0;
  for (const SegmentInfo& seg : segs) {
    EXPECT_EQ(seg.total_size, 20 * MiB);
    const bool has_pool_block = seg.address == reinterpret_cast<std::uintptr_t>(in_pool);
    EXPECT_EQ(seg.pool, has_pool_block ? pool : 0u);
    in_private += seg.pool != 0 ? 1 : 0;
  }
  EXPECT_EQ(in_private, 1u);
  EXPECT_EQ(a.private_pool_reserved(), 20 * MiB);
  EXPECT_EQ(a.private_pool_allocated(), 4 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, kBytes(60 * MiB));  // the pool's segment counts as reserved
  EXPECT_EQ(a.stats().allocated_bytes[0].current, kBytes(12 * MiB));
  a.validate();
  // A freed pool block returns to the pool: the next capture reuses it, the default pools do not.
  a.deallocate(in_pool);
  void* default_again = a.allocate(4 * MiB, graph);
  EXPECT_NE(default_again, in_pool);
  a.begin_allocate_to_pool(pool, graph);
  void* reused = a.allocate(4 * MiB, graph);
  a.end_allocate_to_pool(pool);
  EXPECT_EQ(reused, in_pool);
  for (void* p : {reused, elsewhere, after, default_again}) a.deallocate(p);
  a.release_pool(pool);
  a.release_pool(pool);
  a.validate();
}

TEST(PrivatePool, EmptyCacheKeepsAPoolInUseAndFreesItOnceReleased) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId graph = dev->create_stream();
  const PoolId pool = a.graph_pool_handle();
  a.begin_allocate_to_pool(pool, graph);
  void* small = a.allocate(100 * KiB, graph);
  void* large = a.allocate(30 * MiB, graph);
  a.deallocate(small);
  a.deallocate(large);
  a.end_allocate_to_pool(pool);
  a.empty_cache();  // the pool has a user: its graphs replay into these segments
  EXPECT_EQ(a.private_pool_reserved(), 2 * MiB + 30 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, kBytes(32 * MiB));
  a.release_pool(pool);
  EXPECT_EQ(a.private_pool_reserved(), 32 * MiB);  // released, not yet given back
  a.empty_cache();
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(dev->mem_get_info().free_bytes, GiB);
  a.validate();
  // The pool is gone with its last segment: a second release has nothing to release.
  EXPECT_THROW(a.release_pool(pool), Error);
}

TEST(PrivatePool, SharedPoolNeedsEveryUserReleased) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId graph = dev->create_stream();
  const PoolId pool = a.graph_pool_handle();
  // Two graphs captured into one pool (torch.cuda.graph(pool=...)): two users.
  for (int graph_index = 0; graph_index < 2; ++graph_index) {
    a.begin_allocate_to_pool(pool, graph);
    a.deallocate(a.allocate(3 * MiB, graph));
    a.end_allocate_to_pool(pool);
  }
  EXPECT_EQ(a.private_pool_reserved(), 20 * MiB);  // the second capture reused the first's block
  a.release_pool(pool);
  a.empty_cache();
  EXPECT_EQ(a.private_pool_reserved(), 20 * MiB);
  a.release_pool(pool);
  a.empty_cache();
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  a.validate();
}

TEST(PrivatePool, OutOfMemoryRetryFreesAReleasedPoolAndTheMessageNamesPrivatePools) {
  auto dev = small_device(64 * MiB);
  CachingAllocator a{dev};
  const StreamId graph = dev->create_stream();
  const PoolId pool = a.graph_pool_handle();
  a.begin_allocate_to_pool(pool, graph);
  void* held = a.allocate(20 * MiB, graph);
  void* cached = a.allocate(30 * MiB, graph);
  a.deallocate(cached);
  a.end_allocate_to_pool(pool);
  // The pool is in use: its cached 30 MiB cannot serve the default pool, and stays.
  try {
    a.allocate(40 * MiB, 0);
    FAIL() << "expected out of memory";
  } catch (const OutOfMemoryError& e) {
    // PyTorch's figure is the pools' free blocks, which no other allocation can take.
    EXPECT_NE(std::string(e.what()).find("Of the allocated memory 50.00 MiB is allocated by vramscope, with 30.00 MiB "
                                         "allocated in private pools (e.g., CUDA Graphs), and 0 B is reserved"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.private_pool_reserved(), 50 * MiB);
  a.validate();
  // Released, its cached segment goes in the retry.
  a.deallocate(held);
  a.release_pool(pool);
  void* big = a.allocate(40 * MiB, 0);
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  EXPECT_EQ(a.stats().num_alloc_retries, 2);
  a.deallocate(big);
  a.validate();
}

TEST(PrivatePool, ExpandableSegmentsMapPagesOfThePoolsOwnSegment) {
  auto dev = small_device();
  CachingAllocator a{dev, AllocatorConfig::parse("expandable_segments:True")};
  const StreamId graph = dev->create_stream();
  void* outside = a.allocate(30 * MiB, graph);
  const PoolId pool = a.graph_pool_handle();
  a.begin_allocate_to_pool(pool, graph);
  void* inside = a.allocate(30 * MiB, graph);
  a.end_allocate_to_pool(pool);
  EXPECT_EQ(dev->address_ranges(), 2u);  // one expandable segment each
  EXPECT_EQ(a.private_pool_reserved(), 40 * MiB);  // two 20 MiB pages
  for (const SegmentInfo& seg : a.segments()) {
    EXPECT_TRUE(seg.expandable);
    EXPECT_EQ(seg.pool, seg.address == reinterpret_cast<std::uintptr_t>(inside) ? pool : 0u);
  }
  a.deallocate(inside);
  a.deallocate(outside);
  a.release_pool(pool);
  a.empty_cache();
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  EXPECT_EQ(dev->address_ranges(), 0u);
  a.validate();
}

TEST(PrivatePool, BadCallsAreRefusedAndChangeNothing) {
  auto dev = small_device();
  CachingAllocator a{dev};
  const StreamId graph = dev->create_stream();
  const StreamId other = dev->create_stream();
  const PoolId pool = a.graph_pool_handle();
  a.begin_allocate_to_pool(pool, graph);
  void* p = a.allocate(MiB, graph);
  const DeviceStats before = a.stats();
  const PoolId second = a.graph_pool_handle();
  EXPECT_THROW(a.begin_allocate_to_pool(0, other), Error);           // the default pools
  EXPECT_THROW(a.begin_allocate_to_pool(99, other), Error);          // no handle gave it
  EXPECT_THROW(a.begin_allocate_to_pool(pool, other), Error);        // already being allocated to
  EXPECT_THROW(a.begin_allocate_to_pool(second, graph), Error);      // the stream already has a pool
  EXPECT_THROW(a.begin_allocate_to_pool(second, 12345), Error);      // not a stream of the device
  EXPECT_THROW(a.end_allocate_to_pool(second), Error);               // never begun
  EXPECT_THROW(a.release_pool(second), Error);                       // never made
  a.end_allocate_to_pool(pool);
  EXPECT_THROW(a.end_allocate_to_pool(pool), Error);                 // ended already
  a.release_pool(pool);
  EXPECT_THROW(a.release_pool(pool), Error);                         // no user left
  EXPECT_THROW(a.begin_allocate_to_pool(pool, graph), Error);        // released: take a new handle
  const DeviceStats after = a.stats();
  EXPECT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
  EXPECT_EQ(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
  a.validate();
  // The refused begin on `second` did not make it: a good begin still can.
  a.begin_allocate_to_pool(second, other);
  a.end_allocate_to_pool(second);
  a.release_pool(second);
  a.deallocate(p);  // a block of a released pool still frees into it
  a.empty_cache();
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  a.validate();
}

}  // namespace
}  // namespace mem
