// op_rules.hpp — what the recording of an operator does not say and the runtime must know:
// how its backward treats the incoming gradient, which outputs the CUDA kernel keeps on the
// host, which output sizes the CUDA kernel decides, and which of the runtime's own ops runs it
// (op_kernels.hpp). One row per operator, each with its source in op_rules.cpp; every other
// operator takes the defaults. A graph's operators are looked up once, when it is built.
#pragma once

#include <cstdint>
#include <string_view>

#include "vramscope/runtime/tensor.hpp"

namespace mem::nn::detail {

/// The runtime's own op that runs an operator (op_kernels.cpp), when its arguments allow.
enum class OpKernel : std::uint8_t { None, Convolution, BatchNorm, Attention };
/// A matrix product: which (cuBLAS's workspace, its FLOPs).
enum class OpProduct : std::uint8_t { None, Mm, Addmm, Bmm, Baddbmm };

struct OpRule {
  OpKernel kernel = OpKernel::None;
  OpProduct product = OpProduct::None;
  /// Inputs (bit i: input i) whose gradient is the incoming gradient itself when it has the
  /// input's size and dtype (a view of it: nothing allocated); every other input that needs a
  /// gradient gets a new one of its shape (derivatives.yaml's formulas compute new tensors).
  std::uint32_t passes = 0;
  /// Outputs (bit k) the CUDA kernel returns on the host (the philox seed and offset of the
  /// fused attention kernels): no device allocation.
  std::uint32_t host_outputs = 0;
  /// Output 1 is the fused attention's f32 logsumexp, whose rows the kernel chooses.
  bool attention_logsumexp = false;
  /// A collective of the process group (torch.distributed's functional collectives and c10d's
  /// ops, as a rank's recording under expert parallel holds them): its outputs are the
  /// received data, its work is communication (the bytes of its inputs are sent), no FLOPs.
  bool collective = false;
  /// A dtype conversion: when the run's dtype makes it one to the same dtype it is `x.to(dtype)`
  /// returning x itself (PyTorch's to() aliases then, to_will_alias): no copy, no node.
  bool conversion = false;
};

/// "aten.transpose.int" -> "transpose"; another namespace's keeps it:
/// "_c10d_functional.all_to_all_single.default" -> "_c10d_functional.all_to_all_single".
std::string_view op_base_name(std::string_view op) noexcept;
/// The rule of "aten.<name>.<overload>" (the overload does not matter).
const OpRule& op_rule(std::string_view op);

/// The logsumexp of CUDA's fused attention for q [B, H, S, d] at the run's dtype: flash (f16 /
/// bf16, no mask, a head dimension flash takes) keeps [B, H, S] rows, the memory-efficient
/// kernel [B, H, S rounded up to 32]; f32 either way.
Shape attention_logsumexp_shape(const Shape& q, DType dtype, bool masked);

}  // namespace mem::nn::detail
