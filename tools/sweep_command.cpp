// sweep_command.cpp — `vramscope sweep`: options, validation, the run with its
// progress bar, and the output (table, CSV or JSON; optional SVG plot).
#include <fmt/format.h>

#include <charconv>
#include <iostream>
#include <memory>
#include <optional>

#include "commands.hpp"
#include "vramscope/planner/max_batch.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "max_batch_report.hpp"
#include "model_args.hpp"
#include "progress.hpp"
#include "vramscope/planner/sweep.hpp"
#include "sweep_export.hpp"
#include "sweep_plot.hpp"
#include "sweep_report.hpp"
#include "output_paths.hpp"
#include "usage_error.hpp"
#include "vramscope/instrumentation/exports.hpp"

namespace mem::tools {

namespace {

// The default sweep (no --model): a deep, wide-batch mlp on an 8 GB card. Its
// activations (depth x batch x width x 4 B = 8 GiB in f32) do not fit without
// checkpointing; in f16 they do, and checkpointing brings them near the weights.
constexpr std::int64_t kDemoDepth = 256;
constexpr std::int64_t kDemoWidth = 512;
constexpr std::int64_t kDemoBatch = 16384;
constexpr const char* kDemoDtypes = "f32,f16";

struct SweepArgs {
  ModelArgs model;
  std::string device = kDefaultDevice;
  std::string segments = "auto";
  std::string checkpoint_modules;
  std::string selective;
  std::string offload;
  std::string compile;
  std::string dtypes = kDemoDtypes;
  std::vector<std::string> alloc_confs;
  std::size_t steps = 2;
  std::size_t accumulation = 1;
  bool compute = false;
  std::string optimizer = "adam";
  std::string checkpoint_mode = "non-reentrant";
  bool input_requires_grad = false;
  std::string format = "table";
  std::string plot;
  bool brief = false;
  bool max_batch = false;
  ParallelArgs parallel;
};

std::vector<std::size_t> parse_segments(const std::string& text, const nn::ModelInfo& info) {
  // A model that checkpoints its own modules runs as marked: auto is its one configuration.
  if (text == "auto") {
    return info.checkpointed_modules > 0 || !info.sequential_checkpointing ? std::vector<std::size_t>{0}
                                                                           : planner::auto_segments(info.sequence_length);
  }
  std::vector<std::size_t> out;
  for (const std::string& item : split_list("--segments", text)) {
    std::size_t k = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), k);
    if (ec != std::errc{} || ptr != item.data() + item.size()) {
      throw UsageError(fmt::format(
          "--segments: \"{}\" is not a segment count; give counts like 0,2,4,8 (0 = no "
          "checkpointing) or auto",
          item));
    }
    out.push_back(k);
  }
  if (out.empty()) throw UsageError("--segments: empty; give counts like 0,2,4,8 or auto");
  return out;
}

planner::SweepSpec make_spec(const SweepArgs& args) {
  planner::SweepSpec spec;
  ModelArgs model = args.model;
  if (model.model.empty() && model.model_file.empty() && model.hf_config.empty()) {
    // The demo: only the sizes not given on the command line take its values.
    model.model = "mlp";
    if (model.depth == 0) model.depth = kDemoDepth;
    if (model.width == 0) model.width = kDemoWidth;
    if (model.batch.empty() && !args.max_batch) model.batch = std::to_string(kDemoBatch);
  }
  if (!model.hf_config.empty()) model.precisions = parse_precisions("--dtype", args.dtypes);
  // A compiled row needs the joint graph: an --hf-config is then recorded with it.
  model.compile = !args.compile.empty() && args.compile != "eager";
  if (!model.hf_config.empty()) model.expert_parallel = expert_parallel_of(args.parallel);
  spec.model = resolve_model(model, "mlp");
  // --gradient-checkpointing none,non-reentrant: a group of rows per mode (each checked as
  // the model option it is); the model is described with the first.
  if (model.checkpoint.find(',') != std::string::npos) {
    for (const std::string& mode : split_list("--gradient-checkpointing", model.checkpoint)) {
      if (std::find(spec.checkpoints.begin(), spec.checkpoints.end(), mode) != spec.checkpoints.end()) {
        throw UsageError("--gradient-checkpointing: '" + mode + "' is given twice");
      }
      spec.checkpoints.push_back(mode);
    }
    model.checkpoint = spec.checkpoints.front();
  }
  spec.model_options = to_model_options(model, /*lists_allowed=*/true);
  spec.stack = parse_stack(model);
  resolve_checkpoint_default(spec.model_options, spec.stack);
  if (spec.checkpoints.empty() && !model.checkpoint.empty()) {
    (void)as_usage("--gradient-checkpointing", [&] { return spec.model->describe(spec.model_options); });
  }
  for (std::string& mode : spec.checkpoints) {
    nn::ModelOptions with = spec.model_options;
    with.checkpoint = mode;
    resolve_checkpoint_default(with, spec.stack);
    mode = with.checkpoint.value_or(mode);
    (void)as_usage("--gradient-checkpointing", [&] { return spec.model->describe(with); });
  }
  if (auto batches = parse_size_list("--batch", model.batch, nn::kMaxBatch); batches.size() > 1) {
    spec.batches = std::move(batches);
  }
  if (auto seqs = parse_size_list("--seq", model.seq, nn::kMaxSeq); seqs.size() > 1) spec.seqs = std::move(seqs);
  spec.mode = args.compute ? nn::ExecMode::Compute : nn::ExecMode::DryRun;
  spec.device = resolve_device(args.device, spec.mode);
  spec.precisions = parse_precisions("--dtype", args.dtypes);
  spec.alloc_confs = args.alloc_confs.empty() ? std::vector<std::string>{""} : args.alloc_confs;
  spec.steps = args.steps;
  spec.accumulation = args.accumulation;
  spec.optimizer = as_usage("--optimizer", [&] { return nn::parse_optimizer_config(args.optimizer); });
  spec.checkpoint_mode =
      as_usage("--checkpoint", [&] { return nn::parse_checkpoint_mode(args.checkpoint_mode); });
  spec.input_requires_grad = args.input_requires_grad;
  spec.parallels = parse_parallel_args(args.parallel);
  check_parallel_combination(spec.parallels, spec.mode, spec.optimizer);
  if (args.format != "table" && args.format != "csv" && args.format != "json") {
    throw UsageError("--format: \"" + args.format + "\" is not a format; valid: table, csv, json");
  }
  // The model decides what "auto" and the upper bound of --segments mean.
  const nn::ModelInfo info = planner::describe(*spec.model, spec.model_options);
  spec.segments = parse_segments(args.segments, info);
  if (!args.checkpoint_modules.empty()) {
    if (args.segments != "auto" && spec.segments != std::vector<std::size_t>{0}) {
      throw UsageError("--checkpoint-modules: checkpoints the modules named; leave out --segments (or give 0)");
    }
    if (!spec.checkpoints.empty()) {
      throw UsageError("--checkpoint-modules: names the layers itself; give no --gradient-checkpointing list");
    }
    spec.segments = {0};
    spec.checkpoint_modules = parse_checkpoint_modules(args.checkpoint_modules, *spec.model, spec.model_options, 0);
  }
  spec.offload_activations = parse_offload(args.offload);
  spec.compiles = parse_compiles(args.compile, info);
  if (std::any_of(spec.compiles.begin(), spec.compiles.end(), [](const auto& c) { return c.has_value(); })) {
    const bool segments = std::any_of(spec.segments.begin(), spec.segments.end(), [](std::size_t k) { return k > 1; });
    if (segments || !args.checkpoint_modules.empty() || !args.selective.empty() || spec.offload_activations ||
        !spec.checkpoints.empty() || info.checkpointed_modules > 0) {
      throw UsageError("--compile: the partitioner decides what the compiled step recomputes; give no checkpointing "
                       "(--segments 0, no --checkpoint-modules, --selective, --offload or marks), or "
                       "an activation_memory_budget below 1 instead");
    }
    if (spec.parallels.size() > 1 || spec.parallels.front().enabled()) {
      throw UsageError("--compile: one GPU only for now (--parallel is not modelled with it)");
    }
    if (args.max_batch && info.compiled && !info.compiled->fixed.empty()) {
      throw UsageError(fmt::format("--max-batch --compile: {}'s compiled step holds at batch {} only ({}); record "
                                   "it again where one graph holds every batch, or sweep that batch",
                                   info.name, info.compiled->batch, info.compiled->fixed));
    }
  }
  spec.selective = parse_selective(args.selective, info, spec.checkpoint_modules);
  spec.refine_segments = args.segments == "auto" && info.checkpointed_modules == 0 && info.sequential_checkpointing;
  if (args.max_batch) {
    if (!args.model.batch.empty()) {
      throw UsageError("--max-batch: searches the batch size; leave out --batch");
    }
    if (!args.plot.empty()) throw UsageError("--plot: does not apply to --max-batch (the plot is memory vs segments)");
    if (spec.parallels.size() > 1) throw UsageError("--max-batch: searches one --parallel configuration; give one");
    if (!spec.checkpoints.empty()) {
      throw UsageError("--max-batch: searches one --gradient-checkpointing mode; give one");
    }
    // A pipeline's batch fits when every stage's does, unless one stage was asked for.
    spec.every_stage = spec.parallels.front().pipeline_parallel > 1 && !spec.parallels.front().stage_chosen;
    return spec;  // find_max_batches validates the rest
  }
  // FSDP's ranks differ where dim 0 does not split evenly: rank 0 holds the most rows, the
  // last rank the fewest; ZeRO's by the gradients their partitions touch. Unless a rank was
  // asked for, rank 0 and the other that differs most get their rows; pipeline stages all do.
  {
    std::vector<nn::ParallelConfig> ranks;
    for (const nn::ParallelConfig& p : spec.parallels) {
      // Pipeline stages hold different layers and micro-batches in flight: a row each, unless
      // one was asked for.
      if (p.pipeline_parallel > 1 && !p.stage_chosen) {
        for (std::size_t stage = 0; stage < p.pipeline_parallel; ++stage) {
          nn::ParallelConfig other = p;
          other.stage = stage;
          other.stage_chosen = true;
          ranks.push_back(other);
        }
        continue;
      }
      ranks.push_back(p);
      if (p.engine == nn::ParallelEngine::Dp) {
        // nn.DataParallel: GPU 0 holds the module, the others a replica each; GPU 1 shows them.
        if (args.parallel.options.find("gpu=") != std::string::npos) continue;
        nn::ParallelConfig replica = p;
        replica.rank = 1;
        ranks.push_back(replica);
        continue;
      }
      if (args.parallel.options.find("rank=") != std::string::npos) continue;
      if (p.world_size < 2) continue;
      if (p.engine == nn::ParallelEngine::Fsdp && p.context_parallel > 1) {
        // A ring's places differ (the load balancer's steps, the skipped ones without it): its
        // last GPU beside the first, which is also FSDP2's last shard.
        nn::ParallelConfig last = p;
        last.rank = p.world_size - 1;
        ranks.push_back(last);
      } else if (p.engine == nn::ParallelEngine::Fsdp && p.tensor_parallel < 2) {
        const auto model = spec.model->build(spec.model_options);
        if (nn::fsdp_ranks_alike(model->body(), p.world_size)) continue;
        nn::ParallelConfig last = p;
        last.rank = p.world_size - 1;
        ranks.push_back(last);
      } else if (p.engine == nn::ParallelEngine::Zero1 || p.engine == nn::ParallelEngine::Zero2) {
        // ZeRO: the rank whose partition touches the most gradient elements, beside rank 0.
        const auto model = spec.model->build(spec.model_options);
        const std::size_t heaviest = nn::zero_heaviest_rank(model->body(), p.world_size);
        if (heaviest == 0) continue;
        nn::ParallelConfig other = p;
        other.rank = heaviest;
        ranks.push_back(other);
      }
    }
    spec.parallels = std::move(ranks);
  }
  planner::validate_sweep(spec);
  return spec;
}

void write_plot(const std::string& path, const planner::SweepResult& result) {
  try {
    write_output_file(path, sweep_plot_svg(result), "the sweep plot");
  } catch (const mem::Error& e) {
    throw CommandFailed(std::string("--plot: ") + e.what());
  }
}

void print_max_batches(const planner::SweepSpec& spec, const SweepArgs& args, Capture* capture) {
  if (capture != nullptr) {
    capture->document = max_batch_json(planner::find_max_batches(spec, capture->progress));
    return;
  }
  std::unique_ptr<ProgressBar> bar;
  const planner::SweepProgress progress = [&](std::size_t done, std::size_t total, const std::string& item) {
    if (!bar) bar = std::make_unique<ProgressBar>(total);
    bar->update(done, item);
  };
  const planner::MaxBatchResult result = planner::find_max_batches(spec, progress);
  if (bar) bar->finish();
  if (args.format == "csv") {
    std::cout << max_batch_csv(result);
  } else if (args.format == "json") {
    std::cout << max_batch_json(result).dump(2) << "\n";
  } else {
    ReportOptions options;
    options.how_to_read = !args.brief;
    std::cout << max_batch_report(result, options);
  }
  std::cout.flush();
}

void run(const SweepArgs& args, Capture* capture) {
  const planner::SweepSpec spec = make_spec(args);
  if (args.max_batch) return print_max_batches(spec, args, capture);
  check_output_paths({{"--plot", args.plot}},
                     {{"--model-file", args.model.model_file}, {"--hf-config", args.model.hf_config}});
  if (capture != nullptr) {
    const planner::SweepResult result = planner::run_sweep(spec, capture->progress);
    capture->document = sweep_json(result);
    if (!args.plot.empty()) write_plot(args.plot, result);
    return;
  }

  std::unique_ptr<ProgressBar> bar;
  const planner::SweepProgress progress = [&](std::size_t done, std::size_t total, const std::string& item) {
    if (!bar) bar = std::make_unique<ProgressBar>(total);
    bar->update(done, item);
  };
  const planner::SweepResult result = planner::run_sweep(spec, progress);
  if (bar) bar->finish();

  if (args.format == "csv") {
    std::cout << sweep_csv(result);
  } else if (args.format == "json") {
    std::cout << sweep_json(result).dump(2) << "\n";
  } else {
    ReportOptions options;
    options.show_time = args.compute;
    options.how_to_read = !args.brief;
    std::cout << sweep_report(result, options);
  }
  if (!args.plot.empty()) {
    write_plot(args.plot, result);
    (args.format == "table" ? std::cout : std::cerr) << "plot: " << args.plot << "\n";
  }
  std::cout.flush();
}

}  // namespace

void add_sweep_command(CLI::App& app, Capture* capture) {
  auto args = std::make_shared<SweepArgs>();
  CLI::App* cmd = app.add_subcommand(
      "sweep",
      "Train a model for a few steps per configuration (checkpoint segments x dtype x allocator "
      "setting) on a real or simulated GPU and tabulate its memory: allocated, max allocated, max "
      "reserved, what nvidia-smi would show, the saving and the recompute cost, and whether it fits.");
  add_model_options(*cmd, args->model,
                    fmt::format("default: the demo, mlp depth={} width={} batch={}", kDemoDepth,
                                kDemoWidth, kDemoBatch));
  cmd->add_option("-d,--device", args->device,
                  "GPU: sim:<preset> (see `vramscope devices`), sim (sim:a100-80g), sim:capacity=8GiB,context=400MiB, "
                  "cuda:0, auto (cuda:0 if present, else sim:a100-80g); the default is trace's too")
      ->capture_default_str()
      ->type_name("SPEC");
  cmd->add_option("-s,--segments", args->segments,
                  "checkpoint_sequential segment counts, e.g. 0,2,4,8,16 (0 = no checkpointing), or "
                  "auto: 0, powers of two up to 8*sqrt(n), round(sqrt(n)) and n for n sequential "
                  "modules, then the midpoints around each dtype's best until its neighbours are "
                  "adjacent (the * is the minimum of its bracket)")
      ->capture_default_str()
      ->type_name("LIST");
  cmd->add_option("--checkpoint-modules", args->checkpoint_modules,
                  "apply_activation_checkpointing on exactly these modules, e.g. layer3.0,layer3.5 (paths as "
                  "`vramscope trace` prints them; what `vramscope plan` chooses); no segments then")
      ->check(non_empty())
      ->type_name("LIST");
  cmd->add_option("--offload", args->offload, kOffloadHelp)->check(non_empty())->type_name("WHAT");
  cmd->add_option("--selective", args->selective, kSelectiveHelp)->check(non_empty())->type_name("OPS");
  cmd->add_option("--compile", args->compile, kCompileHelp)->check(non_empty())->type_name("LIST");
  cmd->add_option("-t,--dtype", args->dtypes, "precisions: f32, f16, bf16, amp, amp-bf16 (comma list)")
      ->capture_default_str()
      ->type_name("LIST");
  cmd->add_option("-a,--alloc-conf", args->alloc_confs,
                  "allocator setting in PYTORCH_CUDA_ALLOC_CONF syntax, e.g. max_split_size_mb:128 "
                  "(repeatable; each is swept)")
      ->type_name("CONF");
  cmd->add_option("--steps", args->steps, "training steps per configuration (the optimizer state "
                                          "appears at step 1, so step 2 shows the steady peak)")
      ->check(integer_in(1, 1000))
      ->capture_default_str()
      ->type_name("N");
  cmd->add_option("--accumulation", args->accumulation,
                  "gradient accumulation: micro-batches per optimizer step (the gradients accumulate across them, "
                  "alive in every forward after the first; Trainer's gradient_accumulation_steps); the run is that "
                  "many micro-batches, then --steps more")
      ->check(integer_in(1, 1024))
      ->type_name("N");
  cmd->add_flag("--compute", args->compute,
                "real arithmetic on the CPU instead of a dry run (small models); adds a time column (the "
                "mean step after the first, warm-up, step); rows that do not fit are found by a dry run "
                "and not computed");
  cmd->add_option("--optimizer", args->optimizer, kOptimizerHelp)->capture_default_str();
  add_parallel_options(*cmd, args->parallel, /*list=*/true);
  cmd->add_option("--checkpoint", args->checkpoint_mode,
                  "non-reentrant (PyTorch's recommended mode) or reentrant (what PyTorch 2.x uses, with a "
                  "warning, when use_reentrant is not given; it needs --input-requires-grad to "
                  "give the first segment's parameters gradients)")
      ->capture_default_str();
  cmd->add_flag("--input-requires-grad", args->input_requires_grad,
                "the batch requires grad, as x.requires_grad_() before checkpoint_sequential");
  cmd->add_option("-f,--format", args->format, "table, csv or json")->capture_default_str();
  cmd->add_option("--plot", args->plot, "also write an SVG of the memory curves vs segment count")
      ->check(non_empty())
      ->type_name("FILE.svg");
  cmd->add_flag("--max-batch", args->max_batch,
                "instead of running one batch: find, for each dtype x segments x setting (x seq), the "
                "largest batch that fits on the device (doubling, then bisection, with dry runs), with "
                "its peaks and where one more sample runs out");
  cmd->add_flag("--brief", args->brief, "leave out the 'how to read this' note");
  cmd->footer(
      "Examples:\n"
      "  vramscope sweep                                   # the demo: a deep mlp on an RTX 2080 SUPER\n"
      "  vramscope sweep --model resnet50 --batch 128 --device sim:a100-40g --dtype f32,amp\n"
      "  vramscope sweep --model gpt2 --batch 8 --segments 0,2,3,4,6,12 --device sim:v100-32g\n"
      "  vramscope sweep --model resnet50 --batch 32,64,128 --segments 0,4 --device sim:rtx4090\n"
      "  vramscope sweep --model resnet50 --max-batch --dtype f32,amp --segments 0,2,4,8 --device sim:a100-80g\n"
      "  vramscope sweep --model gpt2 --batch 4 --seq 256,512,1024 --dtype amp\n"
      "  vramscope sweep --model llama-3.2-1b --seq 2048 --dtype bf16 --parallel none,ddp:8 --device sim:h100-80g\n"
      "  vramscope sweep --model forum-cnn --compute --segments 0,2,4 --steps 3\n"
      "  vramscope sweep -a '' -a max_split_size_mb:128 --format csv > sweep.csv\n"
      "  vramscope sweep --plot sweep.svg\n"
      "Every figure is read from the caching allocator after real (dry-run or --compute) steps;\n"
      "the simulated device's assumptions are printed under the table.");
  cmd->callback([args, capture] { run(*args, capture); });
}

}  // namespace mem::tools
