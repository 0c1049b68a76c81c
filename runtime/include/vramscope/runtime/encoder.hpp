// encoder.hpp — torch.nn's transformer layers as PyTorch 2.5 runs them in training:
// nn.MultiheadAttention (self-attention, need_weights=False: the SDPA path of
// F.multi_head_attention_forward), nn.RMSNorm (F.rms_norm's composite), and the token
// layers of torchvision's VisionTransformer (the class token, the position embedding, the
// class token's selection). What model files' "MultiheadAttention", "RMSNorm",
// "ClassToken", "PositionEmbedding" and "SelectToken" build.
#pragma once

#include <cstdint>
#include <optional>

#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn {

/// nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first) called as
/// attn(x, x, x, need_weights=False). Parameters in_proj_weight [3E, E], in_proj_bias [3E],
/// out_proj (weight [E, E], bias [E]). SDPA picks flash for half inputs, memory-efficient
/// for f32, as in the decoders.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(std::int64_t embed_dim, std::int64_t heads, double dropout = 0.0, bool bias = true,
                     bool batch_first = false);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t embed_, heads_;
  double dropout_;
  bool bias_, batch_first_;
  std::size_t in_weight_, in_bias_;
  Module* out_proj_;
};

/// nn.RMSNorm(normalized_shape, eps, elementwise_affine) over the last dimension: F.rms_norm
/// computes in the input's dtype, x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), then
/// times the weight. Keeps the per-row rsqrt and the normalized input (for the weight).
/// eps unset: torch.finfo(dtype).eps.
class TorchRMSNorm : public Module {
 public:
  TorchRMSNorm(std::int64_t features, std::optional<double> eps, bool affine = true);
  Tensor forward(const Tensor& input) override;

 private:
  std::optional<double> eps_;
  bool affine_;
  std::size_t weight_ = 0;
};

/// torchvision's class token: a parameter [1, 1, E] expanded over the batch and
/// concatenated before the tokens (torch.cat([class_token.expand(n, -1, -1), x], dim=1)).
class ClassToken : public Module {
 public:
  explicit ClassToken(std::int64_t embed_dim);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t token_;
};

/// A learned position embedding [1, N, E] added to [B, N, E] (input + self.pos_embedding).
class PositionEmbedding : public Module {
 public:
  PositionEmbedding(std::int64_t positions, std::int64_t embed_dim);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t embedding_;
};

/// x.select(dim, index), as torchvision's x[:, 0]: a view; backward writes the gradient
/// into zeros of the input's shape (one allocation).
class SelectToken : public Module {
 public:
  SelectToken(std::int64_t dim, std::int64_t index);
  Tensor forward(const Tensor& input) override;

 private:
  std::int64_t dim_, index_;
};

}  // namespace mem::nn
