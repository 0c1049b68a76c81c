// layout_search.hpp — `plan --parallel auto --gpus N`: which way of spreading one training
// step over N GPUs fits, and what each costs. The meshes are torchtitan's combinations (data
// parallel by DDP or FSDP2, tensor + sequence parallel inside a node, pipeline stages
// outermost; for a recorded mixture of experts, expert parallel inside FSDP2); each is run as dry runs of every rank that differs (every pipeline stage) at
// the same global batch, and ranked: those that fit first, by the compute they lose (the
// recompute checkpointing needs, a pipeline's bubble), then by the bytes each GPU moves over
// collectives per step.
//
//   mem::planner::LayoutSearchSpec spec;
//   spec.base = ...;              // model, seq, one dtype, device, optimizer (a SweepSpec)
//   spec.gpus = 64;
//   spec.global_batch = 256;     // sequences per optimizer step, over all GPUs
//   auto result = mem::planner::search_layouts(spec);
//   if (const auto* best = result.best()) fmt::print("{}\n", best->label());
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/planner/sweep.hpp"

namespace mem::planner {

struct LayoutSearchSpec {
  SweepSpec base;                  ///< the model, its seq, one dtype, the device, the optimizer
  std::size_t gpus = 8;            ///< the job's GPUs
  std::int64_t global_batch = 0;   ///< sequences (samples) per optimizer step over all GPUs
  std::size_t gpus_per_node = 8;   ///< tensor parallel stays inside a node (NVLink)
  /// A mixture of experts the exporter records (an --hf-config): the model recorded as one GPU's
  /// under expert parallel over N GPUs (vramscope.export --expert-parallel N), which adds
  /// fsdp:G with ep_size=N for each N of 2, 4, ... dividing the GPUs. Returns nullptr for a
  /// model without experts (no such layouts); throws mem::Error where its experts do not split
  /// over N (that layout is listed as refused).
  std::function<std::shared_ptr<const nn::ModelSource>(std::size_t ranks)> record_expert_parallel;
};

/// One layout: a mesh, its checkpointing, and what its ranks' dry runs showed.
struct LayoutCandidate {
  nn::ParallelConfig parallel;     ///< rank 0's (stage 0's); every stage is run
  /// The model it runs when not the spec's: expert parallel's recording of one GPU.
  std::shared_ptr<const nn::ModelSource> model;
  std::string checkpoint;          ///< "none" or "non-reentrant" (every decoder layer); "" for other models
  std::int64_t batch = 0;          ///< per data-parallel replica: a GPU, a tensor-parallel group, a pipeline
  std::size_t replicas = 1;        ///< data-parallel replicas (global batch / batch)
  bool fits = false;               ///< every rank's steps ran within the device
  /// Why the layout does not apply to this model (what vramscope or PyTorch refuses).
  std::optional<std::string> refused;
  /// Not run: the same mesh fits without checkpointing, which loses less compute and moves no
  /// more (checkpointing only adds recompute, and a recomputed forward's collectives again).
  bool dominated = false;
  std::size_t fullest_stage = 0;   ///< the stage with the highest nvidia-smi peak (0 without pp)
  RunFigures fullest;              ///< that rank's figures (the failing rank's when one ran out)
  std::optional<OomFailure> oom;   ///< the first rank that ran out of memory
  /// Bytes each GPU moves over collectives per step (the most of its ranks): what it sends in
  /// ring all-gathers and reduce-scatters ((n - 1) / n of the gathered tensor), all-reduces
  /// (twice that) and point-to-point sends, as the engines issue them in the run's last step.
  double communication_bytes = 0;
  /// Checkpointing's extra forward FLOPs over the step's work, the most of its ranks (a
  /// pipeline's slowest stage sets the pace).
  double recompute_share = 0;
  /// The share of the step a pipeline's GPU idles, (P - 1) / (M + P - 1) under GPipe and 1F1B
  /// (the stages' start and drain); 0 without pipeline parallel.
  double bubble_share = 0;
  std::size_t runs = 0;            ///< dry runs it took (a stage that ran out ends them)
  /// What the layout loses against an ideal step: recompute and the pipeline's idle share.
  double lost_share() const noexcept { return recompute_share + bubble_share; }

  /// "pp:4xfsdp:2xtp:8 microbatches=80, every layer checkpointed".
  std::string label() const;
};

struct LayoutSearchResult {
  LayoutSearchSpec spec;
  nn::ModelInfo model;
  DeviceInfo device;
  /// Ranked: those that fit by lost_share(), then communication, then nvidia-smi's peak; then
  /// those that do not, the nearest first; then the refused, then the dominated (not run).
  std::vector<LayoutCandidate> layouts;
  std::size_t runs = 0;
  double wall_ms = 0;
  /// The first that fits; nullptr when none does.
  const LayoutCandidate* best() const noexcept;
};

/// The layouts of spec.gpus GPUs for this model, not run yet: the data-parallel degree must
/// divide the global batch; tensor parallel (2, 4, 8 within a node) and pipeline stages (a
/// power of two, at most the decoder's layers + 2, one sample per micro-batch as torchtitan's
/// default, at least as many micro-batches as stages; under 1F1B, and under interleaved 1F1B
/// with two stages per rank when the ranks divide the micro-batches)
/// for transformers decoders only; DDP alone, or FSDP2 under the others. Throws UsageError for a spec that does not apply.
std::vector<LayoutCandidate> layout_candidates(const LayoutSearchSpec& spec, const nn::ModelInfo& model);

/// Runs every candidate (each stage of a pipeline until one runs out) and ranks them.
LayoutSearchResult search_layouts(const LayoutSearchSpec& spec, const SweepProgress& progress = {});

}  // namespace mem::planner
