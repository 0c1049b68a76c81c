// main.cpp — the `vramscope` command: wires the subcommands and turns errors
// into exit codes (0 ok, 1 the run failed, 2 bad input). The only place that
// decides how the process ends.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "commands.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/errors.hpp"
#include "replay_command.hpp"

namespace {

int fail(int code, const std::string& message) {
  std::cout.flush();
  // Command-line text can hold control characters too: never sent raw to the terminal.
  std::fprintf(stderr, "vramscope: error: %s\n", mem::printable(mem::tools::one_line(message)).c_str());
  return code;
}

/// CLI11's words for an option given more than once ("--batch: At Most 1 required but received
/// 2"), in ours; its other messages already name the option and what was wrong.
std::string in_our_words(const std::string& message) {
  const std::string marker = ": At Most 1 required but received ";
  const std::size_t at = message.find(marker);
  if (at == std::string::npos) return message;
  const std::string option = message.substr(0, at), times = message.substr(at + marker.size());
  return fmt::format("{} given {} times; give it once (options that take several values take a comma list: {} 8,16)",
                     option, times, option);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "vramscope — where GPU memory goes when you train a network: a CUDA caching allocator with "
      "PyTorch's policy on a real or simulated GPU, a minimal autograd runtime on it, and the "
      "table you build by hand today.",
      "vramscope"};
  app.set_version_flag("--version", "vramscope 0.1.0");
  app.require_subcommand(0, 1);
  mem::tools::add_sweep_command(app);
  mem::tools::add_trace_command(app);
  mem::tools::add_plan_command(app);
  mem::tools::add_devices_command(app);
  mem::tools::add_models_command(app);
  mem::tools::add_replay_command(app);
  app.footer(
      "Examples:\n"
      "  vramscope sweep                          # a deep mlp that only fits with checkpointing\n"
      "  vramscope sweep --model resnet50 --batch 128 --device sim:a100-40g --dtype f32,amp\n"
      "  vramscope trace --model resnet18 --batch 128 --max-depth 2 --snapshot step.pickle\n"
      "  vramscope plan --model resnet152 --batch 256 --device sim:a100-40g   # what makes it fit\n"
      "  vramscope devices\n"
      "  vramscope models\n"
      "Run `vramscope <command> --help` for each command's options.");

  try {
    app.parse(argc, argv);
    if (app.get_subcommands().empty()) {
      std::cout << app.help();
      return fail(mem::tools::kExitUsage,
                  "no command given: choose sweep, trace, plan, replay, devices or models (help above)");
    }
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where;
    for (const CLI::App* sub : app.get_subcommands()) where = " " + sub->get_name();
    return fail(mem::tools::kExitUsage, fmt::format("{} (see `vramscope{} --help`)", in_our_words(e.what()), where));
  } catch (const mem::tools::UsageError& e) {
    return fail(mem::tools::kExitUsage, e.what());
  } catch (const mem::tools::CommandFailed& e) {
    return fail(mem::tools::kExitFailure, e.what());
  } catch (const mem::OutOfMemoryError& e) {
    return fail(mem::tools::kExitFailure, e.what());
  } catch (const std::exception& e) {
    return fail(mem::tools::kExitFailure, e.what());
  }
  return 0;
}
