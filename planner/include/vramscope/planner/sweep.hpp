// sweep.hpp — the sweep engine: one training run per configuration (segment
// count x precision x allocator setting), each on a fresh device and allocator,
// measured by an observer on that allocator. No printing here: tools/ (sweep_report,
// sweep_export, sweep_plot) turns a SweepResult into text and files.
//
//   mem::planner::SweepSpec spec;
//   spec.model = mem::models::find("mlp");
//   spec.device = "sim:rtx2080s";
//   spec.segments = {0, 4, 16};
//   spec.precisions = {mem::nn::Precision::F32};
//   spec.alloc_confs = {""};
//   mem::planner::SweepResult r = mem::planner::run_sweep(spec);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::planner {

/// What to sweep. Every list must be non-empty (validate_sweep checks).
struct SweepSpec {
  std::shared_ptr<const nn::ModelSource> model;  ///< required (mem::models::find, ModelFile)
  nn::ModelOptions model_options;
  std::string device = "sim:rtx2080s";
  std::vector<std::size_t> segments;       ///< 0 = no checkpointing
  /// --batch / --seq lists, each value swept (empty: model_options' batch / seq). A model
  /// without a sequence length refuses a seq list as it refuses the option.
  std::vector<std::int64_t> batches;
  std::vector<std::int64_t> seqs;
  std::vector<nn::Precision> precisions;
  std::vector<std::string> alloc_confs;    ///< "" = PyTorch's defaults
  std::size_t steps = 2;
  /// --accumulation: micro-batches per optimizer step (gradient accumulation); 1: none.
  std::size_t accumulation = 1;
  nn::ExecMode mode = nn::ExecMode::DryRun;
  nn::OptimizerConfig optimizer;
  nn::CheckpointMode checkpoint_mode = nn::CheckpointMode::NonReentrant;
  bool input_requires_grad = false;  ///< the batch requires grad (reentrant checkpointing needs it)
  nn::Stack stack;                   ///< the versions modelled (--stack)
  /// --parallel: each a group of rows (one rank's step each); one GPU ({none}) by default.
  /// --max-batch takes one.
  std::vector<nn::ParallelConfig> parallels{nn::ParallelConfig{}};
  /// --gradient-checkpointing as a list (transformers models): each mode a group of rows
  /// ("none", "reentrant", "non-reentrant"); empty: the model options' one.
  std::vector<std::string> checkpoints;
  /// --segments auto: after the sampled counts, run the midpoints around each dtype's best
  /// until its neighbours are adjacent, so the star is the minimum of its bracket.
  bool refine_segments = false;
  /// Exactly these modules run checkpointed (nn::TrainConfig::checkpoint_modules); nullopt:
  /// the model's own marks. `plan` sets it for --max-batch of a plan.
  std::optional<std::vector<std::string>> checkpoint_modules;
  /// Selective checkpointing of the checkpointed modules (nn::TrainConfig::selective); the
  /// baselines without checkpointing run without it.
  std::optional<nn::SelectivePolicy> selective;
  /// Activation offloading (nn::TrainConfig::offload_activations), every row.
  bool offload_activations = false;
  /// --compile: each a group of rows, the step eager (nullopt) or torch.compile'd under this
  /// activation_memory_budget (nn::TrainConfig::compile); empty: eager only. A compiled group's
  /// saving is against the eager step.
  std::vector<std::optional<nn::CompileMode>> compiles;
  /// Pipeline parallel without a stage asked for: --max-batch's batch fits when every stage's
  /// step does (its figures are the fullest stage's).
  bool every_stage = false;
  /// A simulated device this much smaller than `device` says (plan's headroom, which the
  /// largest batch it finds must leave free); a real GPU's memory is what it is. 0: as given.
  std::size_t headroom = 0;
};

/// Figures of one run, every one read from the allocator (an observer sees the
/// totals after each allocator event; the rest comes from the runtime's StepStats).
struct RunFigures {
  std::int64_t allocated_end = 0;        ///< memory_allocated() after the last step
  std::int64_t reserved_end = 0;
  std::int64_t peak_allocated = 0;       ///< max_memory_allocated() over all steps
  std::int64_t peak_reserved = 0;        ///< max_memory_reserved()
  std::int64_t peak_device_used = 0;     ///< the most nvidia-smi would have shown
  /// Reserved but unallocated at the moment live tensors peaked (cache + fragmentation).
  std::int64_t unallocated_at_peak = 0;
  double recompute_ratio = 0;            ///< extra forward FLOPs / one forward (last step)
  /// Extra forward FLOPs over the step's own work (forward + backward + optimizer), last step:
  /// what checkpointing costs, as `sweep` and `plan` both report it.
  double recompute_share = 0;
  double step_ms = 0;                    ///< mean host time of a step
  std::size_t steps_done = 0;
  bool gradients_missing = false;        ///< reentrant pitfall: some parameter got no grad
  /// What the live bytes were at the highest step peak (weights, gradients, ...); all
  /// zero unless every step ran.
  MemoryComposition peak_composition;
  std::vector<std::string> warnings;
  /// Pinned host memory at the end (activation offloading's copies, cached): 0 without it.
  std::int64_t pinned_host_bytes = 0;
  /// Bytes this GPU sent over collectives in the last step (nn::StepStats::communication_bytes).
  double communication_bytes = 0;
  /// A torch.compile'd step: what its partitioner chose (nn::CompiledStep).
  struct Compiled {
    double memory_budget = 1;
    std::vector<std::string> saved_values;  ///< the joint graph's node names, in graph order
    std::int64_t saved_bytes = 0;           ///< of those that are no parameter or input
    std::size_t recomputed_nodes = 0;       ///< forward nodes the backward runs again
    std::size_t graph_nodes = 0;
    std::int64_t forward_buffer_peak = 0;   ///< the most its graphs' own buffers hold at once
    std::int64_t backward_buffer_peak = 0;
    /// CUDA graphs: bytes of the segments of their private pool at the end (part of reserved).
    std::int64_t graph_pool_reserved = 0;
  };
  std::optional<Compiled> compiled;
};

/// Where and how a run ran out of memory.
struct OomFailure {
  std::size_t step = 0;                  ///< 1-based; 0 = while allocating the parameters
  Phase phase = Phase::None;
  std::string module;                    ///< innermost module scope at the failure
  OutOfMemoryError::Figures figures;     ///< the allocator's state at the failure
  std::string message;
};

/// A run that autograd refused, as PyTorch refuses it (nn::AutogradError: a tensor saved
/// for backward modified in place, e.g. a checkpointed segment that begins with an
/// in-place ReLU). No capacity fixes it, so there is no 'needs' run.
struct AutogradFailure {
  std::size_t step = 0;                  ///< 1-based
  Phase phase = Phase::None;             ///< the runtime's phase at the error (backward)
  std::string module;                    ///< innermost module scope at the error
  std::string message;                   ///< PyTorch's message and our hint
  /// A saved tensor modified in place (InplaceModifiedError): the segment counts matter.
  bool inplace = false;
};
/// The failure `e` raised in 1-based step `step`: its phase, module path and message.
AutogradFailure autograd_failure(const nn::AutogradError& e, std::size_t step);

/// A configuration's label: "f32 seg 16", with its shape and allocator setting when given
/// ("f32 batch 32 seg 16 [max_split_size_mb:128]"). Sweep and --max-batch rows use it.
std::string configuration_label(nn::Precision precision, const std::string& shape, std::size_t segments,
                                const std::string& alloc_conf);

/// "eager", "compiled" (PyTorch's default partition), "compiled budget 0.5", "reduce-overhead",
/// "reduce-overhead budget 0.5" (CUDA graphs).
std::string compile_label(const std::optional<nn::CompileMode>& compile);
/// Whether any of --compile's settings runs the step as CUDA graphs (its rows take
/// nn::kCudaGraphSteps steps at least).
bool any_cudagraphs(const std::vector<std::optional<nn::CompileMode>>& compiles) noexcept;

struct SweepRow {
  std::size_t segments = 0;              ///< as asked; 0 = no checkpointing
  nn::Precision precision = nn::Precision::F32;
  std::string alloc_conf;
  std::int64_t batch = 0;                ///< the run's batch (the model's default when not given)
  std::int64_t seq = 0;                  ///< its --seq; 0 when not given
  nn::ParallelConfig parallel;           ///< one GPU, or one rank of this engine
  std::string checkpoint;                ///< its --gradient-checkpointing from a list; "" otherwise
  std::optional<nn::CompileMode> compile;  ///< torch.compile (its budget, CUDA graphs); nullopt: eager
  /// A baseline run of a model with its own checkpoint marks (a model file's "checkpoint"):
  /// the same model with none of them.
  bool unmarked = false;
  /// "batch 32 seq 512 ddp:8" when the sweep runs several batches, sequence lengths or
  /// parallel configurations, else empty.
  std::string shape;
  RunFigures figures;                    ///< for an OOM or error row: up to the failure
  std::optional<OomFailure> oom;
  std::optional<AutogradFailure> error;  ///< PyTorch would refuse it: never fits, never best
  /// For an OOM row: the same configuration on the same device model without its
  /// capacity limit (a dry run) — what it would have needed.
  std::optional<RunFigures> unlimited;
  /// Out of memory while allocating the parameters, which alone outgrow the device: their
  /// bytes (under an engine that shards them, this GPU's share at the least: the weights over
  /// its shards), and no run without the capacity limit (it would take as long as the model is large).
  std::int64_t weights_alone = 0;
  /// Max allocated saved against no checkpointing (same precision and allocator
  /// setting); unset for OOM and error rows and when the baseline could not be measured.
  std::optional<std::int64_t> saving;
  double saving_fraction = 0;
  bool best = false;                     ///< lowest nvidia-smi peak of its group that fits

  /// Ran every step within the device's memory (neither OOM nor an autograd error).
  bool fits() const noexcept { return !oom.has_value() && !error.has_value(); }
  /// The label of the row: "f32 seg 16", with the shape and allocator setting when given
  /// ("f32 batch 32 seg 16 [max_split_size_mb:128]").
  std::string label() const;
};

struct SweepResult {
  SweepSpec spec;
  nn::ModelInfo model;
  DeviceInfo device;
  std::vector<SweepRow> rows;           ///< alloc conf, precision, batch, seq, then segments
  /// Runs without checkpointing done only to measure savings (not asked for).
  std::vector<SweepRow> baselines;
  double wall_ms = 0;                    ///< the whole sweep
  /// When some row is an error row: the segment counts (1 = none) autograd accepts
  /// for this model (accepted_segment_counts), for the hint under the table.
  std::optional<std::vector<std::size_t>> accepted_segments;
};

/// Called before each run: runs finished, runs planned, the one starting.
using SweepProgress = std::function<void(std::size_t, std::size_t, const std::string&)>;

/// Checks the spec without running it: model (at every batch and seq asked), device,
/// precisions, allocator settings, segment counts within [0, sequential modules],
/// steps >= 1. Throws UsageError naming what is valid. Returns the model's description
/// at the first batch and seq.
nn::ModelInfo validate_sweep(const SweepSpec& spec);

/// The model options of one run: the spec's, with the row's batch and seq when given.
nn::ModelOptions row_options(const SweepSpec& spec, std::int64_t batch, std::int64_t seq);

/// The training configuration of one row of `spec` (its segments, precision, setting, shape).
nn::TrainConfig train_config(const SweepSpec& spec, const SweepRow& row);
/// Gradient accumulation of `micro_batches` on `cfg`: the first optimizer step makes the
/// state; `steps_after` micro-batches more run with the state and the accumulating gradients
/// live, as every later step does.
void accumulate(nn::TrainConfig& cfg, std::size_t micro_batches, std::size_t steps_after);

/// A useful range of segment counts for `modules` sequential modules:
/// 0, the powers of two up to min(modules, 8 * sqrt(modules)), and round(sqrt(modules)).
std::vector<std::size_t> auto_segments(std::size_t modules);

/// Runs every configuration (validate first). An out-of-memory configuration
/// becomes an OOM row, one that autograd refuses an error row, and the sweep goes on.
SweepResult run_sweep(const SweepSpec& spec, const SweepProgress& progress = {});

/// Runs one configuration (cfg.steps steps) on a fresh allocator of `device`. Returns
/// the figures (up to the failure, if any) and fills `oom` or `error` when it failed.
RunFigures run_config(const nn::TrainConfig& cfg, std::shared_ptr<Device> device,
                      std::optional<OomFailure>& oom, std::optional<AutogradFailure>& error);

/// The device a run of `spec` gets: a fresh one per run, so runs share no cache. UsageError when
/// its headroom leaves nothing beside the CUDA context.
std::shared_ptr<Device> make_run_device(const SweepSpec& spec);

/// A simulated device like `info` (context, granularity) without a capacity limit.
std::shared_ptr<Device> unlimited_twin(const DeviceInfo& info);

}  // namespace mem::planner
