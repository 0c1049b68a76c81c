// bench_counters.hpp — the cache counters every allocator benchmark reports
// (docs/BENCHMARKS.md, "Counters"), computed one way for all suites.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>

#include "peers/peer_allocators.hpp"

namespace mem::bench {

/// peak_reserved and peak_requested (bytes, kIs1024), reserved_per_requested
/// and cache_hit_rate (allocations served without cudaMalloc).
inline void report_cache_counters(benchmark::State& state, const PeerCounters& c,
                                  std::size_t peak_requested, std::uint64_t allocations) {
  using benchmark::Counter;
  state.counters["peak_reserved"] =
      Counter(static_cast<double>(c.peak_reserved), Counter::kDefaults, Counter::kIs1024);
  state.counters["peak_requested"] =
      Counter(static_cast<double>(peak_requested), Counter::kDefaults, Counter::kIs1024);
  state.counters["reserved_per_requested"] =
      peak_requested ? static_cast<double>(c.peak_reserved) / static_cast<double>(peak_requested)
                     : 0.0;
  state.counters["cache_hit_rate"] =
      allocations ? 1.0 - static_cast<double>(c.device_allocs) / static_cast<double>(allocations)
                  : 0.0;
}

}  // namespace mem::bench
