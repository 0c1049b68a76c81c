// layout_report.hpp — `plan --parallel auto` as people read it: the layouts of N GPUs ranked,
// the one picked and why, those that do not apply; JSON for tools.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>

#include "vramscope/planner/layout_search.hpp"

namespace mem::tools {

/// Title, the ranked table (up to `top` rows), the pick, and the layouts refused with why.
std::string layout_report(const planner::LayoutSearchResult& result, std::size_t top, bool how_to_read);

/// Every layout with its figures, ranked, for tools.
nlohmann::json layout_json(const planner::LayoutSearchResult& result);

}  // namespace mem::tools
