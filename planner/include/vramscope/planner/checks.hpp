// checks.hpp — a spec's parts checked before anything runs, each refusal a UsageError that
// names the option it came from (the command's vocabulary, which the Python API shares).
#pragma once

#include <string>

#include "vramscope/runtime/models.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::planner {

/// Shapes and sizes of the chosen model; throws UsageError for an option the model
/// does not take or an impossible size (naming --model, --model-file or --hf-config).
nn::ModelInfo describe(const nn::ModelSource& model, const nn::ModelOptions& options);

/// Checks a device spec by building it; UsageError with the valid forms otherwise.
/// Compute mode needs host memory behind the device (a simulated GPU).
void check_device(const std::string& spec, nn::ExecMode mode);

/// Checks an allocator config string (PYTORCH_CUDA_ALLOC_CONF syntax).
void check_alloc_conf(const std::string& conf);

}  // namespace mem::planner
