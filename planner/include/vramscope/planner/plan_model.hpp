// plan_model.hpp — `plan`'s cheap model of a training step: what each module keeps for
// backward and in which order (one instrumented dry run), and the backward pass replayed on
// those figures alone to say which modules to checkpoint, and in which order, to lower the
// peak by a given amount for the least recomputed FLOPs. Dry runs decide; this only orders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vramscope/runtime/training.hpp"

namespace mem::planner {

/// One module with a path, its subtree's figures from the profile's first forward.
struct ModuleCost {
  std::string path;
  std::size_t saved_bytes = 0;  ///< kept for backward inside it (each storage once)
  std::size_t input_bytes = 0;  ///< its inputs over its calls: what a checkpoint of it keeps
  double forward_flops = 0;     ///< what rerunning it costs
  std::size_t first_save = 0;   ///< its saves: [first_save, end_save) of StepProfile::saves
  std::size_t end_save = 0;
};

/// What one module saved, in the order of the forward (each storage under the module that
/// saved it first, SavedTensorLog's rows).
struct SavedRun {
  std::string module;
  std::size_t bytes = 0;
};

/// One operator call of an operator-level model's forward: what a selective checkpoint that
/// keeps it holds, and what it then need not recompute.
struct OpCallCost {
  std::string module;     ///< the module whose own forward ran it
  std::string op;         ///< as recorded: "aten.mm.default"
  std::size_t bytes = 0;  ///< the storages its outputs made
  double flops = 0;
  /// An in-place operator later writes into its output: keeping it fails the recompute
  /// ("Tensor cached during selective activation checkpoint has been mutated").
  bool mutated_later = false;
};

/// The cheap model of one step, from one dry run without checkpointing on an unlimited twin.
struct StepProfile {
  std::vector<ModuleCost> modules;  ///< every module with a path, depth-first
  std::vector<SavedRun> saves;      ///< forward order
  std::vector<OpCallCost> op_calls; ///< forward order; empty for a model of modules
  std::vector<std::string> blocks;  ///< the repeated blocks (decoder layers, Bottlenecks)
  nn::FlopCounts flops;             ///< of the profiled step
};

/// Whether module `path` is inside module `outer` ("a.b.c" in "a.b", not "a.bc" nor "a.b").
bool inside(const std::string& path, const std::string& outer);

/// The cheap model: one step of `cfg` (checkpointing cleared, one GPU) on an unlimited twin.
StepProfile profile_step(nn::TrainConfig cfg);

/// The backward pass on the profile's figures: the activation bytes live at its worst moment
/// when the modules `checkpointed` (disjoint, by index into profile.modules) run under
/// checkpoint(). It starts with everything saved outside them plus their inputs; a
/// checkpointed module's saves come back when its backward begins (its recompute), and each
/// save goes when its module's backward is done.
std::int64_t estimated_peak(const StepProfile& profile, const std::vector<std::size_t>& checkpointed);

struct CheckpointSequence {
  std::vector<std::string> modules;  ///< in the order the greedy took them
  /// How many of them the model says lower the peak by the deficit (modules.size() when
  /// all of them do not).
  std::size_t enough = 0;
};

/// Greedy on estimated_peak: each time the module that lowers the estimated peak the most per
/// recomputed FLOP, none inside or around one already taken, until the peak is `deficit`
/// lower, then a few more (every one that still lowers it when `exhaustive`: the dry runs may
/// need more than the model says). The modules with the most saved bytes per FLOP beyond their
/// inputs are the candidates, at most `candidates`, fewer for a long profile (the work stays
/// near 2e8 steps); a module whose saves are not one run of the forward is left out.
CheckpointSequence checkpoint_sequence(const StepProfile& profile, std::int64_t deficit, bool exhaustive = false,
                                       std::size_t candidates = 256);

/// One step of the call-by-call plan's greedy: a checkpointed region (a block, or a module
/// holding them all) keeps one more operator call's outputs, or stops being checkpointed (it
/// then keeps what autograd saves and recomputes nothing).
struct KeepStep {
  std::size_t block = 0;  ///< index into the regions
  std::string call;       ///< "aten.mm.default@2" (the third call in the region's forward); empty: the whole region
  std::int64_t bytes = 0; ///< what it adds to the peak, by the profile
  double flops = 0;       ///< the recompute it spares
};

/// From every region checkpointed keeping nothing: each time the step sparing the most
/// recomputed FLOPs per added byte (a knapsack's greedy order). A call's figures are its own
/// (keeping it spares its recompute alone: its producers still rerun); a whole region's are
/// what it saves beyond its input and the calls it keeps already, and the recompute it still
/// has. A call whose output an in-place operator later changes is never kept (PyTorch's
/// selective checkpoint refuses it). Empty for a model without operators or regions.
std::vector<KeepStep> keep_sequence(const StepProfile& profile, const std::vector<std::string>& regions);

/// How many operator calls of the regions keep_sequence may keep.
std::size_t keepable_calls(const StepProfile& profile, const std::vector<std::string>& regions);

}  // namespace mem::planner
