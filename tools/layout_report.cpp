// layout_report.cpp — the ranked layouts of `plan --parallel auto` as text and JSON.
#include "layout_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "table.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem::tools {
namespace {

std::string checkpointing(const planner::LayoutCandidate& c) {
  return c.checkpoint == "non-reentrant" ? "every layer" : c.checkpoint == "none" ? "none" : "";
}

std::string fits_cell(const planner::LayoutCandidate& c) {
  if (c.fits) return "yes";
  const std::string stage =
      c.parallel.pipeline_parallel > 1 ? fmt::format("stage {}, ", c.fullest_stage) : std::string{};
  if (!c.oom) return "no";
  return fmt::format("no: {}step {}, {} of {}", stage, c.oom->step, phase_name(c.oom->phase),
                     c.oom->module.empty() ? "the model" : c.oom->module);
}

}  // namespace

std::string layout_report(const planner::LayoutSearchResult& result, std::size_t top, bool how_to_read) {
  const planner::LayoutSearchSpec& spec = result.spec;
  std::string out = fmt::format(
      "vramscope plan --parallel auto: {}, {} sequences per step on {} GPUs of {} ({} total), optimizer {}\n",
      result.model.name, spec.global_batch, spec.gpus, result.device.name,
      // The device's own total (a simulated one runs smaller by the headroom).
      human_bytes(static_cast<std::int64_t>(result.device.total_bytes +
                                            (result.device.simulated ? spec.base.headroom : 0))),
      nn::optimizer_name(spec.base.optimizer.kind));
  std::size_t applicable = 0, dominated = 0;
  for (const planner::LayoutCandidate& c : result.layouts) {
    applicable += c.refused || c.dominated ? 0 : 1;
    dominated += c.dominated ? 1 : 0;
  }
  out += fmt::format("{} layouts tried in {} dry runs (every pipeline stage, both ends of a ring){}{}\n\n", applicable, result.runs,
                     spec.base.headroom > 0
                         ? fmt::format("; each leaves {} free (--headroom)",
                                       human_bytes(static_cast<std::int64_t>(spec.base.headroom)))
                         : std::string{},
                     applicable > top ? fmt::format("; the first {} shown (--top)", top) : std::string{});

  Table table{{{"#", Align::Right},
               {"layout", Align::Left},
               {"checkpointing", Align::Left},
               {"batch x replicas", Align::Right},
               {"max alloc", Align::Right},
               {"max nvidia-smi", Align::Right},
               {"recompute", Align::Right},
               {"bubble", Align::Right},
               {"communication / step", Align::Right},
               {"fits", Align::Left}}};
  std::size_t shown = 0;
  for (const planner::LayoutCandidate& c : result.layouts) {
    if (c.refused || c.dominated || shown == top) continue;
    ++shown;
    const bool ran = c.fits;
    table.add_row({std::to_string(shown), nn::parallel_label(c.parallel), checkpointing(c),
                   fmt::format("{} x {}", c.batch, c.replicas), ran ? human_bytes(c.fullest.peak_allocated) : "",
                   ran ? human_bytes(c.fullest.peak_device_used) : "", ran ? human_share(c.recompute_share) : "",
                   human_share(c.bubble_share),
                   ran ? human_bytes(static_cast<std::int64_t>(c.communication_bytes)) : "", fits_cell(c)});
  }
  out += table.render("  ");
  if (const planner::LayoutCandidate* best = result.best()) {
    out += fmt::format("\npicks: {}: the least compute lost (recompute and bubble) that fits, then the least "
                       "communication per step{}\n",
                       best->label(),
                       best->parallel.pipeline_parallel > 1
                           ? fmt::format(" (its figures are stage {}'s, the fullest of {})", best->fullest_stage,
                                         best->parallel.pipeline_parallel)
                           : std::string{});
  } else {
    out += "\nNo layout fits: a larger device, more GPUs, a smaller global batch or a shorter sequence would.\n";
  }
  if (dominated > 0) {
    out += fmt::format("not run: {} checkpointed layout{} whose mesh fits without checkpointing, which loses less\n",
                       dominated, dominated == 1 ? "" : "s");
  }
  std::set<std::string> reasons;
  for (const planner::LayoutCandidate& c : result.layouts) {
    if (c.refused && reasons.insert(*c.refused).second) {
      out += fmt::format("not applicable: {}: {}\n", nn::parallel_label(c.parallel), *c.refused);
    }
  }
  if (how_to_read) {
    out +=
        "\nHow to read this: every row is one GPU's training step (two steps run, the figures of the fuller) at the "
        "same global batch, split over the data-parallel replicas (a GPU, a node's tensor-parallel group or a "
        "pipeline or a context-parallel ring); a pipeline's row is its fullest stage, every stage run, one sample per "
        "micro-batch (torchtitan's default); a ring's row the fuller of its first and last GPU. Recompute is checkpointing's extra forward as a share of the step's work (a pipeline's most "
        "recomputing stage's), the bubble the share of the step a pipeline's GPUs idle ((P - 1) / (M + P - 1) under "
        "1F1B and GPipe); the ranking adds the two. Communication is what "
        "each GPU sends per step over its collectives as the engines issue them (ring all-gathers and "
        "reduce-scatters (n - 1) / n of the gathered tensor, all-reduces twice that, a pipeline's sends whole, the "
        "ring attention's K and V to each other GPU of the ring and its gradients' all-to-alls whole, expert "
        "parallel's all-to-alls (n - 1) / n of the rows under its even routing), "
        "no timing: NVLink inside a node is an order of magnitude faster than the network across nodes. NCCL's "
        "own buffers are in nvidia-smi's figure. A mixture of experts the exporter records (an --hf-config) is "
        "recorded again for each expert-parallel size tried (fsdp:G with ep_size=N, ep:G). DeepSpeed's ZeRO is not "
        "searched: give it to sweep.\n";
  }
  return out;
}

nlohmann::json layout_json(const planner::LayoutSearchResult& result) {
  nlohmann::json layouts = nlohmann::json::array();
  for (const planner::LayoutCandidate& c : result.layouts) {
    nlohmann::json j = {{"parallel", nn::parallel_label(c.parallel)},
                        {"checkpoint", c.checkpoint},
                        {"batch", c.batch},
                        {"replicas", c.replicas},
                        {"fits", c.fits},
                        {"runs", c.runs}};
    if (c.dominated) {
      j["not_run"] = "the same mesh fits without checkpointing";
    } else if (c.refused) {
      j["refused"] = *c.refused;
    } else {
      if (c.parallel.pipeline_parallel > 1) j["fullest_stage"] = c.fullest_stage;
      j["peak_allocated"] = c.fullest.peak_allocated;
      j["peak_reserved"] = c.fullest.peak_reserved;
      j["peak_nvidia_smi"] = c.fullest.peak_device_used;
      j["recompute_share"] = c.recompute_share;
      j["bubble_share"] = c.bubble_share;
      j["communication_bytes_per_step"] = c.communication_bytes;
      if (c.oom) j["out_of_memory"] = {{"step", c.oom->step}, {"phase", phase_name(c.oom->phase)}, {"module", c.oom->module}};
    }
    layouts.push_back(std::move(j));
  }
  const planner::LayoutCandidate* best = result.best();
  return {{"model", result.model.name},
          {"device", result.device.name},
          {"gpus", result.spec.gpus},
          {"global_batch", result.spec.global_batch},
          {"runs", result.runs},
          {"wall_ms", result.wall_ms},
          {"best", best != nullptr ? nlohmann::json(best->label()) : nlohmann::json(nullptr)},
          {"layouts", std::move(layouts)}};
}

}  // namespace mem::tools
