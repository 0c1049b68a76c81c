// max_batch_report.cpp — the --max-batch table, footnotes, CSV and JSON.
#include "max_batch_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "model_args.hpp"
#include "sweep_export.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::tools {

namespace {

constexpr const char* kNone = "—";

std::string segments_cell(std::size_t k) { return k <= 1 ? fmt::format("{} (none)", k) : std::to_string(k); }

/// Where the batch after the largest ran out: "step 2, backward of layer4.1".
std::string runs_out(const planner::MaxBatchRow& row) {
  if (row.size_limited) return "sizes overflow";
  if (!row.over) return kNone;
  const planner::OomFailure& o = *row.over;
  std::string out = o.step == 0 ? std::string("parameters") : fmt::format("step {}, {}", o.step, phase_name(o.phase));
  if (!o.module.empty()) out += " of " + o.module;
  return out;
}

// One list of fields drives the CSV header, the CSV cells and the JSON rows.
struct Field {
  const char* name;
  nlohmann::json (*get)(const planner::MaxBatchResult&, const planner::MaxBatchRow&);
};
using R = const planner::MaxBatchResult&;
using W = const planner::MaxBatchRow&;
nlohmann::json at_max(const planner::MaxBatchRow& r, std::int64_t v) {
  return r.max_batch > 0 ? nlohmann::json(v) : nlohmann::json(nullptr);
}
template <class F>
nlohmann::json if_over(const planner::MaxBatchRow& r, F f) {
  return r.over ? nlohmann::json(f(*r.over)) : nlohmann::json(nullptr);
}
const std::array kFields = {
    Field{"model", [](R s, W) -> nlohmann::json { return s.model.name; }},
    Field{"device", [](R s, W) -> nlohmann::json { return s.device.name; }},
    Field{"stack", [](R s, W) -> nlohmann::json { return s.spec.stack.spec(); }},
    Field{"parallel", [](R s, W) -> nlohmann::json { return nn::parallel_label(s.spec.parallels.front()); }},
    Field{"dtype", [](R, W r) -> nlohmann::json { return std::string(nn::precision_name(r.precision)); }},
    Field{"seq", [](R, W r) -> nlohmann::json { return r.seq > 0 ? nlohmann::json(r.seq) : nlohmann::json(nullptr); }},
    Field{"segments", [](R, W r) -> nlohmann::json { return r.segments; }},
    Field{"alloc_conf", [](R, W r) -> nlohmann::json { return r.alloc_conf; }},
    Field{"max_batch", [](R, W r) -> nlohmann::json { return r.max_batch; }},
    Field{"best", [](R, W r) -> nlohmann::json { return r.best; }},
    Field{"allocated_after_step", [](R, W r) { return at_max(r, r.at_max.allocated_end); }},
    Field{"max_allocated", [](R, W r) { return at_max(r, r.at_max.peak_allocated); }},
    Field{"max_reserved", [](R, W r) { return at_max(r, r.at_max.peak_reserved); }},
    Field{"max_nvidia_smi", [](R, W r) { return at_max(r, r.at_max.peak_device_used); }},
    Field{"recompute_ratio", [](R, W r) -> nlohmann::json { return r.max_batch > 0 ? nlohmann::json(r.at_max.recompute_ratio) : nlohmann::json(nullptr); }},
    Field{"recompute_share", [](R, W r) -> nlohmann::json { return r.max_batch > 0 ? nlohmann::json(r.at_max.recompute_share) : nlohmann::json(nullptr); }},
    Field{"gradients_missing", [](R, W r) -> nlohmann::json { return r.at_max.gradients_missing; }},
    Field{"next_oom_step", [](R, W r) { return if_over(r, [](const planner::OomFailure& o) { return o.step; }); }},
    Field{"next_oom_phase", [](R, W r) { return if_over(r, [](const planner::OomFailure& o) { return std::string(phase_name(o.phase)); }); }},
    Field{"next_oom_module", [](R, W r) { return if_over(r, [](const planner::OomFailure& o) { return o.module; }); }},
    Field{"next_oom_requested", [](R, W r) { return if_over(r, [](const planner::OomFailure& o) { return o.figures.requested; }); }},
    Field{"size_limited", [](R, W r) -> nlohmann::json { return r.size_limited; }},
    Field{"error", [](R, W r) -> nlohmann::json { return r.error ? nlohmann::json(r.error->message) : nlohmann::json(nullptr); }},
    Field{"probes", [](R, W r) -> nlohmann::json { return r.probes; }},
};

}  // namespace

std::string max_batch_report(const planner::MaxBatchResult& result, const ReportOptions& options) {
  const nn::ModelInfo& m = result.model;
  const planner::SweepSpec& spec = result.spec;
  nn::ModelOptions shown = spec.model_options;
  std::string title = model_title(m, shown, {}, spec.seqs);
  // The default batch in the title would read as the one used: the batch is what is searched.
  if (const auto at = title.find(fmt::format(" batch={}", m.batch)); at != std::string::npos) {
    title.erase(at, fmt::format(" batch={}", m.batch).size());
  }
  std::string out = fmt::format(
      "vramscope sweep --max-batch: {}, {} sequential modules, {} parameters ({} in f32)\n", title,
      m.sequence_length, human_count(m.parameters), format_bytes(m.parameter_bytes(nn::DType::F32)));
  out += fmt::format("on {} ({} total){}, optimizer {}, {} step{} per run{}, {} dry runs\n\n",
                     result.device.name, format_bytes(result.device.total_bytes), per_gpu(spec.parallels),
                     nn::optimizer_label(spec.optimizer), spec.steps, spec.steps == 1 ? "" : "s",
                     planner::any_cudagraphs(spec.compiles) && spec.steps < nn::kCudaGraphSteps
                         ? fmt::format(" ({} with CUDA graphs: warmup, recording, replay)", nn::kCudaGraphSteps)
                         : std::string(),
                     result.probes);

  const bool show_conf = spec.alloc_confs.size() > 1 || (spec.alloc_confs.size() == 1 && !spec.alloc_confs[0].empty());
  const bool show_seq = spec.seqs.size() > 1;
  const bool show_compile = !spec.compiles.empty();
  std::vector<Column> cols{{"dtype", Align::Left}};
  if (show_seq) cols.push_back({"seq", Align::Right});
  if (show_compile) cols.push_back({"step", Align::Left});
  cols.push_back({"segments", Align::Right});
  if (show_conf) cols.push_back({"alloc conf", Align::Left});
  for (const char* h : {"max batch", "max alloc", "max reserved", "max nvidia-smi", "recompute"}) {
    cols.push_back({h, Align::Right});
  }
  // Under pipeline parallel the next batch tried is the next multiple of the micro-batches.
  const std::int64_t step = planner::batch_grid(spec.parallels.front()).step;
  const std::string next = "batch+" + std::to_string(step);
  cols.push_back({next + " runs out in", Align::Left});
  Table table{cols};
  std::string previous_group;
  std::size_t footnote = 0;
  std::string notes;
  for (const planner::MaxBatchRow& row : result.rows) {
    const std::string group = fmt::format("{}|{}|{}", nn::precision_name(row.precision), row.seq, row.alloc_conf);
    if (!previous_group.empty() && group != previous_group) table.add_separator();
    previous_group = group;
    std::vector<std::string> cells{std::string(nn::precision_name(row.precision))};
    if (show_seq) cells.push_back(std::to_string(row.seq));
    if (show_compile) cells.push_back(planner::compile_label(row.compile));
    cells.push_back(segments_cell(row.segments));
    if (show_conf) cells.push_back(row.alloc_conf.empty() ? "default" : row.alloc_conf);
    if (row.max_batch > 0) {
      std::string batch = std::to_string(row.max_batch);
      if (row.best) batch += " *";
      if (row.at_max.gradients_missing) batch += " (grads missing!)";
      cells.push_back(batch);
      cells.push_back(human_bytes(row.at_max.peak_allocated));
      cells.push_back(human_bytes(row.at_max.peak_reserved));
      cells.push_back(human_bytes(row.at_max.peak_device_used));
      cells.push_back(human_share(row.at_max.recompute_share));
      cells.push_back(runs_out(row));
    } else {
      const std::string mark = fmt::format("none [{}]", ++footnote);
      cells.push_back(mark);
      for (int i = 0; i < 4; ++i) cells.push_back(kNone);
      cells.push_back(row.error ? std::string(kNone) : runs_out(row));
      if (row.error) {
        notes += wrap(fmt::format("[{}] {}: fails as on PyTorch, {}: {}", footnote, row.label(),
                                  describe_place(*row.error), row.error->message),
                      "  ", "      ");
      } else if (row.over) {
        const auto& f = row.over->figures;
        notes += wrap(fmt::format("[{}] {}: the smallest batch does not fit: out of memory asking for {}, with {} "
                                  "allocated and {} in nvidia-smi's view of {}.",
                                  footnote, row.label(), format_bytes(f.requested), format_bytes(f.allocated),
                                  format_bytes(f.process_used), format_bytes(f.device_total)),
                      "  ", "      ");
      }
    }
    table.add_row(std::move(cells));
  }
  out += table.render("  ");
  out += notes;
  if (std::any_of(result.rows.begin(), result.rows.end(), [](const planner::MaxBatchRow& r) { return r.best; })) {
    out += "  * the largest batch of its dtype; among equals, the least recomputation\n";
  }
  if (options.how_to_read) {
    out += "\nHow to read this:\n";
    out += step == 1 && planner::batch_grid(spec.parallels.front()).lowest == 1
               ? "  max batch       the batch found by doubling from 1 and then bisecting: it runs every step\n"
                 "                  within the device's memory, and one more sample runs out. Memory grows with\n"
               : "  max batch       the batch found by doubling from the smallest the pipeline runs and then\n"
                 "                  bisecting on its batches: it runs every step (of every stage, unless one\n"
                 "                  is chosen) within the device's memory, and the next batch runs out. Memory grows with\n";
    out += "                  the batch almost, not strictly, monotonically (blocks are rounded and cached),\n"
           "                  so a few larger batches may fit again; none of the tried ones did.\n";
    out += "  max alloc ...   the peaks of the run at that batch, as in `vramscope sweep`.\n";
    out += step == 1 ? "  batch+1 ...     where the run one sample larger ran out of memory: the step, phase and module.\n"
                     : fmt::format("  {:<15} where the run {} samples larger (the next batch the micro-batches divide)\n"
                                   "                  ran out of memory: the step, phase and module.\n",
                                   next + " ...", step);
  }
  out += fmt::format("\ndevice: {}\nstack: {} (--stack)\n", result.device.assumptions, result.spec.stack.to_string());
  out += assumptions_note(result.model.assumed);
  out += parallel_note(result.spec.parallels, result.device);
  return out;
}

std::string max_batch_csv(const planner::MaxBatchResult& result) {
  std::string out;
  for (const Field& f : kFields) {
    if (!out.empty()) out += ',';
    out += f.name;
  }
  out += "\n";
  for (const planner::MaxBatchRow& row : result.rows) {
    for (std::size_t i = 0; i < kFields.size(); ++i) {
      if (i > 0) out += ',';
      out += csv_cell(kFields[i].get(result, row));
    }
    out += "\n";
  }
  return out;
}

nlohmann::json max_batch_json(const planner::MaxBatchResult& result) {
  const nn::ModelInfo& m = result.model;
  const planner::SweepSpec& spec = result.spec;
  nlohmann::json j;
  j["schema_version"] = kMaxBatchSchemaVersion;
  j["model"] = {{"name", m.name},
                {"options", spec.model_options.to_string()},
                {"parameters", m.parameters},
                {"sequential_modules", m.sequence_length},
                {"seqs", spec.seqs}};
  j["device"] = device_json(result.device);
  j["stack"] = result.spec.stack.spec();
  j["parallel"] = nn::parallel_label(result.spec.parallels.front());
  j["optimizer"] = nn::optimizer_label(spec.optimizer);
  j["checkpoint_mode"] = std::string(nn::checkpoint_mode_name(spec.checkpoint_mode));
  j["steps"] = spec.steps;
  j["probes"] = result.probes;
  j["wall_ms"] = result.wall_ms;
  j["rows"] = nlohmann::json::array();
  for (const planner::MaxBatchRow& row : result.rows) {
    nlohmann::json r = nlohmann::json::object();
    for (const Field& f : kFields) {
      const std::string name = f.name;
      if (name != "model" && name != "device") r[name] = f.get(result, row);
    }
    r["label"] = row.label();
    r["compile"] = row.compile ? nlohmann::json(row.compile->memory_budget) : nlohmann::json(nullptr);
    r["cudagraphs"] = row.compile && row.compile->cudagraphs;
    j["rows"].push_back(std::move(r));
  }
  return j;
}

}  // namespace mem::tools
