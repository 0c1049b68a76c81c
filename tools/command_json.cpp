// command_json.cpp — a command's parse and run, its JSON kept instead of printed.
#include "command_json.hpp"

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "usage_error.hpp"

namespace mem::tools {

nlohmann::json command_json(const std::vector<std::string>& args,
                            const std::function<void(std::size_t, std::size_t, const std::string&)>& progress) {
  if (args.empty() || (args.front() != "sweep" && args.front() != "plan" && args.front() != "trace")) {
    throw UsageError("give sweep, trace or plan and its options (replay, devices and models answer in tables and "
                     "files)");
  }
  // The document is the answer: options that choose how the command prints have no place here.
  for (const std::string& a : args) {
    for (const char* option : {"--format", "-f", "--brief", "--top"}) {
      if (a == option || a.starts_with(std::string(option) + "=")) {
        throw UsageError(std::string(option) + ": the library returns the JSON document; there is nothing to format");
      }
    }
  }
  Capture capture;
  capture.progress = progress;
  CLI::App app{"vramscope", "vramscope"};
  app.require_subcommand(1, 1);
  add_sweep_command(app, &capture);
  add_plan_command(app, &capture);
  add_trace_command(app, &capture);
  // CLI11 takes the arguments last first.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    throw UsageError("--help: the command's help is `vramscope " + args.front() + " --help`");
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  return std::move(capture.document);
}

}  // namespace mem::tools
