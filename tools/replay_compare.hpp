// replay_compare.hpp — `vramscope replay`'s what-if: each setting against the one the trace
// was recorded with (all start from the recorded state, see vramscope/replay/replay.hpp),
// and one line of advice.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "vramscope/replay/replay.hpp"

namespace mem::tools {

/// A run's change against the baseline's: max reserved, nvidia-smi's view, cudaMalloc
/// calls and the first OOM.
struct ReplayChange {
  std::int64_t reserved = 0;
  std::int64_t device_used = 0;
  std::int64_t device_allocs = 0;
  /// "" when both or neither ran out of memory, else "no OOM" / "OOM at event N".
  std::string oom;
};
ReplayChange change_against(const ReplayResult& run, const ReplayResult& baseline);
/// "-1.20 GiB, -1.19 GiB in nvidia-smi, -30 cudaMalloc, no OOM"; "same" when nothing moved.
std::string describe_change(const ReplayChange& change);

/// One line: the supported run with the least max nvidia-smi and no OOM, against the
/// baseline, or that none does better. `labels` and `runs` are parallel. With `smallest`
/// (--min-capacity: each run's smallest GPU, 0 where none was found) the runs are ranked by
/// it instead, so the advice says what the smallest-GPU column shows.
std::string replay_advice(const std::vector<std::string>& labels, const std::vector<const ReplayResult*>& runs,
                          std::size_t baseline, const std::string& baseline_name,
                          const std::vector<std::size_t>& smallest = {});

}  // namespace mem::tools
