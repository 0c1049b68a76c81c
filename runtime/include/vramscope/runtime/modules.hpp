// modules.hpp — layers as modules (torch.nn): a tree with dotted paths, whose
// every call opens a mem::ModuleScope so the instrumentation attributes each
// byte to the module (and phase) that allocated it.
//
//   mem::nn::Sequential net;
//   net.append("0", std::make_unique<mem::nn::Linear>(1024, 1024));
//   net.append("1", std::make_unique<mem::nn::ReLU>());
//   net.set_path("");                     // names children "0", "1"
//   net.materialize(rt, mem::nn::DType::F32);   // allocates weight, then bias
//   auto y = net(x);                      // scopes "0" then "1", Phase::Forward
//
// Parameters are declared with shapes at construction and allocated by
// materialize(), so a model's size is known without allocating it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

/// A parameter or buffer slot of a module.
struct ParamSlot {
  std::string name;        ///< local name ("weight")
  Shape shape;
  bool is_buffer = false;  ///< running statistics: no grad, not optimised
  DType fixed_dtype = DType::F32;  ///< buffers that keep their dtype (i64 counters)
  bool keeps_dtype = false;
  double init_low = 0;     ///< uniform initialisation range (compute mode)
  double init_high = 0;
  Tensor tensor;           ///< undefined until materialize()
  bool frozen = false;     ///< requires_grad_(False): no gradient, no optimizer state
  /// A packed weight (bitsandbytes' Params4bit: two 4-bit values per byte) counts as the
  /// elements it stands for; -1: as its shape says.
  std::int64_t logical_numel = -1;
};

class Module;
struct SelectivePolicy;

/// Forward hooks of a module (register_forward_pre_hook / register_forward_hook), what
/// FSDP's fully_shard installs: around the module's call, outside any checkpoint of it.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  /// Before forward; returns the input forward gets.
  virtual Tensor pre_forward(Module& module, const Tensor& input) = 0;
  /// After forward; returns what the caller gets.
  virtual Tensor post_forward(Module& module, const Tensor& output) = 0;
};

/// While one lives, Module::materialize makes parameters on the meta device (no block):
/// `with torch.device("meta")` around a model's construction, buffers aside (to_empty gives
/// them blocks before training). Per thread.
class MetaParameters {
 public:
  MetaParameters() noexcept;
  ~MetaParameters();
  MetaParameters(const MetaParameters&) = delete;
  MetaParameters& operator=(const MetaParameters&) = delete;
  static bool active() noexcept;

 private:
  bool previous_;
};

/// A per-module checkpoint mark: the module's forward runs under checkpoint(), as
/// torch.distributed.algorithms._checkpoint's apply_activation_checkpointing wraps the
/// modules its check_fn selects (checkpoint_wrapper, NO_REENTRANT or REENTRANT).
enum class CheckpointMark : std::uint8_t { None, NonReentrant, Reentrant };

class Module {
 public:
  explicit Module(std::string type_name);
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// Runs forward() inside a ModuleScope(path, current phase) and makes nodes created
  /// inside attribute their backward to (path, Backward). With a checkpoint mark, under
  /// grad mode, forward runs under checkpoint() and reruns in backward.
  Tensor operator()(const Tensor& input);
  virtual Tensor forward(const Tensor& input) = 0;
  /// Whether forward hands its input back and only makes outputs of its own on the side (a
  /// rotary embedding's cos and sin, which need no gradient): what hooks on its outputs see in
  /// PyTorch is then nothing that backward reaches.
  virtual bool passes_input_through() const noexcept { return false; }

  const std::string& type_name() const noexcept { return type_name_; }
  /// Full dotted path ("layer1.0.conv1"); "" for a root.
  const std::string& path() const noexcept { return path_; }
  /// Sets this module's path and its children's (path + "." + name).
  void set_path(const std::string& path);
  bool training() const noexcept { return training_; }
  /// train(true) / eval(), recursively.
  void train(bool on = true);

  const std::vector<std::pair<std::string, std::unique_ptr<Module>>>& children() const noexcept {
    return children_;
  }
  const std::vector<ParamSlot>& slots() const noexcept { return slots_; }
  /// Parameters (not buffers) of this module and its descendants, in registration
  /// order (PyTorch's model.parameters()). Undefined tensors before materialize().
  std::vector<Tensor> parameters() const;
  /// Buffers (running statistics, rotary tables) of this module and its descendants, in
  /// PyTorch's named_buffers() order.
  std::vector<Tensor> buffers() const;
  /// The parameters that require grad, what an optimizer is given
  /// (filter(lambda p: p.requires_grad, model.parameters())).
  std::vector<Tensor> trainable_parameters() const;
  /// requires_grad_(false) on every parameter here and below; call before materialize().
  void freeze();
  /// Parameters here and below stay f32 whatever dtype the model is materialized in (PEFT's
  /// autocast_adapter_dtype upcasts f16 / bf16 LoRA adapters). Call before materialize().
  void keep_f32();
  /// Hooks around every call of this module (null: none); the caller keeps them alive.
  void set_forward_hooks(ForwardHooks* hooks) noexcept { hooks_ = hooks; }
  /// Replaces the tensor of a parameter slot (what fully_shard's setattr of the unsharded
  /// parameter does); the slot's declared shape stays.
  void replace_parameter(std::size_t slot, Tensor tensor) { slots_.at(slot).tensor = std::move(tensor); }
  /// Marks this module to run checkpointed (see CheckpointMark).
  void set_checkpoint(CheckpointMark mark) noexcept { checkpoint_ = mark; }
  CheckpointMark checkpoint_mark() const noexcept { return checkpoint_; }
  /// Selective checkpointing of this module's checkpointed forward (checkpoint_wrapper's
  /// context_fn): the operators whose outputs its checkpoint keeps; null: plain.
  void set_selective_policy(std::shared_ptr<const SelectivePolicy> policy) noexcept { selective_ = std::move(policy); }
  /// Marks this module as code in its parent's forward rather than a module of its own
  /// (the `x + self.mlp(self.ln_2(x))` of a block): it has no path segment and no scope,
  /// so its children are named, and their memory attributed, as the parent's. Call
  /// before set_path.
  void set_inline(bool on = true) noexcept { inline_ = on; }
  bool is_inline() const noexcept { return inline_; }
  /// Modules marked here and below.
  std::size_t checkpoint_marks() const;
  /// Number of parameter elements, from declared shapes (no allocation needed).
  std::int64_t parameter_count() const;
  /// Number of parameter tensors.
  std::int64_t parameter_tensors() const;
  /// Bytes of buffers (running statistics) at `dtype` for floating ones.
  std::size_t buffer_bytes(DType dtype) const;
  /// Allocates every parameter and buffer in registration order (module tree
  /// depth-first, weight before bias), initialising them in compute mode.
  /// Parameters and floating buffers get `dtype` (f16 for .half()).
  void materialize(Runtime& runtime, DType dtype);
  /// Frees every parameter, buffer and gradient.
  void release() noexcept;
  /// The interned context of this module for a phase (cached).
  ContextId context(Phase phase);

 protected:
  /// Declares a parameter; returns its slot index. Initialised uniform(low, high).
  std::size_t add_parameter(std::string name, Shape shape, double low, double high);
  std::size_t add_buffer(std::string name, Shape shape, double fill, bool keep_i64 = false);
  /// A buffer that keeps `dtype` whatever the model's (quantization statistics).
  std::size_t add_typed_buffer(std::string name, Shape shape, DType dtype);
  /// A frozen parameter stored packed in `bytes` u8 that counts as `elements` parameters.
  std::size_t add_packed_parameter(std::string name, std::int64_t bytes, std::int64_t elements);
  /// A rank's shard of a declared parameter (DTensor's local shape): call before materialize().
  void set_slot_shape(std::size_t slot, Shape shape) { slots_.at(slot).shape = std::move(shape); }
  /// Gives a declared slot a dtype of its own (materialize's `dtype` does not apply to it) and /
  /// or freezes it (requires_grad_(False)): a recorded model's parameters as they were recorded.
  void configure_slot(std::size_t slot, bool fixed_dtype, DType dtype, bool frozen);
  /// Called by materialize() once this module's slots are allocated in `dtype`.
  virtual void materialized(Runtime& runtime, DType dtype) { (void)runtime, (void)dtype; }
  /// The tensors besides its input that a marked module's forward reads (a recorded call's
  /// masks and position tables): checkpoint() keeps them as inputs too, as PyTorch's keeps every
  /// tensor argument, and hands them back through take_checkpoint_inputs() before each run of
  /// forward (the first and the recompute).
  virtual std::vector<Tensor> checkpoint_inputs() const { return {}; }
  /// Whether checkpoint() keeps the input forward is called with as one of its inputs (false:
  /// the checkpoint's closure holds it, as PyTorch's holds keyword arguments).
  virtual bool checkpoint_saves_input() const { return true; }
  virtual void take_checkpoint_inputs(std::span<const Tensor> inputs) { (void)inputs; }
  /// True during the first, checkpointed forward of a marked module (not its recompute):
  /// what a module whose forward takes more than its input must keep for the recompute.
  bool checkpointed_call() const noexcept { return checkpointed_call_; }
  Tensor& param(std::size_t slot) noexcept { return slots_[slot].tensor; }
  /// Removes the children `keep` refuses (their parameters were never materialized).
  void remove_children_except(const std::vector<std::string>& keep);
  template <class M>
  M& add_module(std::string name, std::unique_ptr<M> module) {
    M& ref = *module;
    children_.emplace_back(std::move(name), std::move(module));
    return ref;
  }

 private:
  std::string type_name_;
  std::string path_;
  bool training_ = true;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::vector<ParamSlot> slots_;
  std::array<ContextId, kNumPhases> contexts_{};
  bool contexts_ready_ = false;
  CheckpointMark checkpoint_ = CheckpointMark::None;
  std::shared_ptr<const SelectivePolicy> selective_;
  bool inline_ = false;
  bool checkpointed_call_ = false;
  ForwardHooks* hooks_ = nullptr;

  /// forward(), checkpointed if marked.
  Tensor call(const Tensor& input);
  /// forward() inside this module's scopes.
  Tensor run_in_scope(const Tensor& input);
};

/// Modules applied in order; checkpoint_sequential splits its children.
class Sequential : public Module {
 public:
  Sequential();
  /// Appends a child named `name` (PyTorch names them "0", "1", ...).
  Module& append(std::string name, std::unique_ptr<Module> module);
  /// Appends a child named by its index.
  Module& append(std::unique_ptr<Module> module);
  Tensor forward(const Tensor& input) override;
  /// The children where `part` is true, in order (one of a pipeline rank's stages, which
  /// share the rank's body). Throws mem::Error when `part` does not name every child, or
  /// under checkpoint_sequential's segments.
  Tensor forward_part(const Tensor& input, const std::vector<bool>& part);
  std::size_t size() const noexcept { return children().size(); }
  Module& at(std::size_t i) const { return *children().at(i).second; }
  /// Keeps only the children named in `names` (in their order here): a pipeline stage's part
  /// of the model, torchtitan's split deleting what other stages hold. Before materialize().
  void retain(const std::vector<std::string>& names);
  /// The children in order (what checkpoint_sequential takes).
  std::vector<Module*> modules() const;
  /// The containers flattened into this list, in order ("layer1" for "layer1.0", "layer1.1").
  std::vector<std::string> groups() const;
  /// Runs a flattened container's children under one checkpoint() as checkpoint(layer1, x)
  /// would (None: no more); false when `group` is not one of groups().
  bool set_group_checkpoint(std::string_view group, CheckpointMark mark);
  void clear_group_checkpoints() noexcept { group_marks_.clear(); }

 private:
  /// forward() over the children where `part` is true (all when it is empty).
  Tensor run_children(const Tensor& input, const std::vector<bool>& part);
  /// The container a flattened child name belongs to ("layer1" for "layer1.0"),
  /// or "" when it has none or the prefix names a child module itself.
  std::string_view group_of(std::string_view name) const;
  /// A flattened container's path, as its scope names it ("layer1", "model.layer1").
  std::string group_path(std::string_view group) const;
  /// Runs children [first, last) of group `group`, its scope open, under checkpoint().
  Tensor run_group_checkpointed(std::size_t first, std::size_t last, std::string_view group, CheckpointMark mark,
                                const Tensor& input);

  std::vector<std::pair<std::string, CheckpointMark>> group_marks_;
};

/// A residual block as PyTorch code writes one: out = body(x); identity = shortcut(x)
/// (or x); out += identity (or out = out + identity); then the `then` modules. The body
/// runs before the shortcut, as in torchvision's blocks, and a module may run more than
/// once (torchvision's blocks call self.relu after each stage and after the add).
class Residual : public Module {
 public:
  enum class Part : std::uint8_t { Body, Shortcut, Then };
  /// `class_name` is what logs call it ("BasicBlock"); `inplace_add` is `out += identity`.
  Residual(std::string class_name, bool inplace_add);
  /// Adds a child module (registration order = parameter order) and runs it in `part`.
  Module& add(Part part, std::string name, std::unique_ptr<Module> module);
  /// Runs an existing child again in `part`.
  void reuse(Part part, Module& child);
  Tensor forward(const Tensor& input) override;

 private:
  bool inplace_add_;
  std::array<std::vector<Module*>, 3> parts_;
};

/// Branches applied to the same input, joined by a sum or a concatenation
/// (torch.cat(..., dim)). Each branch is a list of this module's children.
class Parallel : public Module {
 public:
  /// How the branches' outputs combine: summed, concatenated along dim, multiplied
  /// elementwise (two branches: a gate), or matrix-multiplied (two branches: a @ b).
  enum class Join : std::uint8_t { Add, Concat, Mul, Matmul };
  Parallel(std::string class_name, Join join, std::int64_t dim = 1);
  /// Starts a new branch.
  void branch();
  /// Adds a child to the current branch.
  Module& add(std::string name, std::unique_ptr<Module> module);
  void reuse(Module& child);
  Tensor forward(const Tensor& input) override;

 private:
  Join join_;
  std::int64_t dim_;
  std::vector<std::vector<Module*>> branches_;
};

/// nn.Identity: returns its input; allocates and saves nothing.
class Identity : public Module {
 public:
  Identity();
  Tensor forward(const Tensor& input) override { return input; }
};

class Linear : public Module {
 public:
  /// weight [out, in] (or [in, out] with `kn_layout`, HF's Conv1D), bias [out].
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true,
         bool kn_layout = false);
  Tensor forward(const Tensor& input) override;
  const Tensor& weight() const noexcept;
  /// The loss applies this weight (a decoder's lm_head under Liger's fused linear cross
  /// entropy): forward passes its input through.
  void apply_in_loss() noexcept { in_loss_ = true; }
  bool has_bias() const noexcept { return has_bias_; }
  /// Tensor parallel, before materialize(): ColwiseParallel keeps `rank`'s chunk of the
  /// output features (weight and bias Shard(0)), RowwiseParallel's of the input features
  /// (weight Shard(1)), as torch.chunk splits them over `ranks`.
  void shard_columns(std::size_t ranks, std::size_t rank);
  void shard_inputs(std::size_t ranks, std::size_t rank);

 private:
  std::size_t weight_, bias_;
  bool has_bias_, kn_layout_;
  bool in_loss_ = false;
};

class Conv2d : public Module {
 public:
  /// weight [out, in / groups, kernel, kernel]; in and out must be multiples of groups.
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel,
         std::int64_t stride = 1, std::int64_t padding = 0, bool bias = true,
         std::int64_t dilation = 1, std::int64_t groups = 1);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_, bias_;
  std::int64_t stride_, padding_, dilation_, groups_;
  bool has_bias_;
};

/// nn.Conv1d on [N, C, L]: the 2-d convolution of the [N, C, 1, L] view with a [O, C/g, 1, k]
/// view of its [O, C/g, k] weight, as cuDNN's path unsqueezes (views allocate nothing).
class Conv1d : public Module {
 public:
  Conv1d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel, std::int64_t stride = 1,
         std::int64_t padding = 0, bool bias = true, std::int64_t dilation = 1, std::int64_t groups = 1);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_, bias_;
  std::int64_t stride_, padding_, dilation_, groups_;
  bool has_bias_;
};

/// nn.ConvTranspose2d (one group): weight [in, out, k, k].
class ConvTranspose2d : public Module {
 public:
  ConvTranspose2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel, std::int64_t stride = 1,
                  std::int64_t padding = 0, std::int64_t output_padding = 0, bool bias = true,
                  std::int64_t dilation = 1);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_, bias_;
  std::int64_t stride_, padding_, output_padding_, dilation_;
  bool has_bias_;
};

/// x.reshape(shape) (-1: inferred): a view when the layout allows, else a copy.
class Reshape : public Module {
 public:
  explicit Reshape(std::vector<std::int64_t> shape);
  Tensor forward(const Tensor& input) override;

 private:
  std::vector<std::int64_t> shape_;
};

/// x.permute(dims): a view.
class Permute : public Module {
 public:
  explicit Permute(std::vector<std::int64_t> dims);
  Tensor forward(const Tensor& input) override;

 private:
  std::vector<std::int64_t> dims_;
};

/// x.transpose(dim0, dim1): a view.
class Transpose : public Module {
 public:
  Transpose(std::int64_t dim0, std::int64_t dim1);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t dim0_, dim1_;
};

/// x.contiguous(): a copy when the layout is not contiguous (saves nothing).
class Contiguous : public Module {
 public:
  Contiguous();
  Tensor forward(const Tensor& input) override { return input.contiguous(); }
};

class ReLU : public Module {
 public:
  explicit ReLU(bool inplace = false);
  Tensor forward(const Tensor& input) override;

 private:
  bool inplace_;
};

class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01, bool inplace = false);
  Tensor forward(const Tensor& input) override;

 private:
  double slope_;
  bool inplace_;
};

/// nn.Hardtanh(min_val, max_val); nn.ReLU6 is Hardtanh(0, 6) named "ReLU6".
class Hardtanh : public Module {
 public:
  Hardtanh(double min_val = -1.0, double max_val = 1.0, bool inplace = false, std::string type = "Hardtanh");
  Tensor forward(const Tensor& input) override;

 private:
  double lo_, hi_;
  bool inplace_;
};

class SiLU : public Module {
 public:
  explicit SiLU(bool inplace = false);
  Tensor forward(const Tensor& input) override;

 private:
  bool inplace_;
};

/// nn.Softmax over the last dimension.
class Softmax : public Module {
 public:
  Softmax();
  Tensor forward(const Tensor& input) override;
};

class Sigmoid : public Module {
 public:
  Sigmoid();
  Tensor forward(const Tensor& input) override;
};

class Tanh : public Module {
 public:
  Tanh();
  Tensor forward(const Tensor& input) override;
};

/// `x * factor` with a Python number (`x / c` is a factor of 1 / c): PyTorch keeps the
/// number as a host scalar, so nothing of the device's is saved for backward.
class Scale : public Module {
 public:
  explicit Scale(double factor);
  Tensor forward(const Tensor& input) override;

 private:
  double factor_;
};

class GELU : public Module {
 public:
  /// nn.GELU, or under `type` a wrapper that calls F.gelu (transformers' GELUActivation,
  /// GELUTanh): one fused op that keeps its input only.
  explicit GELU(bool tanh_approx = false, std::string type = "GELU");
  Tensor forward(const Tensor& input) override;

 private:
  bool tanh_approx_;
};

/// transformers' NewGELUActivation (GPT-2's "gelu_new"), written out in Python as
/// 0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * x.pow(3)))): unlike the fused
/// GELU(approximate="tanh") it keeps four tensors of x's size for backward (x for the pow,
/// tanh's result, 0.5 * x and 1 + tanh for the product) and makes four temporaries on the way.
class NewGELU : public Module {
 public:
  NewGELU();
  Tensor forward(const Tensor& input) override;
};

/// nn.BatchNorm2d, and nn.BatchNorm1d with type "BatchNorm1d" ([N, C] or [N, C, L]).
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(std::int64_t channels, double eps = 1e-5, double momentum = 0.1,
                       std::string type = "BatchNorm2d");
  Tensor forward(const Tensor& input) override;
  const Tensor& running_mean() const noexcept;
  const Tensor& running_var() const noexcept;

 private:
  std::size_t weight_, bias_, mean_, var_, batches_;
  double eps_, momentum_;
};

class GroupNorm : public Module {
 public:
  GroupNorm(std::int64_t groups, std::int64_t channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_ = 0, bias_ = 0;
  std::int64_t groups_;
  double eps_;
  bool affine_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::int64_t features, double eps = 1e-5);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_, bias_;
  double eps_;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(std::int64_t kernel, std::int64_t stride, std::int64_t padding = 0);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t kernel_, stride_, padding_;
};

class AvgPool2d : public Module {
 public:
  AvgPool2d(std::int64_t kernel, std::int64_t stride, std::int64_t padding = 0, bool count_include_pad = true);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t kernel_, stride_, padding_;
  bool count_include_pad_;
};

/// Output size out_h x out_w (default 1x1, global average pooling).
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::int64_t out_h = 1, std::int64_t out_w = 1);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t out_h_, out_w_;
};

class Flatten : public Module {
 public:
  explicit Flatten(std::int64_t start_dim = 1);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t start_dim_;
};

/// x.mean(dim=(k, ..., rank - 1)): the mean over the trailing dimensions from `first_dim`
/// (a global average pool written as a mean); MeanBackward keeps only the input's sizes.
class Mean : public Module {
 public:
  explicit Mean(std::int64_t first_dim, bool keepdim = false);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t first_dim_;
  bool keepdim_;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& input) override;

 private:
  double p_;
};

class Embedding : public Module {
 public:
  /// Initialised uniform(-init_bound, init_bound) in compute mode.
  Embedding(std::int64_t num_embeddings, std::int64_t dim, double init_bound = 1.0);
  /// input: i64 indices.
  Tensor forward(const Tensor& input) override;
  const Tensor& weight() const noexcept;
  /// enable_input_require_grads() (transformers' modeling_utils.py): a forward hook makes the
  /// output require grad even when the weight is frozen, so that checkpointed layers of a
  /// PEFT model see an input that does.
  void set_output_requires_grad(bool on = true) noexcept { output_requires_grad_ = on; }
  /// Rows of the table as declared (the vocabulary).
  std::int64_t weight_rows() const noexcept { return slots()[weight_].shape[0]; }
  /// RowwiseParallel on an embedding, before materialize(): this rank keeps `rows` of the
  /// table and looks up only the ids that fall in them; its gradient is the whole table's.
  void shard_vocab(std::int64_t rows);

 private:
  std::size_t weight_;
  bool output_requires_grad_ = false;
  std::int64_t full_rows_ = 0;  ///< vocabulary-sharded: the table's rows; 0: whole
};

/// lm_head tied to the input embeddings (tie_word_embeddings): a bias-free Linear on the
/// Embedding's weight, which it does not own (no parameter of its own). `untied_first`:
/// built on the device, it first allocates a weight of its own, freed when tied.
class TiedLinear : public Module {
 public:
  explicit TiedLinear(const Embedding& embedding, bool untied_first = false)
      : Module("Linear"), embedding_(&embedding), untied_first_(untied_first) {}
  Tensor forward(const Tensor& input) override;
  /// The embedding's weight: in PyTorch the same Parameter is this module's `weight` too
  /// (what DeepSpeed's ZeRO-3 gathers around it).
  const Tensor& weight() const noexcept { return embedding_->weight(); }
  /// As Linear::apply_in_loss: forward passes its input through.
  void apply_in_loss() noexcept { in_loss_ = true; }

 protected:
  void materialized(Runtime& runtime, DType dtype) override;

 private:
  const Embedding* embedding_;
  bool untied_first_;
  bool in_loss_ = false;
};

enum class AttentionImpl : std::uint8_t;  // decoder.hpp

/// GPT-2's attention: c_attn (Conv1D to 3C), split, heads as views, then eager: q @ k^T
/// (matmul copies the permuted operands), scale, causal mask, softmax, dropout, @ v, merge
/// heads (contiguous copy); or SDPA (transformers' sdpa_attention_forward, causal, attn_pdrop
/// inside the kernel); then c_proj, dropout.
class CausalSelfAttention : public Module {
 public:
  /// `dropout` is attn_pdrop, `resid_dropout` resid_pdrop (both `dropout` when not given); eager.
  CausalSelfAttention(std::int64_t embed, std::int64_t heads, double dropout, double resid_dropout = -1);
  CausalSelfAttention(std::int64_t embed, std::int64_t heads, double dropout, double resid_dropout,
                      AttentionImpl attention);
  Tensor forward(const Tensor& input) override;

 private:
  Tensor sdpa(const Tensor& q, const Tensor& k, const Tensor& v) const;
  std::int64_t embed_, heads_;
  double dropout_;
  AttentionImpl attention_;
  Module *c_attn_, *c_proj_, *attn_dropout_, *resid_dropout_;
};

/// GPT-2 block: x + attn(ln_1(x)), then x + mlp(ln_2(x)) with mlp = c_fc, the activation
/// (NewGELU, GPT-2's "gelu_new", unless given), c_proj, dropout.
class TransformerBlock : public Module {
 public:
  TransformerBlock(std::int64_t embed, std::int64_t heads, double dropout);
  /// n_inner (0: 4 x embed), layer_norm_epsilon, attn_pdrop and resid_pdrop of a config (eager
  /// attention, NewGELU).
  TransformerBlock(std::int64_t embed, std::int64_t heads, std::int64_t inner, double eps, double attn_dropout,
                   double resid_dropout);
  /// Also its activation_function's module and config._attn_implementation.
  TransformerBlock(std::int64_t embed, std::int64_t heads, std::int64_t inner, double eps, double attn_dropout,
                   double resid_dropout, std::unique_ptr<Module> activation, AttentionImpl attention);
  Tensor forward(const Tensor& input) override;

 private:
  Module *ln_1_, *attn_, *ln_2_, *mlp_;
};

}  // namespace mem::nn
