// output_paths.cpp — output files checked before the work starts.
#include "output_paths.hpp"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <system_error>

#include "usage_error.hpp"

namespace mem::tools {

void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs,
                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  namespace fs = std::filesystem;
  std::map<fs::path, std::string> seen;  // the file, as the system resolves it -> option
  for (const auto& [option, path] : outputs) {
    if (path.empty()) continue;
    std::error_code ec;
    const fs::path file{path};
    const fs::file_status status = fs::status(file, ec);  // follows links, as the write will
    if (ec == std::errc::too_many_symbolic_link_levels) {
      throw UsageError(option + ": '" + path + "' is a loop of symbolic links; give a file name");
    }
    if (fs::is_directory(status)) {
      throw UsageError(option + ": '" + path + "' is a directory; give a file name");
    }
    for (const auto& [input_option, input] : inputs) {
      std::error_code same_error;
      if (!input.empty() && fs::equivalent(file, fs::path{input}, same_error)) {
        throw UsageError(option + ": '" + path + "' is the file " + input_option +
                         " reads; writing it would replace the input; choose another path");
      }
    }
    // A device or a FIFO (/dev/null, a pipe) is written through: no directory entry changes,
    // and two outputs may share it.
    if (fs::exists(status) && !fs::is_regular_file(status)) continue;
    std::error_code resolve_error;
    const fs::path target = fs::weakly_canonical(fs::absolute(file, resolve_error), resolve_error);
    const fs::path dir = resolve_error ? (file.has_parent_path() ? file.parent_path() : fs::path{"."})
                                       : target.parent_path();
    if (!fs::is_directory(dir, ec)) {
      throw UsageError(option + ": directory '" + dir.string() +
                       "' does not exist; create it or choose another path");
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      throw UsageError(option + ": directory '" + dir.string() + "' is not writable");
    }
    const auto [it, inserted] = seen.emplace(resolve_error ? file : target, option);
    if (!inserted) {
      throw UsageError(option + ": '" + path + "' is also the file of " + it->second +
                       "; give each output its own file");
    }
  }
}

}  // namespace mem::tools
