// selective_policy.cpp — which operators a selective checkpoint keeps (checkpoint.hpp):
// names as PyTorch's recording writes them, and the groups people save.
#include <algorithm>
#include <array>
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

bool SelectivePolicy::saves(std::string_view op) const noexcept {
  for (const std::string& s : save) {
    // "aten.mm.default" names the overload; "aten.mm" every overload of the operator (its
    // packet), so "aten.mm" must not take "aten.mm_out.default".
    if (op == s) return true;
    if (op.size() > s.size() && op.starts_with(s) && op[s.size()] == '.' &&
        op.find('.', s.size() + 1) == std::string_view::npos && std::count(s.begin(), s.end(), '.') == 1) {
      return true;
    }
  }
  return false;
}

std::string SelectivePolicy::str() const {
  std::string out;
  for (const std::string& s : save) out += (out.empty() ? "" : ",") + s;
  return out;
}

SelectivePolicy SelectivePolicy::parse(std::string_view text) {
  SelectivePolicy policy;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    std::string_view name = text.substr(start, comma - start);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name.empty()) {
      throw Error("selective checkpointing: an empty operator name in '" + std::string(text) +
                  "'; give operators (mm, aten.addmm, aten.convolution.default) or the groups matmuls, attention, "
                  "convolutions, separated by commas");
    }
    if (!std::all_of(name.begin(), name.end(), name_char) || name.front() == '.' || name.back() == '.' ||
        std::count(name.begin(), name.end(), '.') > 2 || name.find("..") != std::string_view::npos) {
      throw Error("selective checkpointing: '" + std::string(name) +
                  "' is no operator name; write them as PyTorch does (aten.mm.default, aten.mm or mm)");
    }
    std::vector<std::string> ops = group(name);
    if (ops.empty()) ops.push_back(qualified(name));
    for (std::string& op : ops) {
      if (std::find(policy.save.begin(), policy.save.end(), op) == policy.save.end()) policy.save.push_back(std::move(op));
    }
    start = comma + 1;
  }
  return policy;
}

}  // namespace mem::nn
