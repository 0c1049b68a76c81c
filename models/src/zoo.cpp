// zoo.cpp — the built-in models by name: the zoo's files, each read once through
// ModelFile (as a user's file is), then the C++ builders.
#include "vramscope/models/zoo.hpp"

#include <map>
#include <mutex>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "zoo_sources.hpp"

namespace mem::models {
std::vector<std::string> names() {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < detail::kZooFileCount; ++i) out.emplace_back(detail::kZooFiles[i].name);
  for (std::size_t i = 0; i < detail::kHfConfigCount; ++i) out.emplace_back(detail::kHfConfigs[i].name);
  return out;
}

std::string_view zoo_file_text(std::string_view name) {
  for (std::size_t i = 0; i < detail::kZooFileCount; ++i) {
    if (name == detail::kZooFiles[i].name) return detail::kZooFiles[i].text;
  }
  return {};
}

std::shared_ptr<const nn::ModelSource> find(std::string_view name) {
  static std::mutex lock;
  static std::map<std::string, std::shared_ptr<const ModelFile>, std::less<>> parsed;
  if (const std::string_view text = zoo_file_text(name); !text.empty()) {
    std::lock_guard guard(lock);
    auto it = parsed.find(name);
    if (it == parsed.end()) {
      it = parsed.emplace(std::string(name), ModelFile::parse(text, "zoo:" + std::string(name))).first;
    }
    return it->second;
  }
  for (std::size_t i = 0; i < detail::kHfConfigCount; ++i) {
    if (name == detail::kHfConfigs[i].name) {
      std::lock_guard guard(lock);
      static std::map<std::string, std::shared_ptr<const nn::ModelSource>, std::less<>> configs;
      auto it = configs.find(name);
      if (it == configs.end()) {
        const std::string n(name);
        it = configs.emplace(n, parse_hf_config(detail::kHfConfigs[i].text, n, "zoo:" + n + "/config.json")).first;
      }
      return it->second;
    }
  }
  std::string valid;
  for (const std::string& n : names()) valid += (valid.empty() ? "" : ", ") + n;
  throw Error("unknown model '" + std::string(name) + "'; valid models: " + valid +
              " (or give your own with --model-file)");
}

}  // namespace mem::models
