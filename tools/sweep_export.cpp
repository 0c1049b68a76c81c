// sweep_export.cpp — CSV and JSON of a sweep.
#include "sweep_export.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>

namespace mem::tools {

namespace {

// One list of the row fields drives the CSV header, the CSV cells and the JSON keys.
struct Field {
  const char* name;
  nlohmann::json (*get)(const planner::SweepResult&, const planner::SweepRow&);
};

nlohmann::json opt_int(const std::optional<std::int64_t>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

template <class F>
nlohmann::json if_oom(const planner::SweepRow& r, F f) {
  return r.oom ? nlohmann::json(f(*r.oom)) : nlohmann::json(nullptr);
}
template <class F>
nlohmann::json if_error(const planner::SweepRow& r, F f) {
  return r.error ? nlohmann::json(f(*r.error)) : nlohmann::json(nullptr);
}
/// Bytes of `kind` at the peak: of the run, or for an OOM row of the run without the limit.
nlohmann::json peak_part(const planner::SweepRow& r, MemoryKind kind) {
  const planner::RunFigures* f = r.fits() ? &r.figures : r.unlimited ? &*r.unlimited : nullptr;
  if (f == nullptr || f->peak_composition.total() == 0) return nullptr;
  return f->peak_composition.of(kind);
}

template <class F>
nlohmann::json if_fits(const planner::SweepRow& r, F f) {
  return r.fits() ? nlohmann::json(f(r.figures)) : nlohmann::json(nullptr);
}

using R = const planner::SweepResult&;
using W = const planner::SweepRow&;
const std::array kFields = {
    Field{"model", [](R s, W) -> nlohmann::json { return s.model.name; }},
    Field{"batch", [](R, W r) -> nlohmann::json { return r.batch; }},
    // The row's --seq of a list, else the one --seq given (empty when none was).
    Field{"seq", [](R s, W r) -> nlohmann::json {
      const std::int64_t seq = r.seq > 0 ? r.seq : s.spec.model_options.seq;
      return seq > 0 ? nlohmann::json(seq) : nlohmann::json(nullptr);
    }},
    Field{"device", [](R s, W) -> nlohmann::json { return s.device.name; }},
    Field{"stack", [](R s, W) -> nlohmann::json { return s.spec.stack.spec(); }},
    Field{"parallel", [](R, W r) -> nlohmann::json { return nn::parallel_label(r.parallel); }},
    // A transformer's per-layer checkpointing (--gradient-checkpointing, a list's mode per row).
    Field{"gradient_checkpointing", [](R s, W r) -> nlohmann::json {
      if (!r.checkpoint.empty()) return r.checkpoint;
      const auto& mode = s.spec.model_options.checkpoint;
      return mode ? nlohmann::json(*mode) : nlohmann::json(nullptr);
    }},
    Field{"dtype", [](R, W r) -> nlohmann::json { return std::string(nn::precision_name(r.precision)); }},
    Field{"segments", [](R, W r) -> nlohmann::json { return r.segments; }},
    Field{"alloc_conf", [](R, W r) -> nlohmann::json { return r.alloc_conf; }},
    Field{"fits", [](R, W r) -> nlohmann::json { return r.fits(); }},
    Field{"best", [](R, W r) -> nlohmann::json { return r.best; }},
    Field{"steps", [](R, W r) -> nlohmann::json { return r.figures.steps_done; }},
    Field{"allocated_after_step", [](R, W r) { return if_fits(r, [](const planner::RunFigures& f) { return f.allocated_end; }); }},
    Field{"max_allocated", [](R, W r) -> nlohmann::json { return r.figures.peak_allocated; }},
    Field{"max_reserved", [](R, W r) -> nlohmann::json { return r.figures.peak_reserved; }},
    Field{"max_nvidia_smi", [](R, W r) -> nlohmann::json { return r.figures.peak_device_used; }},
    Field{"unallocated_at_peak", [](R, W r) -> nlohmann::json { return r.figures.unallocated_at_peak; }},
    Field{"saving", [](R, W r) { return opt_int(r.saving); }},
    Field{"saving_fraction", [](R, W r) -> nlohmann::json { return r.saving ? nlohmann::json(r.saving_fraction) : nlohmann::json(nullptr); }},
    Field{"recompute_ratio", [](R, W r) { return if_fits(r, [](const planner::RunFigures& f) { return f.recompute_ratio; }); }},
    Field{"recompute_share", [](R, W r) { return if_fits(r, [](const planner::RunFigures& f) { return f.recompute_share; }); }},
    Field{"step_ms", [](R, W r) { return if_fits(r, [](const planner::RunFigures& f) { return f.step_ms; }); }},
    Field{"gradients_missing", [](R, W r) -> nlohmann::json { return r.figures.gradients_missing; }},
    Field{"oom_step", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.step; }); }},
    Field{"oom_phase", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return std::string(phase_name(o.phase)); }); }},
    Field{"oom_module", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.module; }); }},
    Field{"oom_requested", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.figures.requested; }); }},
    Field{"oom_allocated", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.figures.allocated; }); }},
    Field{"oom_reserved", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.figures.reserved; }); }},
    Field{"oom_nvidia_smi", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.figures.process_used; }); }},
    Field{"oom_device_free", [](R, W r) { return if_oom(r, [](const planner::OomFailure& o) { return o.figures.device_free; }); }},
    // What the peak is made of (of the run without the limit for an OOM row).
    Field{"peak_weights", [](R, W r) { return peak_part(r, MemoryKind::Weights); }},
    Field{"peak_gradients", [](R, W r) { return peak_part(r, MemoryKind::Gradients); }},
    Field{"peak_optimizer_state", [](R, W r) { return peak_part(r, MemoryKind::OptimizerState); }},
    Field{"peak_optimizer_temporaries", [](R, W r) { return peak_part(r, MemoryKind::OptimizerTemporaries); }},
    Field{"peak_activations", [](R, W r) { return peak_part(r, MemoryKind::Activations); }},
    Field{"peak_workspaces", [](R, W r) { return peak_part(r, MemoryKind::Workspaces); }},
    Field{"peak_logits", [](R, W r) { return peak_part(r, MemoryKind::Logits); }},
    Field{"peak_communication", [](R, W r) { return peak_part(r, MemoryKind::Communication); }},
    Field{"peak_other", [](R, W r) { return peak_part(r, MemoryKind::Other); }},
    Field{"needs_max_allocated", [](R, W r) { return r.unlimited ? nlohmann::json(r.unlimited->peak_allocated) : nlohmann::json(nullptr); }},
    Field{"needs_max_nvidia_smi", [](R, W r) { return r.unlimited ? nlohmann::json(r.unlimited->peak_device_used) : nlohmann::json(nullptr); }},
    // Autograd refused the run, as PyTorch does (e.g. an in-place op on a checkpoint's saved input).
    Field{"error", [](R, W r) { return if_error(r, [](const planner::AutogradFailure& e) { return e.message; }); }},
    Field{"error_step", [](R, W r) { return if_error(r, [](const planner::AutogradFailure& e) { return e.step; }); }},
    Field{"error_phase", [](R, W r) { return if_error(r, [](const planner::AutogradFailure& e) { return std::string(phase_name(e.phase)); }); }},
    Field{"error_module", [](R, W r) { return if_error(r, [](const planner::AutogradFailure& e) { return e.module; }); }},
};

nlohmann::json row_json(const planner::SweepResult& s, const planner::SweepRow& r) {
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : kFields) {
    const std::string name = f.name;
    if (name == "model" || name == "device") continue;  // top level
    j[name] = f.get(s, r);
  }
  j["label"] = r.label();
  // Pinned host memory (activation offloading's, FSDP2's CPUOffloadPolicy's; 0 without them):
  // beside nvidia-smi's figure.
  j["pinned_host"] = r.figures.pinned_host_bytes;
  // What this GPU sent over collectives in the last step (0 on one GPU): what the layout costs
  // in communication, as `plan --parallel auto` ranks it.
  j["communication_bytes_per_step"] = r.figures.communication_bytes;
  if (r.oom) j["oom_message"] = r.oom->message;
  if (r.fits()) j["warnings"] = r.figures.warnings;
  // torch.compile's step (--compile): the budget (null: eager), whether CUDA graphs replay it, and
  // what its partitioner kept.
  j["compile"] = r.compile ? nlohmann::json(r.compile->memory_budget) : nlohmann::json(nullptr);
  j["cudagraphs"] = r.compile && r.compile->cudagraphs;
  if (const auto& c = r.figures.compiled) {
    j["compiled"] = {{"memory_budget", c->memory_budget},
                     {"saved_values", c->saved_values},
                     {"saved_bytes", c->saved_bytes},
                     {"recomputed_nodes", c->recomputed_nodes},
                     {"graph_nodes", c->graph_nodes},
                     {"forward_buffer_peak", c->forward_buffer_peak},
                     {"backward_buffer_peak", c->backward_buffer_peak},
                     {"graph_pool_reserved", c->graph_pool_reserved}};
  }
  return j;
}

}  // namespace

nlohmann::json device_json(const DeviceInfo& device) {
  return {{"name", device.name},
          {"total_bytes", device.total_bytes},
          {"context_bytes", device.context_bytes},
          {"granularity", device.granularity},
          {"simulated", device.simulated},
          {"assumptions", device.assumptions}};
}

std::string csv_cell(const nlohmann::json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) return csv_field(v.get<std::string>());
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
  return v.dump();
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string out = "\"";
  for (const char ch : text) {
    if (ch == '"') out += '"';
    out += ch;
  }
  return out + "\"";
}

std::string sweep_csv_header() {
  std::string out;
  for (const Field& f : kFields) {
    if (!out.empty()) out += ',';
    out += f.name;
  }
  return out;
}

std::string sweep_csv(const planner::SweepResult& result) {
  std::string out = sweep_csv_header() + "\n";
  for (const planner::SweepRow& row : result.rows) {
    std::string line;
    for (std::size_t i = 0; i < kFields.size(); ++i) {
      if (i > 0) line += ',';
      line += csv_cell(kFields[i].get(result, row));
    }
    out += line + "\n";
  }
  return out;
}

nlohmann::json sweep_json(const planner::SweepResult& result) {
  const nn::ModelInfo& m = result.model;
  const planner::SweepSpec& spec = result.spec;
  nlohmann::json j;
  j["schema_version"] = kSweepSchemaVersion;
  j["model"] = {{"name", m.name},
                {"options", spec.model_options.to_string()},
                {"batch", m.batch},  // the first batch; each row has its own
                {"batches", spec.batches},
                {"seqs", spec.seqs},
                {"parameters", m.parameters},
                {"sequential_modules", m.sequence_length},
                {"input_shape", m.input_shape.to_vector()}};
  j["device"] = device_json(result.device);
  j["stack"] = result.spec.stack.spec();
  j["mode"] = std::string(nn::exec_mode_name(spec.mode));
  j["optimizer"] = nn::optimizer_label(spec.optimizer);
  j["checkpoint_mode"] = std::string(nn::checkpoint_mode_name(spec.checkpoint_mode));
  j["steps"] = spec.steps;
  j["accumulation"] = spec.accumulation;
  // Selective checkpointing: the operators the checkpointed modules keep ([] for none), and
  // the scopes' own lists ({"modules": ..., "save": [...]}).
  j["selective"] = spec.selective ? spec.selective->save : std::vector<std::string>{};
  j["selective_scopes"] = nlohmann::json::array();
  if (spec.selective) {
    for (const auto& s : spec.selective->scopes) j["selective_scopes"].push_back({{"modules", s.modules}, {"save", s.save}});
  }
  j["offload"] = spec.offload_activations ? "activations" : "";
  j["wall_ms"] = result.wall_ms;
  j["rows"] = nlohmann::json::array();
  for (const planner::SweepRow& row : result.rows) j["rows"].push_back(row_json(result, row));
  j["baselines"] = nlohmann::json::array();
  for (const planner::SweepRow& row : result.baselines) j["baselines"].push_back(row_json(result, row));
  // Only when a row was refused: the counts (1 = none) autograd accepts for the model.
  j["accepted_segments"] = result.accepted_segments ? nlohmann::json(*result.accepted_segments) : nlohmann::json(nullptr);
  return j;
}

}  // namespace mem::tools
