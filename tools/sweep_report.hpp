// sweep_report.hpp — a sweep as the aligned table users build by hand today,
// with footnotes for OOM rows, a short "how to read this", and the device's
// assumptions underneath.
#pragma once

#include <string>

#include "vramscope/planner/sweep.hpp"
#include "table.hpp"

namespace mem::tools {

struct ReportOptions {
  bool show_time = false;   ///< a time-per-step column (meaningful with --compute)
  bool how_to_read = true;  ///< the explanatory note under the table
};

/// The table alone (one row per configuration).
Table sweep_table(const planner::SweepResult& result, const ReportOptions& options);

/// Title lines, the table, OOM footnotes, the note and the assumptions line.
std::string sweep_report(const planner::SweepResult& result, const ReportOptions& options = {});

/// "mlp depth=256 width=512 batch=16384": the model and its sizes; a sweep's --batch
/// and --seq lists, when given, are written as lists ("batch=8,16,32"), and a
/// --gradient-checkpointing list as "checkpoint=none/non-reentrant".
std::string model_title(const nn::ModelInfo& info, const nn::ModelOptions& options,
                        const std::vector<std::int64_t>& batches = {}, const std::vector<std::int64_t>& seqs = {},
                        const std::vector<std::string>& checkpoints = {});

/// Word-wraps `text` to `width` characters: `first` starts the first line, `rest` the others.
std::string wrap(const std::string& text, const std::string& first, const std::string& rest,
                 std::size_t width = 100);

/// "out of memory in step 1, backward of 17 (asked 64.00 MiB): ..." for an OOM row.
std::string describe_oom(const planner::SweepRow& row);

/// "f32 seg 8: fails as on PyTorch, in step 1, backward of module maxpool: one of the
/// variables needed ..." for an error row.
std::string describe_error(const planner::SweepRow& row);

/// Where autograd refused a step: "in step 1, backward of module maxpool".
std::string describe_place(const planner::AutogradFailure& failure);

/// The footnote text of a row that does not fit (OOM or error); "" for one that fits.
std::string describe_failure(const planner::SweepRow& row);

/// "weights 2.30 GiB, optimizer state 4.60 GiB, activations 3.54 GiB, ..." (kinds that hold bytes).
std::string describe_composition(const MemoryComposition& composition);
/// " in the backward (model.layers.3.mlp)": the phase and module of the allocation that made
/// the peak; "" when unknown.
std::string describe_peak_moment(const MemoryComposition& composition);

}  // namespace mem::tools
