// module_log.hpp — trace's per-module log as a file other tools open (`trace --log`): CSV or
// JSON by the file's extension, one row per line of the printed log, bytes exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "vramscope/instrumentation/memory_logger.hpp"

namespace mem::tools {

class ModuleLog {
 public:
  /// UsageError naming `option` unless `path` ends in .csv or .json, or is a stream
  /// (a device or a FIFO such as /dev/stdout), which gets CSV.
  static void check_path(const std::string& option, const std::string& path);

  /// Keeps a copy of the row (MemoryLoggerOptions::on_row).
  void add(const MemoryLogRow& row);
  std::size_t size() const noexcept { return lines_.size(); }

  /// Header: line,hook,module,type,depth,allocated,change,peak_between,reserved,nvidia_smi.
  std::string csv() const;
  /// `about` (model, device, ...) with "lines": [{hook, module, type, depth, allocated, ...}].
  nlohmann::json json(nlohmann::json about) const;
  /// csv() or json(about) by the extension of `path`; throws mem::Error when it cannot write.
  void write(const std::string& path, const nlohmann::json& about) const;

 private:
  struct Line {
    std::string hook, path, type;
    std::size_t depth = 0;
    std::int64_t allocated = 0, change = 0, peak_between = 0, reserved = 0, nvidia_smi = 0;
  };
  std::vector<Line> lines_;
};

}  // namespace mem::tools
