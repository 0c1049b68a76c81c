// sweep.cpp — runs the configurations of a sweep and measures each one on its
// own allocator: peaks come from an observer that sees the allocator's totals
// after every event, so nothing printed is estimated.
#include "vramscope/planner/sweep.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <span>
#include <tuple>

#include "vramscope/planner/accepted_segments.hpp"
#include "vramscope/planner/host_memory.hpp"
#include "vramscope/planner/checks.hpp"
#include "vramscope/planner/errors.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/peaks.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/runtime/compiled.hpp"

namespace mem::planner {

namespace {

/// The device used for the runs when the user's is out of memory: a simulated
/// GPU with the same context and driver granularity, and 1 PiB of capacity.
constexpr std::size_t kUnlimitedCapacity = std::size_t{1} << 50;
// A row whose weights alone outgrow the device gets its run without the capacity limit (what it
// would need) only for models up to this many parameter tensors: beyond, that run would walk a
// model of millions of modules (a model file's `repeat`) for a figure the weights already decide.
constexpr std::size_t kMaxTensorsForUnlimitedRun = 100'000;

/// Watches one allocator: the peaks over the whole run, the slack at the
/// moment live tensors peaked, and the module scope active at an OOM.
class PeakWatcher final : public AllocatorObserver {
 public:
  explicit PeakWatcher(const DeviceStats& start) { peaks.start(start); }

  void on_event(const TraceEvent& e) noexcept override {
    (void)peaks.update(e);
    // Observers run on the allocating thread: its innermost scope is the culprit.
    if (e.action == TraceAction::Oom) oom_context_ = current_context();
  }

  PeakTotals peaks;
  ContextId oom_context_ = kNoContext;
};

template <class T>
std::vector<T> unique_in_order(const std::vector<T>& items) {
  std::vector<T> out;
  for (const T& item : items) {
    if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
  }
  return out;
}

/// Max allocated of a run without checkpointing, measured without the limit if needed.
std::optional<std::int64_t> baseline_peak(const SweepRow& row) {
  if (row.fits()) return row.figures.peak_allocated;
  if (row.unlimited) return row.unlimited->peak_allocated;
  return std::nullopt;
}

}  // namespace

nn::ModelOptions row_options(const SweepSpec& spec, std::int64_t batch, std::int64_t seq) {
  nn::ModelOptions options = spec.model_options;
  if (batch > 0) options.batch = batch;
  if (seq > 0) options.seq = seq;
  return options;
}

nn::TrainConfig train_config(const SweepSpec& spec, const SweepRow& row) {
  nn::TrainConfig cfg;
  cfg.model = spec.model;
  cfg.model_options = row_options(spec, row.batch, row.seq);
  const bool unmarked_baseline = row.unmarked || (spec.checkpoint_modules && row.checkpoint == "none");
  if (!row.checkpoint.empty() && !unmarked_baseline) cfg.model_options.checkpoint = row.checkpoint;
  cfg.mode = spec.mode;
  cfg.device = spec.device;
  cfg.alloc_conf = row.alloc_conf;
  cfg.steps = spec.steps;
  // PyTorch's checkpoint_sequential with one segment checkpoints nothing: 0 means that.
  cfg.segments = std::max<std::size_t>(row.segments, 1);
  cfg.checkpoint_mode = spec.checkpoint_mode;
  cfg.input_requires_grad = spec.input_requires_grad;
  cfg.precision = row.precision;
  cfg.optimizer = spec.optimizer;
  cfg.stack = spec.stack;
  cfg.parallel = row.parallel;
  // --checkpoint-modules' rows; their saving is measured against the model without marks.
  cfg.checkpoint_modules = unmarked_baseline ? std::vector<std::string>{} : spec.checkpoint_modules;
  if (!unmarked_baseline && row.segments <= 1) cfg.selective = spec.selective;
  cfg.offload_activations = spec.offload_activations;
  cfg.compile = row.compile;
  // CUDA graph trees warm a graph up, record it, then replay it: the third step is the first replay.
  if (row.compile && row.compile->cudagraphs) cfg.steps = std::max(cfg.steps, nn::kCudaGraphSteps);
  if (spec.accumulation > 1) accumulate(cfg, spec.accumulation, spec.steps);
  return cfg;
}

void accumulate(nn::TrainConfig& cfg, std::size_t micro_batches, std::size_t steps_after) {
  cfg.accumulation = micro_batches;
  cfg.steps = micro_batches + steps_after;
}

std::shared_ptr<Device> make_run_device(const SweepSpec& spec) {
  nn::TrainConfig cfg;
  cfg.device = spec.device;
  cfg.mode = spec.mode;
  std::shared_ptr<Device> device = make_device(nn::device_spec_for(cfg));
  const auto* sim = dynamic_cast<const SimDevice*>(device.get());
  if (spec.headroom == 0 || sim == nullptr) return device;
  SimDeviceConfig c = sim->config();
  if (spec.headroom + c.context_bytes >= c.capacity) {
    throw UsageError(fmt::format("--headroom: {} leaves nothing of {} beside the CUDA context ({})",
                                 format_bytes(spec.headroom), format_bytes(c.capacity), format_bytes(c.context_bytes)));
  }
  c.capacity -= spec.headroom;
  return std::make_shared<SimDevice>(std::move(c));
}

bool any_cudagraphs(const std::vector<std::optional<nn::CompileMode>>& compiles) noexcept {
  return std::any_of(compiles.begin(), compiles.end(), [](const auto& c) { return c && c->cudagraphs; });
}

std::string compile_label(const std::optional<nn::CompileMode>& compile) {
  if (!compile) return "eager";
  const char* name = compile->cudagraphs ? "reduce-overhead" : "compiled";
  if (compile->memory_budget >= 1) return name;
  return fmt::format("{} budget {:g}", name, compile->memory_budget);
}

std::string configuration_label(nn::Precision precision, const std::string& shape, std::size_t segments,
                                const std::string& alloc_conf) {
  std::string out = std::string(nn::precision_name(precision));
  if (!shape.empty()) out += " " + shape;
  out += fmt::format(" seg {}", segments);
  if (!alloc_conf.empty()) out += " [" + alloc_conf + "]";
  return out;
}

std::string SweepRow::label() const { return configuration_label(precision, shape, segments, alloc_conf); }

std::vector<std::size_t> auto_segments(std::size_t modules) {
  std::vector<std::size_t> out{0};
  const double root = std::sqrt(static_cast<double>(modules));
  const auto limit = std::min<std::size_t>(modules, static_cast<std::size_t>(8.0 * root));
  for (std::size_t k = 2; k <= limit; k *= 2) out.push_back(k);
  const auto near = static_cast<std::size_t>(std::lround(root));
  if (near >= 2 && near <= modules) out.push_back(near);
  // Every module its own segment: where weights are small beside activations (gpt2's
  // blocks), the curve can fall all the way to n.
  if (modules >= 2) out.push_back(modules);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

nn::ModelInfo validate_sweep(const SweepSpec& spec) {
  if (!spec.model) throw UsageError("no model given; give --model NAME or --model-file PATH");
  // Every shape asked for must build (a size that overflows is an error before anything runs).
  std::optional<nn::ModelInfo> first;
  for (const std::int64_t batch : spec.batches.empty() ? std::vector<std::int64_t>{0} : spec.batches) {
    for (const std::int64_t seq : spec.seqs.empty() ? std::vector<std::int64_t>{0} : spec.seqs) {
      nn::ModelInfo shaped = describe(*spec.model, row_options(spec, batch, seq));
      if (!first) first = std::move(shaped);
    }
  }
  const nn::ModelInfo info = std::move(*first);
  check_device(spec.device, spec.mode);
  if (spec.precisions.empty()) throw UsageError("--dtype: empty; valid: f32, f16, bf16, amp, amp-bf16");
  for (const std::string& conf : spec.alloc_confs) check_alloc_conf(conf);
  if (spec.steps < 1) throw UsageError("--steps: must be at least 1");
  if (spec.accumulation < 1) throw UsageError("--accumulation: must be at least 1");
  if (spec.segments.empty()) throw UsageError("--segments: empty; give counts like 0,2,4,8 or auto");
  for (const std::size_t k : spec.segments) {
    if (k > 1 && info.operators > 0) {
      throw UsageError(fmt::format(
          "--segments: {} is an operator graph, not a chain of modules checkpoint_sequential could split; "
          "checkpoint its module calls by path (--checkpoint-modules, e.g. the first of `vramscope trace`'s "
          "blocks), or let `vramscope plan` choose them, and give --segments 0",
          info.name));
    }
    if (k > 1 && !info.sequential_checkpointing) {
      throw UsageError(fmt::format(
          "--segments: {} checkpoints per decoder layer, as gradient_checkpointing_enable() does; give "
          "--gradient-checkpointing reentrant (or non-reentrant) and --segments 0",
          info.name));
    }
    if (k > 1 && info.checkpointed_modules > 0) {
      throw UsageError(fmt::format(
          "--segments: {} checkpoints {} of its modules itself (checkpoint marks in the file), so "
          "checkpoint_sequential's segments do not apply; give --segments 0, or remove the marks",
          info.name, info.checkpointed_modules));
    }
    if (k > info.sequence_length) {
      throw UsageError(fmt::format(
          "--segments: {} is more than the {} sequential modules {} has; valid: 0 (no "
          "checkpointing) to {}, or auto",
          k, info.sequence_length, info.name, info.sequence_length));
    }
  }
  return info;
}

std::shared_ptr<Device> unlimited_twin(const DeviceInfo& info) {
  SimDeviceConfig c;
  c.name = "unlimited";
  c.capacity = kUnlimitedCapacity;
  c.context_bytes = info.context_bytes;
  c.cublas_bytes = info.cublas_bytes;
  c.cudnn_bytes = info.cudnn_bytes;
  if (info.granularity != 0) c.granularity = info.granularity;
  c.backing = SimBacking::None;
  c.description = "the sweep's device without its capacity limit";
  return std::make_shared<SimDevice>(std::move(c));
}

AutogradFailure autograd_failure(const nn::AutogradError& e, std::size_t step) {
  AutogradFailure failure;
  failure.step = step;
  failure.phase = e.phase();
  failure.module = context_info(e.context()).path;
  failure.message = e.what();
  failure.inplace = dynamic_cast<const nn::InplaceModifiedError*>(&e) != nullptr;
  return failure;
}

// The failure of a row: its step, the module and phase that asked, the allocator's figures.
OomFailure oom_failure(std::size_t step, ContextId context, const OutOfMemoryError::Figures& figures,
                       const char* message) {
  OomFailure failure;
  failure.step = step;
  const ContextInfo& where = context_info(context);
  failure.phase = where.phase;
  failure.module = where.path;
  failure.figures = figures;
  failure.message = message;
  return failure;
}

RunFigures run_config(const nn::TrainConfig& cfg, std::shared_ptr<Device> device,
                      std::optional<OomFailure>& oom, std::optional<AutogradFailure>& error) {
  CachingAllocator allocator{std::move(device), AllocatorConfig::parse(cfg.alloc_conf)};
  attach(allocator);
  PeakWatcher watcher{allocator.stats()};
  allocator.add_observer(&watcher);

  RunFigures f;
  bool built = false;
  double total_ms = 0;
  double first_ms = 0;
  try {
    nn::Trainer trainer{cfg, allocator};
    built = true;
    for (std::size_t i = 0; i < cfg.steps; ++i) {
      const nn::StepStats s = trainer.step();
      ++f.steps_done;
      // The first step warms up (OpenBLAS's threads, first-touch of the host backing): it is
      // timed only when it is the only one, as benchmarks of PyTorch skip their warm-up.
      if (f.steps_done == 1) first_ms = s.wall_ms;
      else total_ms += s.wall_ms;
      f.recompute_ratio = s.recompute_ratio;
      const double work = s.flops.forward + s.flops.backward + s.flops.optimizer;
      f.recompute_share = work > 0 ? s.flops.recompute / work : 0;
      f.allocated_end = s.allocated_end;
      f.reserved_end = s.reserved_end;
      f.communication_bytes = s.communication_bytes;
    }
    if (const nn::CompiledStep* c = trainer.compiled()) {
      RunFigures::Compiled figures;
      figures.memory_budget = c->memory_budget();
      const auto& graph = trainer.info().compiled->graph;
      for (std::int32_t v : c->saved()) figures.saved_values.push_back(graph.nodes[static_cast<std::size_t>(v)].name);
      figures.saved_bytes = c->saved_activation_bytes();
      figures.recomputed_nodes = c->recomputed_nodes();
      figures.graph_nodes = graph.nodes.size();
      figures.forward_buffer_peak = c->forward_buffer_peak();
      figures.backward_buffer_peak = c->backward_buffer_peak();
      if (c->mode().cudagraphs) figures.graph_pool_reserved = static_cast<std::int64_t>(allocator.private_pool_reserved());
      f.compiled = std::move(figures);
    }
    const nn::TrainReport report = trainer.report();
    f.gradients_missing = report.gradients_missing;
    f.peak_composition = report.peak_composition;
    f.warnings = report.warnings;
    f.pinned_host_bytes = report.pinned_host_bytes;
  } catch (const OutOfMemoryError& e) {
    oom = oom_failure(built ? f.steps_done + 1 : 0, watcher.oom_context_, e.figures(), e.what());
  } catch (const RequestTooLargeError& e) {
    // A tensor over 1 PiB (a huge --batch or --seq): on a GPU, cudaMalloc fails and PyTorch
    // raises its out-of-memory error; a row like any OOM, never the end of the sweep.
    oom = oom_failure(built ? f.steps_done + 1 : 0, e.context(), e.figures(), e.what());
  } catch (const nn::AutogradError& e) {
    // PyTorch refuses this configuration too; the step unwound and freed its tensors.
    error = autograd_failure(e, f.steps_done + 1);
  }
  allocator.remove_observer(&watcher);
  f.peak_allocated = watcher.peaks.allocated;
  f.peak_reserved = watcher.peaks.reserved;
  f.peak_device_used = watcher.peaks.device_used;
  f.unallocated_at_peak = watcher.peaks.unallocated_at_peak;
  f.step_ms = f.steps_done <= 1 ? first_ms : total_ms / static_cast<double>(f.steps_done - 1);
  return f;
}

// --segments auto: the curve is bumpy (rounding, caching), so the sampled counts only
// bracket its minimum. Between the best count and its sampled neighbours, the midpoints
// are run until the best count's neighbours are adjacent to it: the best shown is then
// the minimum of its bracket, found in a few runs per halving.
template <class BestOf, class RunRow>
void refine_around_best(std::vector<SweepRow>& rows, BestOf&& best_of, RunRow&& run_row) {
  const auto by_k = [](const SweepRow& a, const SweepRow& b) { return a.segments < b.segments; };
  for (int round = 0; round < 16; ++round) {
    std::sort(rows.begin(), rows.end(), by_k);
    const SweepRow* best = best_of(std::span<SweepRow>(rows));
    if (best == nullptr || best->segments < 2) return;
    const std::size_t k = best->segments;
    const auto at = static_cast<std::size_t>(best - rows.data());
    std::vector<std::size_t> probes;
    if (at > 0 && rows[at - 1].segments >= 2 && k - rows[at - 1].segments > 1) {
      probes.push_back((rows[at - 1].segments + k) / 2);
    }
    if (at + 1 < rows.size() && rows[at + 1].segments - k > 1) {
      probes.push_back((k + rows[at + 1].segments + 1) / 2);
    }
    if (probes.empty()) return;
    for (const std::size_t probe : probes) rows.push_back(run_row(probe));
  }
  std::sort(rows.begin(), rows.end(), by_k);
}

SweepResult run_sweep(const SweepSpec& spec_in, const SweepProgress& progress) {
  const auto start = std::chrono::steady_clock::now();
  SweepResult result;
  result.spec = spec_in;
  SweepSpec& spec = result.spec;
  spec.segments = unique_in_order(spec.segments);
  spec.precisions = unique_in_order(spec.precisions);
  spec.alloc_confs = unique_in_order(spec.alloc_confs);
  if (spec.alloc_confs.empty()) spec.alloc_confs.push_back("");
  result.model = validate_sweep(spec);
  result.device = make_run_device(spec)->info();

  spec.batches = unique_in_order(spec.batches);
  spec.seqs = unique_in_order(spec.seqs);
  const std::vector<std::int64_t> batches = spec.batches.empty() ? std::vector<std::int64_t>{0} : spec.batches;
  const std::vector<std::int64_t> seqs = spec.seqs.empty() ? std::vector<std::int64_t>{0} : spec.seqs;

  const bool has_baseline = std::any_of(spec.segments.begin(), spec.segments.end(),
                                        [](std::size_t k) { return k <= 1; });
  if (spec.parallels.empty()) spec.parallels.emplace_back();
  const std::size_t groups = spec.alloc_confs.size() * spec.precisions.size() * batches.size() * seqs.size() *
                             spec.parallels.size() * std::max<std::size_t>(spec.checkpoints.size(), 1) *
                             std::max<std::size_t>(spec.compiles.size(), 1);
  std::size_t planned = groups * (spec.segments.size() + (has_baseline ? 0 : 1));
  std::size_t done = 0;

  // One group: a setting, a precision and a shape; its rows differ in segment count only.
  struct Group {
    const std::string& conf;
    nn::Precision precision;
    std::int64_t batch;
    std::int64_t seq;
    const nn::ParallelConfig& parallel;
    const std::string& checkpoint;  // a --gradient-checkpointing mode of a list, or ""
    bool unmarked = false;          // the baseline of a model with its own checkpoint marks: none of them
    std::optional<nn::CompileMode> compile;  // torch.compile's budget; nullopt: eager
  };
  const auto run_row = [&](const Group& g, std::size_t segments) {
    SweepRow row;
    row.segments = segments;
    row.precision = g.precision;
    row.alloc_conf = g.conf;
    row.batch = g.batch > 0 ? g.batch : result.model.batch;
    row.seq = g.seq;
    if (batches.size() > 1) row.shape = fmt::format("batch {}", row.batch);
    if (seqs.size() > 1) row.shape += fmt::format("{}seq {}", row.shape.empty() ? "" : " ", row.seq);
    row.parallel = g.parallel;
    row.checkpoint = g.checkpoint;
    row.unmarked = g.unmarked;
    if (spec.parallels.size() > 1) {
      row.shape += (row.shape.empty() ? "" : " ") + (g.parallel.enabled() ? nn::parallel_label(g.parallel) : "1 GPU");
    }
    if (spec.checkpoints.size() > 1) row.shape += (row.shape.empty() ? "" : " ") + ("checkpoint " + g.checkpoint);
    row.compile = g.compile;
    if (!spec.compiles.empty()) row.shape += (row.shape.empty() ? "" : " ") + compile_label(g.compile);
    if (progress) progress(done, planned, row.label());
    const nn::TrainConfig cfg = train_config(spec, row);
    if (cfg.mode == nn::ExecMode::Compute) {
      // The dry run's figures are the computed run's (the runtime guarantees it), in a
      // fraction of the time and host memory: a configuration that does not fit or that
      // PyTorch refuses is reported from it, never computed for minutes first.
      nn::TrainConfig dry = cfg;
      dry.mode = nn::ExecMode::DryRun;
      row.figures = run_config(dry, make_run_device(spec), row.oom, row.error);
      if (!row.oom && !row.error) {
        check_host_memory_for_compute(cfg, result.device);
        row.figures = run_config(cfg, make_run_device(spec), row.oom, row.error);
      }
    } else {
      row.figures = run_config(cfg, make_run_device(spec), row.oom, row.error);
    }
    const std::size_t weights = result.model.parameter_bytes(nn::parameter_dtype(row.precision));
    if (row.oom && row.oom->step == 0 && !row.parallel.shards_parameters() && weights > result.device.total_bytes) {
      // The weights alone outgrow the device: that is the answer, said at once.
      row.weights_alone = static_cast<std::int64_t>(weights);
    }
    // A single tensor larger than the whole device is its own answer (the report says so); the
    // run without the limit would map its terabytes page by page under expandable segments.
    const bool one_tensor_too_large = row.oom && row.oom->figures.requested > result.device.total_bytes;
    // Sharded, each GPU holds at least 1/N of the weights: when that alone outgrows the device
    // the run without the limit is as long as the model is large, for the same answer. (A
    // pipeline stage holds its own layers, which may be less than 1/P of them: no bound there.)
    const nn::ParallelConfig& p = row.parallel;
    const std::size_t shards =
        (p.engine == nn::ParallelEngine::Fsdp || p.engine == nn::ParallelEngine::Zero3 ? p.world_size : 1) *
        p.tensor_parallel;
    const bool share_too_large = row.oom && row.oom->step == 0 && p.shards_parameters() && p.pipeline_parallel == 1 &&
                                 weights / std::max<std::size_t>(shards, 1) > result.device.total_bytes;
    if (share_too_large) row.weights_alone = static_cast<std::int64_t>(weights / std::max<std::size_t>(shards, 1));
    const bool outgrown = row.weights_alone > 0;
    if (row.oom && !one_tensor_too_large &&
        (!outgrown || static_cast<std::size_t>(result.model.parameter_tensors) <= kMaxTensorsForUnlimitedRun)) {
      // What it would have needed: the same run without the capacity limit. Dry run
      // (the runtime guarantees identical statistics to compute mode), so it is cheap.
      nn::TrainConfig dry = cfg;
      dry.mode = nn::ExecMode::DryRun;
      std::optional<OomFailure> again;
      std::optional<AutogradFailure> refused;
      RunFigures needed = run_config(dry, unlimited_twin(result.device), again, refused);
      if (!again && !refused) row.unlimited = std::move(needed);
      // Out of memory before backward reached the error: the row is an error row all the same.
      if (refused) row.error = std::move(refused);
    }
    ++done;
    return row;
  };

  // The row that gets the star: fits (with every gradient; never an OOM or error row),
  // lowest nvidia-smi peak, then least recomputation (equal memory is no reason to recompute
  // more), then lowest max allocated.
  const auto best_of = [](std::span<SweepRow> group) -> SweepRow* {
    SweepRow* best = nullptr;
    for (SweepRow& row : group) {
      if (!row.fits() || row.figures.gradients_missing) continue;
      const auto key = [](const SweepRow& r) {
        return std::tuple(r.figures.peak_device_used, r.figures.recompute_share, r.figures.peak_allocated);
      };
      if (best == nullptr || key(row) < key(*best)) best = &row;
    }
    return best;
  };

  std::map<std::string, std::int64_t> unmarked_base;  // peaks without checkpoint marks, per setting
  const auto run_group = [&](const Group& g) {
    std::vector<SweepRow> rows;
    // FSDP2's and ZeRO-3's hooks wrap the modules, which checkpoint_sequential's segments would
    // cut across: their groups run without segments (checkpointing the blocks is the way there).
    const bool whole = g.parallel.hooks_modules();
    if (whole) {
      planned -= spec.segments.size() - 1;
      rows.push_back(run_row(g, 0));
    } else {
      for (const std::size_t k : spec.segments) {
        if (!rows.empty() && rows.front().weights_alone > 0 && !rows.front().unlimited) {
          // The parameters are allocated before any segment runs, so every count fails there
          // the same way: the first row's failure is theirs (a model of 100,000 layers builds
          // once, not once per count). A row with a run without the limit differs by count.
          SweepRow same = rows.front();
          same.segments = k;
          rows.push_back(std::move(same));
          ++done;
          continue;
        }
        rows.push_back(run_row(g, k));
      }
    }
    if (spec.refine_segments && !whole) refine_around_best(rows, best_of, [&](std::size_t k) {
      ++planned;
      return run_row(g, k);
    });
    const std::size_t first = result.rows.size();
    for (SweepRow& row : rows) result.rows.push_back(std::move(row));
    const std::span<SweepRow> group{result.rows.data() + first, result.rows.size() - first};

    // The baseline: the group's run without checkpointing, or one run just for it. A model
    // whose layers are checkpointed (--gradient-checkpointing) is measured against the same
    // model without: the "none" group of a list, or one run of it.
    const std::string mode = g.checkpoint.empty() ? spec.model_options.checkpoint.value_or("") : g.checkpoint;
    // Its own marks too: a model file's "checkpoint" modules are measured against the same file
    // without them, as --checkpoint-modules naming the same modules is.
    const bool own_marks = result.model.checkpointed_modules > 0 && !spec.checkpoint_modules &&
                           !result.model.checkpoints_by_layer;  // a decoder's marks are its --gradient-checkpointing
    const bool marked = g.compile.has_value() || (!mode.empty() && mode != "none") ||
                        (g.checkpoint.empty() && spec.checkpoint_modules && !spec.checkpoint_modules->empty()) ||
                        (g.checkpoint.empty() && own_marks);
    const std::string key = fmt::format("{}|{}|{}|{}|{}", g.conf, nn::precision_name(g.precision), g.batch, g.seq,
                                        nn::parallel_label(g.parallel));
    std::optional<std::int64_t> base;
    if (marked) {
      // `planned` counted a baseline per group when no segment count is 0: this one, or none.
      if (const auto it = unmarked_base.find(key); it != unmarked_base.end()) {
        base = it->second;
        if (!has_baseline) --planned;
      } else {
        static const std::string none = "none";
        // A compiled group's baseline is the eager step, as the group's own checkpointing has it.
        const Group unmarked = g.compile
                                   ? Group{g.conf, g.precision, g.batch, g.seq, g.parallel, g.checkpoint, false, {}}
                                   : Group{g.conf, g.precision, g.batch, g.seq, g.parallel, none, own_marks, {}};
        if (has_baseline) ++planned;
        result.baselines.push_back(run_row(unmarked, 0));
        base = baseline_peak(result.baselines.back());
      }
    } else {
      for (const SweepRow& row : group) {
        if (row.segments <= 1 && !base) base = baseline_peak(row);
      }
      if (!has_baseline) {
        result.baselines.push_back(run_row(g, 0));
        base = baseline_peak(result.baselines.back());
      }
      if (base) unmarked_base[key] = *base;
    }
    if (base && *base > 0) {
      for (SweepRow& row : group) {
        if (!row.fits()) continue;
        row.saving = *base - row.figures.peak_allocated;
        row.saving_fraction = static_cast<double>(*row.saving) / static_cast<double>(*base);
      }
    }
    if (SweepRow* best = best_of(group)) best->best = true;
  };

  // "none" first, so that the checkpointed modes' savings are measured against its rows.
  std::vector<std::string> modes = spec.checkpoints.empty() ? std::vector<std::string>{""} : spec.checkpoints;
  std::stable_partition(modes.begin(), modes.end(), [](const std::string& m) { return m == "none"; });
  // The eager step first, so that the compiled groups' savings are measured against its rows.
  std::vector<std::optional<nn::CompileMode>> compiles =
      spec.compiles.empty() ? std::vector<std::optional<nn::CompileMode>>{std::nullopt} : spec.compiles;
  std::stable_partition(compiles.begin(), compiles.end(), [](const auto& c) { return !c.has_value(); });
  for (const std::string& conf : spec.alloc_confs) {
    for (const nn::Precision precision : spec.precisions) {
      for (const std::int64_t batch : batches) {
        for (const std::int64_t seq : seqs) {
          for (const nn::ParallelConfig& parallel : spec.parallels) {
            for (const std::string& mode : modes) {
              for (const std::optional<nn::CompileMode>& compile : compiles) {
                run_group(Group{conf, precision, batch, seq, parallel, mode, false, compile});
              }
            }
          }
        }
      }
    }
  }
  const bool refused = std::any_of(result.rows.begin(), result.rows.end(),
                                   [](const SweepRow& r) { return r.error.has_value(); });
  if (refused && !(spec.checkpoint_modules && !spec.checkpoint_modules->empty())) {
    // Which counts would run: a dry run per count, only when one was refused (segment counts
    // say nothing about the modules --checkpoint-modules names).
    SweepRow first;
    first.precision = spec.precisions.front();
    first.alloc_conf = spec.alloc_confs.front();
    first.batch = batches.front();
    first.seq = seqs.front();
    first.parallel = spec.parallels.front();
    result.accepted_segments = accepted_segment_counts(train_config(spec, first), result.device);
  }
  if (progress) progress(done, planned, "done");
  result.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mem::planner
