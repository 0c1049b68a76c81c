// command_json.hpp — `vramscope sweep|plan|trace ...` as a library call: the same options, the same
// run, its JSON document returned instead of printed (what bindings' planner API and the
// Python API reach). Figures equal the command's `--format json` bit for bit: it is the same
// code from the parsed options to the document.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace mem::tools {

/// Runs `args` ("sweep", "--model", "resnet50", ...; "sweep ... --max-batch"; "plan ...";
/// "trace ...") and returns its JSON document. Throws UsageError for what the command exits 2
/// on (the options), CommandFailed or mem::Error for a failed run (exit 1); a trace that ran
/// out of memory returns its log up to there, the message as "failure". Not for replay,
/// devices or models, whose answers are tables and files.
/// `progress` (may be empty) is told (runs done, runs expected or 0 when not known ahead, what
/// runs now) as the runs go.
nlohmann::json command_json(const std::vector<std::string>& args,
                            const std::function<void(std::size_t, std::size_t, const std::string&)>& progress = {});

}  // namespace mem::tools
