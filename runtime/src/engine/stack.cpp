// stack.cpp — the versions the runtime models and what differs between them, each
// behaviour with the source that decides it.
#include "vramscope/runtime/stack.hpp"

#include <algorithm>
#include <charconv>
#include <iterator>

#include "vramscope/allocator/errors.hpp"

namespace mem::nn {
namespace {

std::string join(const std::vector<Version>& versions) {
  std::string out;
  for (const Version& v : versions) out += (out.empty() ? "" : ", ") + v.str();
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

/// "2.11", "2.11.0", "2.11.0+cu130" or pip's "==2.11.0" -> {2, 11}; {-1, -1} when malformed.
Version parse_version(std::string_view text) {
  Version v{-1, -1};
  if (text.starts_with("=")) text.remove_prefix(1);  // torch==2.11, as requirements files write it
  const char* p = text.data();
  const char* end = text.data() + text.size();
  auto [a, ea] = std::from_chars(p, end, v.major);
  if (ea != std::errc{} || a == end || *a != '.') return {-1, -1};
  auto [b, eb] = std::from_chars(a + 1, end, v.minor);
  if (eb != std::errc{}) return {-1, -1};
  if (b != end && ((*b != '.' && *b != '+') || b + 1 == end)) return {-1, -1};
  return v;
}

}  // namespace

std::string Version::str() const { return std::to_string(major) + "." + std::to_string(minor); }

// PyTorch 2.5: the sources the runtime was first written against. 2.11: the H100
// reference (../shared/gpu-reference, docs/VALIDATION.md). 2.15: the newest wheel on PyPI,
// checked on the CPU (tests/models/check_transformers.py, check_export.py).
const std::vector<Version>& Stack::known_torch() {
  static const std::vector<Version> v{{2, 5}, {2, 11}, {2, 15}};
  return v;
}

// transformers 4.50.3: the first sources modelled. 5.17: the H100 reference. 5.24: the
// newest release on PyPI, checked on the CPU.
const std::vector<Version>& Stack::known_transformers() {
  static const std::vector<Version> v{{4, 50}, {5, 17}, {5, 24}};
  return v;
}

// PEFT 0.14 and 0.21: LoRA's Linear.forward is the same in both (peft/tuners/lora/layer.py:
// x cast to lora_A's dtype, result + lora_B(lora_A(dropout(x))) * scaling, cast back).
const std::vector<Version>& Stack::known_peft() {
  static const std::vector<Version> v{{0, 14}, {0, 21}};
  return v;
}

Stack Stack::parse(std::string_view spec) {
  Stack s;
  struct Package {
    std::string_view key;
    Version* field;
    const std::vector<Version>* known;
    bool seen = false;
  };
  Package packages[] = {{"torch", &s.torch, &known_torch()},
                        {"transformers", &s.transformers, &known_transformers()},
                        {"peft", &s.peft, &known_peft()}};
  if (spec.empty()) return s;
  for (std::size_t pos = 0;;) {
    const std::size_t comma = spec.find(',', pos);
    const std::string_view item = trim(spec.substr(pos, comma == std::string_view::npos ? spec.npos : comma - pos));
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw Error("\"" + std::string(item) + "\" is not package=version; give e.g. torch=2.11,transformers=5.17");
    }
    const std::string_view key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    Package* p = std::find_if(std::begin(packages), std::end(packages), [&](const Package& q) { return q.key == key; });
    if (p == std::end(packages)) {
      throw Error("unknown package \"" + std::string(key) + "\"; valid: torch, transformers, peft");
    }
    if (p->seen) throw Error(std::string(key) + " is given twice");
    p->seen = true;
    if (value.empty()) {
      throw Error(std::string(key) + " has no version; give e.g. " + std::string(key) + "=" + p->known->back().str());
    }
    const Version v = parse_version(value);
    if (std::find(p->known->begin(), p->known->end(), v) == p->known->end()) {
      throw Error(std::string(key) + " " + std::string(value) + " is not a version vramscope models; known: " +
                  join(*p->known) + " (docs/VALIDATION.md says what each was checked against)");
    }
    *p->field = v;
    if (comma == std::string_view::npos) return s;
    pos = comma + 1;
  }
}

std::string Stack::to_string() const {
  return "PyTorch " + torch.str() + ", transformers " + transformers.str() + ", PEFT " + peft.str();
}

std::string Stack::spec() const {
  return "torch=" + torch.str() + ",transformers=" + transformers.str() + ",peft=" + peft.str();
}

// transformers 5.x, integrations/sdpa_attention.py: sdpa_attention_forward skips
// repeat_kv and passes enable_gqa=True when use_gqa_in_sdpa(attention_mask, key, value)
// holds (CUDA: no mask and head_dim <= 256), so SDPA keeps k and v with the key heads
// only. 4.50.3 repeats k and v (a copy each) whenever num_key_value_groups exists.
bool Stack::sdpa_enable_gqa() const noexcept { return transformers >= Version{5, 0}; }

// transformers 4.50.3, integrations/sdpa_attention.py: query/key/value = .contiguous()
// (a workaround for pytorch/pytorch#112577) before SDPA; 5.x passes them as they come
// (q and k in the [B, S, H, d] layout of the projection, seen as [B, H, S, d]).
bool Stack::sdpa_contiguous_inputs() const noexcept { return transformers < Version{5, 0}; }

// models/llama/modeling_llama.py, LlamaRotaryEmbedding.__init__: 5.x registers
// original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False) (a second [head_dim / 2]
// f32 tensor, which DDP broadcasts with the buffers: 256 B on the H100 at head_dim 64);
// 4.50.3 sets self.original_inv_freq = self.inv_freq, the same tensor.
bool Stack::rotary_original_inv_freq_buffer() const noexcept { return transformers >= Version{5, 0}; }

// aten/src/ATen/cuda/CublasHandlePool.cpp (2.15): isCUDABlasWorkspaceCachingEnabled() is
// false on CUDA unless TORCH_CUBLAS_WORKSPACE_CACHE=1, so getCurrentCUDABlasHandleWithWorkspace
// allocates getChosenWorkspaceSize() bytes per operation (allocateCUDABlasWorkspace, the caching
// allocator) and CublasLtWorkspace getCUDABlasLtWorkspaceSize() (CublasLtUtils.h), each freed when
// the product returns. 2.11 keeps one per (handle, stream) for the process (measured on an H100).
bool Stack::cublas_workspace_per_operation() const noexcept { return torch >= Version{2, 15}; }

// modeling_utils.py, PreTrainedModel.gradient_checkpointing_enable: without
// gradient_checkpointing_kwargs, {"use_reentrant": True} in 4.50.3, {"use_reentrant": False}
// in 5.17.
std::string_view Stack::checkpoint_default() const noexcept {
  return transformers < Version{5, 0} ? "reentrant" : "non-reentrant";
}

}  // namespace mem::nn
