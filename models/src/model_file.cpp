// model_file.cpp — reads a model file into the runtime's module tree. One pass over the
// JSON builds the modules and follows the activation's shape through them, so a size
// that does not fit its input is reported with both modules and both shapes before
// anything runs. The format is docs/MODEL_FILES.md; the layers' arguments are
// torch.nn's constructor arguments, with the same defaults.
#include "vramscope/models/model_file.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"
#include "vramscope/runtime/encoder.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <sstream>
#include <stdexcept>

#include "expert_routing.hpp"
#include "expression.hpp"
#include "json_kind.hpp"
#include "compiled_model.hpp"
#include "op_model.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/files.hpp"
#include "vramscope/runtime/modules.hpp"

namespace mem::models {

using nlohmann::json;
using detail::kind_of;

struct ModelFile::Doc {
  json root;
  std::string origin;
  std::string name;
  std::string description;
  std::vector<std::string> option_keys;
  nn::ModelOptions defaults;  ///< the file's "options": every key it takes, with its default
  /// "checkpoint_modules": exactly these modules checkpointed by path (what `vramscope plan
  /// --model-out` writes); an empty list: none, whatever the layers' marks say.
  std::optional<std::vector<std::string>> checkpoint_modules;
};

namespace {

/// What flows between modules: the activation's shape and dtype, and who made it.
struct Flow {
  nn::Shape shape;
  bool integer = false;  ///< i64 (token ids) rather than floating
  std::string from;      ///< "'layer4.1' (BasicBlock)", or "the input"
};

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

/// A container's children in order, their names indexed: a file may give one container a
/// million children, so neither the duplicate check nor a {"use": name} may scan them.
template <class Ptr>
struct Siblings {
  std::vector<std::pair<std::string, Ptr>> list;
  std::unordered_map<std::string, std::size_t> index;
  const Ptr* find(const std::string& name) const {
    const auto it = index.find(name);
    return it == index.end() ? nullptr : &list[it->second].second;
  }
};

std::string field(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }
std::string index(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

class Builder {
 public:
  Builder(const ModelFile::Doc& doc, const nn::ModelOptions& given) : doc_(doc), given_(given) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw Error(doc_.origin + ": " + (path.empty() ? "" : path + ": ") + what);
  }

  // --- values -------------------------------------------------------------------------------

  std::optional<std::int64_t> size_value(std::string_view name) const {
    if (const auto v = given_.size(name)) return v;
    if (ep_rows_ && name == kEpRows) return ep_rows_;  // the rows a GPU's experts receive
    if (routing_ && name.starts_with(kExpertRows)) {
      // An expert's rows in a recorded per-expert loop: expert_rows_<e>, from the routing.
      const std::string_view digits = name.substr(kExpertRows.size());
      std::int64_t e = -1;
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), e);
      if (ec != std::errc() || end != digits.data() + digits.size() || e < 0 || e >= routing_->experts) {
        return std::nullopt;
      }
      return routing_->rows(e);
    }
    return doc_.defaults.size(name);
  }

  /// The graph's "routing" (a recorded per-expert loop): experts, top_k and the tokens' formula.
  void read_routing(const json& graph) {
    if (!graph.is_object() || !graph.contains("routing")) return;
    const std::string path = "graph.routing";
    const json& r = graph.at("routing");
    if (!r.is_object()) fail(path, "expected {\"experts\": E, \"top_k\": K, \"tokens\": \"batch*seq\"}, got " + kind_of(r));
    for (const auto& [key, value] : r.items()) {
      if (key != "experts" && key != "top_k" && key != "tokens") {
        fail(path, "unknown key '" + printable(key) + "'; valid keys: experts, top_k, tokens");
      }
    }
    detail::ExpertRouting routing;
    routing.experts = positive_at(r, path, "experts");
    routing.top_k = positive_at(r, path, "top_k");
    routing.tokens = positive_at(r, path, "tokens");
    if (r.at("tokens").is_string()) routing.tokens_formula = printable(r.at("tokens").get<std::string>());
    if (routing.experts > kMaxExperts) fail(field(path, "experts"), "at most " + std::to_string(kMaxExperts));
    if (routing.top_k > routing.experts) fail(field(path, "top_k"), "more than the experts");
    if (routing.tokens > INT64_MAX / routing.top_k) fail(field(path, "tokens"), "times top_k overflows 64 bits");
    if (!doc_.defaults.size("expert_skew")) {
      fail("options", "a model with \"routing\" declares the option expert_skew (its default, 1: even)");
    }
    routing.skew = size_value("expert_skew").value_or(1);
    routing_ = routing;
  }

  /// An integer: a JSON integer or a formula over the size options.
  std::int64_t integer(const json& v, const std::string& path) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
        fail(path, "expected an integer that fits in 64 bits, got " + v.dump());
      }
      return v.get<std::int64_t>();
    }
    if (v.is_string()) {
      try {
        return detail::evaluate(v.get_ref<const std::string&>(),
                                [this](std::string_view n) { return size_value(n); });
      } catch (const std::invalid_argument& e) {
        fail(path, "the formula " + kind_of(v) + " " + e.what());
      }
    }
    fail(path, "expected an integer or a formula over the size options, got " + kind_of(v));
  }

  std::int64_t positive(const json& v, const std::string& path) const {
    const std::int64_t n = integer(v, path);
    if (n <= 0) fail(path, "expected a positive integer, got " + std::to_string(n));
    return n;
  }

  std::int64_t positive_at(const json& obj, const std::string& path, const char* key) const {
    if (!obj.contains(key)) fail(field(path, key), "is required (a positive integer)");
    return positive(obj.at(key), field(path, key));
  }
  std::int64_t positive_or(const json& obj, const std::string& path, const char* key, std::int64_t fallback) const {
    return obj.contains(key) ? positive(obj.at(key), field(path, key)) : fallback;
  }
  std::int64_t non_negative_or(const json& obj, const std::string& path, const char* key, std::int64_t fallback) const {
    if (!obj.contains(key)) return fallback;
    const std::int64_t n = integer(obj.at(key), field(path, key));
    if (n < 0) fail(field(path, key), "expected an integer >= 0, got " + std::to_string(n));
    return n;
  }

  /// A flag: true / false, or the name of the model's "inplace" option.
  bool flag_or(const json& obj, const std::string& path, const char* key, bool fallback) const {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_string() && v.get_ref<const std::string&>() == "inplace" && doc_.defaults.inplace_relu) {
      return given_.inplace_relu.value_or(*doc_.defaults.inplace_relu);
    }
    fail(field(path, key), "expected true or false" + std::string(doc_.defaults.inplace_relu ? " or \"inplace\"" : "") +
                               ", got " + kind_of(v));
  }

  /// A probability in [0, 1), or the name of the model's "dropout" option.
  double probability_or(const json& obj, const std::string& path, const char* key, double fallback) const {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    if (v.is_string() && v.get_ref<const std::string&>() == "dropout" && doc_.defaults.dropout) {
      return given_.dropout.value_or(*doc_.defaults.dropout);
    }
    if (!v.is_number() || v.get<double>() < 0 || v.get<double>() >= 1) {
      fail(field(path, key), "expected a probability in [0, 1)" +
                                 std::string(doc_.defaults.dropout ? " or \"dropout\"" : "") + ", got " + kind_of(v));
    }
    return v.get<double>();
  }

  double positive_number_or(const json& obj, const std::string& path, const char* key, double fallback) const {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e6) {
      fail(field(path, key), "expected a positive number, got " + kind_of(v));
    }
    return v.get<double>();
  }

  /// Any finite number of moderate size (a slope, a clamp bound).
  double number_or(const json& obj, const std::string& path, const char* key, double fallback) const {
    if (!obj.contains(key)) return fallback;
    const json& v = obj.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || std::abs(v.get<double>()) > 1e6) {
      fail(field(path, key), "expected a number, got " + kind_of(v));
    }
    return v.get<double>();
  }

  std::string choice_or(const json& obj, const std::string& path, const char* key,
                        std::initializer_list<const char*> valid) const {
    if (!obj.contains(key)) return *valid.begin();
    const json& v = obj.at(key);
    if (v.is_string()) {
      for (const char* c : valid) {
        if (v.get_ref<const std::string&>() == c) return c;
      }
    }
    std::vector<std::string> names(valid.begin(), valid.end());
    for (auto& n : names) n = "\"" + n + "\"";
    fail(field(path, key), "expected one of " + join(names) + ", got " + kind_of(v));
  }

  const json& list_at(const json& obj, const std::string& path, const char* key, bool required = true) const {
    static const json empty = json::array();
    if (!obj.contains(key)) {
      if (required) fail(field(path, key), "is required (a list of modules)");
      return empty;
    }
    const json& v = obj.at(key);
    if (!v.is_array()) fail(field(path, key), "expected a list, got " + kind_of(v));
    return v;
  }

  /// `module`: a module's keys, where "checkpoint" (read by module()) is valid too.
  void only_keys(const json& obj, const std::string& path, const std::string& what,
                 std::initializer_list<const char*> keys, bool module = false) const {
    for (const auto& item : obj.items()) {
      const std::string& key = item.key();  // not a structured binding: clang 14 cannot capture one
      if (key == "comment") continue;       // free text anywhere, for the reader
      if (module && key == "checkpoint") continue;
      if (std::none_of(keys.begin(), keys.end(), [&](const char* k) { return key == k; })) {
        std::vector<std::string> valid(keys.begin(), keys.end());
        valid.emplace_back("comment");
        fail(path, "unknown key '" + key + "' for " + what + "; valid keys: " + join(valid));
      }
    }
  }

  /// A shape: a list of positive sizes, whose element count (and bytes at 8 per element)
  /// fit in 63 bits.
  nn::Shape shape(const json& v, const std::string& path) const {
    if (!v.is_array() || v.empty() || v.size() > nn::kMaxDims) {
      fail(path, "expected a shape: a list of 1 to " + std::to_string(nn::kMaxDims) + " sizes, got " + kind_of(v));
    }
    std::vector<std::int64_t> dims;
    for (std::size_t i = 0; i < v.size(); ++i) dims.push_back(positive(v[i], index(path, i)));
    return make_shape(dims, path);
  }

  /// A recorded tensor's shape: 0 to kMaxDims sizes (a scalar is []), each 0 or more.
  nn::Shape graph_shape(const json& v, const std::string& path) const {
    if (!v.is_array() || v.size() > nn::kMaxDims) {
      fail(path, "expected a shape: a list of at most " + std::to_string(nn::kMaxDims) + " sizes, got " + kind_of(v));
    }
    std::vector<std::int64_t> dims;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::int64_t n = integer(v[i], index(path, i));
      if (n < 0) fail(index(path, i), "expected a size >= 0, got " + std::to_string(n));
      dims.push_back(n);
    }
    return make_shape(dims, path);
  }

  void check_size(std::span<const std::int64_t> dims, const std::string& path) const {
    std::int64_t n = 8;  // the widest element (i64 / f64): bytes must fit too
    for (std::int64_t d : dims) {
      if (__builtin_mul_overflow(n, d, &n)) {
        std::string s;
        for (std::int64_t x : dims) s += (s.empty() ? "" : ", ") + std::to_string(x);
        fail(path, "the shape [" + s + "] has more bytes than 2^63; no device holds it (check the sizes)");
      }
    }
  }
  void check_size(const nn::Shape& s, const std::string& path) const { check_size(std::span(s.begin(), s.end()), path); }
  nn::Shape make_shape(const std::vector<std::int64_t>& dims, const std::string& path) const {
    check_size(dims, path);
    return nn::Shape(dims);
  }

  // --- modules --------------------------------------------------------------------------------

  using Children = Siblings<std::unique_ptr<nn::Module>>;

  void count_module(const std::string& path) {
    if (++modules_ > kMaxModules) {
      fail(path, "the model has more than " + std::to_string(kMaxModules) + " modules (check the repeat counts)");
    }
  }

  static std::string display(const std::string& mpath, const std::string& type) {
    return "'" + mpath + "' (" + type + ")";
  }

  [[noreturn]] void mismatch(const std::string& path, const std::string& mpath, const std::string& type,
                             const std::string& expects, const Flow& flow) const {
    fail(path, display(mpath, type) + " expects " + expects + ", but its input from " + flow.from + " is " +
                   flow.shape.str() + (flow.integer ? " (int64)" : ""));
  }

  void floating(const Flow& flow, const std::string& path, const std::string& mpath, const std::string& type) const {
    if (flow.integer) mismatch(path, mpath, type, "a floating-point input", flow);
  }

  /// The output of a kernel sliding over [N, C, H, W] (conv and pooling): [N, channels, H', W']
  /// with H' = (H + 2 padding - kernel) / stride + 1, as torch.nn documents it.
  nn::Shape slide(const Flow& flow, std::int64_t channels, std::int64_t kernel, std::int64_t stride,
                  std::int64_t padding, const std::string& path, const std::string& mpath,
                  const std::string& type) const {
    const nn::Shape& in = flow.shape;
    const auto out = [&](std::int64_t side) {
      std::int64_t span = 0;  // side + 2 padding - kernel; a hostile padding must not wrap it
      if (__builtin_mul_overflow(padding, 2, &span) || __builtin_add_overflow(span, side - kernel, &span)) {
        fail(field(path, "padding"), "the padded input overflows 64 bits (padding " + std::to_string(padding) + ")");
      }
      return span < 0 ? 0 : span / stride + 1;
    };
    const std::int64_t h = out(in[2]), w = out(in[3]);
    if (h <= 0 || w <= 0) mismatch(path, mpath, type, "an input at least as large as its kernel", flow);
    return make_shape({in[0], channels, h, w}, path);
  }

  /// "checkpoint": true (non-reentrant, PyTorch's recommended mode), "non-reentrant",
  /// "reentrant", or false.
  nn::CheckpointMark checkpoint_mark(const json& v, const std::string& path) const {
    if (v.is_boolean()) return v.get<bool>() ? nn::CheckpointMark::NonReentrant : nn::CheckpointMark::None;
    if (v == "non-reentrant") return nn::CheckpointMark::NonReentrant;
    if (v == "reentrant") return nn::CheckpointMark::Reentrant;
    fail(path, "expected true, false, \"non-reentrant\" or \"reentrant\", got " + kind_of(v));
  }

  /// A convolution's arguments (Conv1d with `dims` 3, Conv2d with 4), checked against its
  /// input: channels, groups dividing both channel counts, the weight's size, and the
  /// dilated kernel's span, dilation (k - 1) + 1.
  struct Conv {
    std::int64_t cin, cout, k, stride, padding, dilation, groups, span;
  };
  Conv conv(const json& s, const std::string& path, const std::string& type, const Flow& flow,
            const std::string& mpath, std::size_t dims) const {
    only_keys(s, path, type, {"name", "type", "frozen", "in_channels", "out_channels", "kernel_size", "stride",
                              "padding", "dilation", "groups", "bias"}, true);
    Conv c{};
    c.cin = positive_at(s, path, "in_channels");
    c.cout = positive_at(s, path, "out_channels");
    c.k = positive_at(s, path, "kernel_size");
    c.stride = positive_or(s, path, "stride", 1);
    c.padding = non_negative_or(s, path, "padding", 0);
    c.dilation = positive_or(s, path, "dilation", 1);
    c.groups = positive_or(s, path, "groups", 1);
    if (c.cin % c.groups != 0 || c.cout % c.groups != 0) {
      fail(field(path, "groups"), "in_channels " + std::to_string(c.cin) + " and out_channels " + std::to_string(c.cout) +
                                      " must both be divisible by groups " + std::to_string(c.groups));
    }
    floating(flow, path, mpath, type);
    const nn::Shape& in = flow.shape;
    if (in.size() != dims || in[1] != c.cin) {
      mismatch(path, mpath, type,
               "[N, " + std::to_string(c.cin) + (dims == 4 ? ", H, W]" : ", L]") + " (in_channels " +
                   std::to_string(c.cin) + ")",
               flow);
    }
    // The weight before the padded input: a huge kernel makes both overflow, and the weight
    // names the cause. (Linear's and Embedding's weights are the parameter count's concern.)
    std::vector<std::int64_t> weight{c.cout, c.cin / c.groups, c.k};
    if (dims == 4) weight.push_back(c.k);
    check_size(weight, path);
    if (__builtin_mul_overflow(c.dilation, c.k - 1, &c.span) || c.span >= (std::int64_t{1} << 40)) {
      fail(field(path, "dilation"), "the dilated kernel is larger than any input (dilation " +
                                        std::to_string(c.dilation) + ")");
    }
    c.span += 1;
    return c;
  }

  /// A 2-d pooling's kernel_size, stride (default: the kernel) and padding, checked against
  /// its NCHW input, whose shape `flow` now holds the pooled one.
  struct Pool {
    std::int64_t k, stride, padding;
  };
  Pool pool(const json& s, const std::string& path, const std::string& type, Flow& flow,
            const std::string& mpath) const {
    Pool p{};
    p.k = positive_at(s, path, "kernel_size");
    p.stride = positive_or(s, path, "stride", p.k);
    p.padding = non_negative_or(s, path, "padding", 0);
    // PyTorch: "pad should be at most half of effective kernel size".
    if (p.padding > p.k / 2) {
      fail(field(path, "padding"), "must be at most half of kernel_size, got " + std::to_string(p.padding));
    }
    floating(flow, path, mpath, type);
    if (flow.shape.size() != 4) mismatch(path, mpath, type, "[N, C, H, W]", flow);
    flow.shape = slide(flow, flow.shape[1], p.k, p.stride, p.padding, path, mpath, type);
    return p;
  }

  /// Builds one module from `spec`; `flow` goes in as its input and comes out as its output.
  /// Module `name` of the container at module path `parent`.
  std::unique_ptr<nn::Module> module(const json& spec, const std::string& path, const std::string& parent,
                                     const std::string& name, Flow& flow, int depth) {
    const std::string mpath = sub(parent, name);
    if (!spec.is_object()) fail(path, "expected a module (an object with a \"type\"), got " + kind_of(spec));
    if (depth > kMaxNesting) fail(path, "modules nest deeper than " + std::to_string(kMaxNesting));
    count_module(path);
    if (!spec.contains("type") || !spec.at("type").is_string()) {
      fail(field(path, "type"), spec.contains("type") ? "expected a layer type name, got " + kind_of(spec.at("type"))
                                                      : "is required (a layer type such as \"Linear\")");
    }
    const std::string type = spec.at("type").get<std::string>();
    // An inline Residual or Parallel is code in the enclosing forward: its children are
    // named as the enclosing module's. So is an inline Sequential: a stretch of that code,
    // which "checkpoint" runs under one checkpoint() (checkpoint(self.method, x) or
    // checkpoint(F.relu, x) in a forward).
    const bool inline_code =
        (type == "Residual" || type == "Parallel" || type == "Sequential") && flag_or(spec, path, "inline", false);
    std::unique_ptr<nn::Module> m = layer(type, spec, path, inline_code ? parent : mpath, flow, depth);
    m->set_inline(inline_code);
    if (inline_code && spec.contains("name")) {
      fail(field(path, "name"), "an inline " + type + " is code in the enclosing module's forward and has no name");
    }

    if (flag_or(spec, path, "frozen", false)) m->freeze();
    if (spec.contains("checkpoint")) m->set_checkpoint(checkpoint_mark(spec.at("checkpoint"), field(path, "checkpoint")));
    flow.from = display(mpath, m->type_name());
    return m;
  }

  std::unique_ptr<nn::Module> layer(const std::string& type, const json& s, const std::string& path,
                                    const std::string& mpath, Flow& flow, int depth) {
    nn::Shape& in = flow.shape;
    if (type == "Linear") {
      only_keys(s, path, type, {"name", "type", "frozen", "in_features", "out_features", "bias"}, true);
      const std::int64_t fin = positive_at(s, path, "in_features"), fout = positive_at(s, path, "out_features");
      floating(flow, path, mpath, type);
      if (in.back() != fin) mismatch(path, mpath, type, "[..., " + std::to_string(fin) + "] (in_features)", flow);
      std::vector<std::int64_t> dims = in.to_vector();
      dims.back() = fout;
      in = make_shape(dims, path);
      return std::make_unique<nn::Linear>(fin, fout, flag_or(s, path, "bias", true));
    }
    if (type == "Conv2d") {
      const Conv c = conv(s, path, type, flow, mpath, 4);
      in = slide(flow, c.cout, c.span, c.stride, c.padding, path, mpath, type);
      return std::make_unique<nn::Conv2d>(c.cin, c.cout, c.k, c.stride, c.padding, flag_or(s, path, "bias", true),
                                          c.dilation, c.groups);
    }
    if (type == "Conv1d") {
      const Conv c = conv(s, path, type, flow, mpath, 3);
      std::int64_t reach = 0;  // L + 2 padding - the dilated kernel; a hostile padding must not wrap it
      if (__builtin_mul_overflow(c.padding, 2, &reach) || __builtin_add_overflow(reach, in[2] - c.span, &reach)) {
        fail(field(path, "padding"), "the padded input overflows 64 bits (padding " + std::to_string(c.padding) + ")");
      }
      if (reach < 0) mismatch(path, mpath, type, "an input at least as long as its kernel", flow);
      in = make_shape({in[0], c.cout, reach / c.stride + 1}, path);
      return std::make_unique<nn::Conv1d>(c.cin, c.cout, c.k, c.stride, c.padding, flag_or(s, path, "bias", true),
                                          c.dilation, c.groups);
    }
    if (type == "ConvTranspose2d") {
      only_keys(s, path, type, {"name", "type", "frozen", "in_channels", "out_channels", "kernel_size", "stride",
                                "padding", "output_padding", "dilation", "groups", "bias"}, true);
      const std::int64_t cin = positive_at(s, path, "in_channels"), cout = positive_at(s, path, "out_channels");
      const std::int64_t k = positive_at(s, path, "kernel_size"), stride = positive_or(s, path, "stride", 1);
      const std::int64_t padding = non_negative_or(s, path, "padding", 0);
      const std::int64_t output_padding = non_negative_or(s, path, "output_padding", 0);
      const std::int64_t dilation = positive_or(s, path, "dilation", 1);
      if (positive_or(s, path, "groups", 1) != 1) fail(field(path, "groups"), "only 1 is supported for ConvTranspose2d");
      // PyTorch: "output padding must be smaller than either stride or dilation"; and below the
      // stride here, where the output's size determines the input's.
      if (output_padding >= stride) {
        fail(field(path, "output_padding"), "must be smaller than stride (" + std::to_string(stride) + "), got " +
                                                std::to_string(output_padding));
      }
      floating(flow, path, mpath, type);
      if (in.size() != 4 || in[1] != cin) {
        mismatch(path, mpath, type, "[N, " + std::to_string(cin) + ", H, W] (in_channels " + std::to_string(cin) + ")", flow);
      }
      check_size(std::vector<std::int64_t>{cin, cout, k, k}, path);
      if (k > (std::int64_t{1} << 40) || dilation > (std::int64_t{1} << 20) || stride > (std::int64_t{1} << 20) ||
          padding > (std::int64_t{1} << 40)) {
        fail(path, "kernel_size, stride, dilation or padding too large for any input");
      }
      const auto side = [&](std::int64_t n) -> std::int64_t {
        // (n - 1) stride - 2 padding + dilation (k - 1) + output_padding + 1, checked.
        std::int64_t v = 0, t = 0;
        if (__builtin_mul_overflow(n - 1, stride, &v) || __builtin_mul_overflow(dilation, k - 1, &t) ||
            __builtin_add_overflow(v, t + output_padding + 1, &v)) {
          fail(path, "the output's size overflows 64 bits");
        }
        v -= 2 * padding;
        if (v <= 0) mismatch(path, mpath, type, "an input large enough for its padding", flow);
        return v;
      };
      in = make_shape({in[0], cout, side(in[2]), side(in[3])}, path);
      return std::make_unique<nn::ConvTranspose2d>(cin, cout, k, stride, padding, output_padding,
                                                   flag_or(s, path, "bias", true), dilation);
    }
    if (type == "BatchNorm1d") {
      only_keys(s, path, type, {"name", "type", "frozen", "num_features", "eps", "momentum"}, true);
      const std::int64_t c = positive_at(s, path, "num_features");
      floating(flow, path, mpath, type);
      if ((in.size() != 2 && in.size() != 3) || in[1] != c) {
        mismatch(path, mpath, type, "[N, " + std::to_string(c) + "] or [N, " + std::to_string(c) + ", L]", flow);
      }
      return std::make_unique<nn::BatchNorm2d>(c, positive_number_or(s, path, "eps", 1e-5),
                                               probability_or(s, path, "momentum", 0.1), "BatchNorm1d");
    }
    if (type == "GroupNorm") {
      only_keys(s, path, type, {"name", "type", "frozen", "num_groups", "num_channels", "eps", "affine"}, true);
      const std::int64_t groups = positive_at(s, path, "num_groups"), c = positive_at(s, path, "num_channels");
      if (c % groups != 0) {
        fail(field(path, "num_groups"), "num_channels " + std::to_string(c) + " must be divisible by num_groups " +
                                            std::to_string(groups));
      }
      floating(flow, path, mpath, type);
      if (in.size() < 2 || in[1] != c) mismatch(path, mpath, type, "[N, " + std::to_string(c) + ", ...]", flow);
      return std::make_unique<nn::GroupNorm>(groups, c, positive_number_or(s, path, "eps", 1e-5),
                                             flag_or(s, path, "affine", true));
    }
    if (type == "Reshape") {
      only_keys(s, path, type, {"name", "type", "shape"}, true);
      if (!s.contains("shape") || !s.at("shape").is_array() || s.at("shape").empty() ||
          s.at("shape").size() > nn::kMaxDims) {
        fail(field(path, "shape"), "expected a list of 1 to " + std::to_string(nn::kMaxDims) +
                                       " sizes (one of them may be -1)");
      }
      std::vector<std::int64_t> dims;
      std::int64_t known = 1;
      std::optional<std::size_t> infer;
      const json& list = s.at("shape");
      for (std::size_t i = 0; i < list.size(); ++i) {
        const std::string at = index(field(path, "shape"), i);
        if (list[i].is_number_integer() && list[i].get<std::int64_t>() == -1) {
          if (infer) fail(at, "only one size may be -1");
          infer = i;
          dims.push_back(-1);
          continue;
        }
        dims.push_back(positive(list[i], at));
        if (__builtin_mul_overflow(known, dims.back(), &known)) fail(at, "the shape overflows 64 bits");
      }
      const std::int64_t numel = in.numel();
      if (infer) {
        if (numel % known != 0) mismatch(path, mpath, type, "a size divisible by " + std::to_string(known), flow);
        dims[*infer] = numel / known;
      } else if (known != numel) {
        mismatch(path, mpath, type, std::to_string(known) + " elements", flow);
      }
      in = make_shape(dims, path);
      return std::make_unique<nn::Reshape>(std::move(dims));
    }
    if (type == "Permute") {
      only_keys(s, path, type, {"name", "type", "dims"}, true);
      if (!s.contains("dims") || !s.at("dims").is_array()) fail(field(path, "dims"), "expected a list of dimensions");
      const json& list = s.at("dims");
      if (list.size() != in.size()) {
        mismatch(path, mpath, type, std::to_string(list.size()) + " dimensions (dims)", flow);
      }
      std::vector<std::int64_t> dims, sizes;
      std::vector<bool> seen(in.size(), false);
      for (std::size_t i = 0; i < list.size(); ++i) {
        std::int64_t d = integer(list[i], index(field(path, "dims"), i));
        if (d < 0) d += static_cast<std::int64_t>(in.size());
        if (d < 0 || d >= static_cast<std::int64_t>(in.size()) || seen[static_cast<std::size_t>(d)]) {
          fail(field(path, "dims"), "expected a permutation of 0 to " + std::to_string(in.size() - 1));
        }
        seen[static_cast<std::size_t>(d)] = true;
        dims.push_back(d);
        sizes.push_back(in[static_cast<std::size_t>(d)]);
      }
      in = make_shape(sizes, path);
      return std::make_unique<nn::Permute>(std::move(dims));
    }
    if (type == "Transpose") {
      only_keys(s, path, type, {"name", "type", "dim0", "dim1"}, true);
      const auto rank = static_cast<std::int64_t>(in.size());
      std::int64_t d[2] = {0, 0};
      const char* keys[2] = {"dim0", "dim1"};
      for (int i = 0; i < 2; ++i) {
        if (!s.contains(keys[i])) fail(field(path, keys[i]), "is required (a dimension)");
        d[i] = integer(s.at(keys[i]), field(path, keys[i]));
        if (d[i] < 0) d[i] += rank;
        if (d[i] < 0 || d[i] >= rank) fail(field(path, keys[i]), "expected a dimension below " + std::to_string(rank));
      }
      std::vector<std::int64_t> sizes = in.to_vector();
      std::swap(sizes[static_cast<std::size_t>(d[0])], sizes[static_cast<std::size_t>(d[1])]);
      in = make_shape(sizes, path);
      return std::make_unique<nn::Transpose>(d[0], d[1]);
    }
    if (type == "Contiguous") {
      only_keys(s, path, type, {"name", "type"}, true);
      return std::make_unique<nn::Contiguous>();
    }
    if (type == "BatchNorm2d") {
      only_keys(s, path, type, {"name", "type", "frozen", "num_features", "eps", "momentum"}, true);
      const std::int64_t c = positive_at(s, path, "num_features");
      floating(flow, path, mpath, type);
      if (in.size() != 4 || in[1] != c) mismatch(path, mpath, type, "[N, " + std::to_string(c) + ", H, W]", flow);
      return std::make_unique<nn::BatchNorm2d>(c, positive_number_or(s, path, "eps", 1e-5),
                                               probability_or(s, path, "momentum", 0.1));
    }
    if (type == "LayerNorm") {
      only_keys(s, path, type, {"name", "type", "frozen", "normalized_shape", "eps"}, true);
      const std::int64_t c = positive_at(s, path, "normalized_shape");
      floating(flow, path, mpath, type);
      if (in.back() != c) mismatch(path, mpath, type, "[..., " + std::to_string(c) + "]", flow);
      return std::make_unique<nn::LayerNorm>(c, positive_number_or(s, path, "eps", 1e-5));
    }
    if (type == "RMSNorm") {
      only_keys(s, path, type, {"name", "type", "frozen", "normalized_shape", "eps", "elementwise_affine"}, true);
      const std::int64_t c = positive_at(s, path, "normalized_shape");
      floating(flow, path, mpath, type);
      if (in.back() != c) mismatch(path, mpath, type, "[..., " + std::to_string(c) + "]", flow);
      std::optional<double> eps;
      if (s.contains("eps") && !s.at("eps").is_null()) eps = positive_number_or(s, path, "eps", 1e-6);
      return std::make_unique<nn::TorchRMSNorm>(c, eps, flag_or(s, path, "elementwise_affine", true));
    }
    if (type == "MultiheadAttention") {
      only_keys(s, path, type, {"name", "type", "frozen", "embed_dim", "num_heads", "dropout", "bias", "batch_first"},
                true);
      const std::int64_t e = positive_at(s, path, "embed_dim"), heads = positive_at(s, path, "num_heads");
      if (e % heads != 0) {
        fail(field(path, "num_heads"), "expected a divisor of embed_dim " + std::to_string(e) + ", got " +
                                           std::to_string(heads));
      }
      floating(flow, path, mpath, type);
      const bool batch_first = flag_or(s, path, "batch_first", false);
      if (in.size() != 3 || in[2] != e) {
        mismatch(path, mpath, type, batch_first ? "[N, L, " + std::to_string(e) + "]" : "[L, N, " + std::to_string(e) + "]",
                 flow);
      }
      return std::make_unique<nn::MultiheadAttention>(e, heads, probability_or(s, path, "dropout", 0.0),
                                                      flag_or(s, path, "bias", true), batch_first);
    }
    if (type == "ClassToken") {
      only_keys(s, path, type, {"name", "type", "frozen", "embed_dim"}, true);
      const std::int64_t e = positive_at(s, path, "embed_dim");
      floating(flow, path, mpath, type);
      if (in.size() != 3 || in[2] != e) mismatch(path, mpath, type, "[N, L, " + std::to_string(e) + "]", flow);
      std::int64_t tokens = 0;
      if (__builtin_add_overflow(in[1], 1, &tokens)) fail(path, "too many tokens");
      in = make_shape({in[0], tokens, in[2]}, path);
      return std::make_unique<nn::ClassToken>(e);
    }
    if (type == "PositionEmbedding") {
      only_keys(s, path, type, {"name", "type", "frozen", "num_positions", "embed_dim"}, true);
      const std::int64_t n = positive_at(s, path, "num_positions"), e = positive_at(s, path, "embed_dim");
      floating(flow, path, mpath, type);
      if (in.size() != 3 || in[1] != n || in[2] != e) {
        mismatch(path, mpath, type, "[N, " + std::to_string(n) + ", " + std::to_string(e) + "]", flow);
      }
      return std::make_unique<nn::PositionEmbedding>(n, e);
    }
    if (type == "SelectToken") {
      only_keys(s, path, type, {"name", "type", "dim", "index"}, true);
      const auto rank = static_cast<std::int64_t>(in.size());
      std::int64_t dim = s.contains("dim") ? integer(s.at("dim"), field(path, "dim")) : 1;
      if (dim < 0) dim += rank;
      if (dim < 0 || dim >= rank || rank < 2) fail(field(path, "dim"), "expected a dimension below " + std::to_string(rank));
      const std::int64_t index = non_negative_or(s, path, "index", 0);
      if (index >= in[static_cast<std::size_t>(dim)]) {
        fail(field(path, "index"), "expected an index below " + std::to_string(in[static_cast<std::size_t>(dim)]) +
                                       " (the size of dimension " + std::to_string(dim) + ")");
      }
      std::vector<std::int64_t> out;
      for (std::int64_t i = 0; i < rank; ++i) {
        if (i != dim) out.push_back(in[static_cast<std::size_t>(i)]);
      }
      in = make_shape(out, path);
      return std::make_unique<nn::SelectToken>(dim, index);
    }
    if (type == "ReLU") {
      only_keys(s, path, type, {"name", "type", "inplace"}, true);
      floating(flow, path, mpath, type);
      return std::make_unique<nn::ReLU>(flag_or(s, path, "inplace", false));
    }
    if (type == "LeakyReLU") {
      only_keys(s, path, type, {"name", "type", "negative_slope", "inplace"}, true);
      floating(flow, path, mpath, type);
      const double slope = number_or(s, path, "negative_slope", 0.01);
      const bool inplace = flag_or(s, path, "inplace", false);
      // PyTorch refuses it too: the backward of the in-place op reads the sign from the output.
      if (inplace && slope <= 0) fail(field(path, "negative_slope"), "must be positive with inplace (PyTorch's rule)");
      return std::make_unique<nn::LeakyReLU>(slope, inplace);
    }
    if (type == "ReLU6" || type == "Hardtanh") {
      const bool relu6 = type == "ReLU6";
      if (relu6) only_keys(s, path, type, {"name", "type", "inplace"}, true);
      else only_keys(s, path, type, {"name", "type", "min_val", "max_val", "inplace"}, true);
      floating(flow, path, mpath, type);
      const double lo = relu6 ? 0.0 : number_or(s, path, "min_val", -1.0);
      const double hi = relu6 ? 6.0 : number_or(s, path, "max_val", 1.0);
      if (!(hi > lo)) fail(field(path, "max_val"), "must be greater than min_val");
      return std::make_unique<nn::Hardtanh>(lo, hi, flag_or(s, path, "inplace", false), type);
    }
    if (type == "SiLU") {
      only_keys(s, path, type, {"name", "type", "inplace"}, true);
      floating(flow, path, mpath, type);
      return std::make_unique<nn::SiLU>(flag_or(s, path, "inplace", false));
    }
    if (type == "Softmax") {
      only_keys(s, path, type, {"name", "type", "dim"}, true);
      floating(flow, path, mpath, type);
      if (!s.contains("dim")) fail(field(path, "dim"), "is required (the last dimension: -1)");
      const std::int64_t dim = integer(s.at("dim"), field(path, "dim"));
      const auto last = static_cast<std::int64_t>(in.size()) - 1;
      if (dim != -1 && dim != last) {
        fail(field(path, "dim"), "only the last dimension (-1 or " + std::to_string(last) + ") is supported, got " +
                                     std::to_string(dim));
      }
      return std::make_unique<nn::Softmax>();
    }
    if (type == "Sigmoid" || type == "Tanh" || type == "Identity") {
      only_keys(s, path, type, {"name", "type"}, true);
      if (type == "Identity") return std::make_unique<nn::Identity>();
      floating(flow, path, mpath, type);
      if (type == "Tanh") return std::make_unique<nn::Tanh>();
      return std::make_unique<nn::Sigmoid>();
    }
    if (type == "Scale") {
      only_keys(s, path, type, {"name", "type", "factor"}, true);
      floating(flow, path, mpath, type);
      if (!s.contains("factor")) fail(field(path, "factor"), "is required (x * factor; x / c is a factor of 1 / c)");
      const json& f = s.at("factor");
      if (!f.is_number() || !std::isfinite(f.get<double>())) {
        fail(field(path, "factor"), "expected a finite number, got " + kind_of(f));
      }
      return std::make_unique<nn::Scale>(f.get<double>());
    }
    if (type == "GELU") {
      only_keys(s, path, type, {"name", "type", "approximate"}, true);
      floating(flow, path, mpath, type);
      return std::make_unique<nn::GELU>(choice_or(s, path, "approximate", {"none", "tanh"}) == "tanh");
    }
    if (type == "Dropout") {
      only_keys(s, path, type, {"name", "type", "p"}, true);
      floating(flow, path, mpath, type);
      return std::make_unique<nn::Dropout>(probability_or(s, path, "p", 0.5));
    }
    if (type == "MaxPool2d") {
      only_keys(s, path, type, {"name", "type", "kernel_size", "stride", "padding"}, true);
      const Pool p = pool(s, path, type, flow, mpath);
      return std::make_unique<nn::MaxPool2d>(p.k, p.stride, p.padding);
    }
    if (type == "AvgPool2d") {
      only_keys(s, path, type, {"name", "type", "kernel_size", "stride", "padding", "count_include_pad"}, true);
      const Pool p = pool(s, path, type, flow, mpath);
      return std::make_unique<nn::AvgPool2d>(p.k, p.stride, p.padding, flag_or(s, path, "count_include_pad", true));
    }
    if (type == "AdaptiveAvgPool2d") {
      only_keys(s, path, type, {"name", "type", "output_size"}, true);
      // output_size: one side for both, or [h, w].
      std::int64_t oh = 1, ow = 1;
      if (s.contains("output_size")) {
        const json& size = s.at("output_size");
        const std::string at = field(path, "output_size");
        if (size.is_array()) {
          if (size.size() != 2) fail(at, "expected a size or [height, width], got " + kind_of(size));
          oh = positive(size[0], at + "[0]");
          ow = positive(size[1], at + "[1]");
        } else {
          oh = ow = positive(size, at);
        }
      }
      floating(flow, path, mpath, type);
      if (in.size() != 4) mismatch(path, mpath, type, "[N, C, H, W]", flow);
      in = make_shape({in[0], in[1], oh, ow}, path);
      return std::make_unique<nn::AdaptiveAvgPool2d>(oh, ow);
    }
    if (type == "Flatten") {
      only_keys(s, path, type, {"name", "type", "start_dim"}, true);
      const std::int64_t start = non_negative_or(s, path, "start_dim", 1);
      if (start >= static_cast<std::int64_t>(in.size())) {
        mismatch(path, mpath, type, "more than " + std::to_string(start) + " dimensions (start_dim)", flow);
      }
      nn::Shape out;
      std::int64_t rest = 1;
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (static_cast<std::int64_t>(i) < start) out.push_back(in[i]);
        else rest *= in[i];  // cannot overflow: the input's size was checked
      }
      out.push_back(rest);
      in = out;
      return std::make_unique<nn::Flatten>(start);
    }
    if (type == "Mean") {
      // x.mean(dim=(k, ..., -1)): the trailing dimensions from k, as a global average pool
      // written in a forward (torchvision-style `x.mean((2, 3))`).
      only_keys(s, path, type, {"name", "type", "dims", "keepdim"}, true);
      if (!s.contains("dims") || !s.at("dims").is_array() || s.at("dims").empty()) {
        fail(field(path, "dims"), "expected the dimensions averaged, e.g. [2, 3]");
      }
      floating(flow, path, mpath, type);
      const auto rank = static_cast<std::int64_t>(in.size());
      std::vector<std::int64_t> dims;
      for (std::size_t i = 0; i < s.at("dims").size(); ++i) {
        const json& d = s.at("dims")[i];
        const std::string at = field(path, "dims") + "[" + std::to_string(i) + "]";
        if (!d.is_number_integer()) fail(at, "expected a dimension, got " + kind_of(d));
        const std::int64_t v = d.get<std::int64_t>();
        if (v < -rank || v >= rank) mismatch(path, mpath, type, "a dimension " + std::to_string(v), flow);
        dims.push_back(v < 0 ? v + rank : v);
      }
      std::sort(dims.begin(), dims.end());
      const std::int64_t first = dims.front();
      for (std::size_t i = 0; i < dims.size(); ++i) {
        if (dims[i] != first + static_cast<std::int64_t>(i) || first < 1 || dims.back() != rank - 1) {
          fail(field(path, "dims"), "must be the trailing dimensions after the batch, e.g. [2, 3] of [N, C, H, W]");
        }
      }
      const bool keepdim = flag_or(s, path, "keepdim", false);
      nn::Shape out;
      for (std::int64_t i = 0; i < rank; ++i) {
        if (i < first) out.push_back(in[static_cast<std::size_t>(i)]);
        else if (keepdim) out.push_back(1);
      }
      in = out;
      return std::make_unique<nn::Mean>(first, keepdim);
    }
    if (type == "Embedding") {
      only_keys(s, path, type, {"name", "type", "frozen", "num_embeddings", "embedding_dim"}, true);
      const std::int64_t n = positive_at(s, path, "num_embeddings"), dim = positive_at(s, path, "embedding_dim");
      if (!flow.integer) mismatch(path, mpath, type, "int64 indices", flow);
      if (in.size() >= nn::kMaxDims) mismatch(path, mpath, type, "fewer dimensions", flow);
      std::vector<std::int64_t> dims = in.to_vector();
      dims.push_back(dim);
      in = make_shape(dims, path);
      flow.integer = false;
      return std::make_unique<nn::Embedding>(n, dim);
    }
    if (type == "Sequential") {
      only_keys(s, path, type, {"name", "type", "frozen", "layers", "expand", "inline"}, true);
      auto seq = std::make_unique<nn::Sequential>();
      Children children;
      sequence(list_at(s, path, "layers"), field(path, "layers"), mpath, flow, depth + 1, children);
      for (auto& [name, child] : children.list) seq->append(name, std::move(child));
      return seq;
    }
    if (type == "Residual") return residual(s, path, mpath, flow, depth);
    if (type == "Parallel") return parallel(s, path, mpath, flow, depth);
    fail(field(path, "type"),
         "unknown layer type \"" + type +
             "\"; valid types: Linear, Conv1d, Conv2d, ConvTranspose2d, BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, "
             "RMSNorm, ReLU, ReLU6, LeakyReLU, Hardtanh, SiLU, Sigmoid, Tanh, Scale, GELU, Softmax, Dropout, MaxPool2d, "
             "AvgPool2d, AdaptiveAvgPool2d, Flatten, Reshape, Permute, Transpose, Contiguous, Embedding, "
             "MultiheadAttention, ClassToken, PositionEmbedding, SelectToken, Identity, Sequential, Residual, Parallel");
  }

  /// The name of list item `i`: its "name", or its index as nn.Sequential names them.
  std::string child_name(const json& spec, const std::string& path, std::size_t i) const {
    if (!spec.is_object() || !spec.contains("name")) return std::to_string(i);
    const json& n = spec.at("name");
    if (!n.is_string() || n.get_ref<const std::string&>().empty() || n.get_ref<const std::string&>().size() > 128) {
      fail(field(path, "name"), "expected a module name (1 to 128 characters), got " + kind_of(n));
    }
    const std::string& s = n.get_ref<const std::string&>();
    for (char c : s) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) {
        fail(field(path, "name"), "\"" + s + "\" is not a module name: use letters, digits, '_' and '-' ('.' "
                                  "separates modules in paths)");
      }
    }
    return s;
  }

  static std::string sub(const std::string& mpath, const std::string& name) {
    return mpath.empty() ? name : mpath + "." + name;
  }

  /// Adds a child under a name no sibling has yet.
  template <class Ptr>
  void add_child(Siblings<Ptr>& out, std::string name, Ptr m, const std::string& path) const {
    if (!out.index.emplace(name, out.list.size()).second) {
      fail(path, "a second module named '" + name + "' in the same container");
    }
    out.list.emplace_back(std::move(name), std::move(m));
  }

  /// Inline code shares its enclosing module's names, so two containers may name a module
  /// alike: one module called twice in PyTorch, which only a module without parameters
  /// can be here.
  void claim(const std::string& mpath, const nn::Module& m, const std::string& path) {
    if (m.is_inline()) return;
    const bool params = m.parameter_tensors() > 0;
    const auto [at, fresh] = paths_.emplace(mpath, params);
    if (!fresh && (params || at->second)) {
      fail(path, "a second module named '" + mpath + "' (modules with parameters cannot share a name: that would "
                 "share their weights)");
    }
  }

  /// A Sequential's list: modules, and {"repeat": n, "layers": [...]} entries that add
  /// n copies inline. Unnamed modules are named by their index, as nn.Sequential does;
  /// an "expand": true Sequential hands its children to this list ("layer1.0", ...), so
  /// checkpoint_sequential splits between them.
  void sequence(const json& list, const std::string& path, const std::string& mpath, Flow& flow, int depth,
                Children& out) {
    if (depth > kMaxNesting) fail(path, "modules nest deeper than " + std::to_string(kMaxNesting));
    std::unordered_map<std::string, const json*> named;  // for {"use": name}
    for (std::size_t i = 0; i < list.size(); ++i) {
      const json& spec = list[i];
      const std::string ipath = index(path, i);
      if (spec.is_object() && spec.contains("use")) {
        // A module called again (`x = self.act(self.fc2(self.act(self.fc1(x))))`): a copy of
        // it under the same name, which for an activation is the same computation.
        only_keys(spec, ipath, "a reuse", {"use"});
        const json& u = spec.at("use");
        const auto it = u.is_string() ? named.find(u.get<std::string>()) : named.end();
        if (it == named.end()) {
          fail(field(ipath, "use"), "expected the name of a module declared earlier in this Sequential, got " +
                                        kind_of(u));
        }
        check_reusable(it->second->at("type").get<std::string>(), field(ipath, "use"), it->first);
        out.list.emplace_back(it->first, module(*it->second, ipath, mpath, it->first, flow, depth + 1));
        continue;
      }
      if (spec.is_object() && spec.contains("repeat")) {
        only_keys(spec, ipath, "a repeat", {"repeat", "layers"});
        const std::int64_t n = non_negative_or(spec, ipath, "repeat", 0);
        const json& body = list_at(spec, ipath, "layers");
        if (n > static_cast<std::int64_t>(kMaxModules)) {
          fail(field(ipath, "repeat"), "repeats more than " + std::to_string(kMaxModules) + " times");
        }
        for (std::size_t j = 0; j < body.size(); ++j) {
          if (body[j].is_object() && body[j].contains("name")) {
            fail(field(index(field(ipath, "layers"), j), "name"), "repeated modules are named by their index; "
                                                                  "remove the name");
          }
        }
        for (std::int64_t r = 0; r < n; ++r) {
          for (std::size_t j = 0; j < body.size(); ++j) {
            const std::string name = std::to_string(out.list.size());
            add_child(out, name, module(body[j], index(field(ipath, "layers"), j), mpath, name, flow, depth + 1),
                      ipath);
            claim(sub(mpath, name), *out.list.back().second, ipath);
          }
        }
        continue;
      }
      const std::string name = spec.is_object() && spec.contains("name") ? child_name(spec, ipath, i)
                                                                         : std::to_string(out.list.size());
      if (spec.is_object() && spec.value("type", json()) == "Sequential" && spec.contains("expand")) {
        if (!spec.at("expand").is_boolean()) fail(field(ipath, "expand"), "expected true or false, got " + kind_of(spec.at("expand")));
        if (spec.at("expand").get<bool>()) {
          only_keys(spec, ipath, "Sequential", {"name", "type", "layers", "expand"});
          count_module(ipath);
          Children inner;
          sequence(list_at(spec, ipath, "layers"), field(ipath, "layers"), sub(mpath, name), flow, depth + 1, inner);
          for (auto& [child, m] : inner.list) add_child(out, name + "." + child, std::move(m), ipath);
          continue;
        }
      }
      add_child(out, name, module(spec, ipath, mpath, name, flow, depth + 1), ipath);
      claim(sub(mpath, name), *out.list.back().second, ipath);
      if (spec.is_object() && spec.contains("name")) named.emplace(name, &spec);
    }
  }

  /// A module that can run twice: one without parameters or children, whose second run is
  /// the same whether it is the module again or a copy of it.
  void check_reusable(const std::string& type, const std::string& at, const std::string& name) const {
    static const std::set<std::string, std::less<>> kReusable = {
        "ReLU", "ReLU6", "Hardtanh", "LeakyReLU", "SiLU", "Sigmoid", "Tanh", "Scale", "GELU", "Softmax", "Dropout", "Identity"};
    if (!kReusable.contains(type)) {
      fail(at, "only an activation, Dropout or Identity can run twice; '" + name + "' is " + type);
    }
  }

  /// A child list inside Residual or Parallel: modules (named) or {"use": "relu"}, which
  /// runs a module declared earlier in the same container again.
  template <class Add, class Reuse>
  void parts(const json& list, const std::string& path, const std::string& mpath, Flow& flow, int depth,
             Siblings<nn::Module*>& declared, Add add, Reuse reuse) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      const json& spec = list[i];
      const std::string ipath = index(path, i);
      if (spec.is_object() && spec.contains("use")) {
        only_keys(spec, ipath, "a reuse", {"use"});
        const json& u = spec.at("use");
        nn::Module* const* used = u.is_string() ? declared.find(u.get<std::string>()) : nullptr;
        if (used == nullptr) {
          std::vector<std::string> names;
          for (const auto& d : declared.list) {
            if (names.size() == 20) {
              names.push_back("...");
              break;
            }
            names.push_back(d.first);
          }
          fail(field(ipath, "use"), "expected the name of a module declared earlier in this container (" +
                                        (names.empty() ? std::string("none yet") : join(names)) + "), got " + kind_of(u));
        }
        const std::string use_name = u.get<std::string>();
        nn::Module& again = **used;
        const std::string& t = again.type_name();
        check_reusable(t, field(ipath, "use"), use_name);
        if (t != "Identity") floating(flow, ipath, sub(mpath, use_name), t);
        reuse(again);
        flow.from = display(sub(mpath, use_name), t);
        continue;
      }
      const std::string name = child_name(spec, ipath, declared.list.size());
      if (declared.find(name) != nullptr) fail(ipath, "a second module named '" + name + "' in the same container");
      nn::Module& m = add(name, module(spec, ipath, mpath, name, flow, depth + 1));
      add_child(declared, name, &m, ipath);
      claim(sub(mpath, name), m, ipath);
    }
  }

  std::unique_ptr<nn::Module> residual(const json& s, const std::string& path, const std::string& mpath, Flow& flow,
                                       int depth) {
    only_keys(s, path, "Residual", {"name", "type", "frozen", "class", "body", "shortcut", "then", "inplace", "inline"},
              true);
    const std::string cls = class_name(s, path, "Residual");
    auto block = std::make_unique<nn::Residual>(cls, flag_or(s, path, "inplace", false));
    Siblings<nn::Module*> declared;
    using Part = nn::Residual::Part;
    const auto run = [&](const char* key, Part part, Flow& f) {
      parts(list_at(s, path, key, part == Part::Body), field(path, key), mpath, f, depth, declared,
            [&](std::string name, std::unique_ptr<nn::Module> m) -> nn::Module& {
              return block->add(part, std::move(name), std::move(m));
            },
            [&](nn::Module& m) { block->reuse(part, m); });
    };
    const Flow input = flow;
    run("body", Part::Body, flow);
    Flow identity = input;
    run("shortcut", Part::Shortcut, identity);
    if (!(flow.shape == identity.shape) || flow.integer || identity.integer) {
      fail(path, display(mpath, cls) + " adds its body's output " + flow.shape.str() + " from " + flow.from +
                     " to its shortcut's " + identity.shape.str() + " from " + identity.from +
                     ": the shapes must be equal");
    }
    run("then", Part::Then, flow);
    return block;
  }

  std::unique_ptr<nn::Module> parallel(const json& s, const std::string& path, const std::string& mpath, Flow& flow,
                                       int depth) {
    only_keys(s, path, "Parallel", {"name", "type", "frozen", "class", "branches", "join", "dim", "inline"}, true);
    const std::string cls = class_name(s, path, "Parallel");
    const std::string join = choice_or(s, path, "join", {"add", "concat", "mul", "matmul"});
    const bool concat = join == "concat", matmul = join == "matmul";
    const json& branches = list_at(s, path, "branches");
    if (branches.empty()) fail(field(path, "branches"), "expected at least one branch");
    if ((join == "mul" || matmul) && branches.size() != 2) {
      fail(field(path, "branches"), "join \"" + join + "\" takes exactly two branches, got " +
                                        std::to_string(branches.size()));
    }
    std::int64_t dim = non_negative_or(s, path, "dim", 1);
    if (dim >= static_cast<std::int64_t>(flow.shape.size()) && concat) {
      fail(field(path, "dim"), "expected a dimension of the branches' outputs (below " +
                                   std::to_string(flow.shape.size()) + "), got " + std::to_string(dim));
    }
    const auto kind = concat ? nn::Parallel::Join::Concat
                      : matmul ? nn::Parallel::Join::Matmul
                      : join == "mul" ? nn::Parallel::Join::Mul
                                      : nn::Parallel::Join::Add;
    auto block = std::make_unique<nn::Parallel>(cls, kind, dim);
    Siblings<nn::Module*> declared;
    std::optional<Flow> joined;
    for (std::size_t b = 0; b < branches.size(); ++b) {
      const std::string bpath = index(field(path, "branches"), b);
      if (!branches[b].is_array()) fail(bpath, "expected a branch (a list of modules), got " + kind_of(branches[b]));
      block->branch();
      Flow f = flow;
      parts(branches[b], bpath, mpath, f, depth, declared,
            [&](std::string name, std::unique_ptr<nn::Module> m) -> nn::Module& {
              return block->add(std::move(name), std::move(m));
            },
            [&](nn::Module& m) { block->reuse(m); });
      if (!joined) {
        joined = f;
        continue;
      }
      const std::size_t rank = f.shape.size();
      bool ok = rank == joined->shape.size() && f.integer == joined->integer && !f.integer;
      if (matmul) {
        // a [..., M, K] @ b [..., K, N]: the same leading sizes, K shared.
        ok = ok && rank >= 2 && rank <= 4 && f.shape[rank - 2] == joined->shape[rank - 1];
        for (std::size_t d = 0; ok && d + 2 < rank; ++d) ok = f.shape[d] == joined->shape[d];
      }
      for (std::size_t d = 0; ok && !matmul && d < rank; ++d) {
        ok = f.shape[d] == joined->shape[d] || (concat && static_cast<std::int64_t>(d) == dim);
      }
      if (!ok) {
        const std::string verb = concat ? " concatenates" : matmul ? " multiplies (matmul)" : join == "mul" ? " multiplies" : " adds";
        const std::string rule = concat ? ": all but dimension " + std::to_string(dim) + " must be equal"
                                 : matmul ? ": expected [..., M, K] @ [..., K, N] with equal leading sizes (2 to 4 dimensions)"
                                          : ": the shapes must be equal";
        fail(bpath, display(mpath, cls) + verb + " branch " + std::to_string(b) + "'s output " + f.shape.str() +
                        " from " + f.from + " to " + joined->shape.str() + " from " + joined->from + rule);
      }
      if (concat) {
        std::vector<std::int64_t> dims = joined->shape.to_vector();
        if (__builtin_add_overflow(dims[static_cast<std::size_t>(dim)], f.shape[static_cast<std::size_t>(dim)],
                                   &dims[static_cast<std::size_t>(dim)])) {
          fail(bpath, "the concatenation overflows 64 bits");
        }
        joined->shape = make_shape(dims, bpath);
      }
      if (matmul) {
        std::vector<std::int64_t> dims = joined->shape.to_vector();
        dims[rank - 1] = f.shape[rank - 1];
        joined->shape = make_shape(dims, bpath);
      }
    }
    flow.shape = joined->shape;  // each branch's shape and each concatenation were checked
    flow.integer = joined->integer;
    return block;
  }

  std::string class_name(const json& s, const std::string& path, const char* fallback) const {
    if (!s.contains("class")) return fallback;
    const json& c = s.at("class");
    if (!c.is_string() || c.get_ref<const std::string&>().empty() || c.get_ref<const std::string&>().size() > 64) {
      fail(field(path, "class"), "expected a class name (1 to 64 characters), got " + kind_of(c));
    }
    return printable(c.get_ref<const std::string&>());
  }

  // --- the model ---------------------------------------------------------------------------------

  nn::ModelSource::Built build() {
    const json& root = doc_.root;
    nn::ModelInfo info;
    info.description = doc_.description;
    info.batch = *size_value("batch");

    // The input.
    const json& input = root.at("input");
    only_keys(input, "input", "the input", {"shape", "dtype", "high", "requires_grad"});
    if (!input.contains("shape")) fail("input.shape", "is required (a list of sizes, e.g. [\"batch\", 3, 224, 224])");
    info.input_shape = shape(input.at("shape"), "input.shape");
    const bool tokens = choice_or(input, "input", "dtype", {"float", "int64"}) == "int64";
    if (tokens) {
      info.input_dtype = nn::DType::I64;
      info.input_high = positive_at(input, "input", "high");
    } else if (input.contains("high")) {
      fail("input.high", "applies to int64 inputs only (the range token ids are drawn from)");
    }
    if (input.contains("requires_grad")) {
      const json& rg = input.at("requires_grad");
      if (!rg.is_boolean()) fail("input.requires_grad", "expected true or false, got " + kind_of(rg));
      if (rg.get<bool>() && tokens) fail("input.requires_grad", "int64 token ids cannot require grad");
      info.input_requires_grad = rg.get<bool>();
    }
    Flow flow{info.input_shape, tokens, "the input"};

    // The layers, or the operators.
    auto body = std::make_unique<nn::Sequential>();
    if (root.contains("graph")) {
      graph_body(*body, info, flow);
    } else {
      Children children;
      sequence(list_at(root, "", "layers"), "layers", "", flow, 0, children);
      if (children.list.empty()) fail("layers", "expected at least one module");
      for (auto& [name, child] : children.list) body->append(name, std::move(child));
    }
    if (doc_.checkpoint_modules) {
      // apply_activation_checkpointing by name, over the marks the layers carry.
      body->set_path("");
      try {
        nn::mark_checkpointed(*body, *doc_.checkpoint_modules, nn::CheckpointMode::NonReentrant);
      } catch (const Error& e) {
        fail("checkpoint_modules", e.what());
      }
    }

    // The loss.
    const json& loss = root.at("loss");
    only_keys(loss, "loss", "the loss", {"type", "target", "classes"});
    const std::string kind =
        choice_or(loss, "loss", "type", {"mse", "cross_entropy", "sum", "bce_with_logits", "none"});
    if (flow.integer) fail("loss", "the model's output from " + flow.from + " is int64; a loss needs floating outputs");
    if (kind == "sum") {
      if (loss.contains("target") || loss.contains("classes")) fail("loss", "\"sum\" takes no target and no classes");
      info.loss = nn::LossKind::Sum;
      info.target_shape = nn::Shape{1};
    } else if (kind == "none") {
      if (loss.contains("target") || loss.contains("classes")) fail("loss", "\"none\" takes no target and no classes");
      if (flow.shape.numel() != 1) {
        fail("loss", "\"none\" uses the model's output as the loss, so it must be a scalar; the output from " +
                         flow.from + " is " + flow.shape.str());
      }
      info.loss = nn::LossKind::None;
      info.target_shape = nn::Shape{1};
    } else if (kind == "mse" || kind == "bce_with_logits") {
      if (loss.contains("classes")) fail("loss.classes", "applies to cross_entropy only");
      info.loss = kind == "mse" ? nn::LossKind::MSE : nn::LossKind::BCEWithLogits;
      info.target_shape = loss.contains("target") ? shape(loss.at("target"), "loss.target") : flow.shape;
      if (!(info.target_shape == flow.shape)) {
        fail("loss.target", std::string(kind == "mse" ? "mse_loss" : "binary_cross_entropy_with_logits") +
                                " compares the output " + flow.shape.str() + " from " + flow.from +
                                " with a target " + info.target_shape.str() + ": the shapes must be equal");
      }
    } else {
      info.loss = nn::LossKind::CrossEntropy;
      info.target_dtype = nn::DType::I64;
      info.target_classes = positive_at(loss, "loss", "classes");
      nn::Shape expected;
      for (std::size_t d = 0; d + 1 < flow.shape.size(); ++d) expected.push_back(flow.shape[d]);
      info.target_shape = loss.contains("target") ? shape(loss.at("target"), "loss.target") : expected;
      if (flow.shape.size() < 2 || flow.shape.back() != info.target_classes || !(info.target_shape == expected)) {
        fail("loss", "cross_entropy takes logits [..., " + std::to_string(info.target_classes) + "] and class targets " +
                         "[...]; the output from " + flow.from + " is " + flow.shape.str() + " and the target " +
                         info.target_shape.str());
      }
    }
    return {std::move(info), std::move(body)};
  }

 private:
  /// An operator graph (op_model.hpp): one module per recorded module call under an inline
  /// root; checkpointed by module path, never split by checkpoint_sequential.
  void graph_body(nn::Sequential& body, nn::ModelInfo& info, Flow& flow) {
    std::shared_ptr<const nn::OpGraph> graph;
    read_routing(doc_.root.at("graph"));
    if (doc_.root.contains("expert_parallel")) read_expert_rows();
    try {
      graph = detail::read_op_graph(doc_.root.at("graph"),
                                    [this](const json& v, const std::string& p) { return graph_shape(v, p); });
      body.append("", nn::op_graph_module(graph));
    } catch (const Error& e) {
      throw Error(doc_.origin + ": " + e.what());
    }
    const auto& first = graph->tensors[static_cast<std::size_t>(graph->inputs.front())];
    const bool tokens = info.input_dtype == nn::DType::I64;
    if (!(first.shape == info.input_shape) || (tokens != (!first.follows_run_dtype && first.dtype == nn::DType::I64))) {
      const std::string_view kind = first.follows_run_dtype ? "floating" : nn::dtype_name(first.dtype);
      fail("input", fmt::format("the graph's first input is {} {}; \"input\" says {} {}", first.shape.str(), kind,
                                info.input_shape.str(), tokens ? "int64" : "floating"));
    }
    const auto& out = graph->tensors[static_cast<std::size_t>(graph->output)];
    flow.shape = out.shape;
    flow.integer = !out.follows_run_dtype && !nn::is_floating(out.dtype);
    flow.from = "the graph's output";
    info.sequential_checkpointing = false;
    info.operators = graph->ops.size();
    info.module_calls = graph->calls.size();
    for (const auto& op : graph->ops) info.operator_names.push_back(op.op);
    std::sort(info.operator_names.begin(), info.operator_names.end());
    info.operator_names.erase(std::unique(info.operator_names.begin(), info.operator_names.end()),
                              info.operator_names.end());
    info.recorded_with = graph->recorded_with;
    info.assumed = graph->assumed;
    if (doc_.root.contains("compiled")) {
      try {
        info.compiled = detail::read_compiled(doc_.root.at("compiled"), "compiled",
                                              [this](const json& v, const std::string& p) { return integer(v, p); });
      } catch (const Error& e) {
        throw Error(doc_.origin + ": " + e.what());
      }
    }
    if (routing_) info.assumed.push_back(routing_->describe());
    if (doc_.root.contains("expert_parallel")) {
      read_expert_parallel(*graph, info);
      info.assumed.push_back(ep_note_);
    }
  }

  /// expert_parallel's rows: "received" (what a GPU's experts receive under an even routing,
  /// its tokens x top_k: a formula), "top_k", "local_experts"; the graph's dimension ep_rows is
  /// expert_skew times that on the GPU shown, at most every pair that can reach its experts.
  void read_expert_rows() {
    const std::string path = "expert_parallel";
    const json& e = doc_.root.at(path);
    if (!e.is_object()) {
      fail(path, "expected {\"ranks\": N, \"modules\": [...], \"fsdp\": [...], \"received\": \"k*batch*seq\", "
                 "\"top_k\": K, \"local_experts\": E}, got " + kind_of(e));
    }
    for (const auto& [key, value] : e.items()) {
      static const char* const kKeys[] = {"ranks", "modules", "fsdp", "received", "top_k", "local_experts"};
      if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
        fail(path, "unknown key '" + printable(key) + "'; valid keys: ranks, modules, fsdp, received, top_k, local_experts");
      }
    }
    if (!e.contains("ranks") || !e.at("ranks").is_number_integer() || e.at("ranks").get<std::int64_t>() < 2 ||
        e.at("ranks").get<std::int64_t>() > kMaxExperts) {
      fail(field(path, "ranks"), "expected the expert-parallel ranks, 2 to " + std::to_string(kMaxExperts));
    }
    const std::int64_t ranks = e.at("ranks").get<std::int64_t>();
    const std::int64_t received = positive_at(e, path, "received");
    const std::int64_t top_k = positive_at(e, path, "top_k");
    const std::int64_t local = positive_at(e, path, "local_experts");
    if (top_k > kMaxExperts || local > kMaxExperts) fail(path, "top_k and local_experts: at most " + std::to_string(kMaxExperts));
    if (received % top_k != 0) fail(field(path, "received"), "is tokens x top_k: a multiple of top_k");
    if (!doc_.defaults.size("expert_skew")) {
      fail("options", "a model under expert parallel declares the option expert_skew (its default, 1: even)");
    }
    const std::int64_t skew = size_value("expert_skew").value_or(1);
    // The most a GPU's experts can receive: each token of each GPU paired with at most
    // min(top_k, local_experts) of them.
    const std::int64_t tokens = received / top_k;
    if (tokens > INT64_MAX / ranks / std::min(top_k, local)) fail(field(path, "received"), "overflows 64 bits");
    const std::int64_t most = tokens * ranks * std::min(top_k, local);
    const bool capped = received > most / skew;
    ep_rows_ = capped ? most : received * skew;
    ep_note_ = skew == 1
                   ? fmt::format("expert parallel: each GPU's experts receive {} rows, as many as it sends (an even "
                                 "routing; --model-options expert_skew=S gives the GPU shown S times that)", *ep_rows_)
                   : capped ? fmt::format("expert parallel, skewed: the GPU shown receives {} rows, the most it can (its "
                                          "even share {} x expert_skew={}, capped at every token of the {} GPUs paired "
                                          "with min(top_k, its {} experts))", *ep_rows_, received, skew, ranks, local)
                            : fmt::format("expert parallel, skewed: the GPU shown receives {} rows, expert_skew={} times "
                                          "its even share", *ep_rows_, skew);
  }

  /// "expert_parallel": {"ranks": N, "modules": [the experts modules' paths], ...}: the graph is
  /// one rank's of transformers' expert parallel (vramscope.export --expert-parallel N).
  void read_expert_parallel(const nn::OpGraph& graph, nn::ModelInfo& info) const {
    const std::string path = "expert_parallel";
    const json& e = doc_.root.at(path);
    if (!e.contains("modules") || !e.at("modules").is_array() || e.at("modules").empty()) {
      fail(field(path, "modules"), "expected the experts modules' paths, a non-empty list");
    }
    std::unordered_set<std::string> calls;
    for (const auto& call : graph.calls) calls.insert(call.module);
    // A module path the graph calls, or the failure at `at`.
    const auto module_at = [&](const json& m, const std::string& at) -> const std::string& {
      if (!m.is_string() || calls.count(m.get_ref<const std::string&>()) == 0) {
        fail(at, (m.is_string() ? "'" + printable(m.get<std::string>()) + "'" : kind_of(m)) +
                     " is no module the graph calls");
      }
      return m.get_ref<const std::string&>();
    };
    info.expert_parallel = e.at("ranks").get<std::size_t>();
    for (const json& m : e.at("modules")) module_at(m, field(path, "modules"));
    // "fsdp": the engine's fully_shard calls in order, [{"modules": [...], "reshard_after_forward":
    // bool, "mesh": "fsdp" | "efsdp"}, ...], the root ("") alone and last.
    const std::string groups = field(path, "fsdp");
    if (!e.contains("fsdp") || !e.at("fsdp").is_array() || e.at("fsdp").empty()) {
      fail(groups, "expected the engine's fully_shard calls in order, a non-empty list ending with the root's");
    }
    std::unordered_set<std::string> grouped;
    for (std::size_t i = 0; i < e.at("fsdp").size(); ++i) {
      const json& g = e.at("fsdp")[i];
      const std::string at = groups + "[" + std::to_string(i) + "]";
      if (!g.is_object() || !g.contains("modules") || !g.at("modules").is_array() || g.at("modules").empty() ||
          !g.contains("reshard_after_forward") || !g.at("reshard_after_forward").is_boolean() || !g.contains("mesh") ||
          !g.at("mesh").is_string() || (g.at("mesh") != "fsdp" && g.at("mesh") != "efsdp") || g.size() != 3) {
        fail(at, "expected {\"modules\": [paths], \"reshard_after_forward\": true|false, \"mesh\": \"fsdp\"|\"efsdp\"}");
      }
      nn::ModelInfo::ShardGroup group;
      group.reshard_after_forward = g.at("reshard_after_forward").get<bool>();
      group.experts = g.at("mesh") == "efsdp";
      for (const json& m : g.at("modules")) {
        const std::string& module = module_at(m, at);
        if (!grouped.insert(module).second) fail(at, "'" + printable(module) + "' is in two groups");
        group.modules.push_back(module);
      }
      const bool root = group.modules == std::vector<std::string>{""};
      if (root != (i + 1 == e.at("fsdp").size())) fail(at, "the root (\"\") is the last call's, alone");
      info.fsdp_groups.push_back(std::move(group));
    }
  }

  static constexpr std::string_view kExpertRows = "expert_rows_";
  static constexpr std::string_view kEpRows = "ep_rows";
  static constexpr std::int64_t kMaxExperts = 1 << 16;

  const ModelFile::Doc& doc_;
  const nn::ModelOptions& given_;
  std::optional<detail::ExpertRouting> routing_;
  std::optional<std::int64_t> ep_rows_;
  std::string ep_note_;  ///< the rows the GPU shown receives, for the tables' assumptions
  std::size_t modules_ = 0;
  std::unordered_map<std::string, bool> paths_;  ///< module path -> it has parameters
};

constexpr const char* kLayersOrGraph =
    "a model has either \"layers\" (modules) or \"graph\" (operators, what vramscope.export records), not both, "
    "and not neither";

/// The document's head: format, version, name, description, options.
std::unique_ptr<ModelFile::Doc> read_head(json root, std::string origin) {
  auto doc = std::make_unique<ModelFile::Doc>();
  doc->origin = std::move(origin);
  const auto fail = [&](const std::string& path, const std::string& what) {
    throw Error(doc->origin + ": " + (path.empty() ? "" : path + ": ") + what);
  };
  if (!root.is_object()) fail("", "expected a model (a JSON object), got " + kind_of(root));
  for (const auto& [key, value] : root.items()) {
    static const char* const kKeys[] = {"format",  "version", "name", "description", "source",
                                        "options", "input",   "loss", "layers",      "graph",
                                        "checkpoint_modules", "compiled", "expert_parallel", "comment"};
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
      fail("", "unknown key '" + key + "'; valid keys: format, version, name, description, source, options, "
               "input, loss, layers, graph, checkpoint_modules, compiled, expert_parallel, comment");
    }
  }
  if (root.value("format", json()) != "vramscope-model") {
    fail("format", "expected \"vramscope-model\"" +
                       (root.contains("format") ? ", got " + kind_of(root.at("format")) : std::string(" (it is missing)")));
  }
  if (!root.contains("version") || !root.at("version").is_number_integer()) {
    fail("version", "expected the format version, an integer (this build reads " + std::to_string(kModelFileVersion) + ")");
  }
  if (root.at("version").get<std::int64_t>() != kModelFileVersion) {
    fail("version", "this build reads version " + std::to_string(kModelFileVersion) + ", the file is version " +
                        root.at("version").dump());
  }
  if (root.contains("checkpoint_modules")) {
    const json& list = root.at("checkpoint_modules");
    if (!list.is_array() || list.size() > kMaxModules) {
      fail("checkpoint_modules", "expected a list of module paths like [\"layer1.0\", \"layer3.5\"], got " + kind_of(list));
    }
    doc->checkpoint_modules.emplace();
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (!list[i].is_string() || list[i].get_ref<const std::string&>().size() > 1000) {
        fail("checkpoint_modules[" + std::to_string(i) + "]", "expected a module path (a string), got " + kind_of(list[i]));
      }
      doc->checkpoint_modules->push_back(list[i].get<std::string>());
    }
  }
  for (const char* key : {"name", "description", "source"}) {
    if (root.contains(key) && (!root.at(key).is_string() || root.at(key).get_ref<const std::string&>().size() > 1000)) {
      fail(key, "expected a string of at most 1000 characters, got " + kind_of(root.at(key)));
    }
  }
  if (!root.contains("name") || root.at("name").get_ref<const std::string&>().empty()) fail("name", "is required");
  // Names are printed in tables and headers: a control character in a file is data, shown
  // as \xNN, never sent to the terminal.
  doc->name = printable(root.at("name").get_ref<const std::string&>());
  doc->description = printable(root.value("description", std::string()));
  if (root.contains("layers") == root.contains("graph")) fail("", kLayersOrGraph);
  if (root.contains("expert_parallel") && !root.contains("graph")) {
    fail("expert_parallel", "is one rank's recording of an operator graph: it goes with \"graph\" (vramscope.export "
                            "--expert-parallel)");
  }
  if (root.contains("compiled") && !root.contains("graph")) {
    fail("compiled", "is the operator-level step torch.compile partitions: it goes with \"graph\" (vramscope.export --compile)");
  }
  for (const char* key : {"input", "loss"}) {
    if (!root.contains(key) || !root.at(key).is_object()) {
      fail(key, root.contains(key) ? "expected an object, got " + kind_of(root.at(key)) : "is required");
    }
  }

  // The options: every key a user may set, with its default.
  if (!root.contains("options") || !root.at("options").is_object()) {
    fail("options", "is required: the model's options with their defaults, at least {\"batch\": N}");
  }
  std::string text;
  for (const auto& [key, value] : root.at("options").items()) {
    const auto& valid = nn::ModelOptions::keys();
    if (std::find(valid.begin(), valid.end(), key) == valid.end()) {
      fail("options." + key, "is not an option vramscope can set; valid options: " + join(valid));
    }
    std::string v;
    if (key == "inplace") {
      if (!value.is_boolean()) fail("options.inplace", "expected true or false, got " + kind_of(value));
      v.assign(1, value.get<bool>() ? '1' : '0');  // not `= "1"`: GCC 12's false -Wrestrict (bug 105329)
    } else if (key == "dropout") {
      if (!value.is_number()) fail("options.dropout", "expected a probability in [0, 1), got " + kind_of(value));
      std::ostringstream os;
      os.precision(17);
      os << value.get<double>();
      v = os.str();
    } else {
      if (!value.is_number_integer() || value.get<std::int64_t>() <= 0 ||
          (value.is_number_unsigned() && value.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))) {
        fail("options." + key, "expected a positive integer, got " + kind_of(value));
      }
      v = value.dump();
    }
    doc->option_keys.push_back(key);
    text += (text.empty() ? "" : ",") + key + "=" + v;
  }
  try {
    doc->defaults = nn::ModelOptions::parse(text);
  } catch (const Error& e) {
    fail("options", e.what());
  }
  if (!doc->defaults.batch) fail("options.batch", "is required: the default batch size");
  // Keep option_keys in ModelOptions::keys() order, as messages list them.
  std::vector<std::string> ordered;
  for (const std::string& k : nn::ModelOptions::keys()) {
    if (std::find(doc->option_keys.begin(), doc->option_keys.end(), k) != doc->option_keys.end()) ordered.push_back(k);
  }
  doc->option_keys = std::move(ordered);
  doc->root = std::move(root);
  return doc;
}

}  // namespace

ModelFile::ModelFile(std::unique_ptr<Doc> doc) : doc_(std::move(doc)) {}
ModelFile::~ModelFile() = default;

const std::string& ModelFile::name() const noexcept { return doc_->name; }
const std::vector<std::string>& ModelFile::option_keys() const noexcept { return doc_->option_keys; }
const std::string& ModelFile::origin() const noexcept { return doc_->origin; }

nn::ModelSource::Built ModelFile::make(const nn::ModelOptions& options) const {
  return Builder(*doc_, options).build();
}

std::shared_ptr<const ModelFile> ModelFile::parse(std::string_view json_text, std::string origin) {
  if (json_text.size() > kMaxModelFileBytes) {
    throw Error(origin + ": " + std::to_string(json_text.size()) + " bytes; a model file may have at most " +
                std::to_string(kMaxModelFileBytes >> 20) + " MiB");
  }
  json root;
  try {
    // Bounded far above kMaxNesting's containers (two JSON levels each), which the reader then
    // refuses by name: this bound only keeps a hostile file from costing more than its size.
    root = detail::parse_bounded(json_text, origin, kMaxJsonDepth);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 3, column 5: ..." -> from "parse error".
    std::string what = e.what();
    if (const auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
    throw Error(origin + ": not valid JSON: " + what);
  }
  auto file = std::make_shared<const ModelFile>(read_head(std::move(root), std::move(origin)));
  (void)file->build();  // the whole file, checked at its default options
  return file;
}

std::string ModelFile::with_checkpoint_modules(const std::optional<std::vector<std::string>>& paths) const {
  json root = doc_->root;
  if (paths) root["checkpoint_modules"] = *paths;
  return root.dump(2) + "\n";
}

std::shared_ptr<const ModelFile> ModelFile::load(const std::string& path) {
  check_input_file(path, "the model file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open the model file (does it exist, and may it be read?)");
  std::string text;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxModelFileBytes) {
      throw Error(path + ": larger than " + std::to_string(kMaxModelFileBytes >> 20) +
                  " MiB; a model file may have at most that");
    }
  }
  if (in.bad()) throw Error(path + ": cannot read the model file");
  return parse(text, path);
}

}  // namespace mem::models
