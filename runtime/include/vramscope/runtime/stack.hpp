// stack.hpp — the software stack a run models: which PyTorch, transformers and PEFT.
//
// What a layer keeps for backward changes between releases, so a figure is right only
// for the versions it models. A Stack names them; every behaviour that differs between
// versions is a question asked of it here, answered with its source and the version
// that changed it (stack.cpp). Tables print the stack they modelled.
//
//   mem::nn::Stack s = mem::nn::Stack::parse("torch=2.11,transformers=4.50");
//   s.sdpa_enable_gqa();   // false: transformers 4.50 repeats k and v before SDPA
//   s.to_string();         // "PyTorch 2.11, transformers 4.50, PEFT 0.21"
#pragma once

#include <compare>
#include <string>
#include <string_view>
#include <vector>

namespace mem::nn {

/// major.minor of a release; patch releases do not change what layers keep.
struct Version {
  int major = 0;
  int minor = 0;
  auto operator<=>(const Version&) const = default;
  std::string str() const;
};

struct Stack {
  Version torch{2, 11};
  Version transformers{5, 17};
  Version peft{0, 21};

  /// The default: the newest stack validated against a real GPU (docs/VALIDATION.md).
  static Stack validated() noexcept { return {}; }
  /// "torch=2.15,transformers=5.24,peft=0.21" (keys in any order; keys omitted take the
  /// default's; "" is the default; a patch part such as 2.11.0 is accepted). Throws
  /// mem::Error for an unknown key or version, naming the known ones.
  static Stack parse(std::string_view spec);
  /// The versions the runtime models, per package, oldest first.
  static const std::vector<Version>& known_torch();
  static const std::vector<Version>& known_transformers();
  static const std::vector<Version>& known_peft();

  /// "PyTorch 2.11, transformers 5.17, PEFT 0.21".
  std::string to_string() const;
  /// "torch=2.11,transformers=5.17,peft=0.21": what parse() reads back.
  std::string spec() const;
  bool operator==(const Stack&) const = default;

  // --- behaviours that differ between versions (sources in stack.cpp) -----------------
  /// transformers' sdpa_attention_forward passes enable_gqa=True to SDPA instead of
  /// repeating k and v per query head, when no mask is given (5.x).
  bool sdpa_enable_gqa() const noexcept;
  /// sdpa_attention_forward calls .contiguous() on q, k and v before SDPA (4.x).
  bool sdpa_contiguous_inputs() const noexcept;
  /// What gradient_checkpointing_enable() does without arguments: "reentrant" (4.x) or
  /// "non-reentrant" (5.x).
  std::string_view checkpoint_default() const noexcept;
  /// LlamaRotaryEmbedding keeps original_inv_freq as a buffer of its own (5.x).
  bool rotary_original_inv_freq_buffer() const noexcept;
  /// Each matrix product allocates its cuBLAS (or cublasLt) workspace from the caching
  /// allocator and frees it afterwards, instead of one kept per thread (torch 2.15 on CUDA).
  bool cublas_workspace_per_operation() const noexcept;
};

}  // namespace mem::nn
