// compiled_model.hpp — reading a model file's "compiled" (the joint graph of the
// torch.compile'd step, docs/MODEL_FILES.md) into the runtime's CompiledModel. The
// model-file reader calls it.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "vramscope/runtime/compiled.hpp"

namespace mem::models::detail {

/// A size (an integer or a formula over the file's options, "2*batch*seq + 64") at the run's
/// options; throws mem::Error naming `path` (the model-file reader's own size reader).
using SizeReader = std::function<std::int64_t(const nlohmann::json&, const std::string&)>;

/// Reads `compiled` (the JSON object at key "compiled") at the run's options. Throws mem::Error
/// naming the JSON path of the first problem ("compiled.graph.nodes[12].users[0]: ...").
std::shared_ptr<const nn::CompiledModel> read_compiled(const nlohmann::json& compiled, const std::string& path,
                                                       const SizeReader& size);

}  // namespace mem::models::detail
