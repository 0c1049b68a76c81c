// zoo_sources.hpp — the zoo's parts: its files (compiled in by CMake from models/zoo/)
// and its C++ builders.
#pragma once

#include <cstddef>
#include <memory>
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

/// gpt2, gpt2-medium, gpt2-large, gpt2-xl; nullptr for another name.
std::shared_ptr<const nn::ModelSource> gpt2_source(std::string_view name);

}  // namespace mem::models::detail
