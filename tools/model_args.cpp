// model_args.cpp — model, size and device options shared by `sweep` and `trace`.
#include "model_args.hpp"

#include "hf_model.hpp"
#include "hf_record.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <system_error>

#include "usage_error.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::tools {

CLI::Validator integer_in(std::int64_t min, std::int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        std::int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (ec == std::errc::result_out_of_range || (ec == std::errc{} && ptr == end &&
                                                     (value < min || value > max))) {
          return fmt::format("{} is out of range: give a whole number from {} to {}", text, min,
                             max);
        }
        if (ec != std::errc{} || ptr != end) {
          return fmt::format("\"{}\" is not a whole number (from {} to {})", text, min, max);
        }
        return {};
      },
      fmt::format("N in [{}, {}]", min, max));
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.find_first_not_of(" \t") == std::string::npos
                   ? "an empty value; give one, or leave the option out for its default"
                   : std::string();
      },
      "");
}

void add_model_options(CLI::App& app, ModelArgs& args, const std::string& default_note) {
  const std::string names = fmt::format("{}", fmt::join(models::names(), ", "));
  app.add_option("-m,--model", args.model, "a model of the zoo: " + names + " (" + default_note + ")")
      ->check(CLI::Validator(
          [names](std::string& name) -> std::string {
            return name.empty() ? "an empty model name; valid: " + names : std::string{};
          },
          "NAME"))
      ->type_name("NAME");
  app.add_option("--model-file", args.model_file,
                 "your own model as a model file (JSON; docs/MODEL_FILES.md) instead of --model")
      ->type_name("PATH");
  app.add_option("--hf-config", args.hf_config,
                 "a Hugging Face config.json instead of --model: llama, mistral, qwen2 and gpt2 built in "
                 "(docs/TRANSFORMERS.md); any other decoder recorded as operators by python3 -m vramscope.export "
                 "(torch and transformers needed; $VRAMSCOPE_PYTHON picks the Python; docs/OPERATORS.md)")
      ->type_name("PATH");
  // --hf-model: the config.json of a folder or of a Hub model in the local cache, as --hf-config.
  app.add_option("--hf-model", args.hf_config,
                 "a Hugging Face model by name (org/name, from the local Hugging Face cache: $HF_HUB_CACHE, "
                 "$HF_HOME/hub or ~/.cache/huggingface/hub; nothing is downloaded) or a folder with its config.json, "
                 "as --hf-config")
      ->transform(CLI::Validator(
          [](std::string& name) -> std::string {
            try {
              name = find_hf_config(name);
              return {};
            } catch (const UsageError& e) {
              const std::string what = e.what();  // "--hf-model NAME: why": CLI11 names the option
              return what.starts_with("--hf-model ") ? what.substr(std::string_view("--hf-model ").size()) : what;
            }
          },
          "NAME"))
      ->excludes("--hf-config")
      ->type_name("NAME");
  // The sizes: each a whole number from 1 to the runtime's bound for it.
  const struct {
    const char* name;
    std::int64_t* value;
    const char* help;
    std::int64_t max;
  } sizes[] = {{"--depth", &args.depth, "mlp: number of Linear+ReLU layers", nn::kMaxDepth},
               {"--width", &args.width, "mlp: features per layer", nn::kMaxWidth},
               {"--image", &args.image, "resnet: input side in pixels", nn::kMaxImage},
               {"--classes", &args.classes, "resnet: number of classes", nn::kMaxClasses}};
  // Batch and sequence length take comma lists ("8,16,32"); each item is checked.
  app.add_option("-b,--batch", args.batch, "batch size (default: the model's); sweep takes a list: 8,16,32")
      ->type_name("N[,N...]");
  for (const auto& size : sizes) {
    app.add_option(size.name, *size.value, size.help)->check(integer_in(1, size.max))->type_name("N");
  }
  app.add_option("--seq", args.seq, "sequence length of models that take one (gpt2: <= 1024); sweep takes a list")
      ->type_name("N[,N...]");
  app.add_option("--attn", args.attention, "transformers: eager, sdpa (flash; the default, but eager for GPT-2 configs, as the GPU references ran it) or sdpa-efficient")
      ->type_name("IMPL");
  app.add_option("--gradient-checkpointing", args.checkpoint,
                 "transformers: checkpoint every decoder layer: on (gradient_checkpointing_enable() as the --stack's "
                 "transformers does it: non-reentrant in 5.x, reentrant in 4.x), reentrant or non-reentrant")
      ->type_name("MODE");
  app.add_option("--lora", args.lora, "transformers: LoRA adapters of this rank; base weights frozen")
      ->check(integer_in(1, nn::kMaxLoraRank))
      ->type_name("RANK");
  app.add_option("--lora-targets", args.lora_targets,
                 "transformers: adapted projections, q_proj+v_proj (PEFT's default), ... or all")
      ->type_name("P+P...");
  app.add_option("--quant", args.quant,
                 "transformers: nf4 (QLoRA: 4-bit base weights, double quantization) or nf4-single; needs --lora")
      ->type_name("Q");
  app.add_option("--stack", args.stack,
                 "the versions to model, e.g. torch=2.15,transformers=5.24,peft=0.21 (default: " +
                     nn::Stack::validated().spec() + ", the newest validated on a GPU; keys left out keep it)")
      ->type_name("PKG=VER,...");
  app.add_option("--model-options", args.extra,
                 "more model options as key=value,... (dropout=0,inplace=1; expert_skew=S for a mixture of experts recorded with its per-expert loop, its busiest expert S times its share, or under expert parallel, the GPU shown receiving S times its share; see `vramscope models`)")
      ->type_name("K=V,...");
  // An empty value would silently mean the default (`--batch ''` from an unset shell variable).
  for (const char* name : {"--model-file", "--hf-config", "--hf-model", "--batch", "--seq", "--attn", "--gradient-checkpointing",
                           "--lora-targets", "--quant", "--stack", "--model-options"}) {
    app.get_option(name)->check(non_empty());
  }
}

nn::Stack parse_stack(const ModelArgs& args) {
  return as_usage("--stack", [&] { return nn::Stack::parse(args.stack); });
}

void resolve_checkpoint_default(nn::ModelOptions& options, const nn::Stack& stack) {
  if (options.checkpoint == "on") options.checkpoint = std::string(stack.checkpoint_default());
}

std::vector<std::int64_t> parse_size_list(const std::string& option, const std::string& text, std::int64_t max) {
  std::vector<std::int64_t> out;
  const CLI::Validator check = integer_in(1, max);
  for (std::string item : split_list(option, text)) {
    const std::string problem = check(item);
    if (!problem.empty()) throw UsageError(option + ": " + problem);
    out.push_back(std::stoll(item));
  }
  return out;
}

nn::ModelOptions to_model_options(const ModelArgs& args, bool lists_allowed) {
  nn::ModelOptions o = as_usage("--model-options", [&] { return nn::ModelOptions::parse(args.extra); });
  const auto set = [](const char* option, std::int64_t value, std::int64_t& field) {
    if (value < 0) {
      throw UsageError(fmt::format("{}: {} is negative; give a positive number", option, value));
    }
    if (value > 0) field = value;
  };
  const auto first = [&](const char* option, const std::string& text, std::int64_t max) -> std::int64_t {
    const std::vector<std::int64_t> list = parse_size_list(option, text, max);
    if (list.size() > 1 && !lists_allowed) {
      throw UsageError(fmt::format("{}: {} values given; this command runs one (sweep takes a list)",
                                   option, list.size()));
    }
    return list.empty() ? 0 : list.front();
  };
  set("--batch", first("--batch", args.batch, nn::kMaxBatch), o.batch);
  set("--depth", args.depth, o.depth);
  set("--width", args.width, o.width);
  set("--seq", first("--seq", args.seq, nn::kMaxSeq), o.seq);
  set("--image", args.image, o.image);
  set("--classes", args.classes, o.classes);
  // An --hf-config the exporter records takes --attn and --lora there (recorded_hf_options):
  // the file it writes has them in its operators, not as options.
  const bool recorded = !args.hf_config.empty() && !builtin_hf_type(args.hf_config);
  if (!recorded) {
    set("--lora", args.lora, o.lora);
    if (!args.attention.empty()) o.attention = args.attention;
    if (!args.lora_targets.empty()) o.lora_targets = args.lora_targets;
    if (!args.checkpoint.empty()) o.checkpoint = args.checkpoint;
  }
  if (!args.quant.empty()) o.quant = args.quant;
  return o;
}

void check_parallel_combination(const std::vector<nn::ParallelConfig>& parallels, nn::ExecMode mode,
                                const nn::OptimizerConfig& optimizer) {
  for (const nn::ParallelConfig& c : parallels) {
    if (!c.enabled() || c.engine == nn::ParallelEngine::Ddp) continue;
    const std::string label = nn::parallel_label(c);
    if (mode == nn::ExecMode::Compute) {
      throw UsageError("--compute with --parallel " + label + ": " +
                       (c.engine == nn::ParallelEngine::Dp
                            ? std::string("nn.DataParallel runs as a dry run only (one simulated GPU receives no data "
                                          "from the others)")
                            : std::string("sharded engines run as a dry run only (their collectives on one simulated "
                                          "rank bring no data from the others)")) +
                       "; drop --compute, or use ddp");
    }
    if (c.pipeline_parallel > 1 && optimizer.kind == nn::OptimizerKind::Adam8bit) {
      throw UsageError("--optimizer adam8bit with --parallel " + label +
                       ": pipeline parallel is modelled with adam, sgd or none (its 8-bit state is not yet)");
    }
    if (c.tensor_parallel > 1 && optimizer.kind != nn::OptimizerKind::Adam &&
        optimizer.kind != nn::OptimizerKind::None) {
      throw UsageError("--optimizer " + std::string(nn::optimizer_name(optimizer.kind)) + " with --parallel " + label +
                       ": tensor parallel is modelled with adam (what it copies out of the embedding's whole-table "
                       "gradient) or none; give adam, adamw or none");
    }
    const bool zero = c.engine != nn::ParallelEngine::Fsdp && c.engine != nn::ParallelEngine::None;
    if (zero && optimizer.kind == nn::OptimizerKind::Adam8bit) {
      throw UsageError("--optimizer adam8bit with --parallel " + label + ": DeepSpeed's ZeRO runs its own FusedAdam, "
                       "bitsandbytes' 8-bit Adam is not modelled under it; give adam, sgd or sgd-momentum");
    }
    if (zero && optimizer.kind == nn::OptimizerKind::None) {
      throw UsageError("--optimizer none with --parallel " + label + ": ZeRO partitions an optimizer's state, and "
                       "there is none; give adam, sgd or sgd-momentum");
    }
  }
}

std::string hf_autocast(const std::vector<nn::Precision>& precisions) {
  std::string first;
  for (std::size_t i = 0; i < precisions.size(); ++i) {
    const std::optional<nn::DType> half = nn::autocast_dtype(precisions[i]);
    const std::string autocast = half ? std::string(nn::dtype_name(*half)) : "";
    if (i == 0) {
      first = autocast;
    } else if (autocast != first) {
      throw UsageError("--dtype: an --hf-config that the exporter records runs under one autocast (its casts are "
                       "recorded operators): give amp-bf16, amp, or plain precisions, in separate runs");
    }
  }
  return first;
}

std::shared_ptr<const nn::ModelSource> resolve_model(const ModelArgs& args, const std::string& fallback) {
  if (static_cast<int>(!args.model.empty()) + static_cast<int>(!args.model_file.empty()) +
          static_cast<int>(!args.hf_config.empty()) > 1) {
    throw UsageError("--model, --model-file and --hf-config each name a model; give one");
  }
  if (!args.hf_config.empty()) {
    return as_usage("--hf-config", [&]() -> std::shared_ptr<const nn::ModelSource> {
      if (recorded_hf_config(args)) return record_hf_config(args.hf_config, hf_recording(args));
      return models::load_hf_config(args.hf_config);
    });
  }
  if (!args.model_file.empty()) {
    auto file = as_usage("--model-file", [&]() -> std::shared_ptr<const nn::ModelSource> {
      return models::ModelFile::load(args.model_file);
    });
    if (args.lora > 0 && file->describe().operators > 0) {
      throw UsageError("--lora: an operator-level model has its adapters in its operators: record it with PEFT applied "
                       "(get_peft_model in your factory, or python -m vramscope.export --hf-config ... --lora RANK)");
    }
    return file;
  }
  return as_usage("--model", [&] { return models::find(args.model.empty() ? fallback : args.model); });
}

bool recorded_hf_config(const ModelArgs& args) {
  return !args.hf_config.empty() && (!builtin_hf_type(args.hf_config) || args.compile);
}

HfRecording hf_recording(const ModelArgs& args) {
  HfRecording how;
  how.autocast = hf_autocast(args.precisions);
  if (!args.attention.empty() && args.attention != "sdpa" && args.attention != "eager") {
    throw UsageError("--attn " + args.attention + ": a model_type the exporter records runs sdpa or eager (as "
                     "transformers' attn_implementation)");
  }
  how.attention = args.attention;
  if (args.checkpoint.find(',') != std::string::npos) {
    throw UsageError("--gradient-checkpointing: a model_type the exporter records takes one mode per run (its "
                     "checkpoints are recorded); give none, on, reentrant or non-reentrant");
  }
  if (!args.checkpoint.empty() && args.checkpoint != "none") how.checkpoint = args.checkpoint;
  if (!args.quant.empty()) {
    throw UsageError("--quant: bitsandbytes' 4-bit layers run on a GPU only, so a model_type the exporter records "
                     "cannot have them; the built-in llama, mistral and qwen2 model QLoRA");
  }
  how.lora = args.lora;
  how.lora_targets = args.lora_targets;
  how.compile = args.compile;
  how.expert_parallel = args.expert_parallel;
  return how;
}

std::optional<std::vector<std::string>> parse_checkpoint_modules(const std::string& text, const nn::ModelSource& model,
                                                                 nn::ModelOptions& options, std::size_t segments) {
  if (text.empty()) return std::nullopt;
  std::vector<std::string> paths = split_list("--checkpoint-modules", text);
  if (segments > 1) {
    throw UsageError("--checkpoint-modules: checkpoints the modules named; leave out --segments (or give 0)");
  }
  const auto built = as_usage("--checkpoint-modules", [&] { return model.build(options); });
  if (built->info().checkpoints_by_layer && !options.checkpoint) options.checkpoint = "non-reentrant";
  as_usage("--checkpoint-modules", [&] {
    nn::mark_checkpointed(built->body(), paths, nn::CheckpointMode::NonReentrant);
    return 0;
  });
  return paths;
}

std::optional<nn::SelectivePolicy> parse_selective(const std::string& text, const nn::ModelInfo& info,
                                                   const std::optional<std::vector<std::string>>& checkpoint_modules) {
  if (text.empty()) return std::nullopt;
  nn::SelectivePolicy policy = as_usage("--selective", [&] { return nn::SelectivePolicy::parse(text); });
  if (info.operators == 0) {
    throw UsageError(fmt::format("--selective: names PyTorch operators, and {} is a model of modules; record it at "
                                 "the operator level (python3 -m vramscope.export ...) or checkpoint whole modules",
                                 info.name));
  }
  // An operator-level model takes no checkpoint_sequential segments: its marks or the modules named.
  const bool checkpointed = checkpoint_modules ? !checkpoint_modules->empty() : info.checkpointed_modules > 0;
  if (!checkpointed) {
    throw UsageError("--selective: applies inside checkpointed modules; name them with --checkpoint-modules");
  }
  return policy;
}

bool parse_offload(const std::string& text) {
  if (text.empty()) return false;
  if (text == "activations") return true;
  throw UsageError(fmt::format("--offload: \"{}\" is not modelled; valid: activations (save_on_cpu; DeepSpeed's "
                               "offload_optimizer and offload_param are not modelled yet)",
                               text));
}

std::vector<std::optional<nn::CompileMode>> parse_compiles(const std::string& text, const nn::ModelInfo& info) {
  std::vector<std::optional<nn::CompileMode>> out;
  if (text.empty()) return out;
  for (const std::string& item : split_list("--compile", text)) {
    std::optional<nn::CompileMode> value;
    // mode="reduce-overhead", alone or with a budget after a colon.
    const std::string_view reduce = "reduce-overhead";
    const bool cudagraphs = item.rfind(reduce, 0) == 0 && (item.size() == reduce.size() || item[reduce.size()] == ':');
    const std::string budget_text = cudagraphs ? item.substr(std::min(item.size(), reduce.size() + 1)) : item;
    if (item == "eager") {
      value = std::nullopt;
    } else if (budget_text.empty() || budget_text == "on" || budget_text == "default") {
      value = nn::CompileMode{1.0, cudagraphs};
    } else {
      double budget = -1;
      const auto [ptr, ec] = std::from_chars(budget_text.data(), budget_text.data() + budget_text.size(), budget);
      if (ec != std::errc{} || ptr != budget_text.data() + budget_text.size() || !(budget >= 0 && budget <= 1)) {
        throw UsageError(fmt::format("--compile: \"{}\" is no setting; give eager, on (PyTorch's default partition), "
                                     "an activation_memory_budget from 0 to 1, or reduce-overhead (CUDA graphs, "
                                     "reduce-overhead:0.5 with a budget), e.g. eager,on,0.5,reduce-overhead",
                                     item));
      }
      value = nn::CompileMode{budget, cudagraphs};
    }
  if (std::find(out.begin(), out.end(), value) != out.end()) {
      throw UsageError(fmt::format("--compile: \"{}\" is given twice", item));
    }
    out.push_back(value);
  }
  const bool compiled = std::any_of(out.begin(), out.end(), [](const auto& c) { return c.has_value(); });
  if (compiled && !info.compiled) {
    throw UsageError(fmt::format("--compile: {} has no compiled step recorded; record it with python3 -m "
                                 "vramscope.export ... --compile (the file then carries the joint graph torch.compile "
                                 "partitions)",
                                 info.name));
  }
  return out;
}

std::vector<std::string> split_list(const std::string& option, const std::string& text) {
  std::vector<std::string> out;
  if (text.find_first_not_of(" \t") == std::string::npos) return out;  // nothing given
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const auto b = item.find_first_not_of(" \t");
    if (b == std::string::npos) {
      throw UsageError(fmt::format("{}: \"{}\" has an empty item; separate items with single commas",
                                   option, text));
    }
    out.push_back(item.substr(b, item.find_last_not_of(" \t") - b + 1));
    if (comma == std::string::npos) return out;
    pos = comma + 1;
  }
}

std::vector<nn::Precision> parse_precisions(const std::string& option, const std::string& list) {
  std::vector<nn::Precision> out;
  for (const std::string& name : split_list(option, list)) {
    const nn::Precision p = as_usage(option, [&] { return nn::parse_precision(name); });
    bool seen = false;
    for (const nn::Precision q : out) seen = seen || q == p;
    if (!seen) out.push_back(p);
  }
  if (out.empty()) {
    throw UsageError(option + ": empty list; valid: f32, f16, bf16, amp, amp-bf16");
  }
  return out;
}

std::string resolve_device(const std::string& spec, nn::ExecMode mode) {
  if (mode != nn::ExecMode::Compute) return spec;
  if (spec == "sim" || (spec == "auto" && cuda_device_count() == 0)) {
    return "sim:" + default_sim_preset();
  }
  return spec;
}

std::string model_label(const nn::ModelInfo& info, const nn::ModelOptions& options) {
  const std::string sizes = options.to_string();
  std::string label = info.name;
  if (!sizes.empty()) label += " " + sizes;
  return label;
}

void add_parallel_options(CLI::App& app, ParallelArgs& args, bool list) {
  app.add_option("--parallel", args.spec,
                 std::string("the step on several GPUs, each rank's memory: ddp:N (DistributedDataParallel, one "
                             "process per GPU), fsdp:N (FSDP2: fully_shard on each block, then the root), zero1:N, zero2:N "
                             "or zero3:N (DeepSpeed's ZeRO stage 1, 2 or 3, bf16 or f16 with its FusedAdam), tp:N (tensor + "
                             "sequence parallel: torchtitan's Llama plan through DTensor, on a --hf-config decoder), "
                             "fsdp:MxTP:N (FSDP2 over tensor parallel), cp:N or fsdp:MxCP:N (context parallel: each GPU 1/N of "
                             "every sequence, SDPA as ring attention, FSDP2 over all M x N; xtp:K inside), pp:N (pipeline stages: "
                             "torchtitan's split of a "
                             "--hf-config decoder through torch.distributed.pipelining's schedules), pp:NxTP:K, pp:NxFSDP:M "
                             "or pp:NxFSDP:MxTP:K (tensor parallel, FSDP2, or both inside each stage: torchtitan's "
                             "3-D layout), ep:N (expert parallel: transformers' DistributedConfig(ep_size=N) on a mixture "
                             "of experts, 1/N of the experts on each GPU and tokens sent to them by all-to-all, FSDP2 over "
                             "the rest; an --hf-config is recorded so, a --model-file must be: vramscope.export "
                             "--expert-parallel N), dp:N (nn.DataParallel: one process, the module on GPU 0 replicated onto the "
                             "others at each forward; sweep shows GPU 0 and GPU 1) or none") +
                     (list ? "; a list (none,ddp:8,fsdp:8,zero2:8) gives each its rows" : ""))
      ->check(non_empty())
      ->capture_default_str();
  app.add_option("--parallel-options", args.options,
                 "the engine's arguments by their names, e.g. bucket_cap_mb=50,gradient_as_bucket_view=true "
                 "(ddp: bucket_cap_mb, gradient_as_bucket_view, broadcast_buffers, init_sync, static_graph, "
                 "find_unused_parameters; fsdp: reshard_after_forward (true, false or a factor k of N), param_dtype, "
                 "reduce_dtype (MixedPrecisionPolicy), offload_policy=cpu (CPUOffloadPolicy: shards, gradients and "
                 "the optimizer on the host; pin_memory=false leaves them pageable), "
                 "init=meta|cuda (built on the meta device, the default, or whole on the GPU first), rank=R (the rank "
                 "shown; the last ones hold fewer rows when dim 0 does not split evenly; under cp, R % N is its "
                 "place in the ring), with cp cp_rotate_method=allgather|alltoall (K and V gathered once per call, "
                 "the default, or passed on each step) and cp_load_balance=true|false (the head-tail chunks), "
                 "ep_size=N (expert parallel inside fsdp:M, N dividing M: each expert on M / N GPUs, FSDP2-sharded "
                 "over them); zero1, zero2: "
                 "reduce_bucket_size (elements), overlap_comm, offload_optimizer=cpu (the fp32 master, its "
                 "gradients and Adam's state on the host, DeepSpeedCPUAdam; pin_memory=false leaves them "
                 "pageable), rank=R; zero3: reduce_bucket_size, overlap_comm, offload_optimizer, pin_memory, rank "
                 "and the stage3_ keys "
                 "(elements) stage3_prefetch_bucket_size, stage3_param_persistence_threshold, "
                 "stage3_model_persistence_threshold, stage3_max_live_parameters, stage3_max_reuse_distance, and "
                 "sub_group_size, zero3_init_flag=false (the model built whole on the GPU, not under zero.Init), "
                 "offload_param=cpu (the parameters' partitions on the host, copied to the GPU for each gather); "
                 "tp: sequence_parallel=true (the plan modelled), loss_parallel=true|false (torchtitan's default "
                 "true: the logits stay sharded on the vocabulary and the loss is computed on the shards), rank=R; "
                 "dp: gpu=K (the GPU shown: 0 holds the module, the gathered output and the optimizer); "
                 "pp: schedule=1f1b|gpipe|interleaved1f1b|interleavedzerobubble|zbvzerobubble|dualpipev (Schedule1F1B, "
                 "torchtitan's default, ScheduleGPipe, ScheduleInterleaved1F1B: several stages per GPU, rank r "
                 "holding stages r, r + N, ..., or the zero-bubble schedules, each backward split into the input's "
                 "gradient and the weights', later: ScheduleInterleavedZeroBubble, stages as interleaved, and "
                 "ScheduleZBVZeroBubble, stages r and 2N - 1 - r; dualpipev, ScheduleDualPipeV, ZBV's stages with "
                 "a forward and a backward overlapped, at least 2N micro-batches), "
                 "layers_per_stage=K (torchtitan's pipeline_parallel_layers_per_stage: ceil((layers + 2) / K) stages "
                 "in all; default: one per GPU, two under the multi-stage schedules), microbatches=M "
                 "(n_microbatches, dividing the batch; default: the batch, one sample each), return_outputs=true|false "
                 "(step()'s: the last stage keeps the logits until the next step), stage=S (the one pipeline rank "
                 "shown; without it sweep gives each rank a row; under 1f1b rank 0 keeps the most activations, under "
                 "gpipe every rank all of them); with fsdp or tp inside, their options too (fsdp's rank, or tp's when "
                 "it is alone; reshard_after_forward defaults to false there, as torchtitan sets it under pp))")
      ->check(non_empty());
  app.add_option("--topology", args.topology,
                 "with --parallel: how the node's GPUs talk, which decides NCCL's buffers on each GPU (outside "
                 "the caching allocator, in the nvidia-smi view): nvswitch (8 GPUs on NVLink through "
                 "NVSwitches; NVLS on Hopper and newer), pcie, none (leave them out), auto (nvswitch for "
                 "A100, H100, H200, B200, V100, else pcie); more than 8 GPUs are nodes of 8 on a network "
                 "(GPUDirect RDMA buffers on the GPU with nvswitch, in host memory with pcie)")
      ->capture_default_str();
  app.add_flag("--stray-contexts", args.stray_contexts,
               "with --parallel: the other ranks of the node made CUDA contexts on GPU 0 (no "
               "torch.cuda.set_device before CUDA was first used): rank 0's GPU holds one more context each, "
               "the classic \"rank 0 uses more memory\"");
}

std::size_t expert_parallel_of(const ParallelArgs& args) {
  if (args.spec.empty()) return 0;
  const std::vector<nn::ParallelConfig> configs = parse_parallel_args(args);
  const std::size_t ep = configs.front().expert_parallel;
  for (const nn::ParallelConfig& c : configs) {
    if (c.expert_parallel != ep) {
      throw UsageError("--parallel: an --hf-config is recorded once, as one GPU's of expert parallel or without it; "
                       "give configurations of one ep size in a run (" + nn::parallel_label(configs.front()) + " and " +
                       nn::parallel_label(c) + " differ)");
    }
  }
  return ep > 1 ? ep : 0;
}

std::vector<nn::ParallelConfig> parse_parallel_args(const ParallelArgs& args) {
  std::vector<nn::ParallelConfig> out;
  for (const std::string& item : split_list("--parallel", args.spec)) {
    const nn::ParallelConfig engine = as_usage("--parallel", [&] { return nn::parse_parallel(item); });
    out.push_back(engine.enabled()
                      ? as_usage("--parallel-options", [&] { return nn::parse_parallel(item, args.options); })
                      : engine);
  }
  const bool any = std::any_of(out.begin(), out.end(), [](const nn::ParallelConfig& c) { return c.enabled(); });
  if (!any && !args.options.empty()) {
    (void)as_usage("--parallel-options", [&] { return nn::parse_parallel("none", args.options); });  // says why
  }
  if (out.empty()) throw UsageError("--parallel: empty; give ddp:N, fsdp:N, zero2:N or none");
  const nn::Topology topology = as_usage("--topology", [&] { return nn::parse_topology(args.topology); });
  if (!any && (args.topology != "auto" || args.stray_contexts)) {
    throw UsageError(std::string(args.stray_contexts ? "--stray-contexts" : "--topology") +
                     ": applies to several GPUs; give --parallel ddp:N, fsdp:N or zero2:N");
  }
  for (nn::ParallelConfig& c : out) {
    c.topology = topology;
    c.stray_contexts = args.stray_contexts;
  }
  return out;
}

std::string per_gpu(const std::vector<nn::ParallelConfig>& configs) {
  return configs.size() == 1 && configs[0].enabled() ? ", each GPU of " + nn::parallel_label(configs[0]) : "";
}

std::string assumptions_note(const std::vector<std::string>& assumed) {
  std::string out;
  for (const std::string& line : assumed) out += fmt::format("recorded assuming: {}\n", line);
  return out;
}

namespace {

/// Whose figures a pipeline row shows: its stage's, or (--max-batch over every stage) the fullest's.
std::string stage_of(const nn::ParallelConfig& config) {
  const std::string of = " of " + std::to_string(config.pipeline_parallel);
  if (nn::multi_stage(config.schedule)) {
    // A rank holds several stages: r, r + P, ... (ZBV: r and 2P - 1 - r)
    return config.stage_chosen || config.stage != 0
               ? "pipeline rank " + std::to_string(config.stage) + "'s" + of + ", its stages " +
                     std::to_string(config.stage) + ", " +
                     (nn::v_shaped(config.schedule)
                          ? std::to_string(2 * config.pipeline_parallel - 1 - config.stage)
                          : std::to_string(config.stage + config.pipeline_parallel) + ", ...")
               : "the fullest pipeline rank's" + of + ", every rank run (a batch fits when each rank's step does)";
  }
  return config.stage_chosen || config.stage != 0
             ? "stage " + std::to_string(config.stage) + "'s" + of
             : "the fullest stage's" + of + ", every stage run (a batch fits when each stage's step does)";
}

}  // namespace

std::string parallel_note(const std::vector<nn::ParallelConfig>& configs, const DeviceInfo& device) {
  std::string out;
  bool nccl_said = false, pipeline_said = false;
  std::vector<std::string> communicators;  // NCCL's notes said so far
  for (const nn::ParallelConfig& config : configs) {
    if (!config.enabled()) continue;
    // NCCL's buffers: in the nvidia-smi view, once per kind of job (a mesh holds a communicator
    // per dimension, a job across nodes its network links); the first without its label.
    const nn::NcclMemory nccl = nn::nccl_memory(config, device.name, device.compute_capability);
    if (!nccl.assumptions.empty() &&
        std::find(communicators.begin(), communicators.end(), nccl.assumptions) == communicators.end()) {
      out += "parallel: " + (communicators.empty() ? std::string{} : nn::parallel_label(config) + ": ") +
             nccl.assumptions + ", in the nvidia-smi view\n";
      communicators.push_back(nccl.assumptions);
    }
    // The stray contexts: once per run of notes.
    if (!nccl_said) {
      if (config.stray_contexts) {
        out += "parallel: rank 0's GPU also holds the other " +
               std::to_string(std::min<std::size_t>(config.gpus(), 8) - 1) + " ranks' CUDA contexts (" +
               format_bytes(device.context_bytes) + " each, as its own; users measured 871 MiB to 1 GB: "
               "pytorch/pytorch#49481, #135279): call torch.cuda.set_device(local_rank) before any CUDA work\n";
      }
      nccl_said = true;
    }
    const bool zero = config.engine == nn::ParallelEngine::Zero1 || config.engine == nn::ParallelEngine::Zero2;
    const std::string engine =
        config.engine == nn::ParallelEngine::Zero3
            ? "each rank alike (DeepSpeed's ZeRO-3 keeps a 1/N partition of every parameter, its fp32 master, "
              "optimizer state and gradients, a gradient bucket of reduce_bucket_size elements made once, and "
              "gathers each module's parameters as it runs: small ones (stage3_param_persistence_threshold) stay "
              "gathered, and from the second step the recorded trace prefetches stage3_prefetch_bucket_size "
              "elements ahead and keeps those used again within stage3_max_reuse_distance" +
                  std::string(config.cpu_offload
                                  ? std::string("; offload_optimizer=cpu: the fp32 master, the bf16 gradient "
                                                "partitions, each sub group's fp32 gradient and Adam's state on the "
                                                "host (DeepSpeedCPUAdam steps there), ") +
                                        (config.offload_pin_memory ? "the gradients pinned (the pinned host figure)"
                                                                   : "pageable (pin_memory=false)") +
                                        "; each gradient partition comes back to the device for an fp64 copy "
                                        "for its norm and an fp32 copy"
                                  : std::string()) +
                  std::string(config.offload_param
                                  ? std::string("; offload_param=cpu: every parameter's partition is on the host ") +
                                        (config.offload_pin_memory ? "(pinned)" : "(pageable, pin_memory=false)") +
                                        " and the trained ones move into one pinned flat buffer there; each gather "
                                        "first copies the partitions to the GPU (ds_tensor.to(device)), a single "
                                        "parameter's until its all-gather is waited"
                                  : std::string()) +
                  ")"
        : zero ? "rank " + std::to_string(config.rank) +
                   "'s (DeepSpeed's ZeRO keeps the parameters whole, flattened into one buffer, the fp32 master "
                   "weights and the optimizer's state of its 1/N partition, each backward a gradient bucket of "
                   "reduce_bucket_size elements, and the gradients of the parameters its partition touches" +
                   (config.engine == nn::ParallelEngine::Zero1 ? "; stage 1 holds every gradient until the backward ends"
                                                               : "") +
                   (config.cpu_offload
                        ? std::string("; offload_optimizer=cpu: the fp32 master partition, its gradients and Adam's "
                                      "state are on the host (DeepSpeedCPUAdam steps there), ") +
                              (config.offload_pin_memory ? "the master and gradients pinned (the pinned host figure)"
                                                         : "pageable (pin_memory=false)") +
                              "; the GPU keeps a bf16 buffer of the largest parameter, and each gradient of the "
                              "partition leaves it in the backward that makes it"
                        : std::string()) +
                   ")"
        : config.engine == nn::ParallelEngine::Dp
            ? (config.rank == 0
                   ? std::string("GPU 0's (nn.DataParallel: one process; GPU 0 holds the module, its gradients and the "
                                 "optimizer, the whole batch, the gathered output (with a model's own loss, the "
                                 "whole batch's logits until the loss is taken) and the loss, runs its piece of the "
                                 "batch, and at the end of backward flattens and sums every GPU's gradients into new "
                                 "buffers that become the .grad; each forward flattens the parameters' and buffers' "
                                 "10 MiB groups of several tensors to broadcast them)")
                   : "GPU " + std::to_string(config.rank) +
                         "'s (nn.DataParallel: no module of its own; each forward receives the parameters and "
                         "buffers in 10 MiB groups and runs its piece of the batch (torch.chunk's) on those views, "
                         "a group going once every parameter in it has its gradient; the output (and a model's own "
                         "loss) goes to GPU 0, the gradient comes back as a copy; the gradients are flattened and "
                         "sent to GPU 0 at the end of backward; no optimizer state)")
        : config.engine == nn::ParallelEngine::Ddp
            ? "each rank alike (DistributedDataParallel runs the whole step on each GPU and adds its gradient "
              "buckets and broadcasts)"
        : config.pipeline_parallel > 1 && pipeline_said
            ? stage_of(config) + " (as above)"
        : config.pipeline_parallel > 1
            ? stage_of(config) +
                  " (torchtitan's split: the embedding and the final norm with lm_head count as a layer each, stage 0 "
                  "holds the embedding, the last stage the norm and lm_head; torch.distributed.pipelining's " +
                  (config.schedule == nn::PipelineSchedule::GPipe
                       ? std::string("ScheduleGPipe: every micro-batch's activations in flight before the first backward")
                   : config.schedule == nn::PipelineSchedule::Interleaved1F1B
                       ? std::string("ScheduleInterleaved1F1B through _PipelineScheduleRuntime: rank r runs stages r, "
                                     "r + P, ... depth first, warming up with (V - 1) x M / rounds + 2 (P - 1 - r) "
                                     "forwards, then one more before its first backward; each stage's output is held "
                                     "until its own backward of the micro-batch and every gradient sent back until the "
                                     "step ends")
                   : config.schedule == nn::PipelineSchedule::InterleavedZeroBubble
                       ? std::string("ScheduleInterleavedZeroBubble (ZB1P) through _PipelineScheduleRuntime: rank r "
                                     "runs stages r, r + P, ... as interleaved 1F1B does, warming up with one forward "
                                     "less per rank, each backward split into I (the input's gradient, sent back) and "
                                     "W (the weights', r backwards later): between them the stage keeps the micro-batch's "
                                     "whole graph, its input, the gradient received and each projection's output "
                                     "gradient; stage 0 runs its whole backward at W")
                   : config.schedule == nn::PipelineSchedule::DualPipeV
                       ? std::string("ScheduleDualPipeV through _PipelineScheduleRuntime: rank r holds stages r and "
                                     "2P - 1 - r (a V), the steady state running one stage's forward and the other's "
                                     "whole backward as one overlapped action, the first and last backwards split "
                                     "into I and W: between them the stage keeps the micro-batch's whole graph, its "
                                     "input, the gradient received and each projection's output gradient")
                   : config.schedule == nn::PipelineSchedule::ZBVZeroBubble
                       ? std::string("ScheduleZBVZeroBubble through _PipelineScheduleRuntime: rank r holds stages r "
                                     "and 2P - 1 - r (a V: the last rank hands stage P - 1's output to stage P without "
                                     "a send), each backward split into I and W; between them the stage keeps the "
                                     "micro-batch's whole graph, its input, the gradient received and each projection's "
                                     "output gradient; stage 0 runs its whole backward at W")
                       : std::string("Schedule1F1B: stage s keeps min(M, P - s) micro-batches' activations in flight, "
                                     "stage 0 the most")) +
                  "; a stage after the first receives each micro-batch's hidden states and, before the last, its "
                  "gradient into fresh buffers" +
                  (config.return_outputs ? "; the last stage keeps every micro-batch's output (the logits) until the "
                                           "next step and returns them concatenated (step()'s return_outputs=True)"
                                         : "") +
                  ")"
        : config.engine == nn::ParallelEngine::None
            ? "rank " + std::to_string(config.rank) + "'s of the tensor-parallel group"
            : "rank " + std::to_string(config.rank) +
                  "'s (FSDP2 keeps a padded 1/N shard of each parameter, all-gathers each block's before it runs "
                  "and reduce-scatters its gradients, on streams of its own; ranks differ only in the rows of "
                  "shards that do not split evenly; its rows run without checkpoint_sequential's segments, which would cut "
                  "across the blocks it wraps: checkpoint the blocks instead)";
    const std::string tensor_parallel =
        config.tensor_parallel < 2
            ? ""
            : "; tp:" + std::to_string(config.tensor_parallel) +
                  " inside it: torchtitan's tensor + sequence parallel plan through DTensor (1/N of each projection, "
                  "of the embedding's rows and of lm_head's, the norms and residuals on 1/N of the sequence, "
                  "all-gathers before the attention, the MLP and lm_head and reduce-scatters after o_proj, down_proj "
                  "and the embedding; " +
                  (config.loss_parallel ? std::string("loss_parallel: the logits stay sharded on the vocabulary, the loss "
                                                      "all-reduces per token; ")
                                        : std::string("the logits gathered whole on every GPU; ")) +
                  "the embedding's gradient is the whole table and the norms' Partial, redistributed "
                  "before " + (config.engine == nn::ParallelEngine::Fsdp ? "FSDP's reduce-scatter" : "each optimizer op that reads them") +
                  "; position_ids passed by the caller)";
    const std::string context_parallel =
        config.context_parallel < 2
            ? ""
            : "; cp:" + std::to_string(config.context_parallel) + " inside it, place " +
                  std::to_string(config.rank % config.context_parallel) +
                  " in the ring (torchtitan's train_context: context_parallel() gives each GPU 1/" +
                  std::to_string(config.context_parallel) + " of every sequence" +
                  (config.cp_load_balance ? ", two chunks under the head-tail load balancer," : ",") +
                  " and F.scaled_dot_product_attention runs as ring attention: K and V " +
                  (config.cp_all_to_all ? "passed on by an all-to-all each step" : "all-gathered once per call") +
                  ", the output merged in f32, the gradients accumulated in f32 and passed on by all-to-all; "
                  "context_parallel()'s copies of the batch while it shards it, B x S x 8 bytes each, left out)";
    const std::string expert_parallel =
        config.expert_parallel < 2
            ? ""
            : "; ep:" + std::to_string(config.expert_parallel) + " inside it (transformers' DistributedConfig(fsdp_size=" +
                  std::to_string(config.world_size) + ", ep_size=" + std::to_string(config.expert_parallel) +
                  "), the recording's: 1/" + std::to_string(config.expert_parallel) +
                  " of the experts on each GPU, each (token, expert) pair sent to its expert's GPU by all-to-all and "
                  "the outputs sent back, the routing even; the experts fully_shard'ed over " +
                  std::to_string(config.world_size / config.expert_parallel) +
                  (config.world_size / config.expert_parallel == 1 ? " GPU (whole)" : " GPUs") +
                  ", the dense modules over all " + std::to_string(config.world_size) + ")";
    // FSDP2 inside a pipeline stage, as torchtitan applies it there.
    const bool interleaved = nn::multi_stage(config.schedule);
    const std::string sharded_stage =
        config.pipeline_parallel < 2 || config.engine != nn::ParallelEngine::Fsdp
            ? ""
            : "; fsdp:" + std::to_string(config.world_size) + " inside each stage, rank " + std::to_string(config.rank) +
                  "'s shards (torchtitan's apply_fsdp under pp: each decoder layer and the stage fully_shard'ed, " +
                  (interleaved
                       ? std::string("each stage a root of its own, gathered by the runtime's UNSHARD for the next "
                                     "three stages the rank computes, waited before the stage's compute and resharded "
                                     "when it leaves that window, reshard_after_forward=False")
                   : config.reshard_after_forward.value_or(false)
                       ? std::string("reshard_after_forward=true: a forward gathers a layer again once an earlier one resharded it")
                       : std::string("reshard_after_forward=False: the first micro-batch gathers the parameters and they "
                                     "stay gathered until the step's end")) +
                  "; each micro-batch's backward adds into the unsharded gradients (set_requires_gradient_sync(False)), " +
                  (interleaved ? std::string("reduce-scattered by each stage's REDUCE_GRAD after its last backward, which "
                                             "reshards it (_PipelineScheduleRuntime, torch 2.15)")
                               : std::string("reduce-scattered once after the last backward, as torch 2.15's PipelineStage "
                                             "finalizes it (perform_reduce_grad)")) +
                  ", whatever --stack says)";
    const std::string offload =
        config.engine != nn::ParallelEngine::Fsdp || !config.cpu_offload
            ? ""
            : std::string("; offload_policy=cpu (CPUOffloadPolicy): the shards, their gradients and the optimizer's "
                          "state and step are on the host, ") +
                  (config.offload_pin_memory ? "the shards and gradients pinned (the pinned host figure)"
                                             : "pageable (pin_memory=false)") +
                  "; each all-gather first copies its group's shards to the GPU, each reduce-scatter's output is "
                  "copied back and freed";
    out += "parallel: " + nn::parallel_label(config) + ": every figure is one GPU's, " + engine + sharded_stage +
           offload + tensor_parallel + context_parallel + expert_parallel + "\n";
    pipeline_said = pipeline_said || config.pipeline_parallel > 1;
  }
  return out;
}

}  // namespace mem::tools
