// plan_command.cpp — `vramscope plan`: options, the search with its progress bar, the
// table or JSON, and the best plan's PyTorch code (--code).
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <iostream>
#include <memory>
#include <system_error>

#include "commands.hpp"
#include "layout_report.hpp"
#include "model_args.hpp"
#include "output_paths.hpp"
#include "vramscope/planner/layout_search.hpp"
#include "vramscope/planner/max_batch.hpp"
#include "vramscope/planner/plan.hpp"
#include "plan_report.hpp"
#include "progress.hpp"
#include "usage_error.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/files.hpp"

namespace mem::tools {

namespace {

struct PlanArgs {
  ModelArgs model;
  std::string device = kDefaultDevice;
  std::string dtype = "f32";
  std::string alloc_conf;
  std::string optimizer = "adam";
  ParallelArgs parallel;
  std::string search = "selective,compile,allocator,loss,accumulation,precision,optimizer";
  std::size_t top = 8;
  std::string format = "table";
  std::string code;
  std::string model_out;
  std::string headroom = "5%";
  bool max_batch = false;
  bool brief = false;
  std::size_t gpus = 0;  ///< --gpus, with --parallel auto
};

/// --max-batch: the largest batch any checkpointing fits, found with the most saving uniform
/// one (every repeated block; else checkpoint_sequential at sqrt(n) segments) by --max-batch's
/// doubling and bisection, leaving `headroom` free. Returns it (0: not even batch 1), and says how
/// it was found in `how`.
std::int64_t largest_checkpointed_batch(const planner::SweepSpec& base, std::size_t headroom, std::string& how) {
  planner::SweepSpec spec = base;
  spec.headroom = headroom;  // the batch leaves the headroom free
  planner::SweepRow row;
  row.precision = base.precisions.front();
  row.alloc_conf = base.alloc_confs.front();
  row.parallel = base.parallels.front();
  const auto model = base.model->build(base.model_options);
  const nn::ModelInfo& info = model->info();
  std::vector<std::string> blocks;
  model->body().set_path("");
  for (const nn::Module* m : nn::repeated_blocks(model->body())) blocks.push_back(m->path());
  if (!blocks.empty()) {
    spec.checkpoint_modules = blocks;
    if (info.checkpoints_by_layer) spec.model_options.checkpoint = "non-reentrant";
    how = fmt::format("every one of the {} repeated blocks checkpointed", blocks.size());
  } else if (info.sequential_checkpointing && info.checkpointed_modules == 0 && info.sequence_length > 1 &&
             !row.parallel.enabled()) {
    row.segments = static_cast<std::size_t>(std::lround(std::sqrt(static_cast<double>(info.sequence_length))));
    how = fmt::format("checkpoint_sequential with {} segments", row.segments);
  } else {
    how = "no checkpointing (the model has no blocks to checkpoint)";
  }
  return planner::find_max_batch(spec, row).max_batch;
}

/// --headroom as typed: bytes ("1GiB", "0") or a share of the device's memory ("5%"), in whole MiB.
std::size_t headroom_as_given(const std::string& text, const planner::SweepSpec& base) {
  if (!text.empty() && text.back() == '%') {
    double percent = -1;
    const std::string number = text.substr(0, text.size() - 1);
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), percent);
    if (ec != std::errc{} || end != number.data() + number.size() || !(percent >= 0 && percent <= 90)) {
      throw UsageError("--headroom: \"" + text + "\" is not a share of the device; give 0% to 90% or a size (1GiB)");
    }
    const double total = static_cast<double>(planner::make_run_device(base)->info().total_bytes);
    return static_cast<std::size_t>(total * percent / 100.0) / (std::size_t{1} << 20) * (std::size_t{1} << 20);
  }
  return as_usage("--headroom", [&] { return parse_bytes(text, /*allow_zero=*/true); });
}

/// --headroom, checked against the device: bytes ("1GiB", "0") or a share of its memory ("5%",
/// the default: what cuDNN's benchmark workspaces, NCCL, a second process or the data loader's
/// CUDA tensors take beside the step, which a plan to the last MiB leaves no room for).
std::size_t headroom_bytes(const std::string& text, const planner::SweepSpec& base) {
  planner::check_device(base.device, nn::ExecMode::DryRun);
  const std::size_t bytes = headroom_as_given(text, base);
  planner::SweepSpec with_room = base;
  with_room.headroom = bytes;
  (void)planner::make_run_device(with_room);  // a UsageError when it leaves nothing
  return bytes;
}

planner::PlanSearch parse_search(const std::string& text) {
  planner::PlanSearch s{.allocator = false, .accumulation = false, .precision = false, .optimizer = false, .loss = false,
                        .selective = false, .compile = false};
  if (text == "none" || text == "checkpointing") return s;
  for (const std::string& item : split_list("--search", text)) {
    if (item == "allocator") s.allocator = true;
    else if (item == "accumulation") s.accumulation = true;
    else if (item == "precision") s.precision = true;
    else if (item == "optimizer") s.optimizer = true;
    else if (item == "loss") s.loss = true;
    else if (item == "selective") s.selective = true;
    else if (item == "compile") s.compile = true;
    else if (item == "checkpointing") continue;  // always searched
    else {
      throw UsageError("--search: \"" + item +
                       "\" is not something the plan changes; valid: selective, compile, allocator, loss, accumulation, "
                       "precision, optimizer (checkpointing is always searched; none for checkpointing of whole modules alone)");
    }
  }
  return s;
}

/// `plan --parallel auto --gpus N`: the layouts of N GPUs at the global batch, ranked.
void run_layouts(const PlanArgs& args, planner::SweepSpec base, Capture* capture) {
  if (args.max_batch || !args.code.empty() || !args.model_out.empty() || !args.parallel.options.empty() ||
      args.search != PlanArgs{}.search || args.parallel.topology != "auto" || args.parallel.stray_contexts) {
    throw UsageError("--parallel auto searches the layouts (the mesh and whether every layer is checkpointed); "
                     "--max-batch, --code, --model-out, --search, --parallel-options, --topology and --stray-contexts "
                     "apply to one layout: give it as --parallel");
  }
  if (args.gpus == 0) throw UsageError("--parallel auto: give --gpus N, the GPUs to spread the step over");
  if (args.model.batch.empty()) {
    throw UsageError("--parallel auto: give --batch, the global batch (sequences per optimizer step over all GPUs)");
  }
  planner::LayoutSearchSpec spec;
  spec.gpus = args.gpus;
  spec.global_batch = base.model_options.batch;
  if (recorded_hf_config(args.model) && !args.model.compile) {
    // A config the exporter records may be a mixture of experts: each expert-parallel size is a
    // recording of its own (the exporter refuses a model without experts to shard).
    ModelArgs model_args = args.model;
    model_args.precisions = parse_precisions("--dtype", args.dtype);
    spec.record_expert_parallel = [model_args](std::size_t ranks) mutable -> std::shared_ptr<const nn::ModelSource> {
      model_args.expert_parallel = ranks;
      try {
        return record_hf_config(model_args.hf_config, hf_recording(model_args));
      } catch (const Error& e) {
        // No experts at all (_expert_parallel.py's refusal): no expert-parallel layouts.
        if (std::string_view(e.what()).find("no expert-parallel plan") != std::string_view::npos) return nullptr;
        throw;
      }
    };
  }
  base.segments = {0};
  base.headroom = headroom_bytes(args.headroom, base);  // a layout fits leaving it free
  spec.base = std::move(base);
  std::unique_ptr<ProgressBar> bar;
  const planner::SweepProgress progress = [&](std::size_t done, std::size_t planned, const std::string& item) {
    if (!bar) bar = std::make_unique<ProgressBar>(planned);
    bar->update(done, item);
  };
  planner::SweepProgress told;
  if (capture != nullptr && capture->progress) {
    told = [&](std::size_t done, std::size_t planned, const std::string& item) { capture->progress(done, planned, item); };
  }
  const planner::LayoutSearchResult result = planner::search_layouts(spec, capture != nullptr ? told : progress);
  if (bar) bar->finish();
  if (capture != nullptr) {
    capture->document = layout_json(result);
  } else if (args.format == "json") {
    std::cout << layout_json(result).dump(2) << "\n";
  } else {
    std::cout << layout_report(result, args.top, !args.brief);
  }
  std::cout.flush();
}

void run(const PlanArgs& args, Capture* capture) {
  planner::PlanSpec spec;
  planner::SweepSpec& base = spec.base;
  if (args.model.model.empty() && args.model.model_file.empty() && args.model.hf_config.empty()) {
    throw UsageError("plan: name a model (--model, --model-file or --hf-config); `vramscope models` lists the zoo");
  }
  if (args.model.batch.find(',') != std::string::npos || args.model.seq.find(',') != std::string::npos) {
    throw UsageError("plan: give one --batch and one --seq (the plan searches micro-batches itself)");
  }
  if (args.model.checkpoint.find(',') != std::string::npos) {
    throw UsageError("--gradient-checkpointing: plan takes one mode (the as-given row); it chooses the layers itself");
  }
  ModelArgs model_args = args.model;
  if (!model_args.hf_config.empty()) model_args.precisions = parse_precisions("--dtype", args.dtype);
  if (!model_args.hf_config.empty() && args.parallel.spec != "auto") {
    model_args.expert_parallel = expert_parallel_of(args.parallel);
  }
  base.model = resolve_model(model_args, "");
  base.model_options = to_model_options(args.model);
  base.stack = parse_stack(args.model);
  resolve_checkpoint_default(base.model_options, base.stack);
  base.device = resolve_device(args.device, nn::ExecMode::DryRun);
  base.precisions = parse_precisions("--dtype", args.dtype);
  if (base.precisions.size() != 1) throw UsageError("--dtype: plan takes one (it tries the others itself)");
  base.alloc_confs = {args.alloc_conf};
  base.optimizer = as_usage("--optimizer", [&] { return nn::parse_optimizer_config(args.optimizer); });
  if (args.format != "table" && args.format != "json") {
    throw UsageError("--format: \"" + args.format + "\" is not a format; valid: table, json");
  }
  if (args.parallel.spec == "auto") return run_layouts(args, base, capture);
  if (args.gpus != 0) throw UsageError("--gpus: the GPUs of --parallel auto's search; a layout given names its own");
  base.parallels = parse_parallel_args(args.parallel);
  check_parallel_combination(base.parallels, nn::ExecMode::DryRun, base.optimizer);
  if (base.parallels.front().pipeline_parallel > 1) {
    // Its stages differ (stage 0 keeps the most activations under 1F1B, the last stage every
    // micro-batch's logits, GPipe's last the most): a plan would have to fit each.
    throw UsageError("--parallel " + nn::parallel_label(base.parallels.front()) +
                     ": plan does not search pipeline layouts yet; `vramscope sweep --parallel pp:N` shows every "
                     "stage, and `sweep --max-batch` the largest batch all of them fit");
  }
  base.segments = {0};
  spec.search = parse_search(args.search);
  spec.headroom = headroom_bytes(args.headroom, base);
  const auto* file = dynamic_cast<const models::ModelFile*>(base.model.get());
  if (!args.model_out.empty() && file == nullptr) {
    throw UsageError("--model-out: " + base.model->name() +
                     " is not a model file (a transformers decoder: --code sets its layers' flags)");
  }
  check_output_paths({{"--code", args.code}, {"--model-out", args.model_out}},
                     {{"--model-file", args.model.model_file}, {"--hf-config", args.model.hf_config}});

  std::int64_t largest = -1;  // --max-batch: the largest batch that fits (0: none)
  std::string largest_note;
  if (args.max_batch) {
    if (!args.model.batch.empty()) throw UsageError("--max-batch: finds the batch; leave out --batch");
    std::string how;
    largest = largest_checkpointed_batch(base, spec.headroom, how);
    largest_note = how;
    if (capture != nullptr || args.format == "json") {
      // said in the document's "max_batch"
    } else if (largest == 0) {
      std::cout << "No batch fits, even batch 1 with " << how << "; the plan at batch 1 says why:\n\n";
    } else {
      std::cout << fmt::format("The largest batch that fits with {}: {}. The least recompute that fits it:\n\n", how,
                               largest);
    }
    base.model_options.batch = std::max<std::int64_t>(largest, 1);
  }

  std::unique_ptr<ProgressBar> bar;
  // The number of runs is not known ahead: the bar counts up to a typical search's.
  constexpr std::size_t kTypicalRuns = 40;
  const planner::PlanProgress progress = [&](std::size_t done, const std::string& item) {
    if (!bar) bar = std::make_unique<ProgressBar>(kTypicalRuns);
    bar->update(std::min(done, kTypicalRuns - 1), item);
  };
  planner::PlanProgress told;  // a library caller's: the runs done, their number not known ahead
  if (capture != nullptr && capture->progress) {
    told = [&](std::size_t done, const std::string& item) { capture->progress(done, 0, item); };
  }
  const planner::PlanResult result = planner::run_plan(spec, capture != nullptr ? told : progress);
  if (bar) bar->finish();

  if (capture != nullptr || args.format == "json") {
    nlohmann::json document = plan_json(result);
    if (largest >= 0) document["max_batch"] = {{"largest", largest}, {"with", largest_note}};
    // The best plan's PyTorch code, what --code writes.
    if (const planner::Plan* best = result.best(); best != nullptr) document["code"] = plan_code(result, *best);
    if (capture != nullptr) {
      capture->document = std::move(document);
    } else {
      std::cout << document.dump(2) << "\n";
    }
  } else {
    std::cout << plan_report(result, args.top, !args.brief);
  }
  if (!args.code.empty()) {
    const planner::Plan* best = result.best();
    if (best == nullptr) throw CommandFailed("--code: no plan fits, so there is no code to write");
    try {
      write_output_file(args.code, plan_code(result, *best), "the plan's code");
    } catch (const mem::Error& e) {
      throw CommandFailed(std::string("--code: ") + e.what());
    }
    if (capture == nullptr) (args.format == "table" ? std::cout : std::cerr) << "code: " << args.code << "\n";
  }
  if (!args.model_out.empty()) {
    const planner::Plan* best = result.best();
    if (best == nullptr) throw CommandFailed("--model-out: no plan fits, so there is no model file to write");
    if (best->segments > 1) {
      throw CommandFailed("--model-out: the best plan is checkpoint_sequential's segments, which a model file does "
                          "not mark; --code applies them");
    }
    // As given: the file unchanged. Else exactly the plan's modules (none: an empty list, which
    // clears the layers' own marks, as the plan was measured).
    const std::string text = best == &result.given ? file->with_checkpoint_modules(std::nullopt)
                                                   : file->with_checkpoint_modules(best->checkpoint_modules.value_or(
                                                         std::vector<std::string>{}));
    try {
      write_output_file(args.model_out, text, "the planned model file");
    } catch (const mem::Error& e) {
      throw CommandFailed(std::string("--model-out: ") + e.what());
    }
    const bool more = best != &result.given && (best->precision_changed || best->change == planner::PlanChange::Optimizer ||
                                                best->change == planner::PlanChange::Allocator || best->accumulation > 1);
    if (capture == nullptr) (args.format == "table" ? std::cout : std::cerr)
        << "model file: " << args.model_out
        << (more ? " (its checkpointing; the plan's other changes are settings of the run: --code writes them)" : "")
        << "\n";
  }
  std::cout.flush();
}

}  // namespace

void add_plan_command(CLI::App& app, Capture* capture) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Find what makes a training step fit on a device with the least recompute: which modules to "
      "checkpoint (any set of the model's modules, every k-th block, checkpoint_sequential), the "
      "allocator setting, gradient accumulation, precision and optimizer. Every plan shown is a full dry "
      "run through the caching allocator; --code writes the PyTorch code of the best.");
  add_model_options(*cmd, args->model, "required");
  cmd->add_option("-d,--device", args->device, "the GPU to fit: sim:<preset> (see `vramscope devices`), sim (sim:a100-80g), cuda:0, auto")
      ->capture_default_str()
      ->type_name("SPEC");
  cmd->add_option("-t,--dtype", args->dtype, "the precision you train in: f32, f16, bf16, amp, amp-bf16")
      ->capture_default_str();
  cmd->add_option("-a,--alloc-conf", args->alloc_conf, "your PYTORCH_CUDA_ALLOC_CONF, if any")->type_name("CONF");
  cmd->add_option("--optimizer", args->optimizer, kOptimizerHelp)->capture_default_str();
  add_parallel_options(*cmd, args->parallel, /*list=*/false);
  cmd->add_option("--gpus", args->gpus,
                  "with --parallel auto (instead of a layout): the job's GPUs; the search tries every mesh of them "
                  "(DDP or FSDP2, tensor parallel inside a node, pipeline stages), each with and without every layer "
                  "checkpointed, at --batch sequences per step over all of them, and ranks those that fit by the "
                  "compute they lose (recompute, a pipeline's bubble), then by the bytes each GPU sends per step")
      ->check(integer_in(1, 1 << 20))
      ->type_name("N");
  cmd->add_option("--search", args->search,
                  "what else the plan may change besides checkpointing whole modules: selective (an operator-level model's "
                  "checkpointed modules keep their products', attention's and convolutions' outputs, or chosen operator "
                  "calls one by one), compile (the step as torch.compile partitions it, under the "
                  "activation_memory_budget that recomputes least, for a file recorded with --compile), allocator "
                  "(expandable_segments, max_split_size_mb), "
                  "loss (a decoder's loss by Liger's fused linear cross entropy: no logits), accumulation "
                  "(micro-batches), precision, optimizer; none for checkpointing whole modules alone")
      ->capture_default_str()
      ->check(non_empty())
      ->type_name("LIST");
  cmd->add_option("--headroom", args->headroom,
                  "what a plan must leave free in nvidia-smi's view: a size (1GiB, 0 for none) or a share of the "
                  "device's memory (cuDNN's benchmark workspaces, NCCL, a second process take room beside the step)")
      ->capture_default_str()
      ->type_name("SIZE");
  cmd->add_option("--top", args->top, "plans shown in the table")->check(integer_in(1, 1000))->capture_default_str();
  cmd->add_option("-f,--format", args->format, "table or json")->capture_default_str();
  cmd->add_option("--code", args->code, "write the best plan's PyTorch code to FILE.py")
      ->check(non_empty())
      ->type_name("FILE.py");
  cmd->add_option("--model-out", args->model_out,
                  "write the model file with the best plan's \"checkpoint_modules\" (zoo files and --model-file)")
      ->check(non_empty())
      ->type_name("FILE.json");
  cmd->add_flag("--max-batch", args->max_batch,
                "instead of --batch: the largest batch any checkpointing fits (every repeated block checkpointed, "
                "found by doubling and bisection), then the plan with the least recompute at it");
  cmd->add_flag("--brief", args->brief, "leave out the 'how to read this' note");
  cmd->footer(
      "Examples:\n"
      "  vramscope plan --model resnet152 --batch 256 --device sim:a100-40g\n"
      "  vramscope plan --model gpt2-xl --batch 8 --dtype bf16 --device sim:rtx4090 --search none\n"
      "  vramscope plan --model llama-3.1-8b --lora 16 --batch 4 --seq 2048 --dtype bf16 --device sim:rtx4090 --code plan.py\n"
      "  vramscope plan --model-file model.json --device sim:t4 --format json\n"
      "  vramscope plan --model llama-3.1-70b --dtype bf16 --seq 4096 --batch 256 --device sim:h100-80g --parallel auto --gpus 64\n"
      "Plans keep your training's arithmetic first (checkpointing, the allocator setting), then change\n"
      "the micro-batch, the precision, the optimizer; each is measured, never estimated.");
  cmd->callback([args, capture] { run(*args, capture); });
}

}  // namespace mem::tools
