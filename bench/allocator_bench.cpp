// allocator_bench.cpp — the allocator against its peers on the same workloads:
// the cache-hit fast path, mixed sizes, an RMM-style random workload, a random live
// set (the slow path), cost against the number of cached blocks, and two threads. vramscope's
// CachingAllocator, CUB's CachingDeviceAllocator (default bins and bin growth
// 2, on a simulated CUDA runtime) and glibc malloc/free as the yardstick.
//
//   build/bench/bench/vramscope_allocator_bench --benchmark_format=json
//
// Counters: time_per_pair (seconds per allocate+free pair), peak_reserved and
// peak_requested (bytes, kIs1024), reserved_per_requested, cache_hit_rate
// (allocations served without cudaMalloc), device_allocs (per iteration) and
// sim_driver_us (the simulated driver time per iteration a GPU would add:
// cudaMalloc/cudaFree cost nothing real here, see docs/BENCHMARKS.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "bench_counters.hpp"
#include "peers/peer_allocators.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::bench {
namespace {

// Fills the common counters. `pairs` allocate+free pairs were timed.
template <class A>
void report(benchmark::State& state, const A& a, std::size_t peak_requested,
            std::uint64_t allocations, std::uint64_t pairs, double driver_us) {
  using benchmark::Counter;
  state.counters["time_per_pair"] =
      Counter(static_cast<double>(pairs), Counter::kIsRate | Counter::kInvert);
  if constexpr (kHasDevice<A>) {
    const PeerCounters c = a.counters();
    report_cache_counters(state, c, peak_requested, allocations);
    state.counters["device_allocs"] =
        Counter(static_cast<double>(c.device_allocs), Counter::kAvgIterations);
    state.counters["sim_driver_us"] = Counter(driver_us, Counter::kAvgIterations);
  }
}

// --- fast path: allocate + free of a cached size --------------------------------

template <class A>
void BM_FastPath(benchmark::State& state) {
  constexpr std::size_t kSize = 1 * KiB;
  A a;
  a.deallocate(a.allocate(kSize), kSize);  // the size is cached from here on
  a.reset_peaks();
  const double driver0 = a.driver_us();
  for (auto _ : state) {
    void* p = a.allocate(kSize);
    benchmark::DoNotOptimize(p);
    a.deallocate(p, kSize);
  }
  report(state, a, kSize, state.iterations(), state.iterations(), a.driver_us() - driver0);
}

// --- mixed sizes: a window of live blocks over a fixed set of sizes -------------

template <class A>
void BM_MixedSizes(benchmark::State& state) {
  constexpr std::size_t kSizes = 64, kWindow = 8;
  std::mt19937_64 rng(42);
  std::vector<std::size_t> sizes(kSizes);
  // Log-uniform from 512 B to 8 MiB: small tensors and large ones.
  std::uniform_real_distribution<double> exponent(9.0, 23.0);
  for (auto& s : sizes) s = static_cast<std::size_t>(std::exp2(exponent(rng)));
  A a;
  std::vector<void*> slot(kWindow, nullptr);
  std::vector<std::size_t> slot_size(kWindow, 0);
  std::size_t i = 0, live = 0, peak = 0;
  // One warm pass so every size has been seen once.
  for (std::size_t k = 0; k < kSizes; ++k) a.deallocate(a.allocate(sizes[k]), sizes[k]);
  a.reset_peaks();
  const double driver0 = a.driver_us();
  for (auto _ : state) {
    const std::size_t w = i % kWindow;
    if (slot[w] != nullptr) {
      a.deallocate(slot[w], slot_size[w]);
      live -= slot_size[w];
    }
    slot_size[w] = sizes[i % kSizes];
    slot[w] = a.allocate(slot_size[w]);
    live += slot_size[w];
    peak = std::max(peak, live);
    ++i;
  }
  report(state, a, peak, state.iterations(), state.iterations(), a.driver_us() - driver0);
  for (std::size_t w = 0; w < kWindow; ++w)
    if (slot[w] != nullptr) a.deallocate(slot[w], slot_size[w]);
}

/// Runs `pass` once untimed (a warm cache: the timed passes are the steady state, however few
/// fit in the time), or marks the benchmark skipped when the device runs out.
template <class F>
bool warm_up(benchmark::State& state, F&& pass) {
  try {
    pass();
    return true;
  } catch (const std::bad_alloc&) {
    state.SkipWithError("out of device memory");
    return false;
  }
}

// --- RMM-style random workload ----------------------------------------------------

// As in RMM's random_allocations benchmark: allocate with a fixed probability
// (73%) sizes uniform in [1, max], else free a random live block, until N
// allocations were made, keeping live bytes under a cap; then free the rest.
struct RandomOps {
  struct Op {
    bool alloc;
    std::uint32_t slot;
    std::size_t size;
  };
  std::vector<Op> ops;
  std::size_t slots = 0;
  std::size_t peak_requested = 0;
};

RandomOps make_random_ops(std::size_t n, std::size_t max_size, std::uint64_t seed) {
  constexpr std::size_t kCap = 16 * GiB;
  RandomOps r;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> size_dist(1, max_size);
  std::uniform_int_distribution<int> coin(0, 99);
  std::vector<std::uint32_t> free_slots, live_slots;
  std::vector<std::size_t> slot_size;
  std::size_t live = 0, made = 0;
  while (made < n) {
    const std::size_t size = size_dist(rng);
    const bool alloc = live_slots.empty() || (coin(rng) < 73 && live + size <= kCap);
    if (alloc) {
      std::uint32_t slot;
      if (free_slots.empty()) {
        slot = static_cast<std::uint32_t>(slot_size.size());
        slot_size.push_back(0);
      } else {
        slot = free_slots.back();
        free_slots.pop_back();
      }
      slot_size[slot] = size;
      live_slots.push_back(slot);
      live += size;
      r.peak_requested = std::max(r.peak_requested, live);
      r.ops.push_back({true, slot, size});
      ++made;
    } else {
      const std::size_t k = std::uniform_int_distribution<std::size_t>(0, live_slots.size() - 1)(rng);
      const std::uint32_t slot = live_slots[k];
      live_slots[k] = live_slots.back();
      live_slots.pop_back();
      live -= slot_size[slot];
      free_slots.push_back(slot);
      r.ops.push_back({false, slot, slot_size[slot]});
    }
  }
  for (std::uint32_t slot : live_slots) r.ops.push_back({false, slot, slot_size[slot]});
  r.slots = slot_size.size();
  return r;
}

template <class A>
void BM_RandomWorkload(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t max_size = static_cast<std::size_t>(state.range(1)) * MiB;
  const RandomOps w = make_random_ops(n, max_size, 1234);
  std::vector<void*> slot(w.slots, nullptr);
  A a;
  auto replay = [&] {
    for (const RandomOps::Op& op : w.ops) {
      if (op.alloc) {
        slot[op.slot] = a.allocate(op.size);
      } else {
        a.deallocate(slot[op.slot], op.size);
      }
    }
  };
  // One untimed pass fills the cache, as the fast path and mixed sizes warm up (at N = 100k
  // one or two timed passes fit, and a cold pass's cudaMallocs would set the figure).
  if (!warm_up(state, replay)) return;
  a.reset_peaks();
  const double driver0 = a.driver_us();
  std::uint64_t pairs = 0;
  for (auto _ : state) {
    try {
      replay();
    } catch (const std::bad_alloc&) {
      state.SkipWithError("out of device memory");
      break;
    }
    pairs += n;
  }
  report(state, a, w.peak_requested, pairs, pairs, a.driver_us() - driver0);
}

void random_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {1000, 10000, 100000})
    for (std::int64_t max_mib : {1, 64, 1024}) b->Args({n, max_mib});
  b->ArgNames({"N", "max_MiB"})->Unit(benchmark::kMillisecond);
}

// --- random live set: the slow path ------------------------------------------------

// A working set of `live` blocks, sizes log-uniform in [512 B, max]; each pair frees a
// random live block and allocates a new size in its place. Most requests miss the exact
// size classes the cache holds, so they exercise best fit, splits and merges rather than
// the cache-hit pair (issue 35's three workloads: 300k pairs of 512 B..64 MiB with 10000
// live, 512 B..1 MiB with 1000 live, 512 B..64 MiB with 1000 live).
struct RandomLive {
  std::vector<std::size_t> initial;                        // sizes of the first `live` blocks
  std::vector<std::pair<std::uint32_t, std::size_t>> ops;  // (slot freed, size allocated in it)
};

RandomLive make_random_live(std::size_t live, std::size_t pairs, std::size_t max_size, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> exponent(9.0, std::log2(static_cast<double>(max_size)));
  const auto size = [&] { return static_cast<std::size_t>(std::exp2(exponent(rng))); };
  std::uniform_int_distribution<std::uint32_t> slot(0, static_cast<std::uint32_t>(live - 1));
  RandomLive w;
  for (std::size_t i = 0; i < live; ++i) w.initial.push_back(size());
  for (std::size_t i = 0; i < pairs; ++i) w.ops.emplace_back(slot(rng), size());
  return w;
}

template <class A>
void BM_RandomLive(benchmark::State& state) {
  const auto live = static_cast<std::size_t>(state.range(0));
  const std::size_t max_size = static_cast<std::size_t>(state.range(1)) * KiB;
  constexpr std::size_t kPairs = 300000;
  const RandomLive w = make_random_live(live, kPairs, max_size, 35);
  A a;
  std::vector<void*> ptr(live);
  std::vector<std::size_t> size = w.initial;
  std::size_t live_bytes = 0, peak_requested = 0;
  for (std::size_t i = 0; i < live; ++i) {
    ptr[i] = a.allocate(size[i]);
    live_bytes += size[i];
  }
  const auto pass = [&] {
    for (const auto& [k, bytes] : w.ops) {
      a.deallocate(ptr[k], size[k]);
      live_bytes = live_bytes - size[k] + bytes;
      peak_requested = std::max(peak_requested, live_bytes);
      size[k] = bytes;
      ptr[k] = a.allocate(bytes);
    }
  };
  if (!warm_up(state, pass)) return;
  a.reset_peaks();
  const double driver0 = a.driver_us();
  std::uint64_t pairs = 0;
  for (auto _ : state) {
    pass();
    pairs += kPairs;
  }
  report(state, a, peak_requested, pairs, pairs, a.driver_us() - driver0);
  state.counters["ns_per_op"] = benchmark::Counter(static_cast<double>(2 * pairs),
                                                   benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  for (std::size_t i = 0; i < live; ++i) a.deallocate(ptr[i], size[i]);
}

void random_live_args(benchmark::internal::Benchmark* b) {
  b->Args({10000, 64 * 1024})->Args({1000, 1024})->Args({1000, 64 * 1024});
  b->ArgNames({"live", "max_KiB"})->Unit(benchmark::kMillisecond);
}

// --- cost against the number of cached blocks ----------------------------------

template <class A>
void BM_CachedBlocks(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::mt19937_64 rng(7);
  A a;
  // 2n blocks of distinct small sizes; freeing every other one leaves n free
  // blocks that cannot coalesce (each sits between two live blocks).
  std::vector<void*> blocks(2 * n);
  std::vector<std::size_t> sizes(2 * n);
  for (std::size_t i = 0; i < 2 * n; ++i) {
    sizes[i] = 512 * (1 + rng() % 64);
    blocks[i] = a.allocate(sizes[i]);
  }
  std::vector<std::size_t> freed;
  for (std::size_t i = 0; i < 2 * n; i += 2) {
    a.deallocate(blocks[i], sizes[i]);
    freed.push_back(sizes[i]);
  }
  std::vector<std::size_t> probes(256);  // sizes of cached blocks, in random order
  for (std::size_t& p : probes) p = freed[rng() % freed.size()];
  a.reset_peaks();
  const double driver0 = a.driver_us();
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t s = probes[i++ & 255];
    void* p = a.allocate(s);
    benchmark::DoNotOptimize(p);
    a.deallocate(p, s);
  }
  report(state, a, 0, state.iterations(), state.iterations(), a.driver_us() - driver0);
  for (std::size_t k = 1; k < 2 * n; k += 2) a.deallocate(blocks[k], sizes[k]);
}

void cached_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {100, 1000, 10000, 100000}) b->Arg(n);
  b->ArgName("cached_blocks");
}

// --- two threads on one allocator -----------------------------------------------

template <class A>
struct Shared {
  static inline std::unique_ptr<A> instance;
  static void setup(const benchmark::State&) {
    instance = std::make_unique<A>();
    instance->deallocate(instance->allocate(1 * KiB), 1 * KiB);
  }
  static void teardown(const benchmark::State&) { instance.reset(); }
};

template <class A>
void BM_Threads(benchmark::State& state) {
  constexpr std::size_t kSize = 1 * KiB;
  A& a = *Shared<A>::instance;
  for (auto _ : state) {
    void* p = a.allocate(kSize);
    benchmark::DoNotOptimize(p);
    a.deallocate(p, kSize);
  }
  state.counters["time_per_pair"] = benchmark::Counter(
      static_cast<double>(state.iterations()), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// --- registration: every workload on every allocator ------------------------------

#define VRAMSCOPE_BENCH_ALL(bm, ...)                                        \
  BENCHMARK_TEMPLATE(bm, Vramscope) __VA_ARGS__;                            \
  VRAMSCOPE_BENCH_CUB(bm, __VA_ARGS__)                                      \
  BENCHMARK_TEMPLATE(bm, Glibc) __VA_ARGS__;

#if VRAMSCOPE_HAVE_CUB_PEER
#define VRAMSCOPE_BENCH_CUB(bm, ...)       \
  BENCHMARK_TEMPLATE(bm, Cub) __VA_ARGS__; \
  BENCHMARK_TEMPLATE(bm, CubGrowth2) __VA_ARGS__;
#else
#define VRAMSCOPE_BENCH_CUB(bm, ...)
#endif

VRAMSCOPE_BENCH_ALL(BM_FastPath, )
VRAMSCOPE_BENCH_ALL(BM_MixedSizes, )
BENCHMARK_TEMPLATE(BM_FastPath, VramscopeExpandable);
BENCHMARK_TEMPLATE(BM_MixedSizes, VramscopeExpandable);
VRAMSCOPE_BENCH_ALL(BM_RandomWorkload, ->Apply(random_args))
VRAMSCOPE_BENCH_ALL(BM_CachedBlocks, ->Apply(cached_args))
VRAMSCOPE_BENCH_ALL(BM_RandomLive, ->Apply(random_live_args))
#define VRAMSCOPE_BENCH_THREADS(A)                                                    \
  BENCHMARK_TEMPLATE(BM_Threads, A)                                                   \
      ->Setup(Shared<A>::setup)                                                       \
      ->Teardown(Shared<A>::teardown)                                                 \
      ->Threads(1)                                                                    \
      ->Threads(2)                                                                    \
      ->UseRealTime();
VRAMSCOPE_BENCH_THREADS(Vramscope)
#if VRAMSCOPE_HAVE_CUB_PEER
VRAMSCOPE_BENCH_THREADS(Cub)
VRAMSCOPE_BENCH_THREADS(CubGrowth2)
#endif
VRAMSCOPE_BENCH_THREADS(Glibc)

}  // namespace
}  // namespace mem::bench

BENCHMARK_MAIN();
