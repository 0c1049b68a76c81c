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
//
// Selective (a SelectivePolicy, non-reentrant only): the operators the policy names keep
// their outputs from the forward to the rerun, which takes them instead of running those
// operators again (torch.utils.checkpoint.create_selective_checkpoint_contexts with a list
// of ops). Only an operator-level model's operators (op_graph.hpp) are named by PyTorch's
// names; a model of modules has no such operators and is refused by the Trainer.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
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

struct SelectivePolicy;

struct CheckpointOptions {
  CheckpointMode mode = CheckpointMode::NonReentrant;
  bool preserve_rng_state = true;
  /// The runtime when no input names one: a non-reentrant checkpoint of a call with keyword
  /// arguments only keeps no input (its closure holds them, as PyTorch's does).
  Runtime* runtime = nullptr;
  /// Selective checkpointing (non-reentrant only); null: plain.
  std::shared_ptr<const SelectivePolicy> policy;
};

/// Which operators' outputs a checkpointed region keeps: create_selective_checkpoint_contexts
/// given a list of operators (MUST_SAVE for them, PREFER_RECOMPUTE for the rest). PyTorch's
/// _CachingTorchDispatchMode keeps every output of each call of those operators (a detached
/// alias: the storage stays) from the forward until the recompute takes it, whether or not
/// backward needs it; a rerun that stops early leaves the later ones until the region's
/// graph is freed (torch/utils/checkpoint.py, PyTorch 2.4 to 2.15).
struct SelectivePolicy {
  /// Operators as the recording names them: "aten.mm.default" (that overload), "aten.mm" or
  /// "mm" (every overload of aten.mm).
  std::vector<std::string> save;
  bool saves(std::string_view op) const noexcept;
  /// The names given, comma-separated.
  std::string str() const;
  /// "mm,aten._scaled_dot_product_efficient_attention" or the groups "matmuls", "attention",
  /// "convolutions", "norms" (each expanded to its operators). Throws mem::Error for an empty
  /// list, an empty name or one with characters no operator has.
  static SelectivePolicy parse(std::string_view text);
  /// The operators a group stands for ("matmuls": aten.mm, aten.addmm, ...); empty when `name`
  /// is no group.
  static std::vector<std::string> group(std::string_view name);
};

using SegmentFunction = std::function<TensorList(const TensorList&)>;

/// Runs `fn` on `inputs` without keeping its intermediate activations.
TensorList checkpoint(const SegmentFunction& fn, const TensorList& inputs,
                      const CheckpointOptions& options = {});

}  // namespace mem::nn
