// plan_report.hpp — a plan as people read it: the ranked table, what the best plan's peak
// is made of, why nothing fits and what would, and the PyTorch code that applies the best
// plan; JSON for tools.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "vramscope/planner/plan.hpp"

namespace mem::tools {

/// Title, the table (the given configuration, then up to `top` plans), the best plan's
/// anatomy and, when nothing fits, why and the nearest things that fit.
std::string plan_report(const planner::PlanResult& result, std::size_t top, bool how_to_read);

/// The PyTorch code that applies `plan` to the user's `model` (apply_activation_checkpointing
/// with a check function naming the modules, or gradient_checkpointing_enable with the
/// layers' flags, checkpoint_sequential, the allocator setting, autocast, the optimizer, the
/// accumulation loop), as a Python fragment with its imports.
std::string plan_code(const planner::PlanResult& result, const planner::Plan& plan);

/// Every plan with its figures, for tools.
nlohmann::json plan_json(const planner::PlanResult& result);

}  // namespace mem::tools
