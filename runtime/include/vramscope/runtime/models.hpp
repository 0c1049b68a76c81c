// models.hpp — what a model is to the engine: its options, its shapes and loss, the
// built module tree, and the seam a model comes through (ModelSource). Where models
// come from (the zoo's files, a user's model file, C++ builders) is the models/
// module's concern: mem::models::find("resnet50"), mem::models::ModelFile.
//
//   std::shared_ptr<const mem::nn::ModelSource> source = mem::models::find("mlp");
//   auto model = source->build(mem::nn::ModelOptions::parse("depth=200,width=1024"));
//   model->materialize(rt, mem::nn::DType::F32);
//   fmt::print("{} parameters\n", model->info().parameters);
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

/// Overrides of a model's defaults; 0 / unset means "the model's default".
/// The largest sizes a model description may ask for. Shapes are checked for overflow
/// anyway; these keep a description's own cost (modules built, host memory, time) bounded
/// by what was typed: an mlp of depth 10^12 would never finish building, and one of depth
/// 100,000 took 8.6 s per sweep row (a default sweep of it, minutes). At 10,000 a sweep
/// with --segments auto takes about 8 s.
inline constexpr std::int64_t kMaxBatch = std::int64_t{1} << 40;
inline constexpr std::int64_t kMaxDepth = 10'000;
inline constexpr std::int64_t kMaxWidth = std::int64_t{1} << 31;
inline constexpr std::int64_t kMaxSeq = std::int64_t{1} << 24;
inline constexpr std::int64_t kMaxImage = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxClasses = std::int64_t{1} << 31;
inline constexpr std::int64_t kMaxLoraRank = 65536;
inline constexpr std::int64_t kMaxExpertSkew = 1 << 16;

struct ModelOptions {
  std::int64_t batch = 0;
  std::int64_t depth = 0;    ///< mlp: Linear layers
  std::int64_t width = 0;    ///< mlp: features
  std::int64_t seq = 0;      ///< gpt2: sequence length (<= 1024)
  std::int64_t image = 0;    ///< resnet: input side
  std::int64_t classes = 0;  ///< resnet: classes
  std::optional<double> dropout;       ///< gpt2: dropout probability (default 0.1)
  std::optional<bool> inplace_relu;    ///< mlp: ReLU(inplace=True) (default false; resnets always true)
  // Transformers from Hugging Face configs (docs/TRANSFORMERS.md):
  std::optional<std::string> attention;   ///< attn: eager, sdpa (flash), sdpa-efficient
  std::optional<std::string> checkpoint;  ///< checkpoint: none, reentrant, non-reentrant (per layer)
  std::int64_t lora = 0;                  ///< lora: adapter rank (0: full fine-tune)
  /// expert_skew: a mixture of experts' busiest expert gets this many times its even share of
  /// the routed tokens (at most every token); 1, the default, spreads them evenly
  std::int64_t expert_skew = 0;
  std::optional<std::string> lora_targets;  ///< lora_targets: q_proj+v_proj, ... or all
  std::optional<double> lora_dropout;     ///< lora_dropout in [0, 1)
  std::optional<std::string> quant;       ///< quant: none, nf4 (double quantization), nf4-single
  /// built_on: cpu (built on the CPU or loaded by from_pretrained, then moved) or gpu
  /// (constructed on the GPU: from_config under torch.device("cuda"))
  std::optional<std::string> built_on;
  /// loss: the causal LM loss as transformers computes it ("hf": the logits, then cross
  /// entropy) or Liger's fused linear cross entropy ("liger-flce": no logits)
  std::optional<std::string> loss;

  /// Parses "depth=200,width=1024,batch=32,seq=512,image=128,classes=10,dropout=0,inplace=1"
  /// and the transformer keys "attn=eager,checkpoint=reentrant,lora=16,lora_targets=q_proj+v_proj,
  /// lora_dropout=0.05".
  /// Throws mem::Error naming the bad key or value and listing the valid keys.
  static ModelOptions parse(std::string_view text);
  /// The size option `key` ("batch", "depth", ...) when set; nullopt when not set.
  std::optional<std::int64_t> size(std::string_view key) const;
  /// Every option key: batch, depth, width, seq, image, classes, lora, expert_skew, dropout, inplace, attn,
  /// checkpoint, lora_targets, quant, built_on, loss, lora_dropout.
  static const std::vector<std::string>& keys();
  /// The keys set here, in keys() order.
  std::vector<std::string> given() const;
  /// The canonical text parse() reads back (only the keys that are set).
  std::string to_string() const;
  /// Throws mem::Error naming the first size outside [1, its kMax*] (0 means "not set").
  void check() const;
};

/// mse_loss, cross_entropy (over the last dimension; token targets flattened),
/// binary_cross_entropy_with_logits, output.sum() as the scalar backward starts from, or
/// None: the output is the loss already (a scalar; models that compute their own loss).
/// CausalLM is transformers' ForCausalLMLoss: the logits upcast to f32, then cross entropy
/// of every token against the next one.
enum class LossKind : std::uint8_t { MSE, CrossEntropy, Sum, BCEWithLogits, None, CausalLM };

struct CompiledModel;

/// What a model is, computed from declared shapes (nothing allocated).
struct ModelInfo {
  std::string name;
  std::string description;          ///< one line: layout and defaults
  std::int64_t batch = 0;           ///< effective batch
  Shape input_shape;                ///< including batch
  DType input_dtype = DType::F32;   ///< i64 for token ids (gpt2)
  Shape target_shape;
  DType target_dtype = DType::F32;  ///< i64 for class / token targets
  LossKind loss = LossKind::MSE;
  std::int64_t target_classes = 0;  ///< cross entropy: classes (or vocabulary) of the target
  std::int64_t input_high = 0;      ///< i64 inputs: token ids are drawn from [0, input_high)
  std::int64_t parameters = 0;      ///< elements
  std::int64_t parameter_tensors = 0;
  std::size_t sequence_length = 0;  ///< top-level modules checkpoint_sequential splits
  /// Modules with a checkpoint mark (apply_activation_checkpointing); checkpoint_sequential
  /// does not apply to such a model.
  std::size_t checkpointed_modules = 0;
  bool input_requires_grad = false; ///< the model's input requires grad (x.requires_grad_())
  /// Whether checkpoint_sequential may split the body (false for the Hugging Face
  /// decoders, whose layers take more than one tensor; they checkpoint per layer).
  bool sequential_checkpointing = true;
  /// Whether checkpointing goes through the model's `checkpoint` option, layer by layer (the
  /// Hugging Face decoders: gradient_checkpointing_enable and its layers' flags), rather than
  /// through marks on any module (model files, operator graphs).
  bool checkpoints_by_layer = false;
  /// The causal LM loss takes the hidden states and lm_head's weight (Liger's fused linear
  /// cross entropy): lm_head's forward passes its input through.
  bool fused_linear_loss = false;
  /// A Hugging Face decoder's model_type ("llama", "mistral", "qwen2"); "" for other models.
  std::string model_type;
  /// An operator-level model (op_graph.hpp): its recorded operators and module calls (0: a
  /// model of modules), and the PyTorch it was recorded with.
  std::size_t operators = 0;
  std::size_t module_calls = 0;
  /// The operators it runs, each overload once, sorted ("aten.mm.default"): what a selective
  /// checkpointing policy can name.
  std::vector<std::string> operator_names;
  std::string recorded_with;
  /// What the recording assumed where the program read a value (meta tensors have none).
  std::vector<std::string> assumed;
  /// The step as torch.compile partitions it (compiled.hpp), when the file recorded it.
  std::shared_ptr<const CompiledModel> compiled;
  /// One rank of expert parallel (the file's "expert_parallel", vramscope.export
  /// --expert-parallel N): the ranks it was recorded for (0: not so recorded; its operators
  /// include the all-to-alls, its experts' parameters are the rank's shards).
  std::size_t expert_parallel = 0;
  /// How the engine that applies expert parallel (transformers' DistributedConfig) calls
  /// fully_shard, in order, the root last: each call's modules (one group), its
  /// reshard_after_forward, and whether it shards over the experts' efsdp mesh. Empty: FSDP2
  /// wraps the repeated blocks and the root (torchtitan's apply_fsdp).
  struct ShardGroup {
    std::vector<std::string> modules;
    bool reshard_after_forward = true;
    bool experts = false;
  };
  std::vector<ShardGroup> fsdp_groups;
  std::size_t parameter_bytes(DType dtype) const noexcept {
    return static_cast<std::size_t>(parameters) * dtype_size(dtype);
  }
};

/// A built model: a Sequential body (its children are the units checkpoint_sequential
/// splits), plus its input, target and loss.
class Model {
 public:
  Model(ModelInfo info, std::unique_ptr<Sequential> body);
  ~Model();

  const ModelInfo& info() const noexcept { return info_; }
  Sequential& body() noexcept { return *body_; }
  /// Allocates parameters and buffers (see Module::materialize).
  void materialize(Runtime& runtime, DType dtype) { body_->materialize(runtime, dtype); }
  /// The parameters that require grad: what the optimizer is given.
  std::vector<Tensor> parameters() const { return body_->trainable_parameters(); }

  /// A batch as copied to the device: random floats in [0, 1) or random token ids
  /// in compute mode (seeded by `step`), allocation only in a dry run.
  Tensor make_input(Runtime& runtime, DType dtype, std::uint64_t step) const;
  Tensor make_target(Runtime& runtime, DType dtype, std::uint64_t step) const;
  /// The model's loss of `output` against `target` (reshapes for token targets).
  Tensor loss(const Tensor& output, const Tensor& target) const;

 private:
  ModelInfo info_;
  std::unique_ptr<Sequential> body_;
};

/// Where a model comes from: a zoo file, a user's model file, a C++ builder. build()
/// checks the options (each within its range, and only the keys this model takes:
/// an option that does not apply is an error, never silently ignored), then fills in
/// the figures every model has (parameters, sequence length).
class ModelSource {
 public:
  virtual ~ModelSource();
  virtual const std::string& name() const noexcept = 0;
  /// The option keys it takes, e.g. {"batch", "image", "classes"}.
  virtual const std::vector<std::string>& option_keys() const noexcept = 0;
  /// Builds the module tree (parameters declared, not allocated; paths set).
  /// Throws mem::Error for an option this model does not take or an invalid size.
  std::unique_ptr<Model> build(const ModelOptions& options = {}) const;
  /// Shapes and sizes, from the built tree (nothing allocated).
  ModelInfo describe(const ModelOptions& options = {}) const { return build(options)->info(); }

  /// What make() returns: the body and what only the source knows of the info
  /// (description, batch, shapes, dtypes, loss); build() fills in the rest.
  struct Built {
    ModelInfo info;
    std::unique_ptr<Sequential> body;
  };

 protected:
  virtual Built make(const ModelOptions& options) const = 0;
};

}  // namespace mem::nn
