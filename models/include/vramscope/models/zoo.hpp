// zoo.hpp — the built-in models by name: model files compiled into the library
// (models/zoo/*.json, read through ModelFile like a user's file) and the published
// config.json of Hugging Face models (models/zoo/hf/*.json, read like --hf-config).
//
//   for (const auto& name : mem::models::names()) {
//     auto info = mem::models::find(name)->describe();   // nothing allocated
//     fmt::print("{} {} params\n", name, info.parameters);
//   }
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/runtime/models.hpp"

namespace mem::models {

/// The zoo's names, in a stable order.
std::vector<std::string> names();
/// The model called `name`. Throws mem::Error for an unknown name, listing the valid ones.
std::shared_ptr<const nn::ModelSource> find(std::string_view name);
/// The JSON text of a zoo model file ("" for a Hugging Face config).
std::string_view zoo_file_text(std::string_view name);

}  // namespace mem::models
