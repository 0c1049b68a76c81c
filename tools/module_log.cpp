// module_log.cpp — the per-module log as CSV or JSON.
#include "module_log.hpp"

#include <fmt/format.h>

#include <filesystem>

#include "sweep_export.hpp"
#include "usage_error.hpp"
#include "vramscope/instrumentation/files.hpp"

namespace mem::tools {

void ModuleLog::check_path(const std::string& option, const std::string& path) {
  if (path.ends_with(".csv") || path.ends_with(".json")) return;
  // A stream (/dev/stdout, a pipe) has no extension to say the format: CSV.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status) &&
      !std::filesystem::is_directory(status)) {
    return;
  }
  throw UsageError(option + ": '" + path + "' must end in .csv or .json (the format to write), or be a "
                   "stream such as /dev/stdout (CSV)");
}

void ModuleLog::add(const MemoryLogRow& row) {
  lines_.push_back(Line{std::string(row.hook), std::string(row.path), std::string(row.type), row.depth,
                        row.allocated, row.change, row.peak_between, row.reserved, row.nvidia_smi});
}

std::string ModuleLog::csv() const {
  std::string out = "line,hook,module,type,depth,allocated,change,peak_between,reserved,nvidia_smi\n";
  std::size_t n = 0;
  for (const Line& l : lines_) {
    out += fmt::format("{},{},{},{},{},{},{},{},{},{}\n", ++n, l.hook, csv_field(l.path), csv_field(l.type),
                       l.depth, l.allocated, l.change, l.peak_between, l.reserved, l.nvidia_smi);
  }
  return out;
}

nlohmann::json ModuleLog::json(nlohmann::json about) const {
  nlohmann::json lines = nlohmann::json::array();
  for (const Line& l : lines_) {
    lines.push_back({{"hook", l.hook}, {"module", l.path}, {"type", l.type}, {"depth", l.depth},
                     {"allocated", l.allocated}, {"change", l.change}, {"peak_between", l.peak_between},
                     {"reserved", l.reserved}, {"nvidia_smi", l.nvidia_smi}});
  }
  about["lines"] = std::move(lines);
  return about;
}

void ModuleLog::write(const std::string& path, const nlohmann::json& about) const {
  // Hostile module names (a model file's) are data: escaped, never raw bytes in the JSON.
  const std::string text = path.ends_with(".json")
                               ? json(about).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"
                               : csv();
  write_output_file(path, text, "the module log");
}

}  // namespace mem::tools
