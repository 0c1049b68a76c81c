// accepted_segments.hpp — which checkpoint segment counts autograd accepts for a
// model, for the hint after a refused one (an in-place op at a segment's start).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/allocator/device.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::planner {

/// The segment counts k in 1..n (n = the model's sequential modules; 1 = no
/// checkpointing) at which one training step of `cfg`'s model runs without an
/// nn::AutogradError. Found by a dry run of each with batch 1 on a simulated twin of
/// `device` without a capacity limit: whether a segment begins with an in-place op
/// depends on the modules, not on the shapes or the memory.
/// The search costs one dry step per count, n of them, each O(n): it is made only up to
/// this many modules (the work stays bounded by what was typed); beyond, nullopt.
inline constexpr std::size_t kMaxModulesForAcceptedSearch = 512;
std::optional<std::vector<std::size_t>> accepted_segment_counts(nn::TrainConfig cfg,
                                                                const DeviceInfo& device);

/// The counts as the sweep's --segments reads them: "0 (none), 2-7" (1 and 0 are both
/// no checkpointing), runs of consecutive counts joined with a dash; for a search not made,
/// why.
std::string describe_segment_counts(const std::optional<std::vector<std::size_t>>& counts);

}  // namespace mem::planner
