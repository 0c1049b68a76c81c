// max_batch_bench.cpp — `vramscope sweep --max-batch` for resnet50 over 8
// configurations (f32 and amp x 0, 2, 4 and 6 segments) on a simulated A100 80 GB:
// every doubling and bisection probe is a fresh allocator and two dry-run steps.
// Target (issue 18): under 1 s.
#include <benchmark/benchmark.h>

#include "vramscope/planner/max_batch.hpp"
#include "vramscope/models/zoo.hpp"

namespace {

void BM_MaxBatchResnet50EightConfigs(benchmark::State& state) {
  mem::planner::SweepSpec spec;
  spec.model = mem::models::find("resnet50");
  spec.device = "sim:a100-80g";
  spec.segments = {0, 2, 4, 6};
  spec.precisions = {mem::nn::Precision::F32, mem::nn::Precision::Amp};
  spec.alloc_confs = {""};
  spec.steps = 2;
  std::size_t probes = 0;
  std::int64_t largest = 0;
  for (auto _ : state) {
    const mem::planner::MaxBatchResult result = mem::planner::find_max_batches(spec);
    probes = result.probes;
    for (const auto& row : result.rows) largest = std::max(largest, row.max_batch);
    benchmark::DoNotOptimize(largest);
  }
  state.counters["dry_runs"] = static_cast<double>(probes);
  state.counters["largest_batch"] = static_cast<double>(largest);
}
BENCHMARK(BM_MaxBatchResnet50EightConfigs)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
