// randomized_test.cpp — 100,000+ random operations (sizes across both pools,
// streams, record_stream with held events, empty_cache, injected device
// failures, captures into private pools begun, ended and released), with and without expandable segments, with validate() after every step, against a shadow model of what
// must be live.
#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

#include "test_device.hpp"

namespace mem {
namespace {

struct Live {
  void* ptr;
  std::size_t size;
};

/// How many pool handles the run took (the next one's id, minus one).
PoolId next_pool_id_seen(CachingAllocator& a) { return a.graph_pool_handle() - 1; }

void run_random_workload(const std::string& conf, std::uint64_t seed, int steps) {
  auto dev = testing::small_device(512 * MiB, 0);
  dev->fail_with_probability(0.02, seed);
  CachingAllocator a{dev, AllocatorConfig::parse(conf)};
  const StreamId streams[] = {0, dev->create_stream(), dev->create_stream()};
  std::mt19937_64 rng(seed);
  std::vector<Live> live;
  std::size_t live_requested = 0;
  std::uint64_t ooms = 0;
  std::vector<PoolId> pool_users;  // one entry per user of a private pool
  bool capturing = false;          // pool_users.back() is being allocated to by stream 1 or 2

  auto random_size = [&]() -> std::size_t {
    switch (rng() % 4) {
      case 0: return 1 + rng() % 4096;                  // tiny
      case 1: return 1 + rng() % MiB;                   // small pool
      case 2: return MiB + 1 + rng() % (9 * MiB);       // large, shared segments
      default: return 10 * MiB + rng() % (40 * MiB);    // own segments
    }
  };

  for (int step = 0; step < steps; ++step) {
    const unsigned op = rng() % 100;
    if (op < 55 || live.empty()) {
      const std::size_t size = random_size();
      const StreamId s = streams[rng() % 3];
      try {
        void* p = a.allocate(size, s);
        live.push_back({p, size});
        live_requested += size;
        if (rng() % 10 == 0) a.record_stream(p, streams[rng() % 3]);
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (op < 97) {
      const std::size_t i = rng() % live.size();
      a.deallocate(live[i].ptr);
      live_requested -= live[i].size;
      live[i] = live.back();
      live.pop_back();
    } else if (op < 98) {
      a.empty_cache();
    } else if (op < 99) {
      // A capture: begun into a new or shared pool on a side stream, ended, its pool released.
      if (capturing) {
        a.end_allocate_to_pool(pool_users.back());
        capturing = false;
      } else if (!pool_users.empty() && rng() % 2 == 0) {
        const std::size_t i = rng() % pool_users.size();
        a.release_pool(pool_users[i]);
        pool_users.erase(pool_users.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        const PoolId pool = !pool_users.empty() && rng() % 2 == 0 ? pool_users[rng() % pool_users.size()]
                                                                  : a.graph_pool_handle();
        a.begin_allocate_to_pool(pool, streams[1 + rng() % 2]);
        pool_users.push_back(pool);
        capturing = true;
      }
    } else {
      dev->hold_events(rng() % 2 == 0);
      if (rng() % 2) dev->release_events();
    }
    ASSERT_NO_THROW(a.validate()) << "step " << step;
    const DeviceStats s = a.stats();
    ASSERT_EQ(s.allocation[0].current, static_cast<std::int64_t>(live.size())) << step;
    ASSERT_GE(s.requested_bytes[0].current, static_cast<std::int64_t>(live_requested)) << step;
    ASSERT_EQ(s.reserved_bytes[0].current + static_cast<std::int64_t>(dev->mem_get_info().free_bytes),
              static_cast<std::int64_t>(512 * MiB))
        << step;
  }
  for (const Live& l : live) a.deallocate(l.ptr);
  if (capturing) a.end_allocate_to_pool(pool_users.back());
  for (PoolId pool : pool_users) a.release_pool(pool);
  EXPECT_GT(next_pool_id_seen(a), 3u);
  dev->hold_events(false);
  dev->release_events();
  a.empty_cache();
  a.validate();
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(a.private_pool_reserved(), 0u);
  EXPECT_EQ(s.active_bytes[0].current, 0);
  EXPECT_EQ(static_cast<std::uint64_t>(s.num_ooms), ooms);
  if (a.config().expandable_segments) {
    // Pages were mapped and unmapped, never a cudaMalloc segment; the emptied cache
    // released every reserved range.
    EXPECT_EQ(s.segment[0].peak, 0);
    EXPECT_GT(s.num_device_free, 100);
    EXPECT_GT(s.reserved_bytes[0].peak, 256 * static_cast<std::int64_t>(MiB));
    // Every range is given back but a default pool's segment whose first map failed (the device
    // was full): PyTorch keeps that reservation, addresses without memory, at most one per stream
    // and pool since it has room for any request. A private pool's go with the pool.
    EXPECT_LE(dev->address_ranges(), 6u);
  }
}

TEST(Randomized, DefaultPolicyKeepsEveryInvariant) { run_random_workload("", 1, 60000); }
TEST(Randomized, MaxSplitSizeKeepsEveryInvariant) {
  run_random_workload("max_split_size_mb:24", 2, 25000);
}
TEST(Randomized, RoundupDivisionsKeepEveryInvariant) {
  run_random_workload("roundup_power2_divisions:[1:2,16:4,>:8]", 3, 15000);
}
TEST(Randomized, ExpandableSegmentsKeepEveryInvariant) {
  run_random_workload("expandable_segments:True", 4, 25000);
}
TEST(Randomized, ExpandableSegmentsWithMaxSplitSizeKeepEveryInvariant) {
  run_random_workload("expandable_segments:True,max_split_size_mb:24,roundup_power2_divisions:4", 5, 15000);
}

}  // namespace
}  // namespace mem
