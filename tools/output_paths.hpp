// output_paths.hpp — the files a command will write, checked before it computes anything:
// a run of minutes must not end in "cannot write" (exit 2 up front instead of exit 1 after),
// and two options must not name the same file (the second would overwrite the first).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace mem::tools {

/// (option, path) pairs; empty paths are options not given. Throws UsageError naming the
/// option when a path is a directory, its directory does not exist or cannot be written,
/// two options name the same regular file, or an output is one of the `inputs` (the
/// user's model file must never be overwritten by an export).
void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs,
                        const std::vector<std::pair<std::string, std::string>>& inputs = {});

}  // namespace mem::tools
