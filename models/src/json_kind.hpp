// json_kind.hpp — how the models' readers (model files, config.json) show a JSON value in
// an error: the value itself when it is short ("yes", 2.5, true), else its kind ("a list").
#pragma once

#include <nlohmann/json.hpp>

#include <sstream>
#include <string>

namespace mem::models::detail {

inline std::string kind_of(const nlohmann::json& v) {
  using json = nlohmann::json;
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return v.get<bool>() ? "true" : "false";
    case json::value_t::string: {
      const std::string s = v.get<std::string>();
      return "\"" + (s.size() > 40 ? s.substr(0, 40) + "..." : s) + "\"";
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
