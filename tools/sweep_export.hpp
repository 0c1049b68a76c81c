// sweep_export.hpp — a sweep as CSV (one row per configuration, bytes as
// integers) or JSON (the same rows plus the model, the device and its
// assumptions). Schema version kSweepSchemaVersion; fields listed in docs/COMMAND.md.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "vramscope/planner/sweep.hpp"

namespace mem::tools {

inline constexpr int kSweepSchemaVersion = 2;  // 2: rows carry batch and seq

/// The CSV header, in column order.
std::string sweep_csv_header();
/// Header plus one line per row; fields quoted where needed (RFC 4180).
std::string sweep_csv(const planner::SweepResult& result);

nlohmann::json sweep_json(const planner::SweepResult& result);

/// The device as the JSON exports describe it: name, total and context bytes, granularity,
/// simulated, assumptions.
nlohmann::json device_json(const DeviceInfo& device);
/// One JSON value as a CSV cell: null empty, strings quoted where needed, booleans
/// true/false, floats with 6 significant digits.
std::string csv_cell(const nlohmann::json& value);
/// RFC 4180 quoting of one field.
std::string csv_field(const std::string& text);

}  // namespace mem::tools
