// op_model.hpp — reading a model file's "graph" (an operator-level recording, docs/MODEL_FILES.md)
// into the runtime's OpGraph at one set of options. The model-file reader calls it.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "vramscope/runtime/op_graph.hpp"

namespace mem::models::detail {

/// Evaluates a shape ([..., "batch * seq", 64]) at the file's options; throws mem::Error naming
/// `path` (the model-file reader's own shape reader).
using ShapeReader = std::function<nn::Shape(const nlohmann::json&, const std::string&)>;

/// The most operators and tensors a graph may hold (a 16 MiB file holds fewer anyway).
inline constexpr std::size_t kMaxGraphEntries = 4'000'000;

/// Reads `graph` (the JSON object at key "graph"). Throws mem::Error naming the JSON path of
/// the first problem ("graph.ops[12].in[1]: ..."); then checks the whole graph as the runtime
/// needs it (op_graph_module).
std::shared_ptr<const nn::OpGraph> read_op_graph(const nlohmann::json& graph, const ShapeReader& shape);

}  // namespace mem::models::detail
