// output_paths.cpp — output files checked before the work starts.
#include "output_paths.hpp"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <system_error>

#include "usage_error.hpp"

namespace mem::tools {

void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs) {
  namespace fs = std::filesystem;
  std::map<fs::path, std::string> seen;  // the file, as the system resolves it -> option
  for (const auto& [option, path] : outputs) {
    if (path.empty()) continue;
    std::error_code ec;
    const fs::path file{path};
    if (fs::is_directory(file, ec)) {
      throw UsageError(option + ": '" + path + "' is a directory; give a file name");
    }
    const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path{"."};
    if (!fs::is_directory(dir, ec)) {
      throw UsageError(option + ": directory '" + dir.string() +
                       "' does not exist; create it or choose another path");
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      throw UsageError(option + ": directory '" + dir.string() + "' is not writable");
    }
    std::error_code resolve_error;
    const fs::path key = fs::weakly_canonical(fs::absolute(file, resolve_error), resolve_error);
    const auto [it, inserted] = seen.emplace(resolve_error ? file : key, option);
    if (!inserted) {
      throw UsageError(option + ": '" + path + "' is also the file of " + it->second +
                       "; give each output its own file");
    }
  }
}

}  // namespace mem::tools
