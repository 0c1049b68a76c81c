// selective_policy.cpp — which operators a selective checkpoint keeps (checkpoint.hpp):
// names as PyTorch's recording writes them, and the groups people save.
#include <algorithm>
#include <array>
#include <charconv>
#include <optional>
#include <system_error>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/checkpoint.hpp"

namespace mem::nn {

namespace {

/// The groups, by what people save under selective checkpointing. torchtitan's
/// activation_checkpoint.py (_save_list: mm and the SDPA kernels), the recommendation of
/// create_selective_checkpoint_contexts' docstring (matmuls), and convolutions for CNNs.
struct Group {
  std::string_view name;
  std::vector<std::string_view> ops;
};
const std::array<Group, 3>& groups() {
  static const std::array<Group, 3> table{{
      {"matmuls", {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"}},
      {"attention",
       {"aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
        "aten._flash_attention_forward", "aten._efficient_attention_forward"}},
      {"convolutions", {"aten.convolution", "aten.cudnn_convolution", "aten.convolution_overrideable"}},
  }};
  return table;
}

/// "mm" -> "aten.mm"; names with a namespace stay.
std::string qualified(std::string_view name) {
  return name.find('.') == std::string_view::npos ? "aten." + std::string(name) : std::string(name);
}

bool name_char(char c) noexcept {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.';
}

}  // namespace

std::vector<std::string> SelectivePolicy::group(std::string_view name) {
  for (const Group& g : groups()) {
    if (g.name == name) return {g.ops.begin(), g.ops.end()};
  }
  return {};
}

namespace {

/// "aten.mm.default" names the overload; "aten.mm" every overload of the operator (its
/// packet), so "aten.mm" must not take "aten.mm_out.default".
bool names(std::string_view op, std::string_view name) noexcept {
  if (op == name) return true;
  return op.size() > name.size() && op.starts_with(name) && op[name.size()] == '.' &&
         op.find('.', name.size() + 1) == std::string_view::npos && std::count(name.begin(), name.end(), '.') == 1;
}

/// An entry's operator name and call index ("aten.mm@2"); no index: every call.
std::pair<std::string_view, std::optional<std::size_t>> split_call(std::string_view entry) noexcept {
  const std::size_t at = entry.find('@');
  if (at == std::string_view::npos) return {entry, std::nullopt};
  std::size_t call = 0;
  std::from_chars(entry.data() + at + 1, entry.data() + entry.size(), call);
  return {entry.substr(0, at), call};
}

/// '*' matches any run of characters, everything else itself.
bool glob(std::string_view pattern, std::string_view text) noexcept {
  std::size_t p = 0, t = 0, star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& s : names) out += (out.empty() ? "" : ",") + s;
  return out;
}

/// One scope's operators: names and groups, comma-separated, each with an optional "@CALL".
std::vector<std::string> parse_ops(std::string_view text, std::string_view whole) {
  std::vector<std::string> save;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    std::string_view entry = text.substr(start, comma - start);
    while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
    while (!entry.empty() && entry.back() == ' ') entry.remove_suffix(1);
    const std::size_t at = entry.find('@');
    const std::string_view name = entry.substr(0, at);
    const std::string_view call = at == std::string_view::npos ? std::string_view{} : entry.substr(at + 1);
    if (name.empty()) {
      throw Error("selective checkpointing: an empty operator name in '" + std::string(whole) +
                  "'; give operators (mm, aten.addmm, aten.convolution.default) or the groups matmuls, attention, "
                  "convolutions, separated by commas");
    }
    if (!std::all_of(name.begin(), name.end(), name_char) || name.front() == '.' || name.back() == '.' ||
        std::count(name.begin(), name.end(), '.') > 2 || name.find("..") != std::string_view::npos) {
      throw Error("selective checkpointing: '" + std::string(name) +
                  "' is no operator name; write them as PyTorch does (aten.mm.default, aten.mm or mm)");
    }
    std::vector<std::string> ops = SelectivePolicy::group(name);
    if (at != std::string_view::npos) {
      std::size_t index = 0;
      const auto [end, ec] = std::from_chars(call.data(), call.data() + call.size(), index);
      if (call.empty() || ec != std::errc{} || end != call.data() + call.size() || index > 1'000'000'000) {
        throw Error("selective checkpointing: '" + std::string(entry) +
                    "' has no call index after '@'; write the call counted from 0 in the module's forward "
                    "(aten.mm.default@2 keeps the third)");
      }
      if (!ops.empty()) {
        throw Error("selective checkpointing: '" + std::string(entry) + "' gives a call of the group " +
                    std::string(name) + "; a call index belongs to one operator (aten.mm.default@2)");
      }
    }
    if (ops.empty()) {
      ops.push_back(qualified(name));
      if (at != std::string_view::npos) ops.back().append(1, '@').append(call);
    }
    for (std::string& op : ops) {
      if (std::find(save.begin(), save.end(), op) == save.end()) save.push_back(std::move(op));
    }
    start = comma + 1;
  }
  return save;
}

}  // namespace

bool SelectivePolicy::saves(std::string_view op) const noexcept {
  const auto any = [&](const std::vector<std::string>& list) {
    return std::any_of(list.begin(), list.end(), [&](const std::string& s) { return names(op, split_call(s).first); });
  };
  return any(save) || std::any_of(scopes.begin(), scopes.end(), [&](const Scope& s) { return any(s.save); });
}

bool SelectivePolicy::keeps_call(std::string_view op, CallCounts& calls) const {
  bool kept = false;
  std::vector<std::size_t> counted;  // the counters this call advances (each once)
  for (const std::string& s : save) {
    const auto [name, call] = split_call(s);
    if (!names(op, name)) continue;
    if (!call) {
      kept = true;
      continue;
    }
    auto it = std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == name; });
    if (it == calls.end()) it = calls.insert(calls.end(), {std::string(name), 0});
    const auto index = static_cast<std::size_t>(it - calls.begin());
    if (it->second == *call) kept = true;
    if (std::find(counted.begin(), counted.end(), index) == counted.end()) counted.push_back(index);
  }
  for (const std::size_t index : counted) ++calls[index].second;
  return kept;
}

const std::vector<std::string>* SelectivePolicy::for_module(std::string_view path, std::string_view type) const noexcept {
  for (const Scope& s : scopes) {
    if (glob(s.modules, path) || glob(s.modules, type)) return &s.save;
  }
  return save.empty() ? nullptr : &save;
}

bool SelectivePolicy::empty() const noexcept {
  return save.empty() && std::all_of(scopes.begin(), scopes.end(), [](const Scope& s) { return s.save.empty(); });
}

std::string SelectivePolicy::str() const {
  std::string out = joined(save);
  for (const Scope& s : scopes) out += (out.empty() ? "" : ";") + s.modules + "=" + joined(s.save);
  return out;
}

SelectivePolicy SelectivePolicy::parse(std::string_view text) {
  SelectivePolicy policy;
  bool unscoped = false;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t semicolon = std::min(text.find(';', start), text.size());
    const std::string_view part = text.substr(start, semicolon - start);
    const std::size_t eq = part.find('=');
    if (eq == std::string_view::npos) {
      if (unscoped) {
        throw Error("selective checkpointing: '" + std::string(text) +
                    "' gives two lists for every module; scope all but one as MODULES=OPS");
      }
      unscoped = true;
      policy.save = parse_ops(part, text);
    } else {
      std::string_view modules = part.substr(0, eq);
      while (!modules.empty() && modules.front() == ' ') modules.remove_prefix(1);
      while (!modules.empty() && modules.back() == ' ') modules.remove_suffix(1);
      if (modules.empty() || !std::all_of(modules.begin(), modules.end(), [](char c) { return name_char(c) || c == '*'; })) {
        throw Error("selective checkpointing: '" + std::string(part) +
                    "' names no module before '='; give a module's path or type name, '*' for any characters "
                    "(layers.*=matmuls)");
      }
      policy.scopes.push_back({std::string(modules), parse_ops(part.substr(eq + 1), text)});
    }
    start = semicolon + 1;
  }
  return policy;
}

}  // namespace mem::nn
