// expression.hpp — the integer expressions of model files: a size is a number or a
// formula over the model's options ("depth - 1", "4 * planes", "image / 32"), so one
// file describes a family (resnet at any image size, an mlp of any depth).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace mem::models::detail {

/// Resolves an option name to its value; nullopt for a name the model does not declare.
using NameLookup = std::function<std::optional<std::int64_t>(std::string_view)>;

/// Evaluates integers, names, + - * / and parentheses. Division must be exact (a model's
/// sizes are whole numbers; a remainder is a mistake worth stopping at). Throws
/// std::invalid_argument with a message ("unknown name 'widht'", "overflows 64 bits").
std::int64_t evaluate(std::string_view text, const NameLookup& lookup);

}  // namespace mem::models::detail
