// zoo_sources.hpp — the zoo's parts: its files (compiled in by CMake from models/zoo/)
// and its C++ builders.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "vramscope/runtime/models.hpp"

namespace mem::models::detail {

struct ZooFile {
  const char* name;
  const char* text;
};
extern const ZooFile kZooFiles[];
extern const std::size_t kZooFileCount;
/// Published config.json files of Hugging Face models (models/zoo/hf/).
extern const ZooFile kHfConfigs[];
extern const std::size_t kHfConfigCount;

/// A GPT-2 config (model_type gpt2): n_layer, n_embd, n_head, vocab_size, n_positions,
/// n_inner (0: 4 x n_embd), layer_norm_epsilon, embd_pdrop, attn_pdrop, resid_pdrop.
struct Gpt2Spec {
  std::int64_t layers = 12, embed = 768, heads = 12, vocab = 50257, positions = 1024, inner = 0;
  double eps = 1e-5, embd_dropout = 0.1, attn_dropout = 0.1, resid_dropout = 0.1;
  std::string activation = "gelu_new";  ///< activation_function: gelu_new, gelu_pytorch_tanh or gelu
};
/// GPT2LMHeadModel of that config (eager attention, tied lm_head). Throws mem::Error for an
/// inconsistent one.
std::shared_ptr<const nn::ModelSource> gpt2_source(std::string name, const Gpt2Spec& spec);

}  // namespace mem::models::detail
