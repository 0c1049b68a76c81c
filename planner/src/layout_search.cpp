// layout_search.cpp — the meshes of N GPUs, each rank run as a dry run, ranked (see
// layout_search.hpp).
#include "vramscope/planner/layout_search.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <fmt/format.h>

#include "vramscope/planner/errors.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace mem::planner {
namespace {

/// Pipeline stages tried: powers of two up to this (Megatron's and torchtitan's recipes for
/// 405B use 8 to 16); each stage is a dry run of its own.
constexpr std::size_t kMaxStages = 16;

bool is_decoder(const nn::ModelInfo& model) { return model.checkpoints_by_layer && !model.model_type.empty(); }

/// The mesh outer to inner, as --parallel reads it: "pp:4xfsdp:2xtp:8".
std::string mesh_text(std::size_t pp, const char* engine, std::size_t dp, std::size_t tp) {
  std::string out;
  const auto add = [&](const std::string& dim) { out += (out.empty() ? "" : "x") + dim; };
  if (pp > 1) add("pp:" + std::to_string(pp));
  if (engine != nullptr) add(std::string(engine) + ":" + std::to_string(dp));
  if (tp > 1) add("tp:" + std::to_string(tp));
  return out.empty() ? "none" : out;
}

/// The ranks a candidate runs: each pipeline stage; both ends of a context-parallel ring (its
/// ranks differ by their place in it, the first and the last the most); else one.
std::size_t ranks_run(const nn::ParallelConfig& parallel) {
  return parallel.pipeline_parallel > 1 ? parallel.pipeline_parallel : parallel.context_parallel > 1 ? 2 : 1;
}

/// The i-th of those ranks.
nn::ParallelConfig rank_run(nn::ParallelConfig parallel, std::size_t i) {
  if (parallel.pipeline_parallel > 1) {
    parallel.stage = i;
    parallel.stage_chosen = true;
  } else if (i > 0) {
    parallel.rank = parallel.world_size - 1;  // the ring's last place, and FSDP2's last shard
  }
  return parallel;
}

/// Fitting first, by recompute, communication and peak; then the nearest misses; refused last.
bool ranks_before(const LayoutCandidate& a, const LayoutCandidate& b) {
  if (a.dominated != b.dominated) return !a.dominated;
  if (a.refused.has_value() != b.refused.has_value()) return !a.refused.has_value();
  if (a.fits != b.fits) return a.fits;
  if (!a.fits) return a.fullest.peak_device_used < b.fullest.peak_device_used;
  if (a.lost_share() != b.lost_share()) return a.lost_share() < b.lost_share();
  if (a.communication_bytes != b.communication_bytes) return a.communication_bytes < b.communication_bytes;
  return a.fullest.peak_device_used < b.fullest.peak_device_used;
}

}  // namespace

std::string LayoutCandidate::label() const {
  std::string out = nn::parallel_label(parallel);
  if (checkpoint == "none") out += ", no checkpointing";
  if (checkpoint == "non-reentrant") out += ", every layer checkpointed";
  return out;
}

const LayoutCandidate* LayoutSearchResult::best() const noexcept {
  return !layouts.empty() && layouts.front().fits ? &layouts.front() : nullptr;
}

std::vector<LayoutCandidate> layout_candidates(const LayoutSearchSpec& spec, const nn::ModelInfo& model) {
  if (spec.gpus < 1 || spec.gpus > nn::kMaxWorldSize) {
    throw UsageError(fmt::format("--gpus: {} GPUs; give 1 to {}", spec.gpus, nn::kMaxWorldSize));
  }
  if (spec.global_batch < 1) {
    throw UsageError("--parallel auto: give --batch, the global batch (sequences per step over all GPUs)");
  }
  const bool decoder = is_decoder(model);
  const std::vector<std::string> checkpoints = decoder ? std::vector<std::string>{"none", "non-reentrant"}
                                                       : std::vector<std::string>{""};
  std::vector<LayoutCandidate> out;
  for (std::size_t tp = 1; tp <= std::min(spec.gpus_per_node, spec.gpus); tp *= 2) {
    if (spec.gpus % tp != 0 || (tp > 1 && !decoder)) continue;
    for (std::size_t pp = 1; pp <= std::min(kMaxStages, spec.gpus / tp); pp *= 2) {
      if ((spec.gpus / tp) % pp != 0 || (pp > 1 && !decoder)) continue;
      const std::size_t dp = spec.gpus / (tp * pp);
      if (spec.global_batch % static_cast<std::int64_t>(dp) != 0) continue;
      const std::int64_t batch = spec.global_batch / static_cast<std::int64_t>(dp);
      // One sample per micro-batch (torchtitan's default); 1F1B needs one per stage at least.
      if (pp > 1 && (batch < static_cast<std::int64_t>(pp) || batch > static_cast<std::int64_t>(nn::kMaxMicrobatches))) {
        continue;
      }
      std::vector<const char*> engines;
      if (dp == 1) {
        engines.push_back(nullptr);
      } else {
        engines.push_back("fsdp");
        if (tp == 1 && pp == 1) engines.push_back("ddp");  // DDP beside other dimensions is not modelled
      }
      for (const char* engine : engines) {
        // Schedule1F1B, and ScheduleInterleaved1F1B (two stages per rank, torchtitan's default)
        // where the micro-batches come in rounds of P.
        std::vector<nn::PipelineSchedule> schedules{nn::PipelineSchedule::OneF1B};
        if (pp > 1 && batch % static_cast<std::int64_t>(pp) == 0) {
          schedules.push_back(nn::PipelineSchedule::Interleaved1F1B);
        }
        for (const nn::PipelineSchedule schedule : schedules) {
          const bool interleaved = schedule == nn::PipelineSchedule::Interleaved1F1B;
          const std::string options =
              pp > 1 ? "microbatches=" + std::to_string(batch) + (interleaved ? ",schedule=interleaved1f1b" : "") : "";
          const nn::ParallelConfig parallel = nn::parse_parallel(mesh_text(pp, engine, dp, tp), options);
          for (const std::string& checkpoint : checkpoints) {
            LayoutCandidate c;
            c.parallel = parallel;
            c.checkpoint = checkpoint;
            c.batch = batch;
            c.replicas = dp;
            // Schedule1F1B idles each stage for P - 1 of M + P - 1 slots; with V stages per rank
            // a slot is 1/V of a micro-batch's work, so P - 1 of V x M + P - 1 (Narayanan et al.
            // 2021: the bubble shrinks by V).
            const std::size_t per_rank = interleaved ? 2 : 1;
            if (pp > 1) {
              c.bubble_share = static_cast<double>(pp - 1) /
                               static_cast<double>(static_cast<std::int64_t>(per_rank) * batch + static_cast<std::int64_t>(pp) - 1);
            }
            out.push_back(std::move(c));
          }
        }
      }
    }
  }
  // Context parallel inside FSDP2 (fsdp:MxCP:C, cp:C alone), C up to a node's GPUs: every
  // replica's batch over the ring's C GPUs, each holding 1/C of every sequence.
  for (std::size_t cp = 2; decoder && cp <= std::min(spec.gpus_per_node, spec.gpus); cp *= 2) {
    const std::size_t replicas = spec.gpus / cp;
    if (spec.gpus % cp != 0 || spec.global_batch % static_cast<std::int64_t>(replicas) != 0) continue;
    const nn::ParallelConfig parallel =
        nn::parse_parallel((replicas > 1 ? "fsdp:" + std::to_string(replicas) + "x" : std::string{}) + "cp:" +
                           std::to_string(cp));
    for (const std::string& checkpoint : checkpoints) {
      LayoutCandidate c;
      c.parallel = parallel;
      c.checkpoint = checkpoint;
      c.batch = spec.global_batch / static_cast<std::int64_t>(replicas);
      c.replicas = replicas;
      out.push_back(std::move(c));
    }
  }
  return out;
}

LayoutSearchResult search_layouts(const LayoutSearchSpec& spec, const SweepProgress& progress) {
  const auto start = std::chrono::steady_clock::now();
  if (spec.base.precisions.size() != 1) throw UsageError("--dtype: the layout search takes one");
  LayoutSearchResult result;
  result.spec = spec;
  SweepSpec base = spec.base;
  base.model_options.batch = 1;
  result.model = validate_sweep(base);
  result.layouts = layout_candidates(spec, result.model);
  if (spec.record_expert_parallel && spec.global_batch % static_cast<std::int64_t>(spec.gpus) == 0) {
    // Expert parallel inside FSDP2 over every GPU (transformers' DistributedConfig(fsdp_size=G,
    // ep_size=N)): each N its own recording of one GPU.
    for (std::size_t ranks = 2; ranks <= spec.gpus; ranks *= 2) {
      if (spec.gpus % ranks != 0) continue;
      LayoutCandidate c;
      c.parallel = nn::parse_parallel("fsdp:" + std::to_string(spec.gpus), "ep_size=" + std::to_string(ranks));
      c.batch = spec.global_batch / static_cast<std::int64_t>(spec.gpus);
      c.replicas = spec.gpus;
      try {
        c.model = spec.record_expert_parallel(ranks);
        if (!c.model) break;  // no experts to shard
      } catch (const Error& e) {
        c.refused = e.what();  // experts that do not split over N
      }
      result.layouts.push_back(std::move(c));
    }
  }

  // Every candidate's ranks, counted ahead for the progress (a stage that runs out skips the rest).
  std::size_t planned = 0;
  for (const LayoutCandidate& c : result.layouts) planned += ranks_run(c.parallel);
  for (std::size_t i = 0; i < result.layouts.size(); ++i) {
    LayoutCandidate& c = result.layouts[i];
    if (c.refused) {
      planned -= ranks_run(c.parallel);
      continue;
    }
    // layout_candidates lists each mesh without checkpointing first, then checkpointed.
    if (i > 0 && c.checkpoint == "non-reentrant" && result.layouts[i - 1].checkpoint == "none" &&
        result.layouts[i - 1].parallel == c.parallel && result.layouts[i - 1].fits) {
      c.dominated = true;
      planned -= ranks_run(c.parallel);
      continue;
    }
    c.fits = true;
    // The model this layout runs: its own recording (expert parallel), else the spec's.
    std::optional<SweepSpec> own;
    if (c.model) {
      own = base;
      own->model = c.model;
    }
    const SweepSpec& runs = own ? *own : base;
    for (std::size_t stage = 0; stage < ranks_run(c.parallel) && c.fits; ++stage) {
      SweepRow row;
      row.precision = base.precisions.front();
      row.alloc_conf = base.alloc_confs.empty() ? std::string{} : base.alloc_confs.front();
      row.batch = c.batch;
      row.seq = base.model_options.seq;
      row.checkpoint = c.checkpoint;
      row.parallel = rank_run(c.parallel, stage);
      if (progress) progress(result.runs, planned, nn::parallel_label(row.parallel));
      std::optional<OomFailure> oom;
      std::optional<AutogradFailure> error;
      RunFigures figures;
      try {
        std::shared_ptr<Device> device = make_run_device(base);
        if (result.device.name.empty()) result.device = device->info();
        figures = run_config(train_config(runs, row), std::move(device), oom, error);
      } catch (const Error& e) {
        // What vramscope or PyTorch refuses for this model (a tied embedding under pp, a head
        // count tensor parallel does not divide): the layout does not apply.
        c.refused = e.what();
        c.fits = false;
        break;
      }
      ++c.runs;
      ++result.runs;
      if (error) {
        c.refused = error->message;
        c.fits = false;
        break;
      }
      if (oom) {
        c.fits = false;
        c.oom = oom;
        c.fullest = figures;
        c.fullest_stage = stage;
        break;
      }
      if (stage == 0 || figures.peak_device_used > c.fullest.peak_device_used) {
        c.fullest = figures;
        c.fullest_stage = stage;
      }
      c.communication_bytes = std::max(c.communication_bytes, figures.communication_bytes);
      c.recompute_share = std::max(c.recompute_share, figures.recompute_share);
    }
  }
  std::stable_sort(result.layouts.begin(), result.layouts.end(), ranks_before);
  result.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mem::planner
