// gpt2.cpp — GPT-2 in four sizes as Hugging Face's GPT2LMHeadModel lays it out: token
// and position embeddings, eager-attention blocks, ln_f and an lm_head tied to wte. A
// C++ builder until model files can express its attention (the transformer issue).
#include <cmath>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/ops.hpp"
#include "zoo_sources.hpp"

namespace mem::models::detail {
namespace {

using namespace mem::nn;

constexpr std::int64_t kGptVocab = 50257;
constexpr std::int64_t kGptPositions = 1024;

std::int64_t pick(std::int64_t value, std::int64_t fallback) { return value > 0 ? value : fallback; }

class Gpt2Source final : public ModelSource {
 public:
  Gpt2Source(std::string name, std::int64_t layers, std::int64_t embed, std::int64_t heads)
      : name_(std::move(name)), layers_(layers), embed_(embed), heads_(heads) {}
  const std::string& name() const noexcept override { return name_; }
  const std::vector<std::string>& option_keys() const noexcept override { return keys_; }
  using ModelSource::Built;

 private:
  Built make(const ModelOptions& options) const override;
  std::string name_;
  std::int64_t layers_, embed_, heads_;
  std::vector<std::string> keys_{"batch", "seq", "dropout"};
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


Gpt2Source::Built build_gpt2(const ModelOptions& o, std::int64_t layers, std::int64_t embed, std::int64_t heads,
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
  Gpt2Source::Built b;
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
  b.info.target_classes = kGptVocab;
  b.info.input_high = kGptVocab;
  b.body = std::move(body);
  return b;
}


Gpt2Source::Built Gpt2Source::make(const ModelOptions& options) const {
  return build_gpt2(options, layers_, embed_, heads_, name_);
}

}  // namespace

std::shared_ptr<const ModelSource> gpt2_source(std::string_view name) {
  static const std::shared_ptr<const ModelSource> sources[] = {
      std::make_shared<Gpt2Source>("gpt2", 12, 768, 12), std::make_shared<Gpt2Source>("gpt2-medium", 24, 1024, 16),
      std::make_shared<Gpt2Source>("gpt2-large", 36, 1280, 20), std::make_shared<Gpt2Source>("gpt2-xl", 48, 1600, 25)};
  for (const auto& s : sources) {
    if (s->name() == name) return s;
  }
  return nullptr;
}

}  // namespace mem::models::detail
