// op_model.cpp — a model file's "graph" into the runtime's OpGraph (op_model.hpp).
#include "op_model.hpp"

#include <algorithm>
#include <limits>
#include <string_view>

#include "json_kind.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::models::detail {

namespace {

using nlohmann::json;

std::string at(const std::string& path, const char* key) { return path + "." + key; }
std::string at(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error(path + ": " + what); }

const json& object_at(const json& o, const std::string& path, const char* key) {
  if (!o.contains(key)) fail(at(path, key), "is required");
  return o.at(key);
}

const json& list(const json& o, const std::string& path, const char* key, bool required = true) {
  static const json empty = json::array();
  if (!o.contains(key)) {
    if (required) fail(at(path, key), "is required (a list)");
    return empty;
  }
  const json& v = o.at(key);
  if (!v.is_array()) fail(at(path, key), "expected a list, got " + kind_of(v));
  if (v.size() > kMaxGraphEntries) fail(at(path, key), "more than " + std::to_string(kMaxGraphEntries) + " entries");
  return v;
}

std::int32_t index_value(const json& v, const std::string& path, std::int64_t low = 0) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < low ||
      v.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
    fail(path, "expected an index (an integer from " + std::to_string(low) + "), got " + kind_of(v));
  }
  return static_cast<std::int32_t>(v.get<std::int64_t>());
}

std::vector<std::int32_t> indices(const json& o, const std::string& path, const char* key, bool required,
                                  std::int64_t low = 0) {
  std::vector<std::int32_t> out;
  const json& l = list(o, path, key, required);
  out.reserve(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) out.push_back(index_value(l[i], at(at(path, key), i), low));
  return out;
}

std::string string_value(const json& v, const std::string& path) {
  if (!v.is_string() || v.get_ref<const std::string&>().size() > 1000) {
    fail(path, "expected a string of at most 1000 characters, got " + kind_of(v));
  }
  return printable(v.get_ref<const std::string&>());
}

std::string text(const json& o, const std::string& path, const char* key, bool required) {
  if (!o.contains(key)) {
    if (required) fail(at(path, key), "is required (a string)");
    return {};
  }
  return string_value(o.at(key), at(path, key));
}

/// An optional true / false; false when absent.
bool flag(const json& o, const std::string& path, const char* key) {
  if (!o.contains(key)) return false;
  if (!o.at(key).is_boolean()) fail(at(path, key), "expected true or false");
  return o.at(key).get<bool>();
}

void only_keys(const json& o, const std::string& path, std::initializer_list<const char*> keys) {
  if (!o.is_object()) fail(path, "expected an object, got " + kind_of(o));
  for (const auto& item : o.items()) {
    const std::string& key = item.key();  // not a structured binding: clang 14 cannot capture one
    if (std::find_if(keys.begin(), keys.end(), [&](const char* k) { return key == k; }) == keys.end()) {
      std::string valid;
      for (const char* k : keys) valid += (valid.empty() ? "" : ", ") + std::string(k);
      fail(path, "unknown key '" + printable(key) + "'; valid keys: " + valid);
    }
  }
}

nn::OpGraph::Kind kind(const json& t, const std::string& path) {
  const std::string k = text(t, path, "kind", true);
  if (k == "input") return nn::OpGraph::Kind::Input;
  if (k == "param") return nn::OpGraph::Kind::Param;
  if (k == "buffer") return nn::OpGraph::Kind::Buffer;
  if (k == "const") return nn::OpGraph::Kind::Const;
  if (k == "op") return nn::OpGraph::Kind::Activation;
  if (k == "host") return nn::OpGraph::Kind::Host;
  fail(at(path, "kind"), "expected input, param, buffer, const, op or host, got \"" + k + "\"");
}

}  // namespace

std::shared_ptr<const nn::OpGraph> read_op_graph(const json& g, const ShapeReader& shape) {
  const std::string path = "graph";
  only_keys(g, path,
            {"format", "recorded_with", "autocast", "calls", "tensors", "inputs", "output", "ops", "assumed", "routing"});
  if (g.value("format", json()) != 1) fail(at(path, "format"), "expected 1 (this build reads graph format 1)");
  auto graph = std::make_shared<nn::OpGraph>();
  graph->recorded_with = text(g, path, "recorded_with", false);
  const std::string autocast = text(g, path, "autocast", false);
  if (autocast == "bf16") {
    graph->autocast = nn::DType::BF16;
  } else if (autocast == "f16") {
    graph->autocast = nn::DType::F16;
  } else if (!autocast.empty()) {
    fail(at(path, "autocast"), "expected \"bf16\" or \"f16\" (the half type autocast ran in)");
  }
  const json& assumed = list(g, path, "assumed", false);
  for (std::size_t i = 0; i < assumed.size() && i < 64; ++i) {
    graph->assumed.push_back(string_value(assumed[i], at(at(path, "assumed"), i)));
  }

  const json& calls = list(g, path, "calls");
  graph->calls.reserve(calls.size());
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const std::string p = at(at(path, "calls"), i);
    only_keys(calls[i], p, {"module", "class", "parent", "checkpoint", "args", "inline"});
    nn::OpGraph::CallSpec c;
    c.module = text(calls[i], p, "module", true);
    c.cls = text(calls[i], p, "class", true);
    c.parent = index_value(object_at(calls[i], p, "parent"), at(p, "parent"), -1);
    c.args = indices(calls[i], p, "args", false);
    c.inline_code = flag(calls[i], p, "inline");
    if (calls[i].contains("checkpoint")) {
      const json& mark = calls[i].at("checkpoint");
      if (mark == "non-reentrant") {
        c.checkpoint = nn::CheckpointMark::NonReentrant;
      } else if (mark == "reentrant") {
        c.checkpoint = nn::CheckpointMark::Reentrant;
      } else {
        fail(at(p, "checkpoint"), "expected \"reentrant\" or \"non-reentrant\", got " + kind_of(mark));
      }
    }
    graph->calls.push_back(std::move(c));
  }

  const json& tensors = list(g, path, "tensors");
  graph->tensors.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string p = at(at(path, "tensors"), i);
    only_keys(tensors[i], p, {"kind", "shape", "dtype", "base", "name", "requires_grad"});
    nn::OpGraph::TensorSpec t;
    t.kind = kind(tensors[i], p);
    t.shape = shape(object_at(tensors[i], p, "shape"), at(p, "shape"));
    const std::string dtype = text(tensors[i], p, "dtype", true);
    if (dtype == "float") {
      t.follows_run_dtype = true;
    } else {
      try {
        t.dtype = nn::parse_dtype(dtype);
      } catch (const Error& e) {
        fail(at(p, "dtype"), std::string(e.what()) + ", or float (the run's dtype)");
      }
    }
    if (tensors[i].contains("base")) t.base = index_value(tensors[i].at("base"), at(p, "base"));
    t.name = text(tensors[i], p, "name", false);
    t.requires_grad = flag(tensors[i], p, "requires_grad");
    if (t.kind == nn::OpGraph::Kind::Param && t.name.empty()) fail(at(p, "name"), "a parameter needs its name");
    graph->tensors.push_back(std::move(t));
  }

  graph->inputs = indices(g, path, "inputs", true);
  graph->output = index_value(object_at(g, path, "output"), at(path, "output"));

  const json& ops = list(g, path, "ops");
  graph->ops.reserve(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const std::string p = at(at(path, "ops"), i);
    only_keys(ops[i], p, {"op", "in", "out", "call", "line", "alias", "inplace", "node", "saves", "frees", "frees_after", "args"});
    nn::OpGraph::OpSpec op;
    op.op = text(ops[i], p, "op", true);
    op.in = indices(ops[i], p, "in", true);
    op.out = indices(ops[i], p, "out", true);
    op.alias = indices(ops[i], p, "alias", false, -1);
    op.saves = indices(ops[i], p, "saves", false);
    op.frees = indices(ops[i], p, "frees", false);
    const json& after = list(ops[i], p, "frees_after", false);
    for (std::size_t k = 0; k < after.size(); ++k) {
      const std::string pk = at(at(p, "frees_after"), k);
      if (!after[k].is_array() || after[k].size() != 2) fail(pk, "expected [call, tensor], got " + kind_of(after[k]));
      op.frees_after.emplace_back(index_value(after[k][0], at(pk, std::size_t{0})), index_value(after[k][1], at(pk, std::size_t{1})));
    }
    op.call = index_value(object_at(ops[i], p, "call"), at(p, "call"));
    op.line = text(ops[i], p, "line", false);
    op.node = text(ops[i], p, "node", false);
    op.inplace = flag(ops[i], p, "inplace");
    if (ops[i].contains("args")) {
      const json& args = ops[i].at("args");
      if (!args.is_object() || args.size() > 16) fail(at(p, "args"), "expected an object of at most 16 numbers");
      for (const auto& [key, value] : args.items()) {
        if (!value.is_number() && !value.is_boolean()) fail(at(at(p, "args"), key.c_str()), "expected a number");
        op.args.emplace_back(printable(key), value.is_boolean() ? (value.get<bool>() ? 1.0 : 0.0) : value.get<double>());
      }
    }
    graph->ops.push_back(std::move(op));
  }
  return graph;
}

}  // namespace mem::models::detail
