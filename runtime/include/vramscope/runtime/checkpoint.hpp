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
///
/// A name may keep one call only, "aten.mm.default@2" (the third call of that overload in the
/// region's forward, counted from 0): a policy function that counts, as the per-operator plans
/// of torch.distributed._tools.sac_ilp decide. And a policy may differ per module: scopes
/// "MODULES=OPS" separated by ';', MODULES a checkpointed module's path or type name, '*'
/// matching any run of characters ("layers.*.mlp", "LlamaDecoderLayer").
struct SelectivePolicy {
  /// Operators as the recording names them: "aten.mm.default" (that overload), "aten.mm" or
  /// "mm" (every overload of aten.mm), each with an optional "@CALL". Without scopes: what
  /// every checkpointed module keeps; with them, what a module no scope names keeps.
  std::vector<std::string> save;
  struct Scope {
    std::string modules;  ///< a path or type name, '*' a wildcard
    std::vector<std::string> save;
  };
  std::vector<Scope> scopes;  ///< the first that names a module decides for it

  /// Per name given with a call index: how many calls of it the region has run so far.
  using CallCounts = std::vector<std::pair<std::string, std::size_t>>;
  /// Whether any call of `op` may be kept (ignoring call indices and scopes).
  bool saves(std::string_view op) const noexcept;
  /// Whether this call of `op` is kept, counting it in `calls` (one region's forward or rerun).
  bool keeps_call(std::string_view op, CallCounts& calls) const;
  /// The operators a module with this path and type keeps; null when it keeps none.
  const std::vector<std::string>* for_module(std::string_view path, std::string_view type) const noexcept;
  /// Whether the policy keeps anything anywhere.
  bool empty() const noexcept;
  /// The text parse() reads back: names comma-separated, scopes "MODULES=OPS" joined by ';'.
  std::string str() const;
  /// "mm,aten._scaled_dot_product_efficient_attention" or the groups "matmuls", "attention",
  /// "convolutions" (each expanded to its operators), "aten.addmm.default@1", and scopes
  /// "layers.*=matmuls;other=mm". Throws mem::Error for an empty list, an empty name or one
  /// with characters no operator has, a bad call index or an empty scope.
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
