// c_api_bench.cpp — what the C boundary costs: an allocate + free pair of a cached 1 KiB
// block through the C++ API, through the C API (vramscope_malloc / vramscope_free, in
// libvramscope.so) and through the PyTorch plugin's entry points, on the same simulated
// device and the same workload. The target: the C pair within 5 ns of the C++ pair.
//
//   build/release/bench/vramscope_c_api_bench --benchmark_repetitions=5
//
// Counter: time_per_pair (seconds per allocate+free pair).
#include <benchmark/benchmark.h>

#include <cstddef>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/c_api.h"
#include "vramscope/instrumentation/module_scope.hpp"

namespace {

constexpr std::size_t kSize = 1024;
constexpr const char* kDevice = "sim:a100-80g";

void set_counters(benchmark::State& state) {
  state.counters["time_per_pair"] = benchmark::Counter(
      static_cast<double>(state.iterations()), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// Arg 1: the allocator stamps blocks with the module scope (mem::attach), as the C API's
// allocators do; arg 0: it does not.
void BM_CxxPair(benchmark::State& state) {
  mem::CachingAllocator a{mem::make_device(kDevice)};
  if (state.range(0) != 0) mem::attach(a);
  a.deallocate(a.allocate(kSize));  // cached from here on
  for (auto _ : state) {
    void* p = a.allocate(kSize);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
  set_counters(state);
}
BENCHMARK(BM_CxxPair)->ArgName("attached")->Arg(0)->Arg(1);

// The C API's process allocator for device 0 (created by the first call).
void BM_CApiPair(benchmark::State& state) {
  if (vramscope_init(kDevice, "") != VRAMSCOPE_OK) {
    state.SkipWithError(vramscope_last_error());
    return;
  }
  vramscope_free(vramscope_malloc(kSize, 0, 0));
  for (auto _ : state) {
    void* p = vramscope_malloc(kSize, 0, 0);
    benchmark::DoNotOptimize(p);
    vramscope_free(p);
  }
  set_counters(state);
}
BENCHMARK(BM_CApiPair);

// As PyTorch calls it: a native stream handle, mapped to a vramscope stream per call.
void BM_TorchPluginPair(benchmark::State& state) {
  if (vramscope_init(kDevice, "") != VRAMSCOPE_OK) {
    state.SkipWithError(vramscope_last_error());
    return;
  }
  void* stream = nullptr;  // PyTorch's default stream
  vramscope_torch_free(vramscope_torch_malloc(kSize, 0, stream), kSize, 0, stream);
  for (auto _ : state) {
    void* p = vramscope_torch_malloc(kSize, 0, stream);
    benchmark::DoNotOptimize(p);
    vramscope_torch_free(p, kSize, 0, stream);
  }
  set_counters(state);
}
BENCHMARK(BM_TorchPluginPair);

}  // namespace

BENCHMARK_MAIN();
