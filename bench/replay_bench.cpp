// replay_bench.cpp — replays recorded allocation traces through vramscope
// (PyTorch's default settings, starting state rebuilt) and through CUB's
// CachingDeviceAllocator (default bins, growth 2), timing the whole replay.
//
//   vramscope_replay_bench                       # the real traces in ../shared/real-traces
//   vramscope_replay_bench --trace=my.pickle     # any trace load_trace reads (repeatable)
//
// Counters: time_per_event, peak_reserved, peak_requested (kIs1024),
// reserved_per_requested, device_allocs (cudaMalloc calls in one replay).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "peers/peer_allocators.hpp"
#include "vramscope/instrumentation/replay.hpp"

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
