// commands.hpp — the subcommands of `vramscope`, each registered on the app by
// one function (main wires them). Commands report bad input by throwing
// UsageError (exit 2) and a failed run by throwing CommandFailed (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <string>

#include "vramscope/planner/errors.hpp"


namespace mem::tools {

/// The run itself failed (out of memory in `trace`, an unwritable file): the
/// output so far stands and the message is printed on one line; exit code 1.
using CommandFailed = planner::RunFailed;

/// A library caller's side of sweep, trace and plan (command_json.hpp): the JSON document it gets
/// instead of printed output, and the progress it is told instead of a bar on the terminal.
struct Capture {
  nlohmann::json document;
  /// (runs done, runs expected or 0 when not known ahead, what runs now); may be empty.
  std::function<void(std::size_t, std::size_t, const std::string&)> progress;
};

/// sweep, trace and plan print their answer; with `capture`, nothing is printed (the files a
/// caller asks for are written all the same).
void add_sweep_command(CLI::App& app, Capture* capture = nullptr);
void add_trace_command(CLI::App& app, Capture* capture = nullptr);
void add_plan_command(CLI::App& app, Capture* capture = nullptr);
void add_devices_command(CLI::App& app);
void add_models_command(CLI::App& app);

}  // namespace mem::tools
