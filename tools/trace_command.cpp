// trace_command.cpp — `vramscope trace`: one training step with the per-module
// memory log, a per-phase table, and the exports (PyTorch snapshot pickle,
// Perfetto timeline, SVG plot, memory_summary).
#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "vramscope/planner/accepted_segments.hpp"
#include "commands.hpp"
#include "model_args.hpp"
#include "module_log.hpp"
#include "sweep_export.hpp"
#include "sweep_report.hpp"
#include "table.hpp"
#include "vramscope/planner/host_memory.hpp"
#include "output_paths.hpp"
#include "vramscope/planner/saved_tensors.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/memory_logger.hpp"
#include "vramscope/instrumentation/snapshot.hpp"
#include "vramscope/instrumentation/summary.hpp"
#include "vramscope/instrumentation/timeline.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::tools {

namespace {

/// Events kept for the snapshot's device_traces (80 B each): enough for a step
/// of gpt2-xl; older events are dropped first, as PyTorch's ring does.
constexpr std::size_t kHistoryEntries = std::size_t{1} << 19;

struct TraceArgs {
  ModelArgs model;
  std::string device = kDefaultDevice;
  std::string dtype = "f32";
  std::size_t segments = 0;
  std::string checkpoint_modules;
  std::string selective;
  std::string offload;
  std::string compile;
  std::string alloc_conf;
  std::size_t steps = 1;
  bool compute = false;
  std::string optimizer = "adam";
  std::string checkpoint_mode = "non-reentrant";
  bool input_requires_grad = false;
  std::size_t max_depth = 0;
  bool no_pre = false;
  std::string snapshot;
  std::string timeline;
  std::string plot;
  std::string saved;
  std::string log;
  std::string buffers;
  bool summary = false;
  ParallelArgs parallel;
  std::size_t accumulation = 1;
  /// A library caller's (command_json.hpp): the log, figures and plot as a document, nothing printed.
  Capture* capture = nullptr;
};

nn::TrainConfig make_config(const TraceArgs& args) {
  nn::TrainConfig cfg;
  ModelArgs model_args = args.model;
  if (!model_args.hf_config.empty()) model_args.precisions = parse_precisions("--dtype", args.dtype);
  model_args.compile = !args.compile.empty() && args.compile != "eager";
  if (!model_args.hf_config.empty()) model_args.expert_parallel = expert_parallel_of(args.parallel);
  cfg.model = resolve_model(model_args, "resnet18");
  cfg.model_options = to_model_options(args.model);
  cfg.stack = parse_stack(args.model);
  resolve_checkpoint_default(cfg.model_options, cfg.stack);
  const nn::ModelInfo info = planner::describe(*cfg.model, cfg.model_options);
  cfg.mode = args.compute ? nn::ExecMode::Compute : nn::ExecMode::DryRun;
  cfg.device = resolve_device(args.device, cfg.mode);
  planner::check_device(cfg.device, cfg.mode);
  const auto precisions = parse_precisions("--dtype", args.dtype);
  if (precisions.size() != 1) throw UsageError("--dtype: trace runs one precision; give one of f32, f16, bf16, amp, amp-bf16");
  cfg.precision = precisions.front();
  planner::check_alloc_conf(args.alloc_conf);
  cfg.alloc_conf = args.alloc_conf;
  if (args.segments > 1 && info.operators > 0) {
    throw UsageError(fmt::format("--segments: {} is an operator graph, not a chain of modules checkpoint_sequential "
                                 "could split; checkpoint its module calls by path (--checkpoint-modules) instead",
                                 info.name));
  }
  if (args.segments > 1 && !info.sequential_checkpointing) {
    throw UsageError(fmt::format("--segments: {} checkpoints per decoder layer, as gradient_checkpointing_enable() "
                                 "does; give --gradient-checkpointing reentrant (or non-reentrant) instead",
                                 info.name));
  }
  if (args.segments > 1 && info.checkpointed_modules > 0) {
    throw UsageError(fmt::format("--segments: {} checkpoints {} of its modules itself (checkpoint marks in the "
                                 "file), so checkpoint_sequential's segments do not apply; leave out --segments",
                                 info.name, info.checkpointed_modules));
  }
  if (args.segments > info.sequence_length) {
    throw UsageError(fmt::format("--segments: {} is more than the {} sequential modules {} has; "
                                 "valid: 0 (no checkpointing) to {}",
                                 args.segments, info.sequence_length, info.name, info.sequence_length));
  }
  cfg.segments = std::max<std::size_t>(args.segments, 1);
  cfg.checkpoint_modules = parse_checkpoint_modules(args.checkpoint_modules, *cfg.model, cfg.model_options, args.segments);
  cfg.offload_activations = parse_offload(args.offload);
  cfg.selective = parse_selective(args.selective, info, cfg.checkpoint_modules);
  const auto compiles = parse_compiles(args.compile, info);
  if (compiles.size() > 1) throw UsageError("--compile: trace runs one setting; give eager, on, one budget or reduce-overhead");
  if (!compiles.empty()) cfg.compile = compiles.front();
  if (cfg.compile && cfg.compile->cudagraphs && cfg.steps < nn::kCudaGraphSteps) {
    throw UsageError(fmt::format("--compile reduce-overhead: CUDA graph trees warm each graph up at its first call, "
                                 "record it at the second and replay it from the third; give --steps {} or more (got {})",
                                 nn::kCudaGraphSteps, cfg.steps));
  }
  if (args.steps < 1) throw UsageError("--steps: must be at least 1");
  cfg.steps = args.steps;
  if (args.accumulation > 1) planner::accumulate(cfg, args.accumulation, args.steps);
  cfg.optimizer = as_usage("--optimizer", [&] { return nn::parse_optimizer_config(args.optimizer); });
  const auto parallels = parse_parallel_args(args.parallel);
  if (parallels.size() != 1) throw UsageError("--parallel: trace runs one configuration; give one of " + args.parallel.spec);
  cfg.parallel = parallels.front();
  check_parallel_combination(parallels, cfg.mode, cfg.optimizer);
  cfg.checkpoint_mode =
      as_usage("--checkpoint", [&] { return nn::parse_checkpoint_mode(args.checkpoint_mode); });
  cfg.input_requires_grad = args.input_requires_grad;
  return cfg;
}

void collect_types(const nn::Module& m, std::unordered_map<std::string, std::string>& out) {
  if (!m.path().empty()) out.emplace(m.path(), m.type_name());
  for (const auto& [name, child] : m.children()) collect_types(*child, out);
}

/// The logger's type callback: "layer1.0.conv1" -> "Conv2d", "" for a scope that
/// is not a module of the model ("input", "loss").
ModuleTypeFn module_types(nn::Model& model) {
  auto types = std::make_shared<std::unordered_map<std::string, std::string>>();
  collect_types(model.body(), *types);
  return [types](std::string_view path) {
    const auto it = types->find(std::string(path));
    return it == types->end() ? std::string() : it->second;
  };
}

Table phase_table(const std::vector<nn::StepStats>& steps) {
  Table t{{{"step", Align::Right},
           {"phase", Align::Left},
           {"allocated before", Align::Right},
           {"after", Align::Right},
           {"max alloc", Align::Right},
           {"max reserved", Align::Right},
           {"max nvidia-smi", Align::Right},
           {"blocks", Align::Right}}};
  for (const nn::StepStats& s : steps) {
    const std::pair<const char*, const nn::PhaseStats*> phases[] = {
        {"forward", &s.forward}, {"backward", &s.backward}, {"optimizer", &s.optimizer}};
    for (const auto& [name, p] : phases) {
      t.add_row({std::to_string(s.step), name, human_bytes(p->allocated_begin),
                 human_bytes(p->allocated_end), human_bytes(p->peak_allocated),
                 human_bytes(p->peak_reserved), human_bytes(p->peak_device_used),
                 human_count(p->allocations)});
    }
  }
  return t;
}

template <class F>
void write_file(std::ostream& out, const char* option, const std::string& path, F&& write) {
  try {
    write();
  } catch (const mem::Error& e) {
    throw CommandFailed(std::string(option) + ": " + one_line(e.what()));
  }
  out << fmt::format("{:<10} {}\n", std::string(option).substr(2) + ":", path);
}

/// --saved: module,type,tensors,bytes, a row per module in the order of its first save.
std::string saved_csv(const planner::SavedTensorLog& log, const ModuleTypeFn& type_of) {
  std::string out = "module,type,tensors,bytes\n";
  for (const planner::SavedByModule& r : log.rows()) {
    out += fmt::format("{},{},{},{}\n", csv_field(r.module), csv_field(type_of(r.module)), r.tensors, r.bytes);
  }
  return out;
}

/// --buffers: one row per buffer, CSV (or JSON by the extension).
std::string buffers_text(const std::vector<nn::CommunicationBuffer>& buffers, const std::string& path) {
  if (path.ends_with(".json")) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& b : buffers) {
      rows.push_back({{"buffer", b.what}, {"bytes", b.bytes}, {"stream", b.stream}, {"allocated", b.allocated},
                      {"freed", b.freed.empty() ? nlohmann::json(nullptr) : nlohmann::json(b.freed)}});
    }
    return rows.dump(1) + "\n";
  }
  std::string out = "buffer,bytes,stream,allocated,freed\n";
  for (const auto& b : buffers) {
    out += csv_field(b.what) + "," + std::to_string(b.bytes) + "," + csv_field(b.stream) + "," + csv_field(b.allocated) +
           "," + csv_field(b.freed) + "\n";
  }
  return out;
}

/// The command's exit 1 for a step that ran out of memory or that autograd refused.
void raise_failure(const nn::TrainConfig& cfg, const DeviceInfo& device, const std::optional<std::string>& oom,
                   const std::optional<planner::AutogradFailure>& refused) {
  if (oom) throw CommandFailed("out of memory (the log above shows where); try --segments, a smaller --batch or --dtype f16");
  if (refused && !refused->inplace) {
    // Another refusal (a graph without grad, ...): its own first line, not the in-place advice.
    const std::string& m = refused->message;
    throw CommandFailed("backward failed as it does on PyTorch: " + m.substr(0, m.find('\n')));
  }
  if (refused && cfg.checkpoint_modules && !cfg.checkpoint_modules->empty()) {
    // Not a segment count: a module named in --checkpoint-modules writes its own input.
    throw CommandFailed("backward failed as it does on PyTorch: a module under --checkpoint-modules modified its own "
                        "input in place, which checkpoint() saved (see above); checkpoint the module that contains "
                        "it instead, or make the op out of place (inplace=False)");
  }
  if (refused) {
    throw CommandFailed(fmt::format(
        "backward failed as it does on PyTorch: a tensor saved for backward was modified by an in-place op "
        "(see above); --segments that {} accepts: {}",
        cfg.model->name(), planner::describe_segment_counts(planner::accepted_segment_counts(cfg, device))));
  }
}

void run(const TraceArgs& args) {
  check_output_paths({{"--snapshot", args.snapshot},
                      {"--timeline", args.timeline},
                      {"--plot", args.plot},
                      {"--saved", args.saved},
                      {"--log", args.log},
                      {"--buffers", args.buffers}},
                     {{"--model-file", args.model.model_file}, {"--hf-config", args.model.hf_config}});
  if (!args.log.empty()) ModuleLog::check_path("--log", args.log);
  if (!args.buffers.empty()) ModuleLog::check_path("--buffers", args.buffers);
  const nn::TrainConfig cfg = make_config(args);
  // A library caller gets what would be printed in its document, not on the terminal.
  std::ostringstream captured;
  std::ostream& out = args.capture != nullptr ? captured : std::cout;
  if (!args.buffers.empty() && !cfg.parallel.enabled()) {
    throw UsageError("--buffers: lists a data-parallel engine's communication buffers; give --parallel ddp:N");
  }
  const nn::ModelInfo info = cfg.model->describe(cfg.model_options);
  const auto device = make_device(nn::device_spec_for(cfg));
  planner::check_host_memory_for_compute(cfg, device->info());
  CachingAllocator allocator{device, AllocatorConfig::parse(cfg.alloc_conf)};
  attach(allocator);

  std::optional<History> history;
  if (!args.snapshot.empty()) history.emplace(allocator, kHistoryEntries);
  std::optional<Timeline> timeline;
  if (!args.timeline.empty() || !args.plot.empty() || args.capture != nullptr) timeline.emplace(allocator);

  out << fmt::format(
      "vramscope trace: {}, {}, {} segment{}, {}, {} step{}, on {}{}\n\n",
      model_title(info, cfg.model_options), nn::precision_name(cfg.precision),
      args.segments, args.segments == 1 ? "" : "s", nn::exec_mode_name(cfg.mode), cfg.steps,
      cfg.steps == 1 ? "" : "s", device->info().name, per_gpu({cfg.parallel}));

  std::unique_ptr<nn::Trainer> trainer;
  std::vector<nn::StepStats> steps;
  std::optional<std::string> oom;
  std::optional<planner::AutogradFailure> refused;  // an nn::AutogradError: PyTorch raises it too
  std::optional<planner::SavedTensorLog> saved;
  ModuleLog module_log;
  try {
    trainer = std::make_unique<nn::Trainer>(cfg, allocator);  // allocates the parameters
  } catch (const OutOfMemoryError& e) {
    oom = one_line(e.what());
  }
  if (trainer) {
    out << fmt::format("parameters and buffers{} allocated: {} ({} reserved, {} in nvidia-smi's view)\n\n",
                             cfg.parallel.engine == nn::ParallelEngine::Ddp    ? ", and DDP's gradient buckets,"
                             : cfg.parallel.engine == nn::ParallelEngine::Fsdp ? " (FSDP's shards),"
                             : cfg.parallel.engine == nn::ParallelEngine::Zero3
                                 ? " (ZeRO-3's partitions, master partition, gradient bucket and gradient partitions),"
                             : cfg.parallel.enabled() ? " (ZeRO's flat buffer and master partition),"
                                                                                : "", human_bytes(allocator.stats().allocated_bytes[0].current),
                             human_bytes(allocator.stats().reserved_bytes[0].current),
                             human_bytes(allocator.stats().device_used_bytes.current));
    MemoryLogger log{allocator, out,
                     {.pre_hooks = !args.no_pre,
                      .max_depth = args.max_depth,
                      .device_line = false,  // printed at the end, after the files
                      .module_type = module_types(trainer->model()),
                      .on_row = [&](const MemoryLogRow& row) { module_log.add(row); }}};
    if (!args.saved.empty()) saved.emplace(trainer->model().body());
    try {
      for (std::size_t i = 0; i < cfg.steps; ++i) {
        std::optional<nn::SavedTensorsObserver> observe;  // the first step's forward
        if (saved && i == 0) observe.emplace(saved->observer());
        steps.push_back(trainer->step());
      }
    } catch (const OutOfMemoryError& e) {
      oom = one_line(e.what());
    } catch (const RequestTooLargeError& e) {
      // On a GPU cudaMalloc fails and PyTorch raises its out-of-memory error.
      oom = fmt::format("{}, {}: asked for {}, more than any GPU holds; lower --batch or --seq",
                        context_info(e.context()).path, phase_name(context_info(e.context()).phase),
                        format_bytes(e.figures().requested));
    } catch (const nn::AutogradError& e) {
      refused = planner::autograd_failure(e, steps.size() + 1);
    }
    log.finish();
    // Why the optimizer phase lists every module several times (issue 36).
    if (cfg.optimizer.kind == nn::OptimizerKind::Adam && cfg.optimizer.foreach && !steps.empty()) {
      out << wrap("note: Adam's foreach step (PyTorch's default on a GPU) goes over the parameters in "
                        "passes, so each module appears once per pass: its state at the first step "
                        "(exp_avg, exp_avg_sq), the moments (_foreach_lerp_, _foreach_mul_, "
                        "_foreach_addcmul_), the square roots (_foreach_sqrt: one temporary per parameter, "
                        "alive until the update) and the update (_foreach_addcdiv_).",
                        "", "  ");
    }
  }
  if (timeline) timeline->stop();

  if (!steps.empty()) {
    out << "\nper phase (peaks within each phase; allocated counts the batch and the output):\n"
              << phase_table(steps).render("  ");
    const nn::TrainReport report = trainer->report();
    out << fmt::format(
        "  parameters {}{}, optimizer state {}{}; over the run: max allocated {}, max reserved {}, max "
        "nvidia-smi {}\n",
        human_bytes(report.parameter_bytes), report.parameters_on_host ? " (on the host)" : "",
        human_bytes(report.optimizer_state_bytes), report.optimizer_state_on_host ? " (on the host)" : "",
        human_bytes(report.peak_allocated), human_bytes(report.peak_reserved),
        human_bytes(report.peak_device_used));
    if (cfg.offload_activations) {
      out << wrap(fmt::format("Activations offloaded (save_on_cpu, pin_memory=True): {} of pinned host memory, in "
                              "PyTorch's caching host allocator's power-of-two blocks, kept for reuse.",
                              human_bytes(report.pinned_host_bytes)),
                  "  ", "    ");
    }
    if (report.peak_composition.total() > 0) {
      out << wrap(fmt::format("The peak of {}{} holds: {}.", human_bytes(report.peak_allocated),
                                    describe_peak_moment(report.peak_composition),
                                    describe_composition(report.peak_composition)),
                        "  ", "    ");
    }
    if (cfg.mode == nn::ExecMode::Compute) {
      for (const nn::StepStats& st : steps) {
        out << fmt::format("  step {}: {} on the CPU{}, loss {:.6g}\n", st.step, human_ms(st.wall_ms),
                                 st.step == 1 ? " (warm-up included: OpenBLAS's threads, first touches)" : "",
                                 st.loss);
      }
    }
    for (const std::string& w : report.warnings) out << "  warning: " << w << "\n";
  }
  if (oom) out << "\nout of memory: " << *oom << "\n";
  if (refused) {
    out << "\nautograd error, as PyTorch raises it for this configuration, " << describe_place(*refused)
              << ": " << one_line(refused->message) << "\n";
  }

  if (args.summary) out << "\n" << memory_summary(allocator);
  if (!args.snapshot.empty() || timeline || saved) out << "\n";
  if (!args.snapshot.empty()) {
    SnapshotOptions so;
    so.segments = true;
    so.history = true;
    so.history_source = &*history;
    const Snapshot snap = snapshot(allocator, so);
    // memory_viz names each block by module (with its class) and phase; what a module made
    // outside the step's phases (its parameters and buffers, at construction) says so.
    const PickleOptions po{.module_type = trainer ? module_types(trainer->model()) : ModuleTypeFn{},
                           .unscoped = "outside any module",
                           .none_phase = "parameters and buffers"};
    write_file(out, "--snapshot", args.snapshot, [&] { write_memory_snapshot_pickle(snap, args.snapshot, po); });
  }
  if (saved) {
    write_file(out, "--saved", args.saved, [&] {
      write_output_file(args.saved, saved_csv(*saved, module_types(trainer->model())), "the saved-tensor CSV");
    });
    out << fmt::format("           {} saved for backward in step 1's forward, in {} modules\n",
                             human_bytes(saved->total_bytes()), saved->rows().size());
  }
  const nlohmann::json about = {{"model", info.name}, {"device", device->info().name},
                                {"dtype", nn::precision_name(cfg.precision)},
                                {"segments", cfg.segments <= 1 ? 0 : cfg.segments},
                                {"optimizer", nn::optimizer_label(cfg.optimizer)},
                                {"stack", cfg.stack.to_string()}};
  if (!args.log.empty()) {
    write_file(out, "--log", args.log, [&] { module_log.write(args.log, about); });
  }
  if (!args.buffers.empty()) {
    const std::vector<nn::CommunicationBuffer> buffers = trainer ? trainer->communication_buffers()
                                                                 : std::vector<nn::CommunicationBuffer>{};
    write_file(out, "--buffers", args.buffers, [&] { write_output_file(args.buffers, buffers_text(buffers, args.buffers),
                                                                 "the communication buffers"); });
    out << fmt::format("           {} communication buffers of {}\n", buffers.size(),
                             nn::parallel_label(cfg.parallel));
  }
  if (!args.timeline.empty()) {
    write_file(out, "--timeline", args.timeline, [&] { write_perfetto_trace(*timeline, args.timeline); });
  }
  PlotOptions plot;
  plot.title = fmt::format("{} batch {} ({}), {} training step{}, {} segments, on {}", info.name, info.batch,
                           nn::precision_name(cfg.precision), cfg.steps, cfg.steps == 1 ? "" : "s",
                           cfg.segments <= 1 ? 0 : cfg.segments, device->info().name);
  if (!args.plot.empty()) {
    write_file(out, "--plot", args.plot, [&] { write_memory_plot_svg(*timeline, args.plot, plot); });
  }
  out << "\ndevice: " << device->info().assumptions << "\nstack: " << cfg.stack.to_string() << " (--stack)\n";
  out << assumptions_note(info.assumed);
  out << parallel_note({cfg.parallel}, device->info());
  out.flush();
  if (args.capture != nullptr) {
    nlohmann::json& doc = args.capture->document;
    doc = about;
    doc["device"] = device_json(device->info());
    doc["modules"] = module_log.json({})["lines"];
    if (trainer && !steps.empty()) {
      const nn::TrainReport report = trainer->report();
      doc["max_allocated"] = report.peak_allocated;
      doc["max_reserved"] = report.peak_reserved;
      doc["max_nvidia_smi"] = report.peak_device_used;
      doc["warnings"] = report.warnings;
    }
    doc["plot"] = memory_plot_svg(*timeline, plot);
    doc["text"] = captured.str();
    trainer.reset();
    try {
      raise_failure(cfg, device->info(), oom, refused);
    } catch (const CommandFailed& e) {
      doc["failure"] = e.what();  // the log up to it stands, as the command's does
    }
    return;
  }
  trainer.reset();  // frees the model before the allocator goes
  raise_failure(cfg, device->info(), oom, refused);
}

}  // namespace

void add_trace_command(CLI::App& app, Capture* capture) {
  auto args = std::make_shared<TraceArgs>();
  args->capture = capture;
  CLI::App* cmd = app.add_subcommand(
      "trace",
      "Run one training step of a model and print the per-module memory log: the module tree "
      "indented, one line per pre-forward / forward / backward hook, the change since the "
      "previous line, and the totals; export a PyTorch memory snapshot, a Perfetto timeline, an "
      "SVG plot.");
  add_model_options(*cmd, args->model, "default: resnet18");
  cmd->add_option("-d,--device", args->device,
                  "GPU: sim:<preset> (see `vramscope devices`), sim (sim:a100-80g), sim:capacity=8GiB,context=400MiB, cuda:N, "
                  "auto (cuda:0 if present, else sim:a100-80g); the default is sweep's too")
      ->capture_default_str()
      ->type_name("SPEC");
  cmd->add_option("-t,--dtype", args->dtype, "f32, f16, bf16, amp or amp-bf16")->capture_default_str();
  cmd->add_option("--checkpoint-modules", args->checkpoint_modules,
                  "apply_activation_checkpointing on exactly these modules, e.g. layer3.0,layer3.5 (paths as this "
                  "log prints them; what `vramscope plan` chooses)")
      ->check(non_empty())
      ->type_name("LIST");
  cmd->add_option("--offload", args->offload, kOffloadHelp)->check(non_empty())->type_name("WHAT");
  cmd->add_option("--selective", args->selective, kSelectiveHelp)->check(non_empty())->type_name("OPS");
  cmd->add_option("--compile", args->compile,
                  "torch.compile's step instead of the eager one: on (AOTAutograd's default partition), an "
                  "activation_memory_budget from 0 to 1, or reduce-overhead[:BUDGET] (CUDA graphs in their private "
                  "pool; with --steps 3: warmup, recording, replay); the file must carry the joint graph "
                  "(vramscope.export ... --compile); its buffers show under `compiled forward` and `compiled backward`")
      ->check(non_empty())
      ->type_name("SETTING");
  cmd->add_option("-s,--segments", args->segments, "checkpoint_sequential segments (0 = none)")
      ->capture_default_str()
      ->type_name("N");
  cmd->add_option("-a,--alloc-conf", args->alloc_conf,
                  "allocator setting in PYTORCH_CUDA_ALLOC_CONF syntax")
      ->type_name("CONF");
  cmd->add_option("--steps", args->steps, "training steps to log")
      ->check(integer_in(1, 1000))
      ->capture_default_str();
  cmd->add_flag("--compute", args->compute, "real arithmetic on the CPU instead of a dry run");
  cmd->add_option("--optimizer", args->optimizer, kOptimizerHelp)->capture_default_str();
  add_parallel_options(*cmd, args->parallel);
  cmd->add_flag("--input-requires-grad", args->input_requires_grad,
                "the batch requires grad, as x.requires_grad_() before checkpoint_sequential");
  cmd->add_option("--checkpoint", args->checkpoint_mode,
                  "non-reentrant (PyTorch's recommended mode) or reentrant (what PyTorch 2.x uses, with a "
                  "warning, when use_reentrant is not given; it needs --input-requires-grad to "
                  "give the first segment's parameters gradients)")
      ->capture_default_str();
  cmd->add_option("--accumulation", args->accumulation,
                  "gradient accumulation: micro-batches per optimizer step, as sweep's (the run is that many "
                  "micro-batches, then --steps more)")
      ->check(integer_in(1, 1024))
      ->type_name("N");
  cmd->add_option("--max-depth", args->max_depth, "log modules up to this depth (0 = all)")
      ->check(integer_in(0, 1000))
      ->type_name("N");
  cmd->add_flag("--no-pre", args->no_pre, "leave out the pre-forward / pre-backward lines");
  cmd->add_option("--snapshot", args->snapshot,
                  "write PyTorch's memory snapshot (drag into pytorch.org/memory_viz)")
      ->type_name("FILE.pickle");
  cmd->add_option("--timeline", args->timeline,
                  "write a Chrome/Perfetto trace (ui.perfetto.dev): memory counters and module slices")
      ->type_name("FILE.json");
  cmd->add_option("--plot", args->plot, "write an SVG of memory over the step")->type_name("FILE.svg");
  cmd->add_option("--log", args->log,
                  "also write the per-module log above as CSV or JSON (by the extension): hook, module, "
                  "type, depth and the figures in bytes, one row per line")
      ->type_name("FILE.csv|json");
  cmd->add_option("--buffers", args->buffers,
                  "with --parallel: write every communication buffer the engine allocated (DDP's gradient "
                  "buckets, broadcast copies, shape checks; FSDP's all-gather outputs, unsharded parameters, reduce-scatter inputs "
                  "and outputs; ZeRO's flat parameters, master partition, gradient buckets and gradient partitions; ZeRO-3's partitions, each module's gathers and the reduce-scatters; a recording's collectives, expert parallel's all-to-alls) with its bytes, stream and lifetime, as CSV or JSON "
                  "(by the extension)")
      ->type_name("FILE.csv|json");
  cmd->add_option("--saved", args->saved,
                  "write what each module keeps for backward in the first forward (CSV: module, type, tensors, "
                  "bytes; each storage once, under the module that saved it first; parameters left out), as "
                  "torch.autograd.graph.saved_tensors_hooks counts it")
      ->type_name("FILE.csv");
  for (const char* name : {"--snapshot", "--timeline", "--plot", "--saved", "--log", "--buffers", "--segments"}) {
    cmd->get_option(name)->check(non_empty());
  }
  cmd->add_flag("--summary", args->summary, "print torch.cuda.memory_summary()'s table at the end");
  cmd->footer(
      "Examples:\n"
      "  vramscope trace --model resnet18 --batch 128 --max-depth 2\n"
      "  vramscope trace --model forum-cnn --compute --summary\n"
      "  vramscope trace --model forum-cnn-full --device sim:rtx2080s --snapshot oom.pickle\n"
      "  vramscope trace --model gpt2 --batch 4 --dtype amp --timeline gpt2.json --plot gpt2.svg\n"
      "  vramscope trace --model mlp --depth 64 --segments 8 --no-pre\n"
      "Out of memory: the log up to the failure and the files are still written; exit code 1.\n"
      "A configuration PyTorch's autograd refuses (a checkpointed segment that begins with an\n"
      "in-place ReLU modifies the input it saved) prints PyTorch's error the same way; exit code 1.");
  cmd->callback([args] { run(*args); });
}

}  // namespace mem::tools
