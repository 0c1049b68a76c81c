// sdpa_kernels.hpp — the fused attention kernels' own allocations, without autograd (internal):
// what one call of aten::_scaled_dot_product_{flash,efficient}_attention and its backward
// allocate, in order. F.scaled_dot_product_attention (ops_attention.cpp) wraps one call in
// an autograd node; context parallel's ring attention (ring_attention.cpp) makes one call per
// step of the ring, under the same node.
#pragma once

#include <vector>

#include "vramscope/runtime/ops.hpp"
#include "vramscope/runtime/runtime.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn::detail {

/// One forward call's outputs: the output, the f32 logsumexp (undefined where the efficient
/// kernel needs none) and the flash kernel's philox rng state on the device (rng_state {2}
/// and an unused {} tensor, u64: PyTorch 2.11's flash_api.cpp, seen on an H200).
struct SdpaOutputs {
  Tensor out, lse;
  std::vector<Tensor> rng;
};

/// The forward kernel on q [B, H, Sq, d], k and v [B, H_kv, Sk, d]: allocates (and in compute
/// mode computes) its outputs. `need_lse`: a gradient will read the logsumexp; `dropout`: the
/// call's dropout_p (flash splits the keys only without dropout).
SdpaOutputs sdpa_forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v, SdpaBackend backend, bool causal,
                                bool need_lse, double dropout = 0.0);

/// The backward kernel: dq, dk, dv in the inputs' layouts, with the copies and f32 workspace
/// the kernel holds while it runs.
std::vector<Tensor> sdpa_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, SdpaBackend backend, bool causal);

/// F.scaled_dot_product_attention inside context_parallel(): one rank's ring attention on its
/// share of the sequence (ring_attention.cpp), the merged output and logsumexp and the rng
/// state the autograd node keeps. Dry runs only.
SdpaOutputs ring_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, SdpaBackend backend,
                                   bool causal, double dropout, const ContextParallel& ring);
/// Its backward: dq, dk and dv of the rank's share.
std::vector<Tensor> ring_attention_backward(const Tensor& grad_out, const Tensor& query, Tensor key, Tensor value,
                                            const Tensor& out, const Tensor& logsumexp, SdpaBackend backend,
                                            bool causal, const ContextParallel& ring);

}  // namespace mem::nn::detail
