// models.hpp — the built-in models, by name, with documented shapes and defaults.
//
//   for (const auto& name : mem::nn::model_names()) {
//     auto info = mem::nn::describe_model(name);      // no allocation
//     fmt::print("{} {} params\n", name, info.parameters);
//   }
//   auto model = mem::nn::build_model("mlp", mem::nn::ModelOptions::parse("depth=200,width=1024"));
//   model->materialize(rt, mem::nn::DType::F32);
//
// Names and defaults (batch in brackets):
//   mlp             depth x (Linear(width, width) + ReLU), the last activation a Sigmoid;
//                   input [batch, width], MSE to a [batch, width] target.
//                   Defaults depth 16, width 1024 [64]. 2*depth top-level modules.
//   forum-cnn       input [batch, 20, 19, 22]; three 3x3 padded convs 20->50->25->10 with
//                   ReLU, flatten, Linear 4180->3258; MSE. [100]
//   forum-cnn-full  the same convs on [batch, 20, 45, 43], flatten, three Linear
//                   19350->29913 heads (sigmoid on the first) concatenated; MSE. [100]
//   resnet18        torchvision layout, input [batch, 3, image, image], 1000 classes,
//   resnet50        cross entropy; image 224. [32]
//   gpt2            12 blocks, 768 wide, 12 heads, sequence 1024, vocab 50257, tied
//   gpt2-medium     lm_head, dropout 0.1, GELU(tanh); cross entropy over next tokens. [8]
//   gpt2-large      24 / 1024 / 16; 36 / 1280 / 20; 48 / 1600 / 25.
//   gpt2-xl
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
/// by what was typed: an mlp of depth 10^12 would never finish building.
inline constexpr std::int64_t kMaxBatch = std::int64_t{1} << 40;
inline constexpr std::int64_t kMaxDepth = 100'000;
inline constexpr std::int64_t kMaxWidth = std::int64_t{1} << 31;
inline constexpr std::int64_t kMaxSeq = std::int64_t{1} << 24;
inline constexpr std::int64_t kMaxImage = std::int64_t{1} << 20;
inline constexpr std::int64_t kMaxClasses = std::int64_t{1} << 31;

struct ModelOptions {
  std::int64_t batch = 0;
  std::int64_t depth = 0;    ///< mlp: Linear layers
  std::int64_t width = 0;    ///< mlp: features
  std::int64_t seq = 0;      ///< gpt2: sequence length (<= 1024)
  std::int64_t image = 0;    ///< resnet: input side
  std::int64_t classes = 0;  ///< resnet: classes
  std::optional<double> dropout;       ///< gpt2: dropout probability (default 0.1)
  std::optional<bool> inplace_relu;    ///< mlp: ReLU(inplace=True) (default false; resnets always true)

  /// Parses "depth=200,width=1024,batch=32,seq=512,image=128,classes=10,dropout=0,inplace=1".
  /// Throws mem::Error naming the bad key or value and listing the valid keys.
  static ModelOptions parse(std::string_view text);
  /// The canonical text parse() reads back (only the keys that are set).
  std::string to_string() const;
  /// Throws mem::Error naming the first size outside [1, its kMax*] (0 means "not set").
  void check() const;
};

enum class LossKind : std::uint8_t { MSE, CrossEntropy };

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
  std::int64_t parameters = 0;      ///< elements
  std::int64_t parameter_tensors = 0;
  std::size_t sequence_length = 0;  ///< top-level modules checkpoint_sequential splits
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
  std::vector<Tensor> parameters() const { return body_->parameters(); }

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

/// Names accepted by build_model(), in a stable order.
std::vector<std::string> model_names();
/// Shapes and sizes without allocating. Throws mem::Error for an unknown name
/// (listing the valid ones) or an invalid option.
ModelInfo describe_model(std::string_view name, const ModelOptions& options = {});
/// Builds the module tree (parameters declared, not allocated; paths set).
std::unique_ptr<Model> build_model(std::string_view name, const ModelOptions& options = {});

}  // namespace mem::nn
