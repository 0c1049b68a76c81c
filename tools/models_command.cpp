// models_command.cpp — `vramscope models`: the built-in models with their
// parameters, parameter bytes and default shapes (nothing is allocated).
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "commands.hpp"
#include "model_args.hpp"
#include "table.hpp"
#include "vramscope/allocator/units.hpp"
#include "usage_error.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/models.hpp"

namespace mem::tools {

namespace {

const char* loss_name(nn::LossKind loss) {
  switch (loss) {
    case nn::LossKind::MSE: return "mse";
    case nn::LossKind::CrossEntropy: return "cross entropy";
    case nn::LossKind::Sum: return "sum";
    case nn::LossKind::BCEWithLogits: return "bce with logits";
    case nn::LossKind::None: return "its output";
    case nn::LossKind::CausalLM: return "causal lm";
  }
  return "?";
}

void run(const ModelArgs& args) {
  std::vector<std::shared_ptr<const nn::ModelSource>> sources;
  nn::ModelOptions options = to_model_options(args);
  resolve_checkpoint_default(options, parse_stack(args));
  if (args.model.empty() && args.model_file.empty() && args.hf_config.empty()) {
    if (!options.given().empty()) {
      throw UsageError("size options describe one model: give --model NAME, --model-file PATH or --hf-config "
                       "PATH with them");
    }
    for (const std::string& name : models::names()) sources.push_back(models::find(name));
  } else {
    sources.push_back(resolve_model(args, ""));
  }
  Table t{{{"model", Align::Left},
           {"parameters", Align::Right},
           {"f32", Align::Right},
           {"f16", Align::Right},
           {"batch", Align::Right},
           {"input", Align::Left},
           {"seq modules", Align::Right},
           {"loss", Align::Left}}};
  std::vector<std::pair<std::string, std::string>> notes;
  for (const auto& source : sources) {
    const nn::ModelInfo m = planner::describe(*source, options);
    t.add_row({m.name, human_count(m.parameters), format_bytes(m.parameter_bytes(nn::DType::F32)),
               format_bytes(m.parameter_bytes(nn::DType::F16)), std::to_string(m.batch),
               m.input_shape.str(), m.sequential_checkpointing ? std::to_string(m.sequence_length) : "—",
               loss_name(m.loss)});
    notes.emplace_back(m.name, fmt::format("{} [options: {}]", m.description, fmt::join(source->option_keys(), ", ")));
  }
  std::cout << t.render("  ") << "\n";
  for (const auto& [name, description] : notes) std::cout << fmt::format("  {:<15} {}\n", name, description);
  std::cout << "\n  seq modules: the top-level modules checkpoint_sequential splits (--segments at most this);\n"
               "  — for llama, mistral and qwen2 configs, which checkpoint per layer (--gradient-checkpointing).\n"
               "  Sizes: the options of the model, given with --batch, --depth, --width, --seq, --image, --classes\n"
               "  or --model-options (`vramscope models --model NAME` lists what each model takes).\n";
}

}  // namespace

void add_models_command(CLI::App& app) {
  auto args = std::make_shared<ModelArgs>();
  CLI::App* cmd = app.add_subcommand(
      "models", "List the zoo's models (or describe your --model-file) with their parameters, parameter bytes, shapes and options.");
  add_model_options(*cmd, *args, "default: list all");
  cmd->footer(
      "Examples:\n"
      "  vramscope models\n"
      "  vramscope models --model gpt2 --seq 512\n"
      "  vramscope models --model mlp --depth 256 --width 512 --batch 16384\n"
      "  vramscope models --model-file net.json --batch 64");
  cmd->callback([args] { run(*args); });
}

}  // namespace mem::tools
