// model_file.hpp — a network described as data (docs/MODEL_FILES.md): a JSON file with
// the model's options, its input, its loss and a tree of named modules, read into the
// runtime's module tree. The zoo's models are such files too.
//
//   auto net = mem::models::ModelFile::load("net.json");      // checks the whole file
//   mem::nn::TrainConfig cfg;
//   cfg.model = net;
//   cfg.model_options = mem::nn::ModelOptions::parse("batch=64");
//   auto report = mem::nn::train(cfg);
//
// A file is checked when it is read (schema, formulas, every shape at the default
// options) and each build checks the shapes again at the options it is given. Errors
// name the file, the JSON path and what was expected:
//   net.json: layers[3].kernel_size: expected a positive integer, got -3
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/runtime/models.hpp"

namespace mem::models {

/// The model-file format this build reads ("version" in the file).
inline constexpr int kModelFileVersion = 1;
/// The largest model file read, and the most modules one may build (repeats included):
/// what a file may cost stays bounded by what it says.
inline constexpr std::size_t kMaxModelFileBytes = 16u << 20;
inline constexpr std::size_t kMaxModules = 1'000'000;
inline constexpr int kMaxNesting = 64;
/// The deepest JSON read at all (anything deeper is refused while parsing).
inline constexpr int kMaxJsonDepth = 1024;

class ModelFile final : public nn::ModelSource {
 public:
  /// Reads `json_text`; `origin` names it in messages (a path, or "zoo:resnet18").
  /// Throws mem::Error naming the JSON path of the first problem.
  static std::shared_ptr<const ModelFile> parse(std::string_view json_text, std::string origin);
  /// Reads the file at `path` (at most kMaxModelFileBytes).
  static std::shared_ptr<const ModelFile> load(const std::string& path);

  ~ModelFile() override;
  const std::string& name() const noexcept override;
  const std::vector<std::string>& option_keys() const noexcept override;
  /// Where it was read from.
  const std::string& origin() const noexcept;
  /// The file as JSON with "checkpoint_modules" set to `paths` (exactly the modules that then
  /// run checkpointed, over any marks of its layers; nullopt: the file as it is): what
  /// `vramscope plan --model-out` writes.
  std::string with_checkpoint_modules(const std::optional<std::vector<std::string>>& paths) const;

  struct Doc;  ///< the parsed document (implementation)
  explicit ModelFile(std::unique_ptr<Doc> doc);

 private:
  Built make(const nn::ModelOptions& options) const override;
  std::unique_ptr<Doc> doc_;
};

}  // namespace mem::models
