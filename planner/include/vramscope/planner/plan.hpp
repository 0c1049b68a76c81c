// plan.hpp — `vramscope plan`: what makes a training step fit on a device, with the least
// recompute. One instrumented dry run gives a cheap model of the step (what each module
// keeps for backward, its input, its forward FLOPs); the model orders the candidates, and
// every plan kept is decided and measured by full dry runs through the allocator.
//
//   mem::planner::PlanSpec spec;
//   spec.base.model = mem::models::find("resnet152");
//   spec.base.model_options.batch = 256;
//   spec.base.device = "sim:a100-40g";
//   mem::planner::PlanResult r = mem::planner::run_plan(spec);
//   r.best();   // the first plan that fits: least change, least recompute, least memory
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/planner/plan_model.hpp"
#include "vramscope/planner/sweep.hpp"

namespace mem::planner {

/// What a plan changes, in the order plans are preferred: the step's arithmetic untouched
/// (checkpointing reruns the same forward; the allocator setting moves no number), then
/// the same effective batch in micro-batches (batch norms see smaller batches), then the
/// numbers' precision, then the optimizer.
enum class PlanChange : std::uint8_t { None, Checkpointing, Allocator, Loss, Compile, Accumulation, Precision, Optimizer };
/// "as given", "checkpointing", "allocator", "loss", "compile", "accumulation", "precision", "optimizer".
std::string_view plan_change_name(PlanChange change) noexcept;

/// What the search may change beyond checkpointing (the user's flags).
struct PlanSearch {
  bool allocator = true;     ///< expandable_segments:True, max_split_size_mb:128
  bool accumulation = true;  ///< micro-batches of batch / k, k accumulation steps
  bool precision = true;     ///< amp-bf16 and bf16 from f32; bf16 from amp
  bool optimizer = true;     ///< adam8bit, sgd-momentum, sgd from adam
  /// Liger's fused linear cross entropy for a decoder's causal LM loss (the logits never whole)
  bool loss = true;
  /// Selective checkpointing of an operator-level model: the checkpointed modules keep their
  /// costly operators' outputs (the same arithmetic: ranked with checkpointing)
  bool selective = true;
  /// torch.compile's step, when the file recorded it: the default partition, else the
  /// activation_memory_budget with the least recompute that fits (the same arithmetic, fused)
  bool compile = true;
};

struct PlanSpec {
  /// The configuration as given: one precision, one allocator setting, one --parallel, one
  /// batch; segments and checkpoint lists are not read (the plan chooses them).
  SweepSpec base;
  PlanSearch search;
  /// What a plan must leave free in nvidia-smi's view (a data loader's pinned buffers, a
  /// second process, metrics): a plan fits when its peak is at most the device less this.
  std::size_t headroom = 0;
};

struct Plan {
  PlanChange change = PlanChange::None;
  /// What the checkpointing part is: "" (none), "modules", "blocks", "segments".
  std::string checkpointing;
  std::optional<std::vector<std::string>> checkpoint_modules;  ///< exactly these, when set
  std::size_t blocks_of = 0;              ///< "blocks": how many repeated blocks the model has
  std::size_t segments = 0;               ///< checkpoint_sequential; 0: none
  /// Selective checkpointing: the operators (overloads, "aten.mm.default") whose outputs the
  /// checkpointed modules keep; empty: they keep nothing but their inputs.
  std::vector<std::string> selective;
  std::vector<std::string> selective_groups;  ///< what those are: the groups ("matmuls", "attention")
  /// Selective checkpointing call by call (`selective` then empty): each checkpointed module's
  /// kept operator calls ("aten.mm.default@2"), `kept_calls` of the `calls_of` worth keeping.
  std::vector<nn::SelectivePolicy::Scope> selective_scopes;
  std::size_t kept_calls = 0;
  std::size_t calls_of = 0;
  nn::Precision precision = nn::Precision::F32;
  bool precision_changed = false;         ///< precision differs from the given one
  nn::OptimizerConfig optimizer;
  std::string alloc_conf;
  bool fused_loss = false;                ///< Liger's fused linear cross entropy (model option loss=liger-flce)
  std::optional<double> compile;          ///< torch.compile'd under this activation_memory_budget
  std::int64_t batch = 0;                 ///< the micro-batch each step runs
  std::int64_t accumulation = 1;          ///< steps per optimizer step (batch x accumulation: the effective batch)
  RunFigures figures;
  std::optional<OomFailure> oom;
  std::optional<AutogradFailure> error;
  std::string refused;                    ///< the runtime refused the configuration (mem::Error)
  bool over_headroom = false;             ///< ran, but its peak leaves less than PlanSpec::headroom
  /// Recomputed forward FLOPs over its step's own work (forward + backward + optimizer), as
  /// sweep's RunFigures::recompute_share.
  double recompute_share = 0;

  bool fits() const noexcept { return !oom && !error && refused.empty() && !over_headroom && !figures.gradients_missing; }
  /// "checkpoint 5 modules", "checkpoint 8 of 50 blocks" (", keeping matmuls, attention" when
  /// selective, " keeping 40 of 96 operator calls" call by call), "checkpoint_sequential 4 segments",
  /// "torch.compile" (", activation_memory_budget 0.5"),
  /// "expandable_segments:True", "liger-flce loss", "batch 64 x 4 accumulation steps", "amp-bf16",
  /// "adam8bit", joined by " + ".
  std::string label() const;
  /// The order of preference of its change: 0 for as given, checkpointing, the allocator and the
  /// fused loss (the same arithmetic), 1 accumulation, 2 mixed precision, 3 half weights, 4 the
  /// optimizer.
  int rank_tier() const noexcept;
};

struct PlanResult {
  PlanSpec spec;
  nn::ModelInfo model;
  DeviceInfo device;
  StepProfile profile;
  Plan given;                   ///< the configuration as given, on the device
  /// When it does not fit: the given configuration without the device's limit (what it needs).
  std::optional<RunFigures> given_needs;
  /// The plans worth choosing, ranked by change (rank_tier), recompute and nvidia-smi's peak:
  /// once any fits, those that fit and that no other beats on all three at once; while none
  /// fits, each family's attempt (each family's search leaves its best plan here).
  std::vector<Plan> plans;
  /// When nothing fits: the least hungry plan tried, run without the device's limit (what
  /// it needs), the smallest preset that holds that, and the largest batch of that plan.
  std::optional<Plan> least_hungry;
  std::optional<RunFigures> least_hungry_needs;
  std::string smallest_device;  ///< "" when no preset holds it
  std::optional<std::int64_t> max_batch;
  /// checkpoint_sequential's counts tried (auto_segments; empty where they do not apply).
  std::vector<std::size_t> segments_tried;
  std::size_t dry_runs = 0;
  double wall_ms = 0;

  /// The first plan that fits (the given one when it fits), or null.
  const Plan* best() const noexcept;
};

/// Called before each dry run: runs so far, and what runs.
using PlanProgress = std::function<void(std::size_t, const std::string&)>;

/// Validates the spec (UsageError), then searches. Every plan in the result was run.
PlanResult run_plan(const PlanSpec& spec, const PlanProgress& progress = {});

}  // namespace mem::planner
