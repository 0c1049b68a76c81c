// hf_config_test.cpp — Hugging Face config.json files: the zoo's read back as published,
// a user's file read through the same path, and malformed or unmodelled configs each
// refused with one message naming the key (nothing built).
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::models {
namespace {

using nlohmann::json;

/// A small llama config: every key a real one has.
json base() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 256,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.3", "use_cache": true, "vocab_size": 100})");
}

std::string refusal(const std::string& text) {
  try {
    (void)HfConfig::parse(text, "net", "config.json")->describe();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(HfConfig, ASmallLlamaHasTheParametersItsNumbersSay) {
  const auto model = HfConfig::parse(base().dump(), "tiny-llama", "config.json");
  // embed 100 x 64 twice (untied), per layer q 64x64, k and v 64x32, o 64x64, MLP 3 x 64 x 128,
  // two norms of 64; the final norm.
  const std::int64_t layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64;
  EXPECT_EQ(model->describe().parameters, 2 * 100 * 64 + 2 * layer + 64);
  EXPECT_EQ(model->describe().input_shape, (nn::Shape{1, 256}));  // seq defaults to min(2048, max)
}

TEST(HfConfig, QwenHasQueryKeyValueBiases) {
  json c = base();
  c["model_type"] = "qwen2";
  c.erase("attention_bias");
  c.erase("mlp_bias");
  c.erase("pretraining_tp");
  c["use_sliding_window"] = false;
  c["sliding_window"] = 4096;
  c["max_window_layers"] = 2;
  const auto llama = HfConfig::parse(base().dump(), "l", "l.json"), qwen = HfConfig::parse(c.dump(), "q", "q.json");
  EXPECT_EQ(qwen->describe().parameters - llama->describe().parameters, 2 * (64 + 32 + 32));
}

TEST(HfConfig, EveryZooConfigIsReadAndItsOptionsApply) {
  for (const char* name : {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mistral-7b",
                           "qwen2.5-0.5b", "qwen2.5-7b"}) {
    const auto model = find(name);
    EXPECT_NO_THROW((void)model->describe(nn::ModelOptions::parse("seq=1024,attn=eager,lora=8,lora_targets=all")))
        << name;
  }
}

TEST(HfConfig, MalformedAndUnmodelledConfigsAreRefusedByKey) {
  const auto with = [](const char* key, json value) {
    json c = base();
    if (value.is_discarded()) {
      c.erase(key);
    } else {
      c[key] = value;
    }
    return c.dump();
  };
  const json gone = json::value_t::discarded;
  const std::pair<std::string, std::string> cases[] = {
      {"{", "config.json: not valid JSON: parse error at line 1"},
      // A number no double holds is named by its key, in our words (issue 47).
      {R"({"model_type": "llama", "rope_theta": 1e400})", "config.json: \"rope_theta\": a number too large"},
      {"[1, 2]", "expected a JSON object"},
      {with("model_type", "bert"), "model_type: 'bert' is not modelled"},
      {with("model_type", gone), "model_type: missing"},
      {with("hidden_size", -64), "hidden_size: expected a positive integer"},
      {with("hidden_size", "64"), "hidden_size: expected a positive integer"},
      {with("vocab_size", gone), "vocab_size: missing"},
      {with("num_key_value_heads", 3), "num_key_value_heads: 3 does not divide num_attention_heads 4"},
      {with("num_hidden_layers", 1e12), "num_hidden_layers: expected a positive integer up to 10000"},
      {with("hidden_act", "gelu"), "hidden_act: 'gelu' is not modelled"},
      {with("tie_word_embeddings", "yes"), "tie_word_embeddings: expected true or false"},
      {with("rms_norm_eps", 2), "rms_norm_eps: expected a number in [0"},
      {with("pretraining_tp", 2), "pretraining_tp: only 1 is modelled"},
      {with("quantization_config", json::object()), "quantization_config: quantized checkpoints are not modelled"},
      {with("num_experts", 8), "num_experts: not modelled by vramscope, and it may change memory"},
      {with("head_dim", 0), "head_dim: expected a positive integer"},
      {with("head_dim", 15), "head_dim 15 is odd"},
  };
  for (const auto& [text, message] : cases) {
    const std::string got = refusal(text);
    EXPECT_NE(got.find(message), std::string::npos) << "config " << text << "\n got: " << got;
  }
}

TEST(HfConfig, AValueNestedDeeperThanAnyConfigIsRefusedBeforeAnythingReadsIt) {
  // Issue 47: a layer_types nested 100,000 deep crashed the command (its message dumped the value).
  std::string deep = base().dump();
  deep.pop_back();
  deep += ", \"layer_types\": " + std::string(100'000, '[') + std::string(100'000, ']') + "}";
  EXPECT_NE(refusal(deep).find("nested deeper than 32 levels"), std::string::npos);
}

TEST(HfConfig, OptionsThatDoNotApplyOrOverreachAreErrors) {
  const auto model = HfConfig::parse(base().dump(), "tiny", "config.json");
  const auto fails = [&](const char* options, const char* message) {
    try {
      (void)model->describe(nn::ModelOptions::parse(options));
      ADD_FAILURE() << options << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  fails("seq=257", "seq 257 exceeds max_position_embeddings 256");
  fails("depth=3", "tiny has no depth option");
  fails("attn=flash2", "unknown attention 'flash2'");
  fails("checkpoint=yes", "model option checkpoint='yes'");
  fails("lora_targets=q_proj", "lora_targets needs lora=RANK");
  fails("lora=4,lora_targets=lm_head", "'lm_head' is not a projection");
  fails("lora=4,lora_dropout=1.5", "lora_dropout must be in [0, 1)");
}

TEST(HfConfig, Gpt2ConfigsBuildGpt2AndRefuseWhatIsNotModelled) {
  const json gpt2 = json::parse(std::string(R"({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
      "n_positions": 128, "n_ctx": 128, "vocab_size": 100, "n_inner": 96, "activation_function": "gelu_new",
      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5})"));
  const auto model = parse_hf_config(gpt2.dump(), "tiny-gpt2", "config.json");
  // wte 100 x 64 + wpe 128 x 64; per block two LayerNorms (2 x 128), c_attn 64 x 192 + 192,
  // c_proj 64 x 64 + 64, c_fc 64 x 96 + 96, c_proj 96 x 64 + 64; ln_f 128.
  const std::int64_t block = 2 * 128 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 96 + 96 + 96 * 64 + 64;
  EXPECT_EQ(model->describe().parameters, 100 * 64 + 128 * 64 + 2 * block + 128);
  const auto refused = [&](const char* key, json value, const char* message) {
    json c = gpt2;
    c[key] = value;
    try {
      (void)parse_hf_config(c.dump(), "g", "config.json")->describe();
      ADD_FAILURE() << key << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  // activation_function picks transformers' class (ACT2CLS); the saved bytes of each are
  // checked against transformers by tests/models/check_transformers.py.
  for (const auto& [activation, type] : {std::pair{"gelu_new", "NewGELUActivation"},
                                         std::pair{"gelu_pytorch_tanh", "GELUTanh"},
                                         std::pair{"gelu", "GELUActivation"}}) {
    json c = gpt2;
    c["activation_function"] = activation;
    const std::string description = parse_hf_config(c.dump(), "g", "config.json")->describe().description;
    EXPECT_NE(description.find(std::string(activation) + " (" + type + ")"), std::string::npos) << description;
  }
  refused("scale_attn_by_inverse_layer_idx", true, "scale_attn_by_inverse_layer_idx: true is not modelled");
  refused("reorder_and_upcast_attn", true, "reorder_and_upcast_attn: true is not modelled");
  refused("activation_function", "relu", "activation_function: 'relu' is not modelled");
  refused("n_ctx", 64, "n_ctx: differs from n_positions");
  refused("n_head", 5, "n_embd 64 is not a multiple of n_head 5");
  refused("rotary_dim", 16, "rotary_dim: not modelled by vramscope");
}

// At a sequence as long as the window, transformers gives SDPA a sliding-window 4D mask
// (_ignore_causal_mask_sdpa needs key_value_length < sliding_window): not modelled, refused.
TEST(HfConfig, MistralRefusesASequenceThatReachesItsSlidingWindow) {
  EXPECT_NO_THROW((void)find("mistral-7b")->describe(nn::ModelOptions::parse("seq=4095")));
  try {
    (void)find("mistral-7b")->describe(nn::ModelOptions::parse("seq=4096"));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reaches sliding_window 4096"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mem::models

namespace mem::models {
namespace {

// A --hf-config model is named as people name it: the config's _name_or_path, the folder of
// a config.json, or the file without ".json"; never with a hostile file's control bytes.
TEST(HfConfig, AConfigFileIsNamedAsPeopleNameTheModel) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vramscope-hf-names-" + std::to_string(::getpid()));
  fs::create_directories(dir / "Llama-Tiny");
  const auto write = [](const fs::path& p, const json& doc) { std::ofstream(p) << doc.dump(); };
  const auto named = [](const fs::path& p) { return load_hf_config(p.string())->name(); };
  write(dir / "Llama-Tiny" / "config.json", base());
  EXPECT_EQ(named(dir / "Llama-Tiny" / "config.json"), "Llama-Tiny");
  write(dir / "tiny.json", base());
  EXPECT_EQ(named(dir / "tiny.json"), "tiny");
  json hub = base();
  hub["_name_or_path"] = "meta-llama/Llama-3.2-1B";
  write(dir / "config.json", hub);
  EXPECT_EQ(named(dir / "config.json"), "Llama-3.2-1B");
  json hostile = base();
  hostile["_name_or_path"] = std::string("evil\x1b[2J\n") + std::string(200, 'x');
  write(dir / "hostile.json", hostile);
  const std::string name = named(dir / "hostile.json");
  EXPECT_EQ(name.size(), 64u);
  EXPECT_EQ(name.rfind("evil[2J", 0), 0u);  // the escape byte and the newline are gone
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mem::models
