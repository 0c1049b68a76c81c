// compiled_model.hpp — reading a model file's "compiled" (the joint graph of the
// torch.compile'd step, docs/MODEL_FILES.md) into the runtime's CompiledModel. The
// model-file reader calls it.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "vramscope/runtime/compiled.hpp"

namespace mem::models::detail {

/// Reads `compiled` (the JSON object at key "compiled"). Throws mem::Error naming the JSON path
/// of the first problem ("compiled.graph.nodes[12].users[0]: ...").
std::shared_ptr<const nn::CompiledModel> read_compiled(const nlohmann::json& compiled, const std::string& path);

}  // namespace mem::models::detail
