// checks.cpp — a spec's parts checked before anything runs.
#include "vramscope/planner/checks.hpp"

#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/planner/errors.hpp"

namespace mem::planner {

nn::ModelInfo describe(const nn::ModelSource& model, const nn::ModelOptions& options) {
  // Name the option the model came from: a user's file is --model-file, not --model.
  const auto* file = dynamic_cast<const models::ModelFile*>(&model);
  const char* option = dynamic_cast<const models::HfConfig*>(&model) != nullptr ? "--hf-config"
                       : file == nullptr || file->origin().starts_with("zoo:") ? "--model"
                       : file->origin().starts_with("hf:")                     ? "--hf-config"
                                                                               : "--model-file";
  return as_usage(option, [&] { return model.describe(options); });
}

void check_device(const std::string& spec, nn::ExecMode mode) {
  nn::TrainConfig cfg;
  cfg.device = spec;
  cfg.mode = mode;
  const std::string full = nn::device_spec_for(cfg);
  const auto device = as_usage("--device", [&] { return make_device(full); });
  if (mode == nn::ExecMode::Compute && !device->info().simulated) {
    throw UsageError("--compute: runs the arithmetic on the CPU and needs a simulated device "
                     "(--device sim:<preset>); " + device->info().name + " is a real GPU");
  }
}

void check_alloc_conf(const std::string& conf) {
  as_usage("--alloc-conf", [&] { return AllocatorConfig::parse(conf); });
}

}  // namespace mem::planner
