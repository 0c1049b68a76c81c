// instrumentation_bench.cpp — what instrumentation costs: a statistics-only
// snapshot (meant for hooks), a full snapshot against block count, and the
// allocation fast path with the history ring off and on.
//
//   vramscope_instrumentation_bench --benchmark_format=json
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace {

std::unique_ptr<mem::CachingAllocator> make_allocator() {
  return std::make_unique<mem::CachingAllocator>(
      std::make_shared<mem::SimDevice>(mem::sim_preset("a100-80g")));
}

void BM_SnapshotStatsOnly(benchmark::State& state) {
  auto alloc = make_allocator();
  std::vector<void*> live;
  for (int i = 0; i < 64; ++i) live.push_back(alloc->allocate(64 * mem::KiB));
  for (auto _ : state) {
    mem::Snapshot s = mem::snapshot(*alloc);
    benchmark::DoNotOptimize(s);
  }
  for (void* p : live) alloc->deallocate(p);
}
BENCHMARK(BM_SnapshotStatsOnly);

void BM_SnapshotFull(benchmark::State& state) {
  auto alloc = make_allocator();
  mem::attach(*alloc);
  const auto blocks = static_cast<std::size_t>(state.range(0));
  std::vector<void*> live;
  live.reserve(blocks);
  {
    mem::ModuleScope scope{"model.layer", mem::Phase::Forward};
    for (std::size_t i = 0; i < blocks; ++i) live.push_back(alloc->allocate(4 * mem::KiB));
  }
  // Free every other block so segments hold a mix of states.
  for (std::size_t i = 0; i < live.size(); i += 2) alloc->deallocate(live[i]);
  for (auto _ : state) {
    mem::Snapshot s = mem::snapshot(*alloc, {.segments = true});
    benchmark::DoNotOptimize(s);
  }
  state.counters["blocks"] = static_cast<double>(blocks);
  state.SetComplexityN(static_cast<std::int64_t>(blocks));
  for (std::size_t i = 1; i < live.size(); i += 2) alloc->deallocate(live[i]);
}
BENCHMARK(BM_SnapshotFull)->RangeMultiplier(10)->Range(100, 100000)->Complexity(benchmark::oN);

// The same allocate+free pair with and without a History observer; the
// issue's bar is On <= 1.3x Off.
void alloc_free_loop(benchmark::State& state, mem::CachingAllocator& alloc) {
  void* warm = alloc.allocate(256 * mem::KiB);  // keep a segment cached
  alloc.deallocate(warm);
  for (auto _ : state) {
    void* p = alloc.allocate(256 * mem::KiB);
    benchmark::DoNotOptimize(p);
    alloc.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_AllocFreeHistoryOff(benchmark::State& state) {
  auto alloc = make_allocator();
  alloc_free_loop(state, *alloc);
}
BENCHMARK(BM_AllocFreeHistoryOff);

void BM_AllocFreeHistoryOn(benchmark::State& state) {
  auto alloc = make_allocator();
  mem::History history{*alloc, static_cast<std::size_t>(state.range(0))};
  alloc_free_loop(state, *alloc);
  state.counters["recorded"] = static_cast<double>(history.recorded());
}
BENCHMARK(BM_AllocFreeHistoryOn)->Arg(1 << 10)->Arg(1 << 16)->Arg(1 << 20);

// The same without timestamps: ordering by sequence only, no rdtsc per event.
void BM_AllocFreeHistoryOnNoTimestamps(benchmark::State& state) {
  auto alloc = make_allocator();
  mem::History history{*alloc, static_cast<std::size_t>(state.range(0)), {.timestamps = false}};
  alloc_free_loop(state, *alloc);
  state.counters["recorded"] = static_cast<double>(history.recorded());
}
BENCHMARK(BM_AllocFreeHistoryOnNoTimestamps)->Arg(1 << 10)->Arg(1 << 16);

}  // namespace


// The floor any observer pays: the allocator building a TraceEvent and one
// virtual call per event, with an observer that only stores a counter.
namespace {
struct FloorObserver final : mem::AllocatorObserver {
  void on_event(const mem::TraceEvent& e) noexcept override { last = e.sequence; }
  std::uint64_t last = 0;
};
void BM_AllocFreeFloorObserver(benchmark::State& state) {
  auto alloc = make_allocator();
  FloorObserver o;
  alloc->add_observer(&o);
  alloc_free_loop(state, *alloc);
  alloc->remove_observer(&o);
}
BENCHMARK(BM_AllocFreeFloorObserver);
}
BENCHMARK_MAIN();
