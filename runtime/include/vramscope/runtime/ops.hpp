// ops.hpp — differentiable tensor operations (PyTorch's functional API).
//
// Each op allocates its outputs through the caching allocator in the order the
// CUDA kernels of PyTorch do, and saves for backward exactly what
// derivatives.yaml saves (listed per op below; "nothing" means shapes only).
// Saved tensors that share storage with kept tensors cost nothing extra.
// Under autocast (Runtime::set_autocast) matrix products and convolutions cast
// their inputs to the half type and softmax / log_softmax / layer_norm / losses
// to f32, each cast being one allocation, as torch.autocast does.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

// --- linear algebra ------------------------------------------------------------------------
/// x[..., K] @ w[N, K]^T + b[N] (addmm on the flattened input). Saves x if w needs
/// grad and w if x needs grad. Backward: grad_x [M,K], grad_w [N,K], grad_b [N].
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
/// x[..., K] @ w[K, N] + b[N] (HF's Conv1D layout). Same saves as linear.
Tensor linear_kn(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
/// Batched a[B,M,K] @ b[B,K,N]. Saves b if a needs grad, a if b needs grad.
Tensor bmm(const Tensor& a, const Tensor& b);
/// torch.matmul for >= 3-d operands: folds batch dims with reshape (a copy when
/// the layout does not allow a view), bmm, then a view back.
Tensor matmul(const Tensor& a, const Tensor& b);

// --- attention ----------------------------------------------------------------------------------
/// The fused CUDA backends of F.scaled_dot_product_attention.
enum class SdpaBackend : std::uint8_t { Flash, Efficient };
std::string_view sdpa_backend_name(SdpaBackend backend) noexcept;
/// Whether PyTorch's flash kernel takes this input (f16 / bf16, head dim a multiple of 8 up
/// to 256); the default SDPA choice falls back to the memory-efficient kernel otherwise.
bool flash_supports(DType dtype, std::int64_t head_dim) noexcept;
/// scaled_dot_product_attention(q, k, v, dropout_p, is_causal) on q [B, H, S, d] and k, v
/// [B, H_kv, S, d] (H a multiple of H_kv: grouped query attention), scale 1/sqrt(d).
/// Output in q's layout (flash) or [B, S, H, d] storage returned as [B, H, S, d] (efficient).
/// Saves q, k, v, the output, the f32 logsumexp (flash [B, H, S]; efficient [B, H, S rounded
/// up to 32], allocated only when a gradient needs it); dropout's philox seed
/// and offset live on the host. Flash takes f16 / bf16 only. Under autocast, f32 inputs are
/// cast to the half type first.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, SdpaBackend backend,
                                    bool causal, double dropout = 0.0, bool training = true);

// --- 4-bit weights (QLoRA) --------------------------------------------------------------------
/// A bitsandbytes Params4bit [out, in] and its quant state: the packed u8 weight, the
/// per-64 block absmax (u8 under double quantization, with f32 nested absmax and offset),
/// and the dtype it was loaded in (what dequantize_4bit writes).
struct Nf4Weight {
  Tensor packed, absmax, nested_absmax, offset, code;
  std::int64_t out = 0, in = 0;
  DType dtype = DType::BF16;
  bool double_quant = true;
};
/// bnb.matmul_4bit(x, W.t()) through MatMul4Bit: dequantizes the weight into a temporary
/// (forward and again in backward), saves no activation, gives W no gradient. Dry runs only.
Tensor matmul_4bit(const Tensor& x, const Nf4Weight& weight);

// --- convolution and pooling -----------------------------------------------------------------
/// 2-d convolution, NCHW, as im2col + GEMM per group; weight [O, C/groups, k, k].
/// Saves input and weight. The im2col columns of one sample (all channels) are
/// workspace allocated through the allocator for the duration of the op (none for
/// 1x1 stride-1 unpadded convolutions).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {},
              std::int64_t stride = 1, std::int64_t padding = 0, std::int64_t dilation = 1,
              std::int64_t groups = 1);
/// 1-d convolution of [N, C, L] with weight [O, C/groups, k]: the 2-d convolution of the
/// [N, C, 1, L] view (as cuDNN's path unsqueezes); saves input and weight.
Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias = {}, std::int64_t stride = 1,
              std::int64_t padding = 0, std::int64_t dilation = 1, std::int64_t groups = 1);
/// Transposed 2-d convolution (nn.ConvTranspose2d, one group): weight [C, O, k, k], output
/// side (in - 1) stride - 2 padding + dilation (k - 1) + output_padding + 1. Saves input and
/// weight; one sample's columns [O k k, H_in W_in] are workspace while it runs (and in backward).
Tensor conv_transpose2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {}, std::int64_t stride = 1,
                        std::int64_t padding = 0, std::int64_t output_padding = 0, std::int64_t dilation = 1);
/// Saves input and the i64 argmax indices.
Tensor max_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride, std::int64_t padding = 0);
/// Output 1x1: computed as mean over H and W, which saves nothing.
Tensor adaptive_avg_pool2d(const Tensor& x);
/// Output out_h x out_w (PyTorch's bins); 1x1 is the mean above, any other size saves
/// the input.
Tensor adaptive_avg_pool2d(const Tensor& x, std::int64_t out_h, std::int64_t out_w);
/// Saves the input (for its shape). count_include_pad as nn.AvgPool2d (default true).
Tensor avg_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride, std::int64_t padding = 0,
                  bool count_include_pad = true);

// --- normalisation -----------------------------------------------------------------------------
/// native_batch_norm. Training: saves input, weight and the per-channel f32 mean and
/// invstd; updates running stats (again in a checkpoint's recompute, as PyTorch). Eval: uses
/// running stats.
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum = 0.1, double eps = 1e-5);
/// native_group_norm of [N, C, ...] in `groups` groups of C / groups channels. Saves input,
/// weight and the per-(sample, group) mean and rstd (the input's dtype, f32 for a half
/// input with f32 parameters). Backward takes two [N, C] accumulator-type temporaries.
Tensor group_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, std::int64_t groups,
                  double eps = 1e-5);
/// native_layer_norm over the last dimension. Saves input, weight, bias and the
/// f32 mean and rstd per row.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);

// --- activations --------------------------------------------------------------------------------
/// Saves its output.
Tensor relu(const Tensor& x);
/// In place: returns an alias of x's storage (allocates nothing) and bumps its version
/// counter. Saves the output (at the bumped version). A node that saved x before
/// throws InplaceModifiedError when unpacked, as in PyTorch; recording history on a
/// leaf that requires grad throws AutogradError.
Tensor relu_(const Tensor& x);
/// Saves its input (LeakyReluBackward0).
Tensor leaky_relu(const Tensor& x, double negative_slope);
/// In place, as relu_; saves its output (LeakyReluBackward1). A slope <= 0 is an error,
/// as in PyTorch (the sign cannot be told from the output).
Tensor leaky_relu_(const Tensor& x, double negative_slope);
/// clamp to [lo, hi]; ReLU6 is hardtanh(x, 0, 6). Saves its input.
Tensor hardtanh(const Tensor& x, double lo, double hi);
/// In place. Saves a copy of its input taken before the write: one more activation,
/// allocated in forward (PyTorch 1.13 measured; see ops_activation.cpp).
Tensor hardtanh_(const Tensor& x, double lo, double hi);
/// x * sigmoid(x). Saves its input.
Tensor silu(const Tensor& x);
/// In place; saves a copy of its input, as hardtanh_.
Tensor silu_(const Tensor& x);
/// Saves its output.
Tensor sigmoid(const Tensor& x);
/// Saves its output.
Tensor tanh(const Tensor& x);
/// Saves its input. `tanh_approx` is GELU(approximate="tanh") as GPT-2 uses.
Tensor gelu(const Tensor& x, bool tanh_approx = false);
/// native_dropout: output then a bool mask (both allocated); saves the mask.
/// Identity (no allocation) when !training or p == 0.
Tensor dropout(const Tensor& x, double p, bool training);
/// Softmax over the last dimension. Saves its output.
Tensor softmax(const Tensor& x);
/// softmax(x, dim=-1, dtype=dtype) as Hugging Face's eager attention calls it with f32: a
/// half input goes to the kernel as half_to_float (no f32 copy); others are cast first.
/// Saves its output.
Tensor softmax(const Tensor& x, DType dtype);
/// Log-softmax over the last dimension. Saves its output.
Tensor log_softmax(const Tensor& x);

// --- elementwise and shape ------------------------------------------------------------------------
/// a + b with broadcasting. Saves nothing; a broadcast input's gradient is summed down to
/// its shape (one allocation).
Tensor add(const Tensor& a, const Tensor& b);
/// a += b in place (residual connections); returns an alias of a and bumps its version
/// counter. Saves nothing. Same checks as relu_.
Tensor add_(const Tensor& a, const Tensor& b);
/// a * b with broadcasting and type promotion. Saves b if a needs grad and a if b needs grad.
Tensor mul(const Tensor& a, const Tensor& b);
/// x * s for a scalar s (allocates). Saves nothing.
Tensor mul_scalar(const Tensor& x, double s);
/// x * x (x.pow(2)). Saves x; backward allocates grad * (2 * x.pow(1)) with two temporaries.
Tensor square(const Tensor& x);
/// torch.pow(x, exponent) for a number: PowBackward0 keeps x (its backward makes
/// x.pow(exponent - 1), then exponent times it, then the product with the gradient). On
/// autocast's fp32 list.
Tensor pow_scalar(const Tensor& x, double exponent);
/// 1 / sqrt(x). Saves its output.
Tensor rsqrt(const Tensor& x);
/// -x. Saves nothing.
Tensor neg(const Tensor& x);
/// x + s for a scalar s (allocates). Saves nothing.
Tensor add_scalar(const Tensor& x, double s);
/// x.mean(-1, keepdim=True). Saves nothing; backward allocates the input's shape.
Tensor mean_last(const Tensor& x);
/// Fills the strictly upper triangle of the last two dims with `value` (causal
/// attention mask; torch.where with a constant buffer). Allocates; saves nothing.
Tensor causal_mask(const Tensor& x, double value);
/// Concatenation along `dim`. Saves nothing; backward hands out views of the gradient.
Tensor cat(std::span<const Tensor> tensors, std::int64_t dim);
/// Splits along `dim` into views. Backward concatenates the gradients (allocates).
std::vector<Tensor> split(const Tensor& x, std::span<const std::int64_t> sizes, std::int64_t dim);
/// x.clone(): a copy (allocates). Saves nothing; the gradient passes unchanged.
Tensor clone(const Tensor& x);
/// Cast to another dtype (allocates unless already that dtype). Saves nothing.
Tensor to_dtype(const Tensor& x, DType dtype);
/// Embedding lookup weight[indices]. Saves indices.
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// Sum of all elements to a scalar. Saves nothing.
Tensor sum(const Tensor& x);

// --- introspection for tests and reports -----------------------------------------------------------
/// FLOPs an op of this kind performs, as counted by the runtime (multiply-add = 2).
double linear_flops(std::int64_t m, std::int64_t n, std::int64_t k) noexcept;
double conv2d_flops(const Shape& input, const Shape& weight, std::int64_t stride,
                    std::int64_t padding, std::int64_t dilation = 1) noexcept;

}  // namespace mem::nn
