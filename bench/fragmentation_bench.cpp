// fragmentation_bench.cpp — fragmentation across checkpoint segment counts and
// allocator settings, and the same workloads through CUB.
//
// The workload is a checkpointed training step of a deep network with
// activations of varied sizes (the shape checkpoint_sequential produces: k
// segment boundaries kept, one segment recomputed at a time in backward), as
// an allocation trace replayed under each setting. Counters: peak_allocated,
// peak_reserved, peak_nvidia_smi, reserved_unallocated_at_peak,
// largest_free_block (at the allocated peak), fragmentation (1 - largest free
// block / reserved-but-unallocated at that peak), reserved_per_requested.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "peers/peer_allocators.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/replay.hpp"

namespace mem::bench {
namespace {

constexpr std::size_t kLayers = 64;

// One training step of a kLayers-deep network checkpointed into `segments`.
AllocationTrace checkpoint_step(std::size_t segments) {
  AllocationTrace t;
  t.source = "checkpoint-step";
  t.format = TraceFormat::HistoryCsv;
  std::uintptr_t next = 4096;
  auto alloc = [&](std::size_t size) {
    const std::uintptr_t a = next;
    next += 4096;
    t.events.push_back({RecordedAction::Alloc, a, size, 0, 0});
    return a;
  };
  auto free = [&](std::uintptr_t a, std::size_t size) {
    t.events.push_back({RecordedAction::FreeRequested, a, size, 0, 0});
  };
  auto act = [](std::size_t i) { return (48 * MiB) * (2 + (i * 7) % 5) / 4 + 4096 * (i % 3); };
  auto weight = [](std::size_t i) { return (6 * MiB) * (1 + i % 3) + 512 * 37; };

  std::vector<std::uintptr_t> w(kLayers), bias(kLayers), grad_w(kLayers, 0);
  for (std::size_t i = 0; i < kLayers; ++i) {
    w[i] = alloc(weight(i));
    bias[i] = alloc(4 * KiB);
  }
  const std::size_t per = (kLayers + segments - 1) / segments;
  auto last_segment_start = [&] { return (segments - 1) * per; };
  std::vector<std::uintptr_t> a(kLayers + 1, 0);
  a[0] = alloc(act(0));
  // Forward: inside a checkpointed segment each input is dropped once used;
  // segment outputs (boundaries) and the whole last segment are kept.
  for (std::size_t i = 0; i < kLayers; ++i) {
    a[i + 1] = alloc(act(i + 1));
    const bool boundary = i % per == 0;
    if (i < last_segment_start() && !boundary && segments > 1) {
      free(a[i], act(i));
      a[i] = 0;
    }
  }
  const std::uintptr_t loss = alloc(512);
  std::uintptr_t grad = alloc(act(kLayers));
  std::size_t grad_size = act(kLayers);
  // Backward, segment by segment from the last: recompute, then walk back.
  for (std::size_t seg = segments; seg-- > 0;) {
    const std::size_t lo = seg * per, hi = std::min(kLayers, lo + per);
    if (lo >= hi) continue;
    for (std::size_t i = lo + 1; i < hi; ++i)
      if (a[i] == 0) a[i] = alloc(act(i));
    for (std::size_t i = hi; i-- > lo;) {
      const std::uintptr_t g = alloc(act(i));
      grad_w[i] = alloc(weight(i));
      free(grad, grad_size);
      grad = g;
      grad_size = act(i);
      if (a[i + 1] != 0 && i + 1 != kLayers) {
        free(a[i + 1], act(i + 1));
        a[i + 1] = 0;
      }
    }
  }
  free(grad, grad_size);
  free(loss, 512);
  for (std::size_t i = 0; i <= kLayers; ++i)
    if (a[i] != 0) free(a[i], act(i));
  for (std::size_t i = 0; i < kLayers; ++i) free(grad_w[i], weight(i));  // after the optimizer step
  return t;
}

struct Setting {
  const char* name;
  const char* conf;
  double fraction;
};
constexpr Setting kSettings[] = {
    {"default", "", 0},
    {"max_split_size_mb:64", "max_split_size_mb:64", 0},
    {"roundup_power2_divisions:4", "roundup_power2_divisions:4", 0},
    {"garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6", 0.9},
};

void report(benchmark::State& state, const ReplayResult& r) {
  using benchmark::Counter;
  auto bytes = [](double v) { return Counter(v, Counter::kDefaults, Counter::kIs1024); };
  state.counters["peak_allocated"] = bytes(static_cast<double>(r.peak_allocated));
  state.counters["peak_reserved"] = bytes(static_cast<double>(r.peak_reserved));
  state.counters["peak_nvidia_smi"] = bytes(static_cast<double>(r.peak_device_used));
  state.counters["reserved_unallocated_at_peak"] = bytes(static_cast<double>(r.reserved_unallocated_at_peak));
  state.counters["largest_free_block"] = bytes(static_cast<double>(r.largest_free_block_at_peak));
  state.counters["fragmentation"] = r.fragmentation;
  state.counters["reserved_per_requested"] = r.reserved_per_requested;
  state.counters["device_allocs"] = static_cast<double>(r.segment_allocs);
}

void BM_Fragmentation(benchmark::State& state, const Setting& setting) {
  const AllocationTrace trace = checkpoint_step(static_cast<std::size_t>(state.range(0)));
  ReplayOptions opt;
  opt.config = AllocatorConfig::parse(setting.conf);
  opt.device = "sim:a100-80g";
  opt.memory_fraction = setting.fraction;
  opt.check_conformance = false;
  ReplayResult r;
  for (auto _ : state) r = replay(trace, opt);
  report(state, r);
  if (r.first_oom) state.SkipWithError("out of memory on sim:a100-80g");
}

#if VRAMSCOPE_HAVE_CUB_PEER
void BM_FragmentationCub(benchmark::State& state, CubBins bins) {
  const AllocationTrace trace = checkpoint_step(static_cast<std::size_t>(state.range(0)));
  ReplayResult r;
  for (auto _ : state) {
    CubReplayTarget target{make_bench_device(), bins};
    r = replay_on(trace, target);
  }
  report(state, r);
}
#endif

void segment_counts(benchmark::internal::Benchmark* b) {
  for (std::int64_t k : {1, 2, 4, 8, 16, 32}) b->Arg(k);
  b->ArgName("segments")->Unit(benchmark::kMillisecond);
}

int register_all() {
  for (const Setting& s : kSettings)
    benchmark::RegisterBenchmark((std::string("BM_Fragmentation/vramscope/") + s.name).c_str(),
                                 BM_Fragmentation, s)
        ->Apply(segment_counts);
#if VRAMSCOPE_HAVE_CUB_PEER
  benchmark::RegisterBenchmark("BM_Fragmentation/cub", BM_FragmentationCub, CubBins::Default)
      ->Apply(segment_counts);
  benchmark::RegisterBenchmark("BM_Fragmentation/cub-growth2", BM_FragmentationCub, CubBins::Growth2)
      ->Apply(segment_counts);
#endif
  return 0;
}
const int registered = register_all();

}  // namespace
}  // namespace mem::bench

BENCHMARK_MAIN();
