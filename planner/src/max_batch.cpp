// max_batch.cpp — the largest batch that fits, by doubling and bisection over dry runs.
// Memory grows with the batch, but not strictly (block rounding, the cache's reuse):
// the answer is a batch that fits whose successor does not, which is what a user
// trying batches by hand on the GPU would find.
#include "vramscope/planner/max_batch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "vramscope/planner/checks.hpp"
#include "vramscope/planner/errors.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::planner {

namespace {

struct Probe {
  RunFigures figures;
  std::optional<OomFailure> oom;
  std::optional<AutogradFailure> error;
  bool too_big = false;  ///< the model's sizes overflow at this batch
  bool fits() const noexcept { return !oom && !error && !too_big; }
};

Probe probe(const SweepSpec& spec, SweepRow row, std::int64_t batch, std::int64_t lowest) {
  row.batch = batch;
  Probe p;
  try {
    // A pipeline's batch fits when every stage's does: the figures of the fullest stage, or
    // where the first that does not fit ran out.
    const std::size_t stages = spec.every_stage ? row.parallel.pipeline_parallel : 1;
    for (std::size_t stage = 0; stage < stages && p.fits(); ++stage) {
      if (spec.every_stage) row.parallel.stage = stage;
      RunFigures figures = run_config(train_config(spec, row), make_run_device(spec), p.oom, p.error);
      if (stage == 0 || figures.peak_device_used > p.figures.peak_device_used) p.figures = std::move(figures);
    }
  } catch (const mem::Error&) {
    // The lowest batch was validated; past it, the only thing the batch can break is a size
    // that overflows, and a tensor larger than any device does not fit.
    if (batch == lowest) throw;
    p.too_big = true;
  }
  return p;
}

}  // namespace

BatchGrid batch_grid(const nn::ParallelConfig& parallel) noexcept {
  BatchGrid grid;
  if (parallel.pipeline_parallel > 1 && parallel.microbatches != 0) {
    grid.lowest = grid.step = static_cast<std::int64_t>(parallel.microbatches);
  } else if (parallel.pipeline_parallel > 1 && parallel.schedule == nn::PipelineSchedule::OneF1B) {
    grid.lowest = static_cast<std::int64_t>(parallel.pipeline_parallel);
  } else if (parallel.pipeline_parallel > 1 && parallel.schedule == nn::PipelineSchedule::DualPipeV) {
    // ScheduleDualPipeV runs at least as many micro-batches as stages, two per rank.
    grid.lowest = 2 * static_cast<std::int64_t>(parallel.pipeline_parallel);
  } else if (parallel.engine == nn::ParallelEngine::Dp) {
    // nn.DataParallel: a multiple of N gives every GPU torch.chunk's piece (5 samples over 4
    // GPUs would be pieces of 2, 2 and 1, the fourth GPU idle).
    grid.lowest = grid.step = static_cast<std::int64_t>(parallel.world_size);
  } else if (parallel.pipeline_parallel > 1 && (parallel.schedule == nn::PipelineSchedule::Interleaved1F1B ||
                                                 parallel.schedule == nn::PipelineSchedule::InterleavedZeroBubble)) {
    // One sample per micro-batch: M must be a multiple of the rounds max(1, M / P) (ZB1P's too).
    // Multiples of P always are; the search keeps to them (some others are valid too: P + 1 to
    // 2P - 1). ZBV takes any M; DualPipeV at least 2P (above).
    grid.lowest = grid.step = static_cast<std::int64_t>(parallel.pipeline_parallel);
  }
  return grid;
}

std::string MaxBatchRow::label() const { return configuration_label(precision, shape, segments, alloc_conf); }

MaxBatchRow find_max_batch(const SweepSpec& spec, const SweepRow& row) {
  MaxBatchRow out;
  out.segments = row.segments;
  out.precision = row.precision;
  out.alloc_conf = row.alloc_conf;
  out.seq = row.seq;
  out.shape = row.shape;
  out.compile = row.compile;

  // Records a failed probe at `batch`: the first batch known not to fit.
  const auto failed = [&](Probe& p) {
    out.over = std::move(p.oom);
    out.size_limited = p.too_big;
    if (p.error) out.error = std::move(p.error);
  };
  std::int64_t lo = 0;  // fits (0: nothing known to fit)
  std::int64_t hi = 0;  // does not fit (0: not found yet)
  const BatchGrid grid = batch_grid(row.parallel);
  const std::int64_t lowest = grid.lowest, quantum = grid.step;
  const auto try_batch = [&](std::int64_t batch) {
    ++out.probes;
    Probe p = probe(spec, row, batch, lowest);
    if (p.fits()) {
      lo = batch;
      out.at_max = std::move(p.figures);
    } else {
      hi = batch;
      failed(p);
    }
  };

  try_batch(lowest);
  const std::int64_t cap = nn::kMaxBatch / quantum * quantum;
  while (hi == 0 && lo > 0 && !out.error && lo < cap) try_batch(std::min(lo * 2, cap));
  while (hi - lo > quantum && lo > 0 && !out.error) try_batch(lo + (hi - lo) / 2 / quantum * quantum);
  // An autograd refusal does not depend on the batch: no batch runs.
  out.max_batch = out.error ? 0 : lo;
  if (out.max_batch == 0) out.at_max = {};
  return out;
}

MaxBatchResult find_max_batches(const SweepSpec& spec_in, const SweepProgress& progress) {
  const auto start = std::chrono::steady_clock::now();
  MaxBatchResult result;
  result.spec = spec_in;
  SweepSpec& spec = result.spec;
  if (!spec.batches.empty() || spec.model_options.batch != 0) {
    throw UsageError("--max-batch: searches the batch size; leave out --batch");
  }
  if (spec.mode != nn::ExecMode::DryRun) {
    throw UsageError("--max-batch: --compute does not apply; the search runs dry runs, whose "
                     "figures equal compute mode's");
  }
  result.model = validate_sweep(spec);
  result.device = make_run_device(spec)->info();
  const std::vector<std::int64_t> seqs = spec.seqs.empty() ? std::vector<std::int64_t>{0} : spec.seqs;
  // FSDP2's and ZeRO-3's hooks wrap the modules: their rows run without segments, as sweep's.
  const std::vector<std::size_t> segment_counts =
      spec.parallels.front().hooks_modules() ? std::vector<std::size_t>{0} : spec.segments;
  // The search starts at batch 1. A model whose structure follows the batch (a file's repeat
  // count "batch") may have fewer sequential modules there than the segments asked for.
  for (const std::int64_t seq : seqs) {
    const nn::ModelInfo at_one = describe(*spec.model, row_options(spec, 1, seq));
    for (const std::size_t k : segment_counts) {
      if (k > at_one.sequence_length) {
        throw UsageError(fmt::format(
            "--max-batch: the search starts at batch 1, where {} has {} sequential module{} (its "
            "structure follows the batch), too few for --segments {}; give at most {}",
            at_one.name, at_one.sequence_length, at_one.sequence_length == 1 ? "" : "s", k,
            at_one.sequence_length));
      }
    }
  }

  // --compile: the eager step and each compiled setting, a row each (without segments).
  const std::vector<std::optional<nn::CompileMode>> compiles =
      spec.compiles.empty() ? std::vector<std::optional<nn::CompileMode>>{std::nullopt} : spec.compiles;
  const std::size_t planned = spec.alloc_confs.size() * spec.precisions.size() * seqs.size() *
                              segment_counts.size() * compiles.size();
  for (const std::string& conf : spec.alloc_confs) {
    for (const nn::Precision precision : spec.precisions) {
      for (const std::int64_t seq : seqs) {
        const std::size_t first = result.rows.size();
        for (const std::optional<nn::CompileMode>& compile : compiles) {
          for (const std::size_t k : segment_counts) {
            SweepRow row;
            row.segments = k;
            row.precision = precision;
            row.alloc_conf = conf;
            row.seq = seq;
            row.parallel = spec.parallels.front();
            row.compile = compile;
            if (seqs.size() > 1) row.shape = fmt::format("seq {}", seq);
            if (!spec.compiles.empty()) {
              if (!row.shape.empty()) row.shape += ' ';
              row.shape += compile_label(compile);
            }
            if (progress) progress(result.rows.size(), planned, row.label());
            result.rows.push_back(find_max_batch(spec, row));
            result.probes += result.rows.back().probes;
          }
        }
        // The star: the largest batch of the group; among equals, the least recomputation.
        MaxBatchRow* best = nullptr;
        const auto key = [](const MaxBatchRow& r) {
          return std::tuple(-r.max_batch, r.at_max.recompute_ratio, r.at_max.peak_device_used);
        };
        for (std::size_t i = first; i < result.rows.size(); ++i) {
          MaxBatchRow& r = result.rows[i];
          if (r.max_batch > 0 && !r.at_max.gradients_missing && (best == nullptr || key(r) < key(*best))) {
            best = &r;
          }
        }
        if (best != nullptr) best->best = true;
      }
    }
  }
  if (progress) progress(planned, planned, "done");
  result.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mem::planner
