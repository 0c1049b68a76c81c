// threads_test.cpp — eight threads allocating and freeing on their own and
// shared streams (with record_stream across them and module scopes of their
// own) while another thread takes full snapshots with history, for a bounded
// time. Built with the `tsan` preset it runs under ThreadSanitizer (label
// `threads`). Every snapshot must be self-consistent, and at the end
// everything must validate and return to the device.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

TEST(Threads, EightWorkersAndASnapshotterStayConsistent) {
  auto device = std::make_shared<SimDevice>(parse_sim_spec("capacity=1500MiB,context=300MiB"));
  CachingAllocator alloc{device};
  attach(alloc);
  History history{alloc, 4096};

  constexpr int kWorkers = 8;
  const auto budget = std::chrono::milliseconds(1500);  // bounded: the same on any machine
  const StreamId shared = device->create_stream();
  std::vector<StreamId> own;
  for (int t = 0; t < kWorkers; ++t) own.push_back(device->create_stream());

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> operations{0}, ooms{0}, snapshots{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919 + 1);
      const std::string module = "worker" + std::to_string(t);
      std::vector<void*> mine;
      std::uint64_t ops = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        ModuleScope scope(module, t % 2 == 0 ? Phase::Forward : Phase::Backward);
        const StreamId stream = rng() % 3 == 0 ? shared : own[t];
        if (mine.size() < 64 && (mine.empty() || rng() % 2 == 0)) {
          const std::size_t size = rng() % 4 != 0 ? 1 + rng() % (256 * KiB)  // small pool
                                                  : 1 + rng() % (24 * MiB);  // both large kinds
          try {
            void* p = alloc.allocate(size, stream);
            if (rng() % 8 == 0) alloc.record_stream(p, own[(t + 1) % kWorkers]);
            mine.push_back(p);
          } catch (const OutOfMemoryError&) {
            ooms.fetch_add(1, std::memory_order_relaxed);
          }
        } else {
          const std::size_t k = rng() % mine.size();
          alloc.deallocate(mine[k]);
          mine[k] = mine.back();
          mine.pop_back();
        }
        if (rng() % 4096 == 0) alloc.empty_cache();
        ++ops;
      }
      for (void* p : mine) alloc.deallocate(p);
      operations.fetch_add(ops);
    });
  }

  std::thread snapshotter([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const bool full = snapshots.load() % 4 == 0;
      const Snapshot s = snapshot(alloc, {.segments = full, .history = full,
                                          .history_source = &history});
      // Taken under the allocator lock: the statistics match the blocks listed.
      EXPECT_LE(s.allocated_bytes(), s.active_bytes());
      EXPECT_LE(s.active_bytes(), s.reserved_bytes());
      if (full) {
        std::size_t reserved = 0, allocated = 0;
        for (const SegmentInfo& seg : s.segments) {
          reserved += seg.total_size;
          allocated += seg.allocated_size;
        }
        EXPECT_EQ(reserved, s.reserved_bytes());
        EXPECT_EQ(allocated, s.allocated_bytes());
        EXPECT_LE(s.history.size(), history.capacity());
      }
      snapshots.fetch_add(1);
    }
  });

  std::this_thread::sleep_for(budget);
  stop = true;
  for (auto& w : workers) w.join();
  snapshotter.join();

  std::printf("[ threads ] %d workers: %llu operations, %llu OOMs, %llu snapshots in %lld ms\n",
              kWorkers, static_cast<unsigned long long>(operations.load()),
              static_cast<unsigned long long>(ooms.load()),
              static_cast<unsigned long long>(snapshots.load()),
              static_cast<long long>(budget.count()));
  EXPECT_GT(operations.load(), 1000u);
  EXPECT_GT(snapshots.load(), 10u);
  alloc.validate();
  const DeviceStats s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.allocation[0].allocated, s.allocation[0].freed);
  device->synchronize();
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(device->process_used_bytes(), 300 * MiB);  // only the context is left
  history.detach();
}

}  // namespace
}  // namespace mem
