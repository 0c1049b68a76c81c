// sweep_plot.hpp — an SVG of peak memory against checkpoint segment count: one
// colour per dtype (and allocator setting), max nvidia-smi view solid, max
// allocated dashed, the device capacity as a red line, OOM configurations as
// crosses at what they would have needed, the best configuration circled.
// (instrumentation's memory_plot_svg draws memory over time; this is across runs.)
#pragma once

#include <string>

#include "vramscope/planner/sweep.hpp"

namespace mem::tools {

std::string sweep_plot_svg(const planner::SweepResult& result, int width = 960, int height = 540);

}  // namespace mem::tools
