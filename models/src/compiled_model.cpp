// compiled_model.cpp — a model file's "compiled" (the joint graph torch.compile partitions,
// recorded by `vramscope.export --compile`) into the runtime's CompiledModel (compiled.hpp).
#include "compiled_model.hpp"

#include <algorithm>
#include <array>
#include <string_view>
#include <utility>

#include "json_kind.hpp"
#include "op_model.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::models::detail {
namespace {

using nlohmann::json;
using nn::JointNode;

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error(path + ": " + what); }

std::string at(const std::string& path, std::string_view key) { return path + "." + std::string(key); }
std::string at(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

void only_keys(const json& o, const std::string& path, std::initializer_list<std::string_view> keys) {
  if (!o.is_object()) fail(path, "expected an object, got " + kind_of(o));
  for (const auto& [key, value] : o.items()) {
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      std::string valid;
      for (std::string_view k : keys) valid += (valid.empty() ? "" : ", ") + std::string(k);
      fail(path, "unknown key '" + key + "'; valid keys: " + valid);
    }
  }
}

const json& required(const json& o, const std::string& path, std::string_view key) {
  if (!o.contains(key)) fail(at(path, key), "is required");
  return o.at(std::string(key));
}

std::int64_t integer(const json& v, const std::string& path, std::int64_t low, std::int64_t high) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < low || v.get<std::int64_t>() > high) {
    fail(path, "expected an integer from " + std::to_string(low) + " to " + std::to_string(high) + ", got " +
                   kind_of(v));
  }
  return v.get<std::int64_t>();
}

std::string text(const json& v, const std::string& path) {
  if (!v.is_string() || v.get_ref<const std::string&>().size() > 4096) fail(path, "expected a string, got " + kind_of(v));
  return v.get<std::string>();
}

bool boolean(const json& v, const std::string& path) {
  if (!v.is_boolean()) fail(path, "expected true or false, got " + kind_of(v));
  return v.get<bool>();
}

/// A list of node indices, each below `limit`.
std::vector<std::int32_t> indices(const json& o, const std::string& path, std::string_view key, std::size_t limit,
                                  bool optional = false) {
  std::vector<std::int32_t> out;
  if (!o.contains(key)) {
    if (optional) return out;
    fail(at(path, key), "is required (a list of node indices)");
  }
  const json& list = o.at(std::string(key));
  if (!list.is_array()) fail(at(path, key), "expected a list of node indices, got " + kind_of(list));
  if (list.size() > kMaxGraphEntries) fail(at(path, key), "too many entries");
  for (std::size_t i = 0; i < list.size(); ++i) {
    out.push_back(static_cast<std::int32_t>(integer(list[i], at(at(path, key), i), 0,
                                                    static_cast<std::int64_t>(limit) - 1)));
  }
  return out;
}

constexpr std::array<std::pair<std::string_view, JointNode::Flag>, 18> kFlags{{
    {"fusible", JointNode::Fusible},
    {"compute_intensive", JointNode::ComputeIntensive},
    {"random", JointNode::Random},
    {"view", JointNode::View},
    {"recomputable", JointNode::Recomputable},
    {"cat", JointNode::Cat},
    {"getitem", JointNode::GetItem},
    {"lift_fresh", JointNode::LiftFresh},
    {"non_builtin", JointNode::NonBuiltin},
    {"must_be_in_backward", JointNode::MustBeInBackward},
    {"device_value", JointNode::DeviceValue},
    {"must_save", JointNode::MustSave},
    {"must_recompute", JointNode::MustRecompute},
    {"epilogue_mutation", JointNode::EpilogueMutation},
    {"static", JointNode::Static},
    {"collective", JointNode::Collective},
    {"reduction", JointNode::Reduction},
    {"impure", JointNode::Impure},
}};

std::uint32_t flags_of(const json& list, const std::string& path) {
  if (!list.is_array() || list.size() > 64) fail(path, "expected a list of flags, got " + kind_of(list));
  std::uint32_t flags = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string name = text(list[i], at(path, i));
    auto it = std::find_if(kFlags.begin(), kFlags.end(), [&](const auto& f) { return f.first == name; });
    if (it == kFlags.end()) fail(at(path, i), "unknown flag '" + name + "'");
    flags |= it->second;
  }
  return flags;
}

/// A size or count: an integer, or a formula the file's options evaluate, within [0, high].
std::int64_t sized(const json& v, const std::string& path, const SizeReader& size, std::int64_t high) {
  const std::int64_t n = size(v, path);
  if (n < 0 || n > high) fail(path, "expected a value from 0 to " + std::to_string(high) + ", got " + std::to_string(n));
  return n;
}

JointNode read_node(const json& n, const std::string& path, std::size_t index, std::size_t count,
                    const SizeReader& size) {
  only_keys(n, path, {"name", "op", "target", "users", "args", "inputs", "value", "bytes", "shape", "dtype",
                      "sym_size", "storage", "placeholder", "flags", "flops", "primal", "grad", "outputs",
                      "conv_groups"});
  JointNode node;
  node.name = text(required(n, path, "name"), at(path, "name"));
  const std::string op = text(required(n, path, "op"), at(path, "op"));
  if (op == "placeholder") {
    node.op = JointNode::Op::Placeholder;
  } else if (op == "call_function") {
    node.op = JointNode::Op::CallFunction;
  } else if (op == "get_attr") {
    node.op = JointNode::Op::GetAttr;
  } else if (op == "output") {
    node.op = JointNode::Op::Output;
    if (index + 1 != count) fail(at(path, "op"), "the output node must be the graph's last");
    return node;
  } else {
    fail(at(path, "op"), "expected placeholder, call_function, get_attr or output, got '" + op + "'");
  }
  if (n.contains("target")) node.target = text(n.at("target"), at(path, "target"));
  node.users = indices(n, path, "users", count);
  node.args = indices(n, path, "args", count, true);
  node.inputs = indices(n, path, "inputs", count, true);
  for (std::int32_t i : node.inputs) {
    if (static_cast<std::size_t>(i) >= index) fail(at(path, "inputs"), "a node reads only earlier nodes");
  }
  for (std::int32_t i : node.args) {
    if (static_cast<std::size_t>(i) >= index) fail(at(path, "args"), "a node reads only earlier nodes");
  }
  for (std::int32_t u : node.users) {
    if (static_cast<std::size_t>(u) <= index) fail(at(path, "users"), "a node's users come after it");
  }
  const std::string value = n.contains("value") ? text(n.at("value"), at(path, "value")) : "tensor";
  if (value == "tensor") {
    node.value = JointNode::Value::Tensor;
  } else if (value == "sym") {
    node.value = JointNode::Value::Sym;
  } else if (value == "opaque") {
    node.value = JointNode::Value::Opaque;
  } else if (value == "other") {
    node.value = JointNode::Value::Other;
  } else {
    fail(at(path, "value"), "expected tensor, sym, opaque or other, got '" + value + "'");
  }
  constexpr std::int64_t kMaxBytes = std::int64_t{1} << 44;  // 16 TiB: more than any device, and its weights fit 64 bits
  node.bytes = n.contains("bytes") ? sized(n.at("bytes"), at(path, "bytes"), size, kMaxBytes) : 0;
  if (n.contains("sym_size")) node.sym_size = integer(n.at("sym_size"), at(path, "sym_size"), 0, 8);
  if (n.contains("storage")) {
    node.storage = static_cast<std::int32_t>(integer(n.at("storage"), at(path, "storage"), 0,
                                                     static_cast<std::int64_t>(count)));
  }
  if (n.contains("flags")) node.flags = flags_of(n.at("flags"), at(path, "flags"));
  if (n.contains("conv_groups")) {
    node.conv_groups = integer(n.at("conv_groups"), at(path, "conv_groups"), 1, std::int64_t{1} << 30);
  }
  if (n.contains("flops")) node.flops = sized(n.at("flops"), at(path, "flops"), size, std::int64_t{1} << 62);
  if (n.contains("shape")) {
    const json& shape = n.at("shape");
    if (!shape.is_array() || shape.size() > 16) fail(at(path, "shape"), "expected up to 16 sizes");
    for (std::size_t d = 0; d < shape.size(); ++d) {
      node.shape.push_back(sized(shape[d], at(at(path, "shape"), d), size, kMaxBytes));
    }
  }
  if (n.contains("dtype")) {
    try {
      node.dtype = nn::parse_dtype(text(n.at("dtype"), at(path, "dtype")));
    } catch (const Error& e) {
      fail(at(path, "dtype"), e.what());
    }
  }
  if (node.value == JointNode::Value::Tensor && n.contains("shape")) {
    std::int64_t expected = static_cast<std::int64_t>(nn::dtype_size(node.dtype));
    for (std::int64_t d : node.shape) {
      if (__builtin_mul_overflow(expected, d, &expected) || expected > kMaxBytes) {
        fail(at(path, "shape"), node.shape.str() + " holds more than 16 TiB");
      }
    }
    if (expected != node.bytes) {
      fail(at(path, "bytes"), std::to_string(node.bytes) + " bytes for a " + node.shape.str() + " " +
                                  std::string(nn::dtype_name(node.dtype)) + " tensor of " + std::to_string(expected));
    }
  }
  if (node.op == JointNode::Op::Placeholder) {
    if (!node.inputs.empty() || !node.args.empty()) fail(at(path, "inputs"), "a placeholder reads no node");
    const std::string kind = text(required(n, path, "placeholder"), at(path, "placeholder"));
    if (kind == "primal") {
      node.input = JointNode::Input::Primal;
    } else if (kind == "tangent") {
      node.input = JointNode::Input::Tangent;
    } else if (kind == "fwd_seed") {
      node.input = JointNode::Input::FwdSeed;
    } else if (kind == "bwd_seed") {
      node.input = JointNode::Input::BwdSeed;
    } else {
      fail(at(path, "placeholder"), "expected primal, tangent, fwd_seed or bwd_seed, got '" + kind + "'");
    }
    if (n.contains("primal")) node.primal = text(n.at("primal"), at(path, "primal"));
    if (n.contains("grad")) {
      node.grad = static_cast<std::int32_t>(integer(n.at("grad"), at(path, "grad"), 0,
                                                    static_cast<std::int64_t>(count) - 1));
    }
  }
  return node;
}

}  // namespace

std::shared_ptr<const nn::CompiledModel> read_compiled(const json& compiled, const std::string& path,
                                                       const SizeReader& size) {
  only_keys(compiled, path, {"batch", "seq", "fixed", "graph"});
  auto model = std::make_shared<nn::CompiledModel>();
  model->batch = integer(required(compiled, path, "batch"), at(path, "batch"), 1, std::int64_t{1} << 40);
  if (compiled.contains("seq")) model->seq = integer(compiled.at("seq"), at(path, "seq"), 1, std::int64_t{1} << 40);
  if (compiled.contains("fixed")) model->fixed = text(compiled.at("fixed"), at(path, "fixed"));
  const std::string gpath = at(path, "graph");
  const json& graph = required(compiled, path, "graph");
  only_keys(graph, gpath, {"traced_on", "torch", "partitioner", "forward_outputs", "nodes"});
  nn::JointGraph& g = model->graph;
  g.traced_on = text(required(graph, gpath, "traced_on"), at(gpath, "traced_on"));
  g.torch = text(required(graph, gpath, "torch"), at(gpath, "torch"));
  const json& config = required(graph, gpath, "partitioner");
  const std::string cpath = at(gpath, "partitioner");
  only_keys(config, cpath, {"recompute_views", "treat_parameters_as_free_to_save", "max_dist_from_bw",
                            "ban_recompute_used_far_apart", "ban_recompute_long_fusible_chains",
                            "ban_recompute_materialized_backward", "ban_recompute_not_in_allowlist",
                            "ban_recompute_reductions", "aggressive_recomputation", "activation_memory_budget_solver",
                            "activation_memory_budget_runtime_estimator"});
  auto flag = [&](const char* key, bool& into) {
    if (config.contains(key)) into = boolean(config.at(key), at(cpath, key));
  };
  nn::PartitionerConfig& c = g.config;
  flag("recompute_views", c.recompute_views);
  flag("treat_parameters_as_free_to_save", c.treat_parameters_as_free_to_save);
  flag("ban_recompute_used_far_apart", c.ban_recompute_used_far_apart);
  flag("ban_recompute_long_fusible_chains", c.ban_recompute_long_fusible_chains);
  flag("ban_recompute_materialized_backward", c.ban_recompute_materialized_backward);
  flag("ban_recompute_not_in_allowlist", c.ban_recompute_not_in_allowlist);
  flag("ban_recompute_reductions", c.ban_recompute_reductions);
  flag("aggressive_recomputation", c.aggressive_recomputation);
  if (config.contains("max_dist_from_bw")) {
    c.max_dist_from_bw = integer(config.at("max_dist_from_bw"), at(cpath, "max_dist_from_bw"), 0, 1000000000);
  }
  // vramscope runs the dp knapsack over FLOPs, PyTorch's defaults; another is refused, not guessed.
  if (config.contains("activation_memory_budget_solver") &&
      text(config.at("activation_memory_budget_solver"), at(cpath, "activation_memory_budget_solver")) != "dp") {
    fail(at(cpath, "activation_memory_budget_solver"), "only PyTorch's default, \"dp\", is modelled");
  }
  if (config.contains("activation_memory_budget_runtime_estimator") &&
      text(config.at("activation_memory_budget_runtime_estimator"),
           at(cpath, "activation_memory_budget_runtime_estimator")) != "flops") {
    fail(at(cpath, "activation_memory_budget_runtime_estimator"), "only PyTorch's default, \"flops\", is modelled");
  }
  const json& nodes = required(graph, gpath, "nodes");
  const std::string npath = at(gpath, "nodes");
  if (!nodes.is_array() || nodes.empty() || nodes.size() > kMaxGraphEntries) {
    fail(npath, "expected a list of nodes ending with the output node");
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    g.nodes.push_back(read_node(nodes[i], at(npath, i), i, nodes.size(), size));
  }
  if (g.nodes.back().op != JointNode::Op::Output) fail(npath, "the last node must be the output node");
  const std::string opath = at(npath, nodes.size() - 1);
  g.outputs = indices(nodes.back(), opath, "outputs", nodes.size() - 1);
  g.forward_outputs = static_cast<std::int32_t>(integer(required(graph, gpath, "forward_outputs"),
                                                        at(gpath, "forward_outputs"), 1,
                                                        static_cast<std::int64_t>(g.outputs.size())));
  // Users and inputs must tell the same edges (the partitioner walks both ways), each once.
  const auto output = static_cast<std::int32_t>(g.nodes.size() - 1);
  for (std::size_t i = 0; i + 1 < g.nodes.size(); ++i) {
    const JointNode& n = g.nodes[i];
    const std::string p = at(npath, i);
    auto sorted = n.users;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) fail(p + ".users", "a user listed twice");
    sorted = n.inputs;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) fail(p + ".inputs", "an input listed twice");
    for (std::int32_t u : n.users) {
      const auto& in = g.nodes[u].inputs;
      if (u != output && std::find(in.begin(), in.end(), static_cast<std::int32_t>(i)) == in.end()) {
        fail(p + ".users", "node " + std::to_string(u) + " does not read it");
      }
    }
    for (std::int32_t in : n.inputs) {
      const auto& users = g.nodes[in].users;
      if (std::find(users.begin(), users.end(), static_cast<std::int32_t>(i)) == users.end()) {
        fail(p + ".inputs", "node " + std::to_string(in) + " does not list it among its users");
      }
    }
    for (std::int32_t a : n.args) {
      if (std::find(n.inputs.begin(), n.inputs.end(), a) == n.inputs.end()) {
        fail(p + ".args", "node " + std::to_string(a) + " is no input of it");
      }
    }
  }
  for (std::size_t k = 0; k < g.outputs.size(); ++k) {
    const std::int32_t o = g.outputs[k];
    const auto& users = g.nodes[o].users;
    if (std::find(users.begin(), users.end(), output) == users.end()) {
      fail(opath + ".outputs", "node " + std::to_string(o) + " does not list the output node among its users");
    }
    const JointNode& n = g.nodes[o];
    const bool forward = k < static_cast<std::size_t>(g.forward_outputs);
    if (forward && n.op == JointNode::Op::Placeholder && n.input != JointNode::Input::Primal) {
      fail(opath + ".outputs", "the forward returns " + n.name + ", which only the backward has");
    }
    if (k == 0 && (n.op != JointNode::Op::CallFunction || n.value != JointNode::Value::Tensor)) {
      fail(opath + ".outputs", "the forward's first output, the loss, must be a tensor an operator makes");
    }
  }
  // A primal's gradient: one of the backward's outputs, its own, of its shape and dtype.
  std::vector<bool> taken(g.nodes.size(), false);
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const JointNode& n = g.nodes[i];
    if (n.grad < 0) continue;
    const std::string p = at(npath, i) + ".grad";
    if (n.input != JointNode::Input::Primal) fail(p, "only a primal has a gradient");
    if (std::find(g.outputs.begin() + g.forward_outputs, g.outputs.end(), n.grad) == g.outputs.end()) {
      fail(p, "node " + std::to_string(n.grad) + " is none of the backward's outputs");
    }
    if (taken[n.grad]) fail(p, "node " + std::to_string(n.grad) + " is another primal's gradient too");
    taken[n.grad] = true;
    const JointNode& grad = g.nodes[n.grad];
    if (grad.value != JointNode::Value::Tensor || !(grad.shape == n.shape) || grad.dtype != n.dtype) {
      fail(p, "node " + std::to_string(n.grad) + " is not a gradient of " + n.shape.str() + " " +
                  std::string(nn::dtype_name(n.dtype)));
    }
  }
  return model;
}

}  // namespace mem::models::detail
