// plan_bench.cpp — `vramscope plan`, the whole search: the profile, every family's dry runs
// and the ranking. Targets (issue 33): under 2 s for resnet152 and for llama-3.1-70b.
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "vramscope/planner/plan.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace {

void run(benchmark::State& state, mem::planner::PlanSpec spec) {
  std::size_t runs = 0;
  double recompute = 0;
  for (auto _ : state) {
    const mem::planner::PlanResult result = mem::planner::run_plan(spec);
    runs = result.dry_runs;
    recompute = result.best() != nullptr ? result.best()->recompute_share : -1;
    benchmark::DoNotOptimize(recompute);
  }
  state.counters["dry_runs"] = static_cast<double>(runs);
  state.counters["best_recompute_pct"] = 100 * recompute;
}

mem::planner::PlanSpec spec_of(const char* model, const char* options, mem::nn::Precision precision, const char* device) {
  mem::planner::PlanSpec spec;
  spec.base.model = mem::models::find(model);
  spec.base.model_options = mem::nn::ModelOptions::parse(options);
  spec.base.device = device;
  spec.base.precisions = {precision};
  spec.base.alloc_confs = {""};
  return spec;
}

/// resnet152 at batch 256 on an A100 40 GB, every family searched (52 dry runs).
void BM_PlanResnet152(benchmark::State& state) {
  run(state, spec_of("resnet152", "batch=256", mem::nn::Precision::F32, "sim:a100-40g"));
}
BENCHMARK(BM_PlanResnet152)->Unit(benchmark::kMillisecond);

/// One rank of llama-3.1-70b under FSDP2 on 64 H100s, batch 1 x 4096 in bf16: which layers
/// to checkpoint.
void BM_PlanLlama70BFsdp64(benchmark::State& state) {
  mem::planner::PlanSpec spec = spec_of("llama-3.1-70b", "batch=1,seq=4096,attn=sdpa", mem::nn::Precision::BF16,
                                      "sim:h100-80g");
  spec.base.parallels = {mem::nn::parse_parallel("fsdp:64")};
  run(state, spec);
}
BENCHMARK(BM_PlanLlama70BFsdp64)->Unit(benchmark::kMillisecond);

/// llama-3.1-70b with LoRA on one B200, batch 1 x 8192 in bf16 (51 dry runs).
void BM_PlanLlama70BLoraB200(benchmark::State& state) {
  run(state, spec_of("llama-3.1-70b", "batch=1,seq=8192,attn=sdpa,lora=16", mem::nn::Precision::BF16, "sim:b200"));
}
BENCHMARK(BM_PlanLlama70BLoraB200)->Unit(benchmark::kMillisecond);

/// An operator-level recording (issue 49: under 2 s with the operator-level families), from
/// VRAMSCOPE_BENCH_OPS_MODEL: `python3 -m vramscope.export --hf-config models/zoo/hf/llama-3.1-8b.json
/// --batch 4 --seq 4096 --lora 16 --level ops -o llama8b-lora.json` (the exporter needs PyTorch,
/// so the file is made outside the build), planned in bf16 on an H100. Skipped without it.
void BM_PlanOperatorLevelFile(benchmark::State& state) {
  const char* path = std::getenv("VRAMSCOPE_BENCH_OPS_MODEL");
  if (path == nullptr || *path == '\0') {
    state.SkipWithError("set VRAMSCOPE_BENCH_OPS_MODEL to an operator-level model file");
    return;
  }
  mem::planner::PlanSpec spec;
  spec.base.model = mem::models::ModelFile::load(path);
  spec.base.device = "sim:h100-80g";
  spec.base.precisions = {mem::nn::Precision::BF16};
  spec.base.alloc_confs = {""};
  spec.search = mem::planner::PlanSearch{false, false, false, false, false};
  run(state, spec);
}
BENCHMARK(BM_PlanOperatorLevelFile)->Unit(benchmark::kMillisecond);

/// torch.compile's partition of a recorded joint graph (issue 49), from
/// VRAMSCOPE_BENCH_COMPILED_MODEL: `python3 -m vramscope.export --hf-config
/// models/zoo/hf/llama-3.1-8b.json --batch 4 --seq 4096 --compile -o llama8b-compiled.json`, read
/// at its recorded size; the argument is the activation_memory_budget in percent (100: PyTorch's
/// default, one min cut; 50: three cuts and the knapsack). Skipped without it.
void BM_CompiledPartitionFile(benchmark::State& state) {
  const char* path = std::getenv("VRAMSCOPE_BENCH_COMPILED_MODEL");
  if (path == nullptr || *path == '\0') {
    state.SkipWithError("set VRAMSCOPE_BENCH_COMPILED_MODEL to a model file recorded with --compile");
    return;
  }
  const mem::nn::ModelInfo info = mem::models::ModelFile::load(path)->describe();
  if (!info.compiled) {
    state.SkipWithError("the file has no compiled step");
    return;
  }
  const double budget = static_cast<double>(state.range(0)) / 100.0;
  std::size_t saved = 0;
  for (auto _ : state) {
    saved = mem::nn::choose_saved_values(info.compiled->graph, budget).size();
    benchmark::DoNotOptimize(saved);
  }
  state.counters["nodes"] = static_cast<double>(info.compiled->graph.nodes.size());
  state.counters["saved"] = static_cast<double>(saved);
}
BENCHMARK(BM_CompiledPartitionFile)->Arg(100)->Arg(50)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
