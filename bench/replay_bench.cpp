// replay_bench.cpp — recorded allocation traces through vramscope and CUB's
// CachingDeviceAllocator (default bins, growth 2), two ways:
//   BM_TraceOps<A>/trace  the allocators alone: the trace flattened once
//                          (mem::plan_replay) and replayed by the same loop,
//                          from an empty allocator each iteration (starting
//                          state's live blocks first, leftovers freed last);
//   BM_Replay/who/trace   the whole tool: mem::replay for vramscope (rebuilt
//                          starting state, conformance checks, peaks per event)
//                          and mem::replay_on for CUB.
//
//   vramscope_replay_bench                       # the real traces in ../shared/real-traces
//   vramscope_replay_bench --trace=my.pickle     # any trace load_trace reads (repeatable)
//
// Counters: time_per_event or time_per_op, peak_reserved, peak_requested
// (kIs1024), reserved_per_requested, device_allocs (cudaMalloc calls in one
// replay), for BM_Replay events (trace events replayed) and for BM_TraceOps
// cache_hit_rate (allocations without cudaMalloc).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench_counters.hpp"
#include "peers/peer_allocators.hpp"
#include "vramscope/replay/replay.hpp"

namespace mem::bench {
namespace {

namespace fs = std::filesystem;

void report(benchmark::State& state, const ReplayResult& r) {
  using benchmark::Counter;
  state.counters["time_per_event"] =
      Counter(static_cast<double>(r.events), Counter::kIsIterationInvariantRate | Counter::kInvert);
  state.counters["peak_reserved"] =
      Counter(static_cast<double>(r.peak_reserved), Counter::kDefaults, Counter::kIs1024);
  state.counters["peak_requested"] =
      Counter(static_cast<double>(r.peak_requested), Counter::kDefaults, Counter::kIs1024);
  state.counters["reserved_per_requested"] = r.reserved_per_requested;
  state.counters["device_allocs"] = static_cast<double>(r.segment_allocs);
  state.counters["events"] = static_cast<double>(r.events);  // trace events replayed
}

void BM_ReplayVramscope(benchmark::State& state, std::shared_ptr<const AllocationTrace> trace) {
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  opt.track_fragmentation = false;
  ReplayResult r;
  for (auto _ : state) r = replay(*trace, opt);
  if (!r.supported) {
    state.SkipWithError(r.unsupported_reason.c_str());
    return;
  }
  report(state, r);
}

// A generated snapshot trace of `live` allocations (512 B to 1 MiB, all alive at the end)
// recorded at addresses no allocator gives (odd ones): every allocation diverges. The
// replay counts every divergence and describes the first few; its cost per event must not
// grow with the segments and blocks alive (issue 34: 5k / 10k / 20k / 40k live took 0.11 /
// 0.27 / 1.08 / 4.29 s when each divergence walked every segment).
void BM_ReplayDivergingEverywhere(benchmark::State& state) {
  const auto live = static_cast<std::size_t>(state.range(0));
  AllocationTrace trace;
  trace.source = "generated";
  trace.events.reserve(live);
  std::uint64_t x = 88172645463325252ull;  // xorshift64: the same trace every run
  for (std::size_t i = 0; i < live; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const std::size_t size = 512 * (1 + x % 2048);
    trace.events.push_back(RecordedEvent{RecordedAction::Alloc, 0, (std::uintptr_t{1} << 44) + 16 * i + 1, size,
                                         0, static_cast<double>(i)});
  }
  ReplayOptions opt;
  opt.device = "sim:a100-80g";
  opt.track_fragmentation = false;
  ReplayResult r;
  for (auto _ : state) r = replay(trace, opt);
  if (r.divergence_count < live) {
    state.SkipWithError("the generated trace did not diverge at every allocation");
    return;
  }
  report(state, r);
  state.counters["divergences"] = static_cast<double>(r.divergence_count);
}
BENCHMARK(BM_ReplayDivergingEverywhere)->Arg(5000)->Arg(20000)->Arg(40000)->Unit(benchmark::kMillisecond);

#if VRAMSCOPE_HAVE_CUB_PEER
void BM_ReplayCub(benchmark::State& state, std::shared_ptr<const AllocationTrace> trace, CubBins bins) {
  ReplayResult r;
  for (auto _ : state) {
    CubReplayTarget target{make_bench_device(), bins};
    r = replay_on(*trace, target);
  }
  if (!r.supported) {
    state.SkipWithError(r.unsupported_reason.c_str());
    return;
  }
  report(state, r);
}
#endif

// A plan with its stream handles numbered (0: the default stream), so each
// iteration maps them to streams of its own device outside the timed loop.
struct TraceOps {
  struct Op {
    bool allocate;
    std::uint32_t slot;
    std::uint32_t stream;  // index into the iteration's streams
    std::size_t size;
  };
  std::vector<Op> ops;
  std::size_t slots = 0;
  std::size_t streams = 1;
  std::size_t peak_requested = 0;
  std::size_t allocations = 0;
};

TraceOps make_trace_ops(const ReplayPlan& plan) {
  TraceOps t;
  t.slots = plan.slots;
  std::unordered_map<std::uint64_t, std::uint32_t> stream_index{{0, 0}};
  std::size_t live = 0;
  for (const ReplayOp& op : plan.ops) {
    auto [it, added] = stream_index.try_emplace(op.stream, static_cast<std::uint32_t>(t.streams));
    if (added) ++t.streams;
    t.ops.push_back({op.allocate, op.slot, it->second, op.size});
    if (op.allocate) {
      ++t.allocations;
      live += op.size;
      t.peak_requested = std::max(t.peak_requested, live);
    } else {
      live -= op.size;  // a free carries its allocation's size
    }
  }
  return t;
}

template <class A>
void BM_TraceOps(benchmark::State& state, std::shared_ptr<const TraceOps> trace) {
  std::vector<void*> slot(trace->slots, nullptr);
  PeerCounters counters;
  double seconds = 0;
  // Manual time around the ops alone: Pause/ResumeTiming read the thread's CPU
  // clock (a system call) each time, about a microsecond per iteration that
  // a short trace's replay (silmont2000: 97 events) would carry for both
  // allocators alike, compressing their ratio.
  for (auto _ : state) {
    auto a = std::make_unique<A>();
    std::vector<StreamId> streams(trace->streams, 0);
    for (std::size_t i = 1; i < streams.size(); ++i) streams[i] = a->device_->create_stream();
    const auto start = std::chrono::steady_clock::now();
    try {
      for (const TraceOps::Op& op : trace->ops) {
        if (op.allocate) {
          slot[op.slot] = op.size > 0 ? a->allocate(op.size, streams[op.stream]) : nullptr;
        } else if (slot[op.slot] != nullptr) {
          a->deallocate(slot[op.slot], op.size);
        }
      }
    } catch (const std::bad_alloc&) {
      state.SkipWithError("out of device memory");
      break;
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(elapsed);
    seconds += elapsed;
    counters = a->counters();
  }
  using benchmark::Counter;
  const double ops =
      static_cast<double>(trace->ops.size()) * static_cast<double>(state.iterations());
  state.counters["time_per_op"] = Counter(ops > 0 ? seconds / ops : 0);
  report_cache_counters(state, counters, trace->peak_requested, trace->allocations);
  state.counters["device_allocs"] = static_cast<double>(counters.device_allocs);  // per replay
}

void register_trace(const std::string& path) {
  std::shared_ptr<const AllocationTrace> trace;
  try {
    trace = std::make_shared<const AllocationTrace>(load_trace(path));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "skipping %s: %s\n", path.c_str(), e.what());
    return;
  }
  if (trace->events.empty()) return;  // nothing to replay (a segment list)
  const std::string name = fs::path(path).stem().string();
  const ReplayPlan plan = plan_replay(*trace);
  {
    auto ops = std::make_shared<const TraceOps>(make_trace_ops(plan));
    benchmark::RegisterBenchmark(("BM_TraceOps<Vramscope>/" + name).c_str(), BM_TraceOps<Vramscope>, ops)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#if VRAMSCOPE_HAVE_CUB_PEER
    benchmark::RegisterBenchmark(("BM_TraceOps<Cub>/" + name).c_str(), BM_TraceOps<Cub>, ops)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_TraceOps<CubGrowth2>/" + name).c_str(), BM_TraceOps<CubGrowth2>, ops)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#endif
  }
  benchmark::RegisterBenchmark(("BM_Replay/vramscope/" + name).c_str(), BM_ReplayVramscope, trace)
      ->Unit(benchmark::kMillisecond);
#if VRAMSCOPE_HAVE_CUB_PEER
  benchmark::RegisterBenchmark(("BM_Replay/cub/" + name).c_str(), BM_ReplayCub, trace, CubBins::Default)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark(("BM_Replay/cub-growth2/" + name).c_str(), BM_ReplayCub, trace,
                               CubBins::Growth2)
      ->Unit(benchmark::kMillisecond);
#endif
}

}  // namespace
}  // namespace mem::bench

int main(int argc, char** argv) {
  std::vector<std::string> traces;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--trace=", 8) == 0) {
      traces.emplace_back(argv[i] + 8);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (traces.empty()) {
    std::error_code ec;
    const std::filesystem::path dir{VRAMSCOPE_REAL_TRACES_DIR};
    if (std::filesystem::is_directory(dir, ec)) {
      for (const auto& e : std::filesystem::directory_iterator(dir, ec))
        if (e.path().extension() == ".pickle") traces.push_back(e.path().string());
      std::sort(traces.begin(), traces.end());
    } else {
      std::fprintf(stderr, "no traces: %s is absent and no --trace=FILE was given\n",
                   VRAMSCOPE_REAL_TRACES_DIR);
    }
  }
  for (const auto& t : traces) mem::bench::register_trace(t);
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
