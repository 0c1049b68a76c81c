// hf_config.hpp — a decoder-only transformer from a Hugging Face config.json (model_type
// llama, mistral or qwen2 through HfConfig; gpt2 through GPT-2's builder), built as
// transformers builds it (5.17 by default, docs/TRANSFORMERS.md; the run's Stack picks).
// Nothing is downloaded: the file is the user's, or one of the zoo's published configs.
//
//   auto llama = mem::models::load_hf_config("config.json");
//   mem::nn::TrainConfig cfg;
//   cfg.model = llama;
//   cfg.model_options = mem::nn::ModelOptions::parse("seq=2048,attn=sdpa,lora=16");
//   cfg.precision = mem::nn::Precision::BF16;
//   auto report = mem::nn::train(cfg);
//
// A key that changes memory and is not modelled (quantization_config, a sliding window
// shorter than the sequence, an activation other than silu, ...) is an error naming it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/models.hpp"

namespace mem::models {

/// The largest config.json read.
inline constexpr std::size_t kMaxHfConfigBytes = 1u << 20;
/// The deepest nesting read in a config.json (transformers' deepest, a sub-config's rope
/// parameters, is 3).
inline constexpr int kMaxHfConfigDepth = 32;
/// The model_type a config.json names ("" when it names none). Throws mem::Error for a file
/// that cannot be read or is not a bounded JSON object.
std::string hf_model_type(const std::string& path);

/// The name a config.json's place gives its model: the model's name for a file in the Hugging
/// Face cache (models--org--name/snapshots/<commit>/config.json: "name"), else the folder of a
/// file called config.json, else the file's name without ".json"; "" when none is printable.
std::string hf_name_from_path(const std::string& path);

/// Any supported config.json: gpt2, llama, mistral or qwen2. Throws mem::Error naming the key
/// of the first problem.
std::shared_ptr<const nn::ModelSource> parse_hf_config(std::string_view json_text, std::string name,
                                                       std::string origin);
std::shared_ptr<const nn::ModelSource> load_hf_config(const std::string& path);


/// A llama-layout config (llama, mistral, qwen2).
class HfConfig final : public nn::ModelSource {
 public:
  /// Reads config.json text; `name` names the model and `origin` the file in messages.
  static std::shared_ptr<const HfConfig> parse(std::string_view json_text, std::string name, std::string origin);

  const std::string& name() const noexcept override { return name_; }
  const std::vector<std::string>& option_keys() const noexcept override;
  /// The architecture as read (attention, checkpointing and LoRA at their defaults).
  const nn::DecoderConfig& decoder() const noexcept { return decoder_; }
  const std::string& model_type() const noexcept { return model_type_; }
  std::int64_t max_positions() const noexcept { return max_positions_; }
  /// The decoder a set of options builds (attention, checkpointing, LoRA applied).
  nn::DecoderConfig configure(const nn::ModelOptions& options) const;

  HfConfig(std::string name, std::string model_type, nn::DecoderConfig decoder, std::int64_t max_positions,
           std::int64_t sliding_window);

 private:
  Built make(const nn::ModelOptions& options) const override;
  std::string name_, model_type_;
  nn::DecoderConfig decoder_;
  std::int64_t max_positions_, sliding_window_;
};

}  // namespace mem::models
