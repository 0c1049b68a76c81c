// usage_error.hpp — bad input on the command line. main() prints the message on
// one line and exits with code 2; commands throw, they never exit(). The error is the
// planner's (the library refuses a spec with it), so both say the same.
#pragma once

#include "vramscope/planner/errors.hpp"

namespace mem::tools {

/// Exit code for bad input (unknown names, malformed sizes, impossible options).
inline constexpr int kExitUsage = 2;
/// Exit code for a run that failed (out of memory in `trace`, an unwritable file).
inline constexpr int kExitFailure = 1;

using planner::as_usage;
using planner::one_line;
using planner::UsageError;

}  // namespace mem::tools
