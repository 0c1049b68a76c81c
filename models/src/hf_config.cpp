// hf_config.cpp — config.json of LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM
// read into a DecoderConfig. Every key is either modelled, known not to change training
// memory, or an error: a config is never half understood.
#include "vramscope/models/hf_config.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/files.hpp"
#include "json_kind.hpp"
#include "zoo_sources.hpp"

namespace mem::models {
namespace {

using nlohmann::json;
using detail::kind_of;

/// Keys that do not change what a training step allocates: token ids, initialisation,
/// rotary frequencies (values, not sizes), bookkeeping. use_cache is read as False (what
/// gradient checkpointing forces and training scripts set); torch_dtype is what
/// from_pretrained loads in, and --dtype says what is trained.
const std::set<std::string, std::less<>> kIgnored = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "rope_scaling", "transformers_version", "use_cache", "torch_dtype", "dtype", "model_type",
    "max_position_embeddings",
    "max_window_layers", "tokenizer_class", "output_attentions", "output_hidden_states", "return_dict",
    "is_decoder", "name_or_path"};

class Reader {
 public:
  Reader(const json& root, std::string origin) : root_(root), origin_(std::move(origin)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(origin_ + ": " + key + ": " + what);
  }
  bool has(const std::string& key) const { return root_.contains(key) && !root_.at(key).is_null(); }
  std::int64_t size(const std::string& key, std::int64_t fallback, std::int64_t max = std::int64_t{1} << 31) {
    used_.insert(key);
    if (!has(key)) {
      if (fallback > 0) return fallback;
      fail(key, "missing; expected a positive integer");
    }
    const json& v = root_.at(key);
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0 || v.get<std::int64_t>() > max) {
      fail(key, "expected a positive integer up to " + std::to_string(max) + ", got " + kind_of(v));
    }
    return v.get<std::int64_t>();
  }
  bool flag(const std::string& key, bool fallback) {
    used_.insert(key);
    if (!has(key)) return fallback;
    if (!root_.at(key).is_boolean()) fail(key, "expected true or false, got " + kind_of(root_.at(key)));
    return root_.at(key).get<bool>();
  }
  double number(const std::string& key, double fallback, double lo, double hi) {
    used_.insert(key);
    if (!has(key)) return fallback;
    const json& v = root_.at(key);
    if (!v.is_number() || !(v.get<double>() >= lo && v.get<double>() < hi)) {
      fail(key, "expected a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "), got " + kind_of(v));
    }
    return v.get<double>();
  }
  std::string word(const std::string& key, const std::string& fallback) {
    used_.insert(key);
    if (!has(key)) return fallback;
    if (!root_.at(key).is_string()) fail(key, "expected a string, got " + kind_of(root_.at(key)));
    return root_.at(key).get<std::string>();
  }
  /// A key known not to change memory.
  void ignore(const std::string& key) { used_.insert(key); }
  /// Every key neither read nor ignored is one this reader cannot account for.
  void check_all_used() const {
    for (const auto& [key, value] : root_.items()) {
      // A null is the key's default, as transformers reads it (GPT2Config's n_inner=None:
      // 4 * n_embd; save_pretrained writes every key, null ones too).
      if (used_.count(key) != 0 || kIgnored.count(key) != 0 || key.starts_with("_") || value.is_null()) continue;
      fail(key, "not modelled by vramscope, and it may change memory; remove it if it does not, or ask for it");
    }
  }

 private:
  const json& root_;
  std::string origin_;
  std::set<std::string, std::less<>> used_;
};

const std::vector<std::string> kAllTargets = {"q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};

std::vector<std::string> parse_targets(const std::string& text) {
  if (text == "all" || text == "all-linear") return kAllTargets;
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t plus = text.find('+', pos);
    const std::string item = text.substr(pos, plus == std::string::npos ? std::string::npos : plus - pos);
    const std::string name = item.size() <= 2 && !item.empty() ? item + "_proj" : item;  // q -> q_proj
    if (std::find(kAllTargets.begin(), kAllTargets.end(), name) == kAllTargets.end()) {
      throw Error("model option lora_targets: '" + item +
                  "' is not a projection; valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
                  "(joined by +), or all");
    }
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
    if (plus == std::string::npos) break;
    pos = plus + 1;
  }
  return out;
}

json read_json(std::string_view text, const std::string& origin) {
  if (text.size() > kMaxHfConfigBytes) {
    throw Error(origin + ": " + std::to_string(text.size()) + " bytes; a config.json is at most " +
                std::to_string(kMaxHfConfigBytes));
  }
  json root;
  try {
    root = detail::parse_bounded(text, origin, kMaxHfConfigDepth);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 3, column 5: ..." -> from "parse error".
    std::string what = e.what();
    if (const auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
    throw Error(origin + ": not valid JSON: " + what);
  }
  if (!root.is_object()) throw Error(origin + ": expected a JSON object (a config.json), got " + kind_of(root));
  return root;
}

/// GPT2Config: the keys that size the model, and those that would change memory if set.
std::shared_ptr<const nn::ModelSource> parse_gpt2(const json& root, std::string name, const std::string& origin) {
  Reader r(root, origin);
  (void)r.word("model_type", "");
  detail::Gpt2Spec s;
  s.vocab = r.size("vocab_size", 50257);
  s.positions = r.size("n_positions", 1024, std::int64_t{1} << 24);
  if (r.has("n_ctx") && r.size("n_ctx", 0, std::int64_t{1} << 24) != s.positions) {
    r.fail("n_ctx", "differs from n_positions; not modelled");
  }
  s.embed = r.size("n_embd", 768);
  s.layers = r.size("n_layer", 12, 10'000);
  s.heads = r.size("n_head", 12);
  s.inner = r.has("n_inner") ? r.size("n_inner", 0) : 0;
  s.eps = r.number("layer_norm_epsilon", 1e-5, 0.0, 1.0);
  s.embd_dropout = r.number("embd_pdrop", 0.1, 0.0, 1.0);
  s.attn_dropout = r.number("attn_pdrop", 0.1, 0.0, 1.0);
  s.resid_dropout = r.number("resid_pdrop", 0.1, 0.0, 1.0);
  // transformers/activations.py's ACT2CLS: gelu_new is NewGELUActivation (written out in
  // Python: four saved tensors), gelu_pytorch_tanh GELUTanh and gelu GELUActivation (F.gelu,
  // its input only).
  s.activation = r.word("activation_function", "gelu_new");
  if (s.activation != "gelu_new" && s.activation != "gelu_pytorch_tanh" && s.activation != "gelu") {
    r.fail("activation_function", "'" + s.activation + "' is not modelled; vramscope reads gelu_new (GPT-2's), "
           "gelu_pytorch_tanh and gelu");
  }
  if (!r.flag("scale_attn_weights", true)) r.fail("scale_attn_weights", "false is not modelled");
  if (r.flag("scale_attn_by_inverse_layer_idx", false)) {
    r.fail("scale_attn_by_inverse_layer_idx", "true is not modelled (one more scaled copy of the scores)");
  }
  if (r.flag("reorder_and_upcast_attn", false)) r.fail("reorder_and_upcast_attn", "true is not modelled");
  // GPT2LMHeadModel ties lm_head to wte (_tied_weights_keys); transformers 5's save_pretrained
  // writes the flag, true by default.
  if (!r.flag("tie_word_embeddings", true)) {
    r.fail("tie_word_embeddings", "false (a head of its own beside wte) is not modelled; GPT-2 ties its head");
  }
  if (r.has("add_cross_attention") && r.flag("add_cross_attention", false)) {
    r.fail("add_cross_attention", "true is not modelled (decoder-only models)");
  }
  // GPT2DoubleHeadsModel's summary head, absent from GPT2LMHeadModel.
  for (const char* key : {"summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type",
                          "summary_use_proj", "task_specific_params", "n_special", "predict_special_tokens"}) {
    r.ignore(key);
  }
  r.check_all_used();
  return detail::gpt2_source(std::move(name), s);
}

std::string read_file(const std::string& path) {
  check_input_file(path, "the Hugging Face config");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open");
  std::string text;
  text.resize(kMaxHfConfigBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw Error(path + ": read error");
  text.resize(static_cast<std::size_t>(in.gcount()));
  return text;
}

/// LlamaConfig, MistralConfig, Qwen2Config.
std::shared_ptr<const HfConfig> parse_llama(const json& root, std::string name, const std::string& origin) {
  Reader r(root, origin);
  const std::string type = r.word("model_type", "");
  if (type != "llama" && type != "mistral" && type != "qwen2") {
    r.fail("model_type", type.empty() ? "missing; vramscope reads gpt2, llama, mistral and qwen2 configs"
                                      : "'" + type + "' is not modelled; vramscope reads gpt2, llama, mistral and qwen2");
  }
  nn::DecoderConfig c;
  c.vocab = r.size("vocab_size", 0);
  c.hidden = r.size("hidden_size", 0);
  c.intermediate = r.size("intermediate_size", 0);
  c.layers = r.size("num_hidden_layers", 0, 10'000);
  c.heads = r.size("num_attention_heads", 0);
  c.kv_heads = r.size("num_key_value_heads", c.heads);
  if (c.hidden % c.heads != 0 && !r.has("head_dim")) {
    r.fail("head_dim", "missing, and hidden_size " + std::to_string(c.hidden) + " is not a multiple of " +
                           std::to_string(c.heads) + " heads");
  }
  c.head_dim = r.size("head_dim", c.hidden / c.heads);
  if (c.heads % c.kv_heads != 0) {
    r.fail("num_key_value_heads", std::to_string(c.kv_heads) + " does not divide num_attention_heads " +
                                      std::to_string(c.heads));
  }
  const std::int64_t max_positions = r.size("max_position_embeddings", 2048, std::int64_t{1} << 24);
  c.tie_embeddings = r.flag("tie_word_embeddings", false);
  c.rope_theta = r.number("rope_theta", 10000.0, 1.0, 1e12);
  if (r.has("rope_parameters")) {
    // transformers 5 writes rope_theta (and what 4.x called rope_scaling) into one object,
    // configuration_utils.py's rope_parameters; the type and factors change values only.
    const json& rope = root.at("rope_parameters");
    if (!rope.is_object()) r.fail("rope_parameters", "expected an object, got " + kind_of(rope));
    r.ignore("rope_parameters");
    if (rope.contains("rope_theta")) {
      const json& theta = rope.at("rope_theta");
      if (!theta.is_number() || !(theta.get<double>() >= 1.0 && theta.get<double>() < 1e12)) {
        r.fail("rope_parameters.rope_theta", "expected a number in [1, 1e12), got " + kind_of(theta));
      }
      c.rope_theta = theta.get<double>();
    }
  }
  if (r.has("layer_types")) {
    // transformers 5: one entry per layer; sliding layers would take a mask SDPA keeps.
    const json& types = root.at("layer_types");
    if (!types.is_array()) r.fail("layer_types", "expected a list, got " + kind_of(types));
    // transformers refuses a list of another length (configuration_utils.py,
    // layer_type_validation: "num_hidden_layers ... must be equal to the number of layer types").
    if (types.size() != static_cast<std::size_t>(c.layers)) {
      r.fail("layer_types", std::to_string(types.size()) + " entries for num_hidden_layers " + std::to_string(c.layers) +
                                "; transformers needs one per layer");
    }
    for (const json& t : types) {
      if (t != "full_attention") r.fail("layer_types", kind_of(t) + " is not modelled; only full_attention layers are");
    }
    r.ignore("layer_types");
  }
  c.rms_eps = r.number("rms_norm_eps", 1e-6, 0.0, 1.0);
  c.attention_dropout = r.number("attention_dropout", 0.0, 0.0, 1.0);
  const std::string act = r.word("hidden_act", "silu");
  if (act != "silu") r.fail("hidden_act", "'" + act + "' is not modelled; the MLP is SwiGLU with silu");
  std::int64_t window = 0;
  if (type == "llama") {
    c.qkv_bias = c.o_bias = r.flag("attention_bias", false);
    c.mlp_bias = r.flag("mlp_bias", false);
    if (r.size("pretraining_tp", 1) != 1) r.fail("pretraining_tp", "only 1 is modelled (it slices weights in forward)");
  } else {
    // Mistral and Qwen2 build their masks with config.sliding_window (modeling_qwen2.py,
    // _update_causal_mask: whatever use_sliding_window says), 4096 when the key is absent
    // (their configurations' default), none when it is null. A sequence as long as the
    // window makes SDPA take a 4D mask (_ignore_causal_mask_sdpa): refused per build.
    if (type == "qwen2") {
      c.qkv_bias = true;  // Qwen2Attention: q, k, v with bias, o_proj without
      if (r.flag("use_sliding_window", false)) r.fail("use_sliding_window", "true is not modelled");
    }
    const bool null_window = root.contains("sliding_window") && root.at("sliding_window").is_null();
    if (null_window) r.ignore("sliding_window");
    window = null_window ? 0 : r.size("sliding_window", 4096, std::int64_t{1} << 24);
    c.mistral_mask = true;
    c.sliding_window = window;
  }
  if (r.has("quantization_config")) {
    r.fail("quantization_config", "quantized checkpoints are not modelled; give the unquantized config");
  }
  r.check_all_used();
  return std::make_shared<HfConfig>(std::move(name), type, c, max_positions, window);
}

}  // namespace

namespace {

/// A config.json's model, by its model_type: GPT-2's builder or the llama layout.
std::shared_ptr<const nn::ModelSource> from_root(const json& root, std::string name, const std::string& origin) {
  if (root.contains("model_type") && root["model_type"] == "gpt2") return parse_gpt2(root, std::move(name), origin);
  return parse_llama(root, std::move(name), origin);
}

}  // namespace

std::shared_ptr<const nn::ModelSource> parse_hf_config(std::string_view text, std::string name, std::string origin) {
  return from_root(read_json(text, origin), std::move(name), origin);
}

namespace {

/// Printable ASCII only, at most 64 characters: a hostile file does not reach the terminal
/// through a model's name.
std::string printable_name(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c > ' ' && c < 127 && out.size() < 64) out += c;
  }
  return out;
}

/// The name people give the model: the config's `_name_or_path` (its last part: a Hub id's
/// model, a local folder's name), else the folder of a file called config.json, else the
/// file's name without ".json". Printable ASCII only, at most 64 characters: a hostile file
/// does not reach the terminal through it.
std::string model_name(const std::string& path, const json& root) {
  const auto last_part = [](std::string s) {
    while (!s.empty() && s.back() == '/') s.pop_back();
    const auto slash = s.find_last_of('/');
    return slash == std::string::npos ? s : s.substr(slash + 1);
  };
  if (root.contains("_name_or_path") && root["_name_or_path"].is_string()) {
    const std::string named = printable_name(last_part(root["_name_or_path"].get<std::string>()));
    if (!named.empty()) return named;
  }
  const std::string named = hf_name_from_path(path);
  return named.empty() ? "config" : named;
}

}  // namespace

std::string hf_name_from_path(const std::string& path) {
  const auto clean = [](const std::string& s) {
    const std::string out = printable_name(s);
    return out == "." || out == ".." ? std::string() : out;
  };
  const std::filesystem::path p(path);
  if (p.filename() == "config.json") {
    // The Hub cache: <cache>/models--org--name/snapshots/<commit>/config.json.
    const std::filesystem::path snapshot = p.parent_path();
    const std::string repo = snapshot.parent_path().parent_path().filename().string();
    if (snapshot.parent_path().filename() == "snapshots" && repo.starts_with("models--")) {
      // models--name or models--org--name: the model's name follows the last "--".
      if (const std::string name = clean(repo.substr(repo.rfind("--") + 2)); !name.empty()) return name;
    }
    if (const std::string folder = clean(snapshot.filename().string()); !folder.empty()) return folder;
  }
  std::string file = p.filename().string();
  if (file.size() > 5 && file.ends_with(".json")) file.resize(file.size() - 5);
  return clean(file);
}

std::string hf_model_type(const std::string& path) {
  const json root = read_json(read_file(path), path);
  return root.contains("model_type") && root.at("model_type").is_string() ? root.at("model_type").get<std::string>()
                                                                           : std::string();
}

std::shared_ptr<const nn::ModelSource> load_hf_config(const std::string& path) {
  const json root = read_json(read_file(path), path);  // parsed once: the name and the model
  return from_root(root, model_name(path, root), path);
}

std::shared_ptr<const HfConfig> HfConfig::parse(std::string_view text, std::string name, std::string origin) {
  return parse_llama(read_json(text, origin), std::move(name), origin);
}

HfConfig::HfConfig(std::string name, std::string model_type, nn::DecoderConfig decoder, std::int64_t max_positions,
                   std::int64_t sliding_window)
    : name_(std::move(name)), model_type_(std::move(model_type)), decoder_(decoder), max_positions_(max_positions),
      sliding_window_(sliding_window) {}

const std::vector<std::string>& HfConfig::option_keys() const noexcept {
  static const std::vector<std::string> keys = {"batch", "seq", "attn", "checkpoint", "lora", "lora_targets",
                                                "lora_dropout", "quant", "built_on", "loss"};
  return keys;
}

nn::DecoderConfig HfConfig::configure(const nn::ModelOptions& o) const {
  nn::DecoderConfig c = decoder_;
  if (o.attention) c.attention = nn::parse_attention(*o.attention);
  const std::string mode = o.checkpoint.value_or("none");
  if (mode == "reentrant" || mode == "non-reentrant") {
    c.checkpoint = mode == "reentrant" ? nn::CheckpointMark::Reentrant : nn::CheckpointMark::NonReentrant;
  } else if (mode != "none") {
    throw Error("model option checkpoint='" + mode + "'; valid: none, reentrant (gradient_checkpointing_enable()'s "
                "default in transformers 4.x), non-reentrant (its default in 5.x)");
  }
  if (o.lora_targets && o.lora == 0) throw Error("model option lora_targets needs lora=RANK");
  const std::string quant = o.quant.value_or("none");
  if (quant == "nf4" || quant == "nf4-single") {
    // QLoRA: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    // bnb_4bit_use_double_quant=True); lm_head and the embeddings stay unquantized.
    if (o.lora == 0) throw Error("model option quant=" + quant + " needs lora=RANK: 4-bit weights are frozen (QLoRA)");
    c.nf4 = true;
    c.double_quant = quant == "nf4";
  } else if (quant != "none") {
    throw Error("model option quant='" + quant + "'; valid: none, nf4 (with double quantization, QLoRA's), nf4-single");
  }
  if (o.lora_dropout && o.lora == 0) throw Error("model option lora_dropout needs lora=RANK");
  const std::string built_on = o.built_on.value_or("cpu");
  if (built_on != "cpu" && built_on != "gpu") {
    throw Error("model option built_on='" + built_on +
                "'; valid: cpu (built on the CPU or loaded with from_pretrained, then moved: the default), "
                "gpu (constructed on the GPU, as from_config under torch.device(\"cuda\"))");
  }
  c.built_on_gpu = built_on == "gpu";
  const std::string loss = o.loss.value_or("hf");
  if (loss != "hf" && loss != "liger-flce") {
    throw Error("model option loss='" + loss + "'; valid: hf (transformers' ForCausalLMLoss: the logits, upcast, "
                "then cross entropy), liger-flce (Liger's fused linear cross entropy: the logits never whole)");
  }
  c.fused_linear_cross_entropy = loss == "liger-flce";
  if (o.lora > 0) {
    c.lora.rank = o.lora;
    c.lora.alpha = static_cast<double>(o.lora);
    // PEFT's defaults: lora_dropout 0.0; target_modules for llama, mistral and qwen2 are
    // q_proj and v_proj (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
    c.lora.dropout = o.lora_dropout.value_or(0.0);
    c.lora.targets = o.lora_targets ? parse_targets(*o.lora_targets) : std::vector<std::string>{"q_proj", "v_proj"};
  }
  return c;
}

HfConfig::Built HfConfig::make(const nn::ModelOptions& o) const {
  const nn::DecoderConfig c = configure(o);
  const std::int64_t batch = o.batch > 0 ? o.batch : 1;
  const std::int64_t seq = o.seq > 0 ? o.seq : std::min<std::int64_t>(2048, max_positions_);
  if (seq > max_positions_) {
    throw Error(name_ + ": seq " + std::to_string(seq) + " exceeds max_position_embeddings " +
                std::to_string(max_positions_));
  }
  if (sliding_window_ > 0 && seq >= sliding_window_) {
    throw Error(name_ + ": seq " + std::to_string(seq) + " reaches sliding_window " + std::to_string(sliding_window_) +
                "; the sliding-window mask SDPA then takes is not modelled (give seq below it)");
  }
  if (c.attention != nn::AttentionImpl::Eager && c.attention_dropout > 0 && c.checkpoint != nn::CheckpointMark::None) {
    throw Error(name_ + ": attention_dropout with sdpa under checkpointing is not modelled");
  }
  Built b;
  b.body = nn::build_decoder(c);
  std::ostringstream d;
  d << model_type_ << ": " << c.layers << " layers, hidden " << c.hidden << ", " << c.heads << " heads ("
    << c.kv_heads << " kv) of " << c.head_dim << ", MLP " << c.intermediate << ", vocab " << c.vocab
    << (c.tie_embeddings ? " (tied)" : "") << "; " << nn::attention_name(c.attention) << " attention";
  if (c.checkpoint != nn::CheckpointMark::None) {
    d << ", every layer checkpointed (" << (c.checkpoint == nn::CheckpointMark::Reentrant ? "reentrant" : "non-reentrant")
      << ")";
  }
  if (c.lora.rank > 0) {
    d << (c.nf4 ? ", QLoRA (NF4" : "") << (c.nf4 && c.double_quant ? ", double quant" : "") << (c.nf4 ? ")" : "")
      << ", LoRA r=" << c.lora.rank << " on";
    for (const auto& t : c.lora.targets) d << " " << t;
  }
  d << (c.fused_linear_cross_entropy ? "; causal LM loss by Liger's fused linear cross entropy" : "; causal LM loss");
  b.info.description = d.str();
  b.info.batch = batch;
  b.info.input_shape = nn::Shape{batch, seq};
  b.info.input_dtype = nn::DType::I64;
  b.info.target_shape = nn::Shape{batch, seq};
  b.info.target_dtype = nn::DType::I64;
  b.info.loss = nn::LossKind::CausalLM;
  b.info.fused_linear_loss = c.fused_linear_cross_entropy;
  b.info.model_type = model_type_;
  b.info.target_classes = c.vocab;
  b.info.input_high = c.vocab;
  b.info.sequential_checkpointing = false;
  b.info.checkpoints_by_layer = true;
  return b;
}

}  // namespace mem::models
