// threads_test.cpp — concurrent allocate/free/stats/snapshots from several
// threads (run under TSan with the `tsan` preset); the end state must validate.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "test_device.hpp"

namespace mem {
namespace {

TEST(Threads, ConcurrentAllocateAndFreeStayConsistent) {
  auto dev = testing::small_device(4 * GiB);
  CachingAllocator a{dev};
  const StreamId side = dev->create_stream();
  constexpr int kThreads = 4;
  constexpr int kSteps = 20000;
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 7);
      const StreamId stream = t % 2 == 0 ? StreamId{0} : side;
      std::vector<void*> mine;
      for (int i = 0; i < kSteps; ++i) {
        if (mine.empty() || rng() % 2 == 0) {
          const std::size_t size = rng() % 2 ? 1 + rng() % (64 * KiB) : 1 + rng() % (12 * MiB);
          mine.push_back(a.allocate(size, stream));
        } else {
          const std::size_t k = rng() % mine.size();
          a.deallocate(mine[k]);
          mine[k] = mine.back();
          mine.pop_back();
        }
      }
      for (void* p : mine) a.deallocate(p);
    });
  }
  // A reader polling statistics and segment listings meanwhile.
  std::thread reader([&] {
    while (!stop.load()) {
      const DeviceStats s = a.stats();
      EXPECT_LE(s.allocated_bytes[0].current, s.reserved_bytes[0].current);
      (void)a.segments();
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  reader.join();
  a.validate();
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.allocation[0].allocated, s.allocation[0].freed);
}

// The allocator's lock is biased to the first thread that uses it (no atomics
// for that thread) and revoked when a second thread arrives. Hammer the window:
// the owner runs a tight loop while others join at staggered times, repeatedly.
TEST(Threads, LateThreadsJoiningABusyOwnerStayExclusive) {
  for (int round = 0; round < 20; ++round) {
    auto dev = testing::small_device(4 * GiB);
    CachingAllocator a{dev};
    std::atomic<bool> stop{false};
    std::atomic<long> pairs{0};
    std::thread owner([&] {
      std::vector<void*> mine;
      while (!stop.load(std::memory_order_relaxed)) {
        mine.push_back(a.allocate(512 + 512 * (mine.size() % 7)));
        if (mine.size() > 16) {
          for (void* p : mine) a.deallocate(p);
          mine.clear();
        }
        pairs.fetch_add(1, std::memory_order_relaxed);
      }
      for (void* p : mine) a.deallocate(p);
    });
    while (pairs.load() < 1000) std::this_thread::yield();  // the owner holds the bias
    std::vector<std::thread> late;
    for (int t = 0; t < 3; ++t) {
      late.emplace_back([&, t] {
        for (int i = 0; i < 2000; ++i) {
          void* p = a.allocate(1024 * (1 + (i + t) % 5));
          a.deallocate(p);
        }
      });
    }
    for (auto& th : late) th.join();
    stop = true;
    owner.join();
    a.validate();
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
    EXPECT_EQ(a.stats().allocation[0].allocated, a.stats().allocation[0].freed);
  }
}

}  // namespace
}  // namespace mem
