// checkpoint.hpp — activation checkpointing with torch.utils.checkpoint's semantics.
//
//   auto y = mem::nn::checkpoint([&](const mem::nn::TensorList& in) {
//     return mem::nn::TensorList{block(in[0])};
//   }, {x})[0];
// Checkpointing modules (checkpoint_sequential, marks by path) is checkpoint_modules.hpp's.
//
// Non-reentrant (default): the segment runs with grad enabled, but every tensor
// its ops would save is replaced by a placeholder; only the segment's inputs are
// kept. The first unpack in backward reruns the segment once (Phase::Recompute,
// RNG state restored, stopping early once the last saved tensor is rebuilt) and
// each rebuilt tensor is handed to its node and freed after that node ran.
// Parameters get gradients even when no input requires grad. The inputs are
// saved before the segment runs (PyTorch's _NoopSaveInputs) and version-checked
// when the rerun unpacks them: a segment that changes its own input in place
// (one that begins with ReLU(inplace=True)) makes backward throw
// InplaceModifiedError, as PyTorch does.
//
// Reentrant: the segment runs under no_grad; one node keeps the inputs and in
// backward reruns the segment with grad and backpropagates through it (a nested
// backward). With no input requiring grad the output has no history, the
// segment's parameters get no gradient, and a warning is recorded on the
// Runtime — PyTorch's pitfall, reproduced on purpose so reports can flag it.
// The inputs' versions are recorded after the segment ran (PyTorch saves a
// custom Function's tensors when forward() returns), so an in-place op on the
// segment's input passes the version check; the rerun then applies it to a
// detached leaf that requires grad and throws AutogradError, as PyTorch does.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vramscope/runtime/autograd.hpp"

namespace mem::nn {

enum class CheckpointMode : std::uint8_t { NonReentrant, Reentrant };
/// "non-reentrant", "reentrant".
std::string_view checkpoint_mode_name(CheckpointMode mode) noexcept;
CheckpointMode parse_checkpoint_mode(std::string_view name);

struct CheckpointOptions {
  CheckpointMode mode = CheckpointMode::NonReentrant;
  bool preserve_rng_state = true;
  /// The runtime when no input names one: a non-reentrant checkpoint of a call with keyword
  /// arguments only keeps no input (its closure holds them, as PyTorch's does).
  Runtime* runtime = nullptr;
};

using SegmentFunction = std::function<TensorList(const TensorList&)>;

/// Runs `fn` on `inputs` without keeping its intermediate activations.
TensorList checkpoint(const SegmentFunction& fn, const TensorList& inputs,
                      const CheckpointOptions& options = {});

}  // namespace mem::nn
