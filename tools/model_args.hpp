// model_args.hpp — the options that pick a model, its size and a device, shared
// by `sweep` and `trace`, and their validation into runtime types.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vramscope/planner/checks.hpp"
#include "vramscope/runtime/models.hpp"
#include "vramscope/runtime/training.hpp"
#include "hf_record.hpp"

namespace mem::tools {

/// What the command line says about the model (0 = the model's default).
struct ModelArgs {
  std::string model;          ///< a zoo name; empty: the command's default
  std::string model_file;     ///< --model-file: a model file of the user's
  std::string batch;          ///< --batch as typed: "32", or for sweep a list "8,16,32"
  std::int64_t depth = 0;
  std::int64_t width = 0;
  std::string seq;            ///< --seq, as --batch
  std::int64_t image = 0;
  std::int64_t classes = 0;
  std::string extra;          ///< --model-options "dropout=0,inplace=1"
  std::string hf_config;      ///< --hf-config: a Hugging Face config.json
  std::string attention;      ///< --attn
  std::string checkpoint;     ///< --gradient-checkpointing
  std::int64_t lora = 0;      ///< --lora RANK
  std::string lora_targets;   ///< --lora-targets
  std::string quant;          ///< --quant
  std::string stack;          ///< --stack "torch=2.11,transformers=5.17,peft=0.21"
  /// Set by the command from --dtype: an --hf-config recorded by the exporter is recorded under
  /// their autocast (hf_autocast), since autocast's casts are operators of the recording.
  std::vector<nn::Precision> precisions;
  /// Set by the command from --compile: an --hf-config is recorded by the exporter with the
  /// joint graph torch.compile partitions (the built-in decoders have none).
  bool compile = false;
  /// Set by the command from --parallel (expert_parallel_of): an --hf-config is recorded by the
  /// exporter as one GPU's of expert parallel over N GPUs (0: not).
  std::size_t expert_parallel = 0;
};

/// What the command line alone decides about --parallel with --compute and --optimizer (exit 2,
/// before anything runs): the sharding engines run dry (one simulated rank's collectives bring no
/// data), and ZeRO takes no bitsandbytes 8-bit Adam (DeepSpeed runs its own FusedAdam). The
/// engines refuse the same at run time, for the library's callers.
void check_parallel_combination(const std::vector<nn::ParallelConfig>& parallels, nn::ExecMode mode,
                                const nn::OptimizerConfig& optimizer);

/// The autocast an --hf-config recording needs for these precisions ("bf16", "f16" or "");
/// a UsageError when they mix autocast and plain precisions (one recording serves one).
std::string hf_autocast(const std::vector<nn::Precision>& precisions);

/// A CLI11 check for an integer option: a whole number in [min, max], written in full.
/// Without it CLI11 clamps "99999999999999999999", and "-1" wraps in an unsigned option.
CLI::Validator integer_in(std::int64_t min, std::int64_t max);

/// A CLI11 check refusing an empty (or blank) value, which would silently mean the default.
CLI::Validator non_empty();

/// Adds --model, --model-file, --hf-config, --batch, --depth, --width, --seq, --image,
/// --classes, --attn, --gradient-checkpointing, --lora, --lora-targets, --quant, --model-options.
void add_model_options(CLI::App& app, ModelArgs& args, const std::string& default_note);

/// --stack as a Stack (the validated default when not given); a UsageError names the
/// known versions.
nn::Stack parse_stack(const ModelArgs& args);
/// --gradient-checkpointing on: gradient_checkpointing_enable()'s mode under `stack`.
void resolve_checkpoint_default(nn::ModelOptions& options, const nn::Stack& stack);

/// A list of sizes as typed ("8,16,32"): each a whole number in [1, max], no empty
/// item; an empty text is an empty list. UsageError names `option`.
std::vector<std::int64_t> parse_size_list(const std::string& option, const std::string& text, std::int64_t max);

/// The runtime's options for `args` (extra first, then the explicit flags on top).
/// --batch and --seq take the first item of their lists; a list of more than one is
/// a UsageError unless `lists_allowed` (sweep runs each item; trace and models run one).
/// Throws UsageError naming the option and the valid values.
nn::ModelOptions to_model_options(const ModelArgs& args, bool lists_allowed = false);

/// The model named by --model (or `fallback` when neither is given) or read from
/// --model-file. UsageError for both given, an unknown name (listing the zoo) or a
/// bad file (its JSON path and what was expected).
std::shared_ptr<const nn::ModelSource> resolve_model(const ModelArgs& args, const std::string& fallback);
/// Whether resolve_model records its --hf-config with the exporter (a model_type the built-in
/// readers do not model, or --compile), and how (hf_record.hpp; UsageError for what it refuses).
bool recorded_hf_config(const ModelArgs& args);
HfRecording hf_recording(const ModelArgs& args);


/// Comma-separated list ("f32,f16") split and trimmed. An empty item ("f32,,f16", a
/// trailing comma) is a UsageError naming `option`: it is a typo, not nothing.
std::vector<std::string> split_list(const std::string& option, const std::string& text);

/// --checkpoint-modules "layer3.0,layer4.1" (apply_activation_checkpointing on exactly these
/// modules, as `plan` writes them): the paths, checked against the model built with `options`
/// (UsageError naming an unknown one and the modules at its level). A decoder checkpoints its
/// layers through gradient_checkpointing_enable(): `options` gets its mode (non-reentrant)
/// unless --gradient-checkpointing gave one. Empty text: nullopt (the model's own marks).
std::optional<std::vector<std::string>> parse_checkpoint_modules(const std::string& text, const nn::ModelSource& model,
                                                                 nn::ModelOptions& options, std::size_t segments);

/// --selective "matmuls,attention" (selective checkpointing: what the checkpointed modules keep):
/// the policy; UsageError for a bad name, a model of modules (no operators to name), or nothing
/// checkpointed (the modules --checkpoint-modules gave, parse_checkpoint_modules' result, else
/// the model's own marks). Empty text: nullopt.
std::optional<nn::SelectivePolicy> parse_selective(const std::string& text, const nn::ModelInfo& info,
                                                   const std::optional<std::vector<std::string>>& checkpoint_modules);
inline constexpr const char* kSelectiveHelp =
    "selective checkpointing of an operator-level model: the checkpointed modules keep these operators' outputs for "
    "backward and recompute the rest, e.g. matmuls,attention (groups: matmuls, attention, convolutions; or "
    "operators as PyTorch names them: aten.mm for every overload, aten.mm.default for one, aten.mm.default@2 for "
    "its third call in the module's forward); per module: MODULES=OPS scopes joined by ';', MODULES a checkpointed "
    "module's path or type name with * for any characters (layers.*.mlp=matmuls;attention)";

/// --offload: "activations" (save_on_cpu(pin_memory=True) around the forward) is true; empty
/// text is false; anything else a UsageError naming what is modelled.
bool parse_offload(const std::string& text);
inline constexpr const char* kOffloadHelp =
    "activations: the forward under torch.autograd.graph.save_on_cpu(pin_memory=True): what autograd saves "
    "waits in pinned host memory (the pinned bytes are shown beside nvidia-smi's) and is copied back in backward";

inline constexpr const char* kCompileHelp =
    "torch.compile's step, a group of rows each: eager, on (AOTAutograd's min-cut partition, PyTorch's default), an "
    "activation_memory_budget from 0 to 1 (torch._functorch.config), or reduce-overhead (mode=\"reduce-overhead\": "
    "the graphs replayed as CUDA graphs from their private pool, 3 steps: warmup, recording, replay; "
    "reduce-overhead:0.5 with a budget), e.g. eager,on,0.5,reduce-overhead; the file must carry the joint graph "
    "(python3 -m vramscope.export ... --compile), recorded at the batch and dtype run";
/// --compile's list: nullopt for eager, else the mode ("on": budget 1, "reduce-overhead": CUDA graphs). UsageError
/// for another item, a repeat, or a model that recorded no compiled step.
std::vector<std::optional<nn::CompileMode>> parse_compiles(const std::string& text, const nn::ModelInfo& info);

/// Parses each name with nn::parse_precision; UsageError names the valid ones.
std::vector<nn::Precision> parse_precisions(const std::string& option, const std::string& list);

/// The spec to run on: in compute mode "auto" and "sim" without a GPU become the
/// default simulated preset by name, so the runtime can give it host memory.
std::string resolve_device(const std::string& spec, nn::ExecMode mode);

/// The device every command models when --device is not given: the same simulated GPU for
/// sweep, --max-batch and trace, so one model gives one figure (a real GPU only when asked:
/// --device auto or cuda:N).
inline constexpr const char* kDefaultDevice = "sim:rtx2080s";

/// --optimizer's help, the same for sweep and trace (nn::parse_optimizer_config's names).
inline constexpr const char* kOptimizerHelp =
    "adam, adam8bit (bitsandbytes' 8-bit Adam: u8 moments), sgd (PyTorch's default: momentum 0, no "
    "state), sgd-momentum (0.9: a buffer per parameter) or none";

/// --parallel and --parallel-options, shared by sweep (and --max-batch) and trace.
struct ParallelArgs {
  std::string spec = "none";  ///< "ddp:8"
  std::string options;        ///< "bucket_cap_mb=50,gradient_as_bucket_view=true"
  std::string topology = "auto";  ///< --topology: what NCCL's communicator holds
  bool stray_contexts = false;    ///< --stray-contexts
};
/// `list`: sweep's --parallel takes a comma list ("none,ddp:8"), trace's one value.
void add_parallel_options(CLI::App& app, ParallelArgs& args, bool list = false);
/// The runtime's ParallelConfigs, one per item of --parallel, --parallel-options applied to
/// each engine; UsageError naming the option and what is valid.
std::vector<nn::ParallelConfig> parse_parallel_args(const ParallelArgs& args);
/// The expert-parallel ranks of --parallel's configurations (0: none), for recording an
/// --hf-config under it: one number per run, given to every configuration of the list.
std::size_t expert_parallel_of(const ParallelArgs& args);
/// What the figures of data-parallel runs are, and what they leave out, a line per engine
/// for under a table ("" for one GPU).
std::string parallel_note(const std::vector<nn::ParallelConfig>& configs, const DeviceInfo& device);
/// What a recorded model assumed (values read from tensors, the experts' routing), a line each,
/// as every table ends with it.
std::string assumptions_note(const std::vector<std::string>& assumed);
/// ", each GPU of ddp:8" for a title, when every row is one rank of that ("" otherwise).
std::string per_gpu(const std::vector<nn::ParallelConfig>& configs);


/// One line naming the model's size: "mlp depth=256 width=1024 batch=4096".
std::string model_label(const nn::ModelInfo& info, const nn::ModelOptions& options);

}  // namespace mem::tools
