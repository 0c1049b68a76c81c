// replay_compare.cpp — what-if figures against the recorded setting (replay_compare.hpp).
#include "replay_compare.hpp"

#include <fmt/format.h>

#include "table.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::tools {

namespace {

std::string signed_bytes(std::int64_t bytes) {
  if (bytes == 0) return "0 B";
  std::string out(1, bytes > 0 ? '+' : '-');
  out += human_bytes(bytes > 0 ? bytes : -bytes);
  return out;
}

}  // namespace

ReplayChange change_against(const ReplayResult& run, const ReplayResult& baseline) {
  ReplayChange c;
  c.reserved = run.peak_reserved - baseline.peak_reserved;
  c.device_used = run.peak_device_used - baseline.peak_device_used;
  c.device_allocs = run.segment_allocs - baseline.segment_allocs;
  if (run.first_oom && !baseline.first_oom) c.oom = fmt::format("OOM at event {}", run.first_oom->event_index);
  if (!run.first_oom && baseline.first_oom) c.oom = "no OOM";
  return c;
}

std::string describe_change(const ReplayChange& c) {
  if (c.reserved == 0 && c.device_used == 0 && c.device_allocs == 0 && c.oom.empty()) return "same";
  std::string out = fmt::format("{}, {} in nvidia-smi, {:+} cudaMalloc", signed_bytes(c.reserved),
                                signed_bytes(c.device_used), c.device_allocs);
  if (!c.oom.empty()) out += ", " + c.oom;
  return out;
}

std::string replay_advice(const std::vector<std::string>& labels, const std::vector<const ReplayResult*>& runs,
                          std::size_t baseline, const std::string& baseline_name,
                          const std::vector<std::size_t>& smallest) {
  const ReplayResult& base = *runs[baseline];
  if (!smallest.empty() && smallest[baseline] != 0) {
    // The smallest GPU each setting needs: the figure the column shows, so the advice agrees.
    std::optional<std::size_t> best;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      if (i == baseline || !runs[i]->supported || smallest[i] == 0) continue;
      if (!best || smallest[i] < smallest[*best]) best = i;
    }
    if (!best || smallest[*best] >= smallest[baseline]) {
      return fmt::format("advice: no setting replayed here runs on a smaller GPU than the {} one ({})", baseline_name,
                         format_bytes(smallest[baseline]));
    }
    return fmt::format("advice: {} runs on a GPU of {}, {} less than the {} setting needs ({})", labels[*best],
                       format_bytes(smallest[*best]), format_bytes(smallest[baseline] - smallest[*best]),
                       baseline_name, format_bytes(smallest[baseline]));
  }
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ReplayResult& r = *runs[i];
    if (i == baseline || !r.supported || r.first_oom) continue;
    if (!best || r.peak_device_used < runs[*best]->peak_device_used) best = i;
  }
  const bool better = best && (runs[*best]->peak_device_used < base.peak_device_used || base.first_oom);
  if (!better) {
    return fmt::format("advice: no setting replayed here does better than the {} one ({}{})", baseline_name,
                       human_bytes(base.peak_device_used) + " in nvidia-smi's view",
                       base.first_oom ? "; every one runs out of memory too" : "");
  }
  const ReplayResult& r = *runs[*best];
  if (base.first_oom) {
    return fmt::format("advice: {} runs without the {} setting's OOM, at {} in nvidia-smi's view", labels[*best],
                       baseline_name, human_bytes(r.peak_device_used));
  }
  const std::int64_t saved = base.peak_device_used - r.peak_device_used;
  return fmt::format("advice: {} peaks at {} in nvidia-smi's view, {} ({:.0f}%) less than the {} setting", labels[*best],
                     human_bytes(r.peak_device_used), human_bytes(saved),
                     100.0 * static_cast<double>(saved) / static_cast<double>(base.peak_device_used), baseline_name);
}

}  // namespace mem::tools
