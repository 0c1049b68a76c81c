// fragmentation_bench.cpp — fragmentation across checkpoint segment counts and
// allocator settings on the runtime's built-in models, and the same workloads
// through CUB.
//
//   vramscope_fragmentation_bench --benchmark_min_time=0.001 --benchmark_format=json
//   vramscope_fragmentation_bench --benchmark_filter='gpt2.*(default|cub)'
//
// Each benchmark is two dry-run training steps (mem::nn::Trainer, Adam) of one
// model with checkpoint_sequential over `segments` (1 = no checkpointing), on a
// fresh CachingAllocator on the simulated a100-80g, under one allocator
// setting. An observer sees every allocator event and measures the peaks over
// the whole run (the Trainer never resets the allocator's peaks) and the state
// of the cache at the moment live tensors peaked. The CUB rows replay the
// allocation trace of the same run (recorded by the same observer, requested
// sizes) through cub::CachingDeviceAllocator.
//
// Counters (bytes with kIs1024): peak_allocated (max_memory_allocated),
// peak_requested (callers' sizes), peak_reserved (max_memory_reserved),
// peak_nvidia_smi (context + segments at driver granularity),
// reserved_unallocated_at_peak and largest_free_block (when allocated peaked),
// fragmentation (1 - largest free block / reserved-but-unallocated at that
// peak), reserved_per_requested (peak reserved / peak requested),
// device_allocs / device_frees (num_device_alloc / num_device_free: cudaMalloc
// and cudaFree calls), and for the collector's rows memory_fraction.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "peers/peer_allocators.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/peaks.hpp"
#include "vramscope/replay/replay.hpp"
#include "vramscope/runtime/training.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::bench {
namespace {

/// Two steps: the optimizer state appears in step 1, step 2 is the steady state.
constexpr std::size_t kSteps = 2;

struct Workload {
  const char* name;     ///< benchmark name part
  const char* model;    ///< built-in model
  const char* options;  ///< ModelOptions::parse text
  std::vector<std::int64_t> segments;  ///< checkpoint segment counts (1 = none), around sqrt(modules)
};

const std::vector<Workload>& workloads() {
  // Shapes where activations dominate, so checkpointing matters: mlp with 128 and
  // 400 sequential modules (16 and 32 MiB activations), resnet50 (23 modules, many
  // sizes; from 8 segments on a segment begins with an in-place ReLU on its saved
  // input, which PyTorch refuses), gpt2 small (15 modules).
  static const std::vector<Workload> all = {
      {"mlp-d64", "mlp", "depth=64,width=1024,batch=8192", {1, 2, 4, 8, 11, 16, 32, 64}},
      {"mlp-d200", "mlp", "depth=200,width=512,batch=16384", {1, 2, 4, 8, 16, 20, 32, 64, 128}},
      {"resnet50-b64", "resnet50", "batch=64", {1, 2, 4, 5, 6, 7}},
      {"gpt2-b8-s512", "gpt2", "batch=8,seq=512", {1, 2, 4, 8, 15}},
  };
  return all;
}

struct Setting {
  const char* name;
  const char* conf;
  /// Cap the allocator (set_memory_fraction) at this much over the run's peak
  /// reserved under the default setting; 0 = no cap. The garbage collector acts
  /// only with a cap; 1.25x puts its threshold (0.6 of the cap) at 0.75x that
  /// peak, so it runs, while the cap itself is never reached.
  double cap_over_default_peak;
};
constexpr Setting kSettings[] = {
    {"default", "", 0},
    {"max_split_size_mb:32", "max_split_size_mb:32", 0},
    {"max_split_size_mb:128", "max_split_size_mb:128", 0},
    {"roundup_power2_divisions:4", "roundup_power2_divisions:4", 0},
    {"roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
     "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", 0},
    {"garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6", 1.25},
};

/// What one run measured.
struct Figures {
  std::int64_t peak_allocated = 0;
  std::int64_t peak_requested = 0;
  std::int64_t peak_reserved = 0;
  std::int64_t peak_device_used = 0;
  std::int64_t reserved_unallocated_at_peak = 0;
  std::int64_t largest_free_block = 0;
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  double memory_fraction = 0;
};

/// Watches one allocator: peaks from the totals each event carries, and, when
/// allocated peaks, the largest free block. It keeps its own map of segments
/// and active blocks (an observer must not call back into the allocator):
/// free neighbours are always coalesced, so each gap between active blocks in
/// a segment is exactly one free block. Optionally records the trace.
class PeakWatcher final : public AllocatorObserver {
 public:
  explicit PeakWatcher(AllocationTrace* trace) : trace_(trace) {}

  void on_event(const TraceEvent& e) noexcept override {
    // The state at the peak is the state before this event: settle it now, so
    // the segments walk runs once per climb, not once per allocation.
    if (at_peak_) settle();
    switch (e.action) {
      case TraceAction::SegmentAlloc: segments_[e.address] = e.size; break;
      case TraceAction::SegmentFree: segments_.erase(e.address); break;
      case TraceAction::Alloc:
        active_[e.address] = e.size;
        requested_ += static_cast<std::int64_t>(e.requested_size);
        f_.peak_requested = std::max(f_.peak_requested, requested_);
        record(RecordedAction::Alloc, e);
        break;
      case TraceAction::FreeRequested:
        requested_ -= static_cast<std::int64_t>(e.requested_size);
        if (e.completed) active_.erase(e.address);
        record(RecordedAction::FreeRequested, e);
        break;
      case TraceAction::FreeCompleted: active_.erase(e.address); break;
      case TraceAction::Oom:
      case TraceAction::Relabel:
      case TraceAction::SegmentMap:  // the benchmark's allocator has no expandable segments
      case TraceAction::SegmentUnmap: break;
    }
    if (peaks_.update(e)) at_peak_ = true;
  }

  /// The figures so far (settles a peak reached by the last event).
  Figures figures() {
    if (at_peak_) settle();
    f_.peak_allocated = peaks_.allocated;
    f_.reserved_unallocated_at_peak = peaks_.unallocated_at_peak;
    f_.peak_reserved = peaks_.reserved;
    f_.peak_device_used = peaks_.device_used;
    return f_;
  }

 private:
  void settle() noexcept {
    at_peak_ = false;
    std::size_t largest = 0;
    for (const auto& [base, size] : segments_) {
      std::uintptr_t at = base;
      const std::uintptr_t end = base + size;
      for (auto it = active_.lower_bound(base); it != active_.end() && it->first < end; ++it) {
        largest = std::max(largest, static_cast<std::size_t>(it->first - at));
        at = it->first + it->second;
      }
      largest = std::max(largest, static_cast<std::size_t>(end - at));
    }
    f_.largest_free_block = static_cast<std::int64_t>(largest);
  }

  void record(RecordedAction action, const TraceEvent& e) {
    if (trace_ != nullptr)
      trace_->events.push_back(RecordedEvent{.action = action, .address = e.address, .size = e.requested_size,
                                             .stream = e.stream});
  }

  AllocationTrace* trace_;
  PeakTotals peaks_;  // from zero: the watcher sees a fresh allocator
  Figures f_;         // requested and largest-free-block figures
  std::map<std::uintptr_t, std::size_t> segments_;  ///< address -> size
  std::map<std::uintptr_t, std::size_t> active_;    ///< handed-out blocks: address -> size
  std::int64_t requested_ = 0;
  bool at_peak_ = false;
};

/// kSteps dry-run steps of `w` with `segments` under `config` on a fresh
/// allocator; records the allocation trace into `trace` when given.
Figures run_model(const Workload& w, std::int64_t segments, const AllocatorConfig& config,
                  double memory_fraction, AllocationTrace* trace) {
  nn::TrainConfig cfg;
  cfg.model = models::find(w.model);
  cfg.model_options = nn::ModelOptions::parse(w.options);
  cfg.mode = nn::ExecMode::DryRun;
  cfg.segments = static_cast<std::size_t>(segments);
  cfg.steps = kSteps;

  PeakWatcher watcher{trace};  // outlives the allocator: its destructor reports segment frees
  CachingAllocator allocator{make_bench_device(), config};
  if (memory_fraction > 0) allocator.set_memory_fraction(memory_fraction);
  allocator.add_observer(&watcher);
  nn::Trainer trainer{cfg, allocator};
  for (std::size_t i = 0; i < kSteps; ++i) trainer.step();
  allocator.remove_observer(&watcher);

  Figures f = watcher.figures();
  const DeviceStats s = allocator.stats();
  f.device_allocs = s.num_device_alloc;
  f.device_frees = s.num_device_free;
  f.memory_fraction = memory_fraction;
  return f;
}

/// Per (workload, segments): the default setting's run and its allocation
/// trace, computed once (the collector's cap and the CUB replays use them).
struct Baseline {
  Figures figures;
  AllocationTrace trace;
};
const Baseline& baseline(const Workload& w, std::int64_t segments) {
  static std::mutex mutex;
  static std::map<std::tuple<const Workload*, std::int64_t>, Baseline> cache;
  std::lock_guard guard(mutex);
  auto [it, inserted] = cache.try_emplace({&w, segments});
  if (inserted) {
    it->second.trace.source = std::string(w.name) + " segments " + std::to_string(segments);
    it->second.trace.format = TraceFormat::HistoryCsv;
    it->second.figures = run_model(w, segments, AllocatorConfig{}, 0, &it->second.trace);
  }
  return it->second;
}

benchmark::Counter bytes(std::int64_t v) {
  return benchmark::Counter(static_cast<double>(v), benchmark::Counter::kDefaults,
                            benchmark::Counter::kIs1024);
}
double ratio(std::int64_t num, std::int64_t den) {
  return den > 0 ? static_cast<double>(num) / static_cast<double>(den) : 0.0;
}

void BM_Fragmentation(benchmark::State& state, const Workload& w, const Setting& setting) {
  const std::int64_t segments = state.range(0);
  const AllocatorConfig config = AllocatorConfig::parse(setting.conf);
  double fraction = 0;
  if (setting.cap_over_default_peak > 0) {
    const double total = static_cast<double>(make_bench_device()->info().total_bytes);
    fraction = std::min(1.0, setting.cap_over_default_peak *
                                 static_cast<double>(baseline(w, segments).figures.peak_reserved) /
                                 total);
  }
  Figures f;
  try {
    for (auto _ : state) f = run_model(w, segments, config, fraction, nullptr);
  } catch (const OutOfMemoryError& e) {
    state.SkipWithError(e.what());
    return;
  } catch (const nn::AutogradError& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["peak_allocated"] = bytes(f.peak_allocated);
  state.counters["peak_requested"] = bytes(f.peak_requested);
  state.counters["peak_reserved"] = bytes(f.peak_reserved);
  state.counters["peak_nvidia_smi"] = bytes(f.peak_device_used);
  state.counters["reserved_unallocated_at_peak"] = bytes(f.reserved_unallocated_at_peak);
  state.counters["largest_free_block"] = bytes(f.largest_free_block);
  state.counters["fragmentation"] =
      f.reserved_unallocated_at_peak > 0
          ? 1.0 - ratio(f.largest_free_block, f.reserved_unallocated_at_peak)
          : 0.0;
  state.counters["reserved_per_requested"] = ratio(f.peak_reserved, f.peak_requested);
  state.counters["device_allocs"] = static_cast<double>(f.device_allocs);
  state.counters["device_frees"] = static_cast<double>(f.device_frees);
  if (fraction > 0) state.counters["memory_fraction"] = fraction;
}

#if VRAMSCOPE_HAVE_CUB_PEER
void BM_FragmentationCub(benchmark::State& state, const Workload& w, CubBins bins) {
  const AllocationTrace& trace = baseline(w, state.range(0)).trace;
  ReplayResult r;
  for (auto _ : state) {
    CubReplayTarget target{make_bench_device(), bins};
    r = replay_on(trace, target);
  }
  if (r.first_oom) {
    state.SkipWithError(r.first_oom->message.c_str());
    return;
  }
  state.counters["peak_requested"] = bytes(r.peak_requested);
  state.counters["peak_reserved"] = bytes(r.peak_reserved);
  state.counters["peak_nvidia_smi"] = bytes(r.peak_device_used);
  state.counters["reserved_per_requested"] = r.reserved_per_requested;
  state.counters["device_allocs"] = static_cast<double>(r.segment_allocs);
}
#endif

void add_segments(benchmark::internal::Benchmark* b, const Workload& w) {
  for (const std::int64_t k : w.segments) b->Arg(k);
  b->ArgName("segments")->Unit(benchmark::kMillisecond);
}

int register_all() {
  for (const Workload& w : workloads()) {
    const std::string prefix = std::string("BM_Fragmentation/") + w.name + "/";
    for (const Setting& s : kSettings)
      add_segments(benchmark::RegisterBenchmark((prefix + "vramscope/" + s.name).c_str(),
                                                BM_Fragmentation, w, s),
                   w);
#if VRAMSCOPE_HAVE_CUB_PEER
    add_segments(benchmark::RegisterBenchmark((prefix + "cub").c_str(), BM_FragmentationCub, w,
                                              CubBins::Default),
                 w);
    add_segments(benchmark::RegisterBenchmark((prefix + "cub-growth2").c_str(),
                                              BM_FragmentationCub, w, CubBins::Growth2),
                 w);
#endif
  }
  return 0;
}
const int registered = register_all();

}  // namespace
}  // namespace mem::bench

BENCHMARK_MAIN();
