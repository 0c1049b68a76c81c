// max_batch.hpp — `sweep --max-batch`: for each dtype x segments x setting (x seq),
// the largest batch whose training steps fit on the device, found with dry runs:
// doubling from batch 1 until a run fails, then bisection between the last batch
// that fitted and the first that did not.
//
//   mem::planner::SweepSpec spec = ...;          // batches must be empty
//   mem::planner::MaxBatchResult r = mem::planner::find_max_batches(spec);
//   for (const auto& row : r.rows) fmt::print("{}: {}\n", row.label(), row.max_batch);
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/planner/sweep.hpp"

namespace mem::planner {

/// The batches --max-batch tries under `parallel`: `lowest`, then multiples of `step`. A
/// pipeline runs whole micro-batches: multiples of the micro-batches given, or (one sample
/// each, torchtitan's default) at least its stages under 1F1B; otherwise 1 and every batch.
struct BatchGrid {
  std::int64_t lowest = 1;
  std::int64_t step = 1;
};
BatchGrid batch_grid(const nn::ParallelConfig& parallel) noexcept;

struct MaxBatchRow {
  std::size_t segments = 0;               ///< as asked; 0 = no checkpointing
  nn::Precision precision = nn::Precision::F32;
  std::string alloc_conf;
  std::int64_t seq = 0;                   ///< the row's --seq; 0 when not given
  std::string shape;                      ///< "seq 512" when several were asked, else empty
  std::optional<nn::CompileMode> compile;  ///< torch.compile (--compile); nullopt: eager
  /// The largest batch found: it fits and max_batch + 1 does not (under pipeline parallel the
  /// next batch the micro-batches divide). 0 when the smallest batch (1; a pipeline's
  /// micro-batches) does not fit or autograd refuses the configuration at any batch.
  std::int64_t max_batch = 0;
  RunFigures at_max;                      ///< the run at max_batch (when max_batch > 0)
  /// The run at max_batch + 1 (at 1 when nothing fits): where it ran out of memory.
  std::optional<OomFailure> over;
  std::optional<AutogradFailure> error;   ///< refused as PyTorch refuses it: no batch fits
  /// Sizes overflow past this batch (no device holds it): the search stopped there.
  bool size_limited = false;
  std::size_t probes = 0;                 ///< dry runs it took
  bool best = false;                      ///< largest max batch of its dtype (and shape)

  /// "f32 seg 4", with the shape and allocator setting when given.
  std::string label() const;
};

struct MaxBatchResult {
  SweepSpec spec;
  nn::ModelInfo model;                    ///< at the model's default batch
  DeviceInfo device;
  std::vector<MaxBatchRow> rows;          ///< alloc conf, precision, seq, then segments
  std::size_t probes = 0;
  double wall_ms = 0;
};

/// The largest batch of one configuration: `row` gives segments, precision, setting
/// and seq; its batch is ignored. At most about 2 log2(kMaxBatch) dry runs.
MaxBatchRow find_max_batch(const SweepSpec& spec, const SweepRow& row);

/// Every row of the spec (its batches must be empty: the batch is what is searched;
/// the mode must be the dry run). Throws UsageError for a spec that does not apply.
MaxBatchResult find_max_batches(const SweepSpec& spec, const SweepProgress& progress = {});

}  // namespace mem::planner
