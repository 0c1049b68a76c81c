// json_kind.hpp — how the models' readers (model files, config.json) show a JSON value in
// an error: the value itself when it is short ("yes", 2.5, true), else its kind ("a list").
#pragma once

#include <nlohmann/json.hpp>

#include "vramscope/allocator/errors.hpp"

#include <sstream>
#include <string>
#include <string_view>

namespace mem::models::detail {

/// Parses `text` as JSON nested at most `max_depth` levels, so that what a file costs (the
/// parser's and every later walk's stack) stays bounded by what a real file says: a value
/// nested 100,000 deep is refused here, by name of its file, before anything reads it. Other
/// syntax errors come from nlohmann's parser (json::parse_error).
/// A number no double holds (1e400) is refused by the key it stands under.
inline nlohmann::json parse_bounded(std::string_view text, const std::string& origin, int max_depth) {
  std::string key;  // the last key read: where an overflowing number stands
  try {
    return nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth > max_depth) {
        throw Error(origin + ": nested deeper than " + std::to_string(max_depth) +
                    " levels; no model file or config.json is (check the file)");
      }
      if (event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
        const std::string& k = parsed.get_ref<const std::string&>();
        key = k.size() > 64 ? k.substr(0, 64) + "..." : k;
      }
      return true;
    });
  } catch (const nlohmann::json::out_of_range&) {
    throw Error(origin + ": " + (key.empty() ? std::string("a number") : "\"" + key + "\"") +
                ": a number too large for any dtype (past 1.8e308); check the file");
  }
}

inline std::string kind_of(const nlohmann::json& v) {
  using json = nlohmann::json;
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return v.get<bool>() ? "true" : "false";
    case json::value_t::string: {
      const std::string s = v.get<std::string>();
      return "\"" + (s.size() > 40 ? s.substr(0, 40) + "..." : s) + "\"";  // printable() where it is shown
    }
    case json::value_t::array: return "a list";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: {
      std::ostringstream os;
      os << v.get<double>();
      return os.str();
    }
    default: return v.dump();
  }
}

}  // namespace mem::models::detail
