// checkpoint_modules.hpp — checkpointing modules: checkpoint_sequential as PyTorch splits
// a Sequential, and apply_activation_checkpointing by module path.
//
//   auto out = mem::nn::checkpoint_sequential(model.body().modules(), 4, x);
//   mem::nn::mark_checkpointed(model.body(), {"layer3.0", "layer4"}, mem::nn::CheckpointMode::NonReentrant);
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "vramscope/runtime/checkpoint.hpp"
#include "vramscope/runtime/modules.hpp"

namespace mem::nn {

/// PyTorch's split: segment size = modules.size() / segments; segments - 1 segments
/// of that size are checkpointed and the rest (including the remainder) runs
/// normally. One segment checkpoints nothing.
struct SegmentPlan {
  std::vector<std::pair<std::size_t, std::size_t>> checkpointed;  ///< [first, last] inclusive
  std::size_t tail_begin = 0;  ///< modules from here on run without checkpointing
};
/// Throws mem::Error unless 1 <= segments <= modules.
SegmentPlan plan_segments(std::size_t modules, std::size_t segments);

Tensor checkpoint_sequential(std::span<Module* const> modules, std::size_t segments,
                             const Tensor& input, const CheckpointOptions& options = {});

/// apply_activation_checkpointing with a check function naming modules by path: exactly the
/// modules at `paths` ("layer3.0", "model.layers.7") run checkpointed in `mode`; every other
/// module's mark under `root` (a model file's, gradient_checkpointing_enable's) is cleared, and
/// inline code's (torch.utils.checkpoint written in a forward) kept. Throws
/// mem::Error, changing nothing, for an unknown path (naming the modules at its level), the
/// root, a path given twice, or one inside another.
void mark_checkpointed(Module& root, const std::vector<std::string>& paths, CheckpointMode mode);

/// Every module under `root` that can be checkpointed by path, depth-first in registration
/// order: those with a path of their own (not the root, not inline code of a parent).
std::vector<Module*> named_modules(Module& root);

}  // namespace mem::nn
