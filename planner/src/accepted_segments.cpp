// accepted_segments.cpp — a dry run per segment count, on a device without a
// capacity limit, to find the counts autograd accepts.
#include "vramscope/planner/accepted_segments.hpp"

#include <fmt/format.h>

#include "vramscope/planner/sweep.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/models.hpp"

namespace mem::planner {

std::optional<std::vector<std::size_t>> accepted_segment_counts(nn::TrainConfig cfg,
                                                                const DeviceInfo& device) {
  const std::size_t modules = cfg.model->describe(cfg.model_options).sequence_length;
  if (modules > kMaxModulesForAcceptedSearch) return std::nullopt;
  cfg.mode = nn::ExecMode::DryRun;
  cfg.model_options.batch = 1;
  // What autograd accepts is the model's: nn.DataParallel's GPUs past the first would get no
  // sample of a batch of one.
  if (cfg.parallel.engine == nn::ParallelEngine::Dp) cfg.parallel = nn::ParallelConfig{};
  cfg.steps = 1;
  std::vector<std::size_t> accepted;
  for (std::size_t k = 1; k <= modules; ++k) {
    cfg.segments = k;
    CachingAllocator allocator{unlimited_twin(device), AllocatorConfig::parse(cfg.alloc_conf)};
    try {
      nn::Trainer trainer{cfg, allocator};
      (void)trainer.step();
      accepted.push_back(k);
    } catch (const nn::AutogradError&) {
      // refused at this count
    }
  }
  return accepted;
}

std::string describe_segment_counts(const std::optional<std::vector<std::size_t>>& found) {
  if (!found) {
    return fmt::format("not searched beyond {} sequential modules (a dry run per count)",
                       kMaxModulesForAcceptedSearch);
  }
  const std::vector<std::size_t>& counts = *found;
  std::string out;
  auto add = [&out](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  std::size_t i = 0;
  if (i < counts.size() && counts[i] == 1) {
    add("0 (none)");
    ++i;
  }
  while (i < counts.size()) {
    std::size_t j = i;
    while (j + 1 < counts.size() && counts[j + 1] == counts[j] + 1) ++j;
    add(j == i ? std::to_string(counts[i]) : fmt::format("{}-{}", counts[i], counts[j]));
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

}  // namespace mem::planner
