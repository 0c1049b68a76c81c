// models.cpp — the built-in models: mlp, the forum CNNs, torchvision's resnets
// and GPT-2 in four sizes, with their inputs, targets and losses.
#include "vramscope/runtime/models.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <sstream>

#include "detail.hpp"
#include "vramscope/runtime/losses.hpp"

namespace mem::nn {
namespace {

constexpr std::int64_t kGptVocab = 50257;
constexpr std::int64_t kGptPositions = 1024;

// --- model-specific modules ---------------------------------------------------------------

/// forum-cnn-full's three heads: cat(sigmoid(head0(x)), head1(x), head2(x)).
class ForumHeads final : public Module {
 public:
  ForumHeads(std::int64_t in, std::int64_t out) : Module("ForumHeads") {
    for (int i = 0; i < 3; ++i) heads_[i] = &add_module(std::to_string(i), std::make_unique<Linear>(in, out));
    sigmoid_ = &add_module("sigmoid", std::make_unique<Sigmoid>());
  }
  Tensor forward(const Tensor& x) override {
    const Tensor parts[] = {(*sigmoid_)((*heads_[0])(x)), (*heads_[1])(x), (*heads_[2])(x)};
    return cat(parts, 1);
  }

 private:
  std::array<Module*, 3> heads_{};
  Module* sigmoid_;
};

/// GPT-2's token + position embeddings and embedding dropout ("transformer").
class Gpt2Embeddings final : public Module {
 public:
  Gpt2Embeddings(std::int64_t embed, double dropout) : Module("GPT2Embeddings") {
    wte_ = &add_module("wte", std::make_unique<Embedding>(kGptVocab, embed, 0.02 * std::sqrt(3.0)));
    wpe_ = &add_module("wpe", std::make_unique<Embedding>(kGptPositions, embed, 0.01 * std::sqrt(3.0)));
    drop_ = &add_module("drop", std::make_unique<Dropout>(dropout));
  }
  Tensor forward(const Tensor& idx) override {
    const std::int64_t t = idx.size(1);
    // position_ids = arange(T)[None]: a small i64 tensor on the device each step.
    std::vector<double> pos(static_cast<std::size_t>(t));
    for (std::int64_t i = 0; i < t; ++i) pos[static_cast<std::size_t>(i)] = static_cast<double>(i);
    const Tensor positions = from_values(idx.runtime(), Shape{1, t}, pos, DType::I64);
    const Tensor h = add((*wte_)(idx), (*wpe_)(positions));
    return (*drop_)(h);
  }
  Embedding& wte() noexcept { return *wte_; }

 private:
  Embedding* wte_;
  Module* wpe_;
  Module* drop_;
};

/// lm_head: a bias-free Linear whose weight is tied to wte.
class TiedLMHead final : public Module {
 public:
  explicit TiedLMHead(Embedding& wte) : Module("Linear"), wte_(&wte) {}
  Tensor forward(const Tensor& x) override { return linear(x, wte_->weight()); }

 private:
  Embedding* wte_;
};

// --- builders -------------------------------------------------------------------------------

struct Built {
  ModelInfo info;
  std::unique_ptr<Sequential> body;
};

std::int64_t pick(std::int64_t value, std::int64_t fallback) { return value > 0 ? value : fallback; }

Built build_mlp(const ModelOptions& o) {
  const std::int64_t depth = pick(o.depth, 16), width = pick(o.width, 1024), batch = pick(o.batch, 64);
  auto body = std::make_unique<Sequential>();
  for (std::int64_t i = 0; i < depth; ++i) {
    body->append(std::make_unique<Linear>(width, width));
    if (i + 1 < depth) {
      body->append(std::make_unique<ReLU>(o.inplace_relu.value_or(false)));
    } else {
      body->append(std::make_unique<Sigmoid>());
    }
  }
  Built b;
  b.info.description = std::to_string(depth) + " x (Linear(" + std::to_string(width) + ", " + std::to_string(width) +
                       ") + ReLU), last activation Sigmoid; MSE";
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, width};
  b.info.target_shape = Shape{batch, width};
  b.body = std::move(body);
  return b;
}

void forum_convs(Sequential& body) {
  body.append(std::make_unique<Conv2d>(20, 50, 3, 1, 1));
  body.append(std::make_unique<ReLU>());
  body.append(std::make_unique<Conv2d>(50, 25, 3, 1, 1));
  body.append(std::make_unique<ReLU>());
  body.append(std::make_unique<Conv2d>(25, 10, 3, 1, 1));
  body.append(std::make_unique<ReLU>());
  body.append(std::make_unique<Flatten>(1));
}

Built build_forum_cnn(const ModelOptions& o) {
  const std::int64_t batch = pick(o.batch, 100);
  auto body = std::make_unique<Sequential>();
  forum_convs(*body);
  body->append(std::make_unique<Linear>(10 * 19 * 22, 3258));
  Built b;
  b.info.description = "input 20x19x22, conv3x3 20->50->25->10 (padded) + ReLU, flatten, Linear 4180->3258; MSE";
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, 20, 19, 22};
  b.info.target_shape = Shape{batch, 3258};
  b.body = std::move(body);
  return b;
}

Built build_forum_cnn_full(const ModelOptions& o) {
  const std::int64_t batch = pick(o.batch, 100);
  auto body = std::make_unique<Sequential>();
  forum_convs(*body);
  body->append("heads", std::make_unique<ForumHeads>(10 * 45 * 43, 29913));
  Built b;
  b.info.description =
      "input 20x45x43, conv3x3 20->50->25->10 (padded) + ReLU, flatten, three Linear 19350->29913 heads "
      "(sigmoid on the first) concatenated; MSE";
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, 20, 45, 43};
  b.info.target_shape = Shape{batch, 3 * 29913};
  b.body = std::move(body);
  return b;
}

Built build_resnet(const ModelOptions& o, bool bottleneck, std::array<int, 4> blocks, const std::string& name) {
  const std::int64_t batch = pick(o.batch, 32), image = pick(o.image, 224), classes = pick(o.classes, 1000);
  const std::int64_t expansion = bottleneck ? Bottleneck::kExpansion : BasicBlock::kExpansion;
  auto body = std::make_unique<Sequential>();
  body->append("conv1", std::make_unique<Conv2d>(3, 64, 7, 2, 3, false));
  body->append("bn1", std::make_unique<BatchNorm2d>(64));
  body->append("relu", std::make_unique<ReLU>(true));
  body->append("maxpool", std::make_unique<MaxPool2d>(3, 2, 1));
  std::int64_t in = 64;
  const std::int64_t planes[] = {64, 128, 256, 512};
  for (int layer = 0; layer < 4; ++layer) {
    for (int i = 0; i < blocks[static_cast<std::size_t>(layer)]; ++i) {
      const std::int64_t stride = (i == 0 && layer > 0) ? 2 : 1;
      const bool down = i == 0 && (stride != 1 || in != planes[layer] * expansion);
      const std::string child = "layer" + std::to_string(layer + 1) + "." + std::to_string(i);
      if (bottleneck) {
        body->append(child, std::make_unique<Bottleneck>(in, planes[layer], stride, down));
      } else {
        body->append(child, std::make_unique<BasicBlock>(in, planes[layer], stride, down));
      }
      in = planes[layer] * expansion;
    }
  }
  body->append("avgpool", std::make_unique<AdaptiveAvgPool2d>());
  body->append("flatten", std::make_unique<Flatten>(1));
  body->append("fc", std::make_unique<Linear>(512 * expansion, classes));
  Built b;
  b.info.description = "torchvision " + name + ", input 3x" + std::to_string(image) + "x" + std::to_string(image) +
                       ", " + std::to_string(classes) + " classes, in-place ReLU; cross entropy";
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, 3, image, image};
  b.info.target_shape = Shape{batch};
  b.info.target_dtype = DType::I64;
  b.info.loss = LossKind::CrossEntropy;
  b.body = std::move(body);
  return b;
}

Built build_gpt2(const ModelOptions& o, std::int64_t layers, std::int64_t embed, std::int64_t heads,
                 const std::string& name) {
  const std::int64_t batch = pick(o.batch, 8), seq = pick(o.seq, kGptPositions);
  if (seq > kGptPositions) throw Error(name + ": seq " + std::to_string(seq) + " exceeds the 1024 positions");
  const double p = o.dropout.value_or(0.1);
  auto body = std::make_unique<Sequential>();
  auto& emb = static_cast<Gpt2Embeddings&>(body->append("transformer", std::make_unique<Gpt2Embeddings>(embed, p)));
  for (std::int64_t i = 0; i < layers; ++i) {
    body->append("transformer.h." + std::to_string(i), std::make_unique<TransformerBlock>(embed, heads, p));
  }
  body->append("transformer.ln_f", std::make_unique<LayerNorm>(embed));
  body->append("lm_head", std::make_unique<TiedLMHead>(emb.wte()));
  Built b;
  b.info.description = name + ": " + std::to_string(layers) + " blocks, width " + std::to_string(embed) + ", " +
                       std::to_string(heads) + " heads, sequence " + std::to_string(seq) +
                       ", vocab 50257 (tied lm_head), dropout " + std::to_string(p).substr(0, 4) +
                       ", eager attention, GELU(tanh); cross entropy";
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, seq};
  b.info.input_dtype = DType::I64;
  b.info.target_shape = Shape{batch, seq};
  b.info.target_dtype = DType::I64;
  b.info.loss = LossKind::CrossEntropy;
  b.body = std::move(body);
  return b;
}

// The integer sizes of ModelOptions, once: parse, check, to_string and the applicability
// check all read this table.
struct SizeKey {
  const char* key;
  std::int64_t ModelOptions::*field;
  std::int64_t max;
};
constexpr SizeKey kSizeKeys[] = {{"batch", &ModelOptions::batch, kMaxBatch},
                                 {"depth", &ModelOptions::depth, kMaxDepth},
                                 {"width", &ModelOptions::width, kMaxWidth},
                                 {"seq", &ModelOptions::seq, kMaxSeq},
                                 {"image", &ModelOptions::image, kMaxImage},
                                 {"classes", &ModelOptions::classes, kMaxClasses}};

struct Entry {
  const char* name;
  const char* options;  ///< the keys it takes; any other key set is an error, not ignored
  std::function<Built(const ModelOptions&)> build;
};

constexpr const char* kMlpOptions = "batch, depth, width, inplace";
constexpr const char* kCnnOptions = "batch";
constexpr const char* kResnetOptions = "batch, image, classes";
constexpr const char* kGptOptions = "batch, seq, dropout";

const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = {
      {"mlp", kMlpOptions, build_mlp},
      {"forum-cnn", kCnnOptions, build_forum_cnn},
      {"forum-cnn-full", kCnnOptions, build_forum_cnn_full},
      {"resnet18", kResnetOptions, [](const ModelOptions& o) { return build_resnet(o, false, {2, 2, 2, 2}, "resnet18"); }},
      {"resnet50", kResnetOptions, [](const ModelOptions& o) { return build_resnet(o, true, {3, 4, 6, 3}, "resnet50"); }},
      {"gpt2", kGptOptions, [](const ModelOptions& o) { return build_gpt2(o, 12, 768, 12, "gpt2"); }},
      {"gpt2-medium", kGptOptions, [](const ModelOptions& o) { return build_gpt2(o, 24, 1024, 16, "gpt2-medium"); }},
      {"gpt2-large", kGptOptions, [](const ModelOptions& o) { return build_gpt2(o, 36, 1280, 20, "gpt2-large"); }},
      {"gpt2-xl", kGptOptions, [](const ModelOptions& o) { return build_gpt2(o, 48, 1600, 25, "gpt2-xl"); }},
  };
  return entries;
}

// A size given for a model that has no such size would be echoed in reports and ignored.
void check_applicable(const Entry& e, const ModelOptions& o) {
  const std::string takes = std::string(", ") + e.options + ",";
  const auto require = [&](const char* key, bool given) {
    if (given && takes.find(std::string(", ") + key + ",") == std::string::npos) {
      throw Error(std::string(e.name) + " has no " + key + " option; it takes " + e.options);
    }
  };
  for (const SizeKey& size : kSizeKeys) require(size.key, o.*size.field > 0);
  require("dropout", o.dropout.has_value());
  require("inplace", o.inplace_relu.has_value());
}

Built build(std::string_view name, const ModelOptions& options) {
  options.check();
  for (const Entry& e : registry()) {
    if (name == e.name) {
      check_applicable(e, options);
      Built b = e.build(options);
      b.info.name = e.name;
      b.body->set_path("");
      b.info.parameters = b.body->parameter_count();
      // parameter_bytes() must not wrap either: f32 is the widest parameter dtype.
      if (static_cast<std::uint64_t>(b.info.parameters) > UINT64_MAX / dtype_size(DType::F32)) {
        throw Error(std::string(e.name) + ": " + std::to_string(b.info.parameters) +
                    " parameters need more than 2^64 bytes; no device holds them (check the sizes given)");
      }
      b.info.parameter_tensors = b.body->parameter_tensors();
      b.info.sequence_length = b.body->size();
      return b;
    }
  }
  std::string valid;
  for (const Entry& e : registry()) valid += (valid.empty() ? "" : ", ") + std::string(e.name);
  throw Error("unknown model '" + std::string(name) + "'; valid models: " + valid);
}

std::int64_t parse_int(std::string_view key, std::string_view value) {
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc{} || ptr != value.data() + value.size() || v <= 0) {
    throw Error("model option " + std::string(key) + "='" + std::string(value) + "' is not a positive integer" +
                (ec == std::errc::result_out_of_range ? " that fits in 64 bits" : ""));
  }
  return v;
}


}  // namespace

ModelOptions ModelOptions::parse(std::string_view text) {
  ModelOptions o;
  while (!text.empty()) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw Error("model option '" + std::string(item) + "' is not key=value");
    }
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    const auto size = std::find_if(std::begin(kSizeKeys), std::end(kSizeKeys),
                                   [&](const SizeKey& k) { return key == k.key; });
    if (size != std::end(kSizeKeys)) {
      o.*size->field = parse_int(key, value);
    } else if (key == "dropout") {
      try {
        o.dropout = std::stod(std::string(value));
      } catch (...) {
        throw Error("model option dropout='" + std::string(value) + "' is not a number");
      }
      if (*o.dropout < 0 || *o.dropout >= 1) throw Error("model option dropout must be in [0, 1)");
    } else if (key == "inplace") {
      if (value != "0" && value != "1" && value != "true" && value != "false") {
        throw Error("model option inplace='" + std::string(value) + "' is not 0/1/true/false");
      }
      o.inplace_relu = value == "1" || value == "true";
    } else {
      throw Error("unknown model option '" + std::string(key) +
                  "'; valid keys: batch, depth, width, seq, image, classes, dropout, inplace");
    }
  }
  o.check();
  return o;
}

void ModelOptions::check() const {
  for (const SizeKey& size : kSizeKeys) {
    const std::int64_t value = this->*size.field;
    if (value < 0 || value > size.max) {
      throw Error("model option " + std::string(size.key) + "=" + std::to_string(value) +
                  " is out of range: give 1 to " + std::to_string(size.max));
    }
  }
}

std::string ModelOptions::to_string() const {
  std::string s;
  auto add = [&](const char* key, const std::string& value) {
    if (!s.empty()) s.push_back(',');
    s.append(key).append("=").append(value);
  };
  for (const SizeKey& size : kSizeKeys) {
    if (this->*size.field > 0) add(size.key, std::to_string(this->*size.field));
  }
  if (dropout) {
    std::ostringstream os;
    os << *dropout;
    add("dropout", os.str());
  }
  if (inplace_relu) add("inplace", *inplace_relu ? "1" : "0");
  return s;
}

Model::Model(ModelInfo info, std::unique_ptr<Sequential> body) : info_(std::move(info)), body_(std::move(body)) {}
Model::~Model() = default;

Tensor Model::make_input(Runtime& runtime, DType dtype, std::uint64_t step) const {
  const std::uint64_t seed = runtime.init_seed() ^ (0xabcdefull + step * 0x10001ull);
  if (info_.input_dtype == DType::I64) {
    return uniform(runtime, info_.input_shape, 0, static_cast<double>(kGptVocab) - 1e-9, DType::I64, seed);
  }
  return uniform(runtime, info_.input_shape, 0.0, 1.0, dtype, seed);
}

Tensor Model::make_target(Runtime& runtime, DType dtype, std::uint64_t step) const {
  const std::uint64_t seed = runtime.init_seed() ^ (0x123457ull + step * 0x20003ull);
  if (info_.target_dtype == DType::I64) {
    const auto& last = body_->at(body_->size() - 1);
    double classes = static_cast<double>(kGptVocab);
    if (info_.input_dtype != DType::I64) classes = static_cast<double>(last.slots()[0].shape[0]);
    return uniform(runtime, info_.target_shape, 0, classes - 1e-9, DType::I64, seed);
  }
  return uniform(runtime, info_.target_shape, 0.0, 1.0, dtype, seed);
}

Tensor Model::loss(const Tensor& output, const Tensor& target) const {
  if (info_.loss == LossKind::MSE) return mse_loss(output, target);
  if (output.dim() > 2) return cross_entropy(output.view(Shape{-1, output.size(-1)}), target.reshape(Shape{-1}));
  return cross_entropy(output, target);
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.emplace_back(e.name);
  return names;
}

ModelInfo describe_model(std::string_view name, const ModelOptions& options) { return build(name, options).info; }

std::unique_ptr<Model> build_model(std::string_view name, const ModelOptions& options) {
  Built b = build(name, options);
  return std::make_unique<Model>(std::move(b.info), std::move(b.body));
}

}  // namespace mem::nn
