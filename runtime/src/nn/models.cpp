// models.cpp — model options, the built model's input, target and loss, and
// ModelSource::build's checks shared by every source.
#include "vramscope/runtime/models.hpp"

#include <algorithm>
#include <charconv>
#include <sstream>

#include "engine/detail.hpp"
#include "vramscope/runtime/losses.hpp"

namespace mem::nn {
namespace {

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
                                 {"classes", &ModelOptions::classes, kMaxClasses},
                                 {"lora", &ModelOptions::lora, kMaxLoraRank},
                                 {"expert_skew", &ModelOptions::expert_skew, kMaxExpertSkew}};

// The word-valued keys and what each takes (checked where it applies: the model).
struct WordKey {
  const char* key;
  std::optional<std::string> ModelOptions::*field;
};
constexpr WordKey kWordKeys[] = {{"attn", &ModelOptions::attention},
                                 {"checkpoint", &ModelOptions::checkpoint},
                                 {"lora_targets", &ModelOptions::lora_targets},
                                 {"quant", &ModelOptions::quant},
                                 {"built_on", &ModelOptions::built_on},
                                 {"loss", &ModelOptions::loss}};

double parse_probability(std::string_view key, std::string_view value) {
  double p = 0;
  try {
    std::size_t used = 0;
    p = std::stod(std::string(value), &used);
    if (used != value.size()) throw std::invalid_argument("trailing");
  } catch (...) {
    throw Error("model option " + std::string(key) + "='" + std::string(value) + "' is not a number");
  }
  if (!(p >= 0 && p < 1)) throw Error("model option " + std::string(key) + " must be in [0, 1)");
  return p;
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
  std::vector<std::string_view> seen;  // a key given twice would silently take the last
  const std::string_view whole = text;
  for (bool more = !text.empty(); more;) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    more = comma != std::string_view::npos;
    text = more ? text.substr(comma + 1) : std::string_view{};
    // "a=1,,b=2" or a stray comma is a typo, not nothing.
    if (item.empty()) throw Error("model options '" + std::string(whole) + "' have an empty item; write key=value,...");
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw Error("model option '" + std::string(item) + "' is not key=value");
    }
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      throw Error("model option " + std::string(key) + " is given twice; give it once");
    }
    seen.push_back(key);
    const auto size = std::find_if(std::begin(kSizeKeys), std::end(kSizeKeys),
                                   [&](const SizeKey& k) { return key == k.key; });
    if (size != std::end(kSizeKeys)) {
      o.*size->field = parse_int(key, value);
    } else if (key == "dropout") {
      o.dropout = parse_probability(key, value);
    } else if (key == "lora_dropout") {
      o.lora_dropout = parse_probability(key, value);
    } else if (const auto word = std::find_if(std::begin(kWordKeys), std::end(kWordKeys),
                                              [&](const WordKey& k) { return key == k.key; });
               word != std::end(kWordKeys)) {
      if (value.empty()) throw Error("model option " + std::string(key) + " is empty");
      o.*word->field = std::string(value);
    } else if (key == "inplace") {
      if (value != "0" && value != "1" && value != "true" && value != "false") {
        throw Error("model option inplace='" + std::string(value) + "' is not 0/1/true/false");
      }
      o.inplace_relu = value == "1" || value == "true";
    } else {
      throw Error("unknown model option '" + std::string(key) +
                  "'; valid keys: batch, depth, width, seq, image, classes, lora, expert_skew, dropout, inplace, attn, "
                  "checkpoint, lora_targets, quant, built_on, lora_dropout");
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

std::optional<std::int64_t> ModelOptions::size(std::string_view key) const {
  for (const SizeKey& k : kSizeKeys) {
    if (key == k.key) return this->*k.field > 0 ? std::optional(this->*k.field) : std::nullopt;
  }
  return std::nullopt;
}

const std::vector<std::string>& ModelOptions::keys() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> v;
    for (const SizeKey& k : kSizeKeys) v.emplace_back(k.key);
    v.emplace_back("dropout");
    v.emplace_back("inplace");
    for (const WordKey& k : kWordKeys) v.emplace_back(k.key);
    v.emplace_back("lora_dropout");
    return v;
  }();
  return all;
}

std::vector<std::string> ModelOptions::given() const {
  std::vector<std::string> v;
  for (const SizeKey& k : kSizeKeys) {
    if (this->*k.field > 0) v.emplace_back(k.key);
  }
  if (dropout) v.emplace_back("dropout");
  if (inplace_relu) v.emplace_back("inplace");
  for (const WordKey& k : kWordKeys) {
    if (this->*k.field) v.emplace_back(k.key);
  }
  if (lora_dropout) v.emplace_back("lora_dropout");
  return v;
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
  for (const WordKey& k : kWordKeys) {
    if (this->*k.field) add(k.key, *(this->*k.field));
  }
  if (lora_dropout) {
    std::ostringstream os;
    os << *lora_dropout;
    add("lora_dropout", os.str());
  }
  return s;
}

Model::Model(ModelInfo info, std::unique_ptr<Sequential> body) : info_(std::move(info)), body_(std::move(body)) {}
Model::~Model() = default;

Tensor Model::make_input(Runtime& runtime, DType dtype, std::uint64_t step) const {
  const std::uint64_t seed = runtime.init_seed() ^ (0xabcdefull + step * 0x10001ull);
  if (info_.input_dtype == DType::I64) {
    return uniform(runtime, info_.input_shape, 0, static_cast<double>(info_.input_high) - 1e-9, DType::I64, seed);
  }
  return uniform(runtime, info_.input_shape, 0.0, 1.0, dtype, seed);
}

Tensor Model::make_target(Runtime& runtime, DType dtype, std::uint64_t step) const {
  // output.sum() and a model that returns its own loss take no target.
  if (info_.loss == LossKind::Sum || info_.loss == LossKind::None) return {};
  const std::uint64_t seed = runtime.init_seed() ^ (0x123457ull + step * 0x20003ull);
  if (info_.target_dtype == DType::I64) {
    return uniform(runtime, info_.target_shape, 0, static_cast<double>(info_.target_classes) - 1e-9, DType::I64, seed);
  }
  return uniform(runtime, info_.target_shape, 0.0, 1.0, dtype, seed);
}

namespace {

/// The weight of a decoder's lm_head (its last module): its own, or the embedding's it is tied to.
const Tensor& lm_head_weight(const Sequential& body) {
  const Module& head = body.at(body.size() - 1);
  if (const auto* linear = dynamic_cast<const Linear*>(&head)) return linear->weight();
  if (const auto* tied = dynamic_cast<const TiedLinear*>(&head)) return tied->weight();
  throw Error("the fused linear cross entropy needs the model's lm_head, a Linear; its last module is " +
              head.type_name());
}

}  // namespace

Tensor Model::loss(const Tensor& output, const Tensor& target) const {
  if (info_.loss == LossKind::MSE) return mse_loss(output, target);
  if (info_.loss == LossKind::Sum) return sum(output);
  if (info_.loss == LossKind::BCEWithLogits) return bce_with_logits(output, target);
  if (info_.loss == LossKind::None) {
    if (output.numel() != 1) throw Error("loss none: the model's output " + output.shape().str() + " is not a scalar");
    return output;
  }
  if (info_.loss == LossKind::CausalLM) {
    // ForCausalLMLoss (transformers 4.50.3 and 5.17 alike, loss/loss_utils.py): logits = logits.float();
    // labels = pad(labels, (0, 1), value=-100); shift_labels = labels[..., 1:].contiguous();
    // cross entropy of logits.view(-1, V) (the f32 copy lives until the loss returns).
    // The labels' two i64 copies are allocated as there; compute mode scores each token
    // against its own label (the runtime's cross entropy has no ignore_index).
    if (info_.fused_linear_loss) {
      // LigerForCausalLMLoss (liger-kernel transformers/model/loss_utils.py): no upcast; labels
      // padded and shifted as transformers does (the padded copy lives until it returns), the
      // hidden states viewed as [BT, H], then the fused linear cross entropy with lm_head's weight.
      const Tensor padded = empty(target.runtime(), Shape{target.size(0), target.size(1) + 1}, DType::I64);
      const Tensor shift_labels = empty(target.runtime(), target.shape(), DType::I64);
      if (target.runtime().computing()) detail::copy_raw(shift_labels, target);
      return fused_linear_cross_entropy(output.view(Shape{-1, output.size(-1)}), lm_head_weight(*body_),
                                        shift_labels.view(Shape{-1}));
    }
    const Tensor logits = to_dtype(output, DType::F32);
    Tensor shift_labels;
    {
      const Tensor padded = empty(target.runtime(), Shape{target.size(0), target.size(1) + 1}, DType::I64);
      shift_labels = empty(target.runtime(), target.shape(), DType::I64);
      if (target.runtime().computing()) detail::copy_raw(shift_labels, target);
    }
    return cross_entropy(logits.view(Shape{-1, logits.size(-1)}), shift_labels.view(Shape{-1}));
  }
  if (output.dim() > 2) return cross_entropy(output.view(Shape{-1, output.size(-1)}), target.reshape(Shape{-1}));
  return cross_entropy(output, target);
}

ModelSource::~ModelSource() = default;

std::unique_ptr<Model> ModelSource::build(const ModelOptions& options) const {
  options.check();
  const std::vector<std::string>& takes = option_keys();
  for (const std::string& key : options.given()) {
    if (std::find(takes.begin(), takes.end(), key) == takes.end()) {
      std::string list;
      for (const std::string& k : takes) list += (list.empty() ? "" : ", ") + k;
      throw Error(name() + " has no " + key + " option; it takes " + (list.empty() ? "none" : list));
    }
  }
  Built b = make(options);
  b.info.name = name();
  b.body->set_path("");
  b.info.parameters = b.body->parameter_count();
  // parameter_bytes() must not wrap either: f32 is the widest parameter dtype.
  if (static_cast<std::uint64_t>(b.info.parameters) > UINT64_MAX / dtype_size(DType::F32)) {
    throw Error(name() + ": " + std::to_string(b.info.parameters) +
                " parameters need more than 2^64 bytes; no device holds them (check the sizes given)");
  }
  b.info.parameter_tensors = b.body->parameter_tensors();
  b.info.sequence_length = b.body->size();
  b.info.checkpointed_modules = b.body->checkpoint_marks();
  return std::make_unique<Model>(std::move(b.info), std::move(b.body));
}

}  // namespace mem::nn
