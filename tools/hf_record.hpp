// hf_record.hpp — `--hf-config` for the decoders the built-in C++ families do not model: the
// config is recorded at the operator level by the Python exporter (OPERATORS.md) and read back
// as a model file. The built-in families (llama, mistral, qwen2, gpt2) stay the fast path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "vramscope/runtime/models.hpp"

namespace mem::tools {

/// Whether the built-in readers model this config.json's model_type (or cannot tell: a file that
/// does not parse is theirs to report).
bool builtin_hf_type(const std::string& path);

/// Records `path` with `python3 -m vramscope.export --hf-config` ($VRAMSCOPE_PYTHON, else python3,
/// with this build's python/ on its path) at batch 2 (a batch of 1 takes other paths) and
/// sequence 128, whose sizes become the file's formulas, and reads the file. Throws mem::Error with the exporter's message, or saying
/// what to install when no Python with torch and transformers is found. Says on a terminal that
/// it is recording (it takes seconds).
/// How the exporter records: each is its option of the same name (empty, 0: its default).
struct HfRecording {
  std::string autocast;      ///< --amp: "bf16", "f16" (recorded under CUDA's autocast)
  std::string attention;     ///< --attn: sdpa, eager
  std::int64_t lora = 0;     ///< --lora RANK: PEFT's adapters, base frozen
  std::string lora_targets;  ///< --lora-targets
  std::string checkpoint;    ///< --gradient-checkpointing: on, reentrant, non-reentrant
  bool compile = false;      ///< --compile: the joint graph torch.compile partitions too
  std::size_t expert_parallel = 0;  ///< --expert-parallel N: one GPU's of expert parallel
};
std::shared_ptr<const nn::ModelSource> record_hf_config(const std::string& path, const HfRecording& how = {});

}  // namespace mem::tools
