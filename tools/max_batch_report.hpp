// max_batch_report.hpp — `sweep --max-batch` as a table (largest batch per row, its
// peaks, where the next batch runs out), CSV and JSON.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "vramscope/planner/max_batch.hpp"
#include "sweep_report.hpp"

namespace mem::tools {

inline constexpr int kMaxBatchSchemaVersion = 1;

/// Title lines, the table, footnotes, the note and the device's assumptions.
std::string max_batch_report(const planner::MaxBatchResult& result, const ReportOptions& options = {});
/// One line per row: model, device, dtype, seq, segments, alloc_conf, max_batch, the
/// figures at it, and where max_batch + 1 ran out.
std::string max_batch_csv(const planner::MaxBatchResult& result);
nlohmann::json max_batch_json(const planner::MaxBatchResult& result);

}  // namespace mem::tools
