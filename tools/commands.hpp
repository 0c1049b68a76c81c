// commands.hpp — the subcommands of `vramscope`, each registered on the app by
// one function (main wires them). Commands report bad input by throwing
// UsageError (exit 2) and a failed run by throwing CommandFailed (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

#include <stdexcept>

namespace mem::tools {

/// The run itself failed (out of memory in `trace`, an unwritable file): the
/// output so far stands and the message is printed on one line; exit code 1.
class CommandFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// sweep and plan print their answer; with `capture`, the command library's callers
/// (command_json.hpp) get its JSON document there instead, and nothing is printed.
void add_sweep_command(CLI::App& app, nlohmann::json* capture = nullptr);
void add_trace_command(CLI::App& app);
void add_plan_command(CLI::App& app, nlohmann::json* capture = nullptr);
void add_devices_command(CLI::App& app);
void add_models_command(CLI::App& app);

}  // namespace mem::tools
