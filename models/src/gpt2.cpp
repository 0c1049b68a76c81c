// gpt2.cpp — GPT-2 as Hugging Face's GPT2LMHeadModel lays it out: token and position
// embeddings, eager-attention blocks, ln_f and an lm_head tied to wte. Built from a
// config.json (model_type gpt2: the zoo's gpt2, gpt2-medium, gpt2-large and gpt2-xl are
// their published configs, models/zoo/hf/) until model files can express its attention.
#include <cmath>
#include <sstream>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/ops.hpp"
#include "zoo_sources.hpp"

namespace mem::models::detail {
namespace {

using namespace mem::nn;

/// GPT-2's token + position embeddings and embedding dropout ("transformer").
class Gpt2Embeddings final : public Module {
 public:
  Gpt2Embeddings(const Gpt2Spec& s, double dropout) : Module("GPT2Embeddings") {
    wte_ = &add_module("wte", std::make_unique<Embedding>(s.vocab, s.embed, 0.02 * std::sqrt(3.0)));
    wpe_ = &add_module("wpe", std::make_unique<Embedding>(s.positions, s.embed, 0.01 * std::sqrt(3.0)));
    drop_ = &add_module("drop", std::make_unique<Dropout>(dropout));
  }
  Tensor forward(const Tensor& idx) override {
    const std::int64_t t = idx.size(1);
    // position_ids = arange(T)[None]: a small i64 tensor on the device each step.
    const Tensor positions = arange(idx.runtime(), t).view(Shape{1, t});
    const Tensor h = add((*wte_)(idx), (*wpe_)(positions));
    return (*drop_)(h);
  }
  Embedding& wte() noexcept { return *wte_; }

 private:
  Embedding* wte_;
  Module* wpe_;
  Module* drop_;
};

/// The MLP's activation_function as transformers' ACT2CLS makes it.
std::unique_ptr<Module> activation(const Gpt2Spec& s) {
  if (s.activation == "gelu_pytorch_tanh") return std::make_unique<GELU>(true, "GELUTanh");
  if (s.activation == "gelu") return std::make_unique<GELU>(false, "GELUActivation");
  return std::make_unique<NewGELU>();
}

class Gpt2Source final : public ModelSource {
 public:
  Gpt2Source(std::string name, Gpt2Spec spec) : name_(std::move(name)), spec_(spec) {}
  const std::string& name() const noexcept override { return name_; }
  const std::vector<std::string>& option_keys() const noexcept override { return keys_; }

 private:
  Built make(const ModelOptions& options) const override;
  std::string name_;
  Gpt2Spec spec_;
  std::vector<std::string> keys_{"batch", "seq", "dropout", "attn"};
};

ModelSource::Built Gpt2Source::make(const ModelOptions& o) const {
  const Gpt2Spec& s = spec_;
  const std::int64_t batch = o.batch > 0 ? o.batch : 8, seq = o.seq > 0 ? o.seq : s.positions;
  if (seq > s.positions) {
    throw Error(name_ + ": seq " + std::to_string(seq) + " exceeds the " + std::to_string(s.positions) + " positions");
  }
  // The dropout option sets all three probabilities (embd, attn, resid).
  const double embd = o.dropout.value_or(s.embd_dropout), attn = o.dropout.value_or(s.attn_dropout),
               resid = o.dropout.value_or(s.resid_dropout);
  // Eager unless asked: the references measured on GPUs (pytorch_sweep.py, the H200 plans)
  // ran transformers' eager GPT-2; transformers 5's own default is sdpa.
  const AttentionImpl attention = o.attention ? parse_attention(*o.attention) : AttentionImpl::Eager;
  auto body = std::make_unique<Sequential>();
  auto& emb = static_cast<Gpt2Embeddings&>(body->append("transformer", std::make_unique<Gpt2Embeddings>(s, embd)));
  for (std::int64_t i = 0; i < s.layers; ++i) {
    body->append("transformer.h." + std::to_string(i),
                 std::make_unique<TransformerBlock>(s.embed, s.heads, s.inner, s.eps, attn, resid, activation(s),
                                                    attention));
  }
  body->append("transformer.ln_f", std::make_unique<LayerNorm>(s.embed, s.eps));
  body->append("lm_head", std::make_unique<TiedLinear>(emb.wte()));
  Built b;
  std::ostringstream d;
  d << name_ << ": " << s.layers << " blocks, width " << s.embed << ", " << s.heads << " heads, sequence " << seq
    << ", vocab " << s.vocab << " (tied lm_head), dropout " << std::to_string(resid).substr(0, 4)
    << ", " << attention_name(attention) << " attention, " << s.activation << " (" << activation(s)->type_name()
    << "); the causal-LM loss of model(input_ids, labels=...)";
  b.info.description = d.str();
  b.info.batch = batch;
  b.info.input_shape = Shape{batch, seq};
  b.info.input_dtype = DType::I64;
  b.info.target_shape = Shape{batch, seq};
  b.info.target_dtype = DType::I64;
  // GPT2LMHeadModel(input_ids, labels=...) computes transformers' ForCausalLMLoss itself: the
  // logits upcast to f32, the labels shifted (models.cpp).
  b.info.loss = LossKind::CausalLM;
  b.info.target_classes = s.vocab;
  b.info.input_high = s.vocab;
  b.body = std::move(body);
  return b;
}

}  // namespace

std::shared_ptr<const nn::ModelSource> gpt2_source(std::string name, const Gpt2Spec& spec) {
  const auto positive = [](const char* key, std::int64_t v) {
    if (v <= 0) throw Error(std::string(key) + ": expected a positive integer, got " + std::to_string(v));
  };
  positive("n_layer", spec.layers);
  positive("n_embd", spec.embed);
  positive("n_head", spec.heads);
  positive("vocab_size", spec.vocab);
  positive("n_positions", spec.positions);
  if (spec.embed % spec.heads != 0) {
    throw Error("n_embd " + std::to_string(spec.embed) + " is not a multiple of n_head " + std::to_string(spec.heads));
  }
  return std::make_shared<Gpt2Source>(std::move(name), spec);
}

}  // namespace mem::models::detail
