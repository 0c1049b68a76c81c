// encoder.cpp — nn.MultiheadAttention and nn.RMSNorm as PyTorch 2.5's Python and ATen
// composites write them (torch/nn/functional.py, multi_head_attention_forward;
// aten/src/ATen/native/layer_norm.cpp, rms_norm), and torchvision's ViT token layers
// (torchvision/models/vision_transformer.py).
#include "vramscope/runtime/encoder.hpp"

#include <cmath>
#include <limits>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {

MultiheadAttention::MultiheadAttention(std::int64_t embed_dim, std::int64_t heads, double dropout, bool bias,
                                       bool batch_first)
    : Module("MultiheadAttention"), embed_(embed_dim), heads_(heads), dropout_(dropout), bias_(bias),
      batch_first_(batch_first) {
  if (heads <= 0 || embed_dim % heads != 0) {
    throw Error("MultiheadAttention: embed_dim " + std::to_string(embed_dim) + " is not a multiple of num_heads " +
                std::to_string(heads));
  }
  const double bound = std::sqrt(6.0 / static_cast<double>(4 * embed_dim));  // xavier_uniform_ of [3E, E]
  in_weight_ = add_parameter("in_proj_weight", Shape{3 * embed_dim, embed_dim}, -bound, bound);
  in_bias_ = bias ? add_parameter("in_proj_bias", Shape{3 * embed_dim}, 0.0, 0.0) : 0;
  out_proj_ = &add_module("out_proj", std::make_unique<Linear>(embed_dim, embed_dim, bias));
}

Tensor MultiheadAttention::forward(const Tensor& input) {
  if (input.dim() != 3 || input.size(2) != embed_) {
    throw Error("MultiheadAttention: expected [" + std::string(batch_first_ ? "B, S, " : "S, B, ") +
                std::to_string(embed_) + "], got " + input.shape().str());
  }
  // batch_first: query = key = value = query.transpose(1, 0), a view [S, B, E].
  const Tensor x = batch_first_ ? input.transpose(0, 1) : input;
  const std::int64_t s = x.size(0), b = x.size(1), e = embed_, h = heads_, d = embed_ / heads_;
  Tensor q, k, v;
  {
    // _in_projection_packed: proj = linear(q, w, b) [S, B, 3E], then unflatten(-1, (3, E))
    // .unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous(): a copy [3, S, B, E], and
    // proj[0], proj[1], proj[2] (selects: each gradient is written into zeros of the whole).
    const Tensor proj = linear(x, param(in_weight_), bias_ ? param(in_bias_) : Tensor{});
    const Tensor packed = proj.view(Shape{s, b, 3, e}).permute({2, 0, 1, 3}).contiguous();
    // q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1), then .view(bsz, num_heads, ...).
    const auto heads_of = [&](std::int64_t i) {
      return packed.narrow(0, i, 1).view(Shape{s, b * h, d}).transpose(0, 1).view(Shape{b, h, s, d});
    };
    q = heads_of(0);
    k = heads_of(1);
    v = heads_of(2);
  }
  const DType runs_in = q.runtime().autocast().value_or(q.dtype());
  const SdpaBackend backend = is_half(runs_in) ? SdpaBackend::Flash : SdpaBackend::Efficient;
  Tensor out = scaled_dot_product_attention(q, k, v, backend, false, dropout_, training());
  // attn_output.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim), out_proj,
  // .view(tgt_len, bsz, E), and back to batch first.
  out = out.permute({2, 0, 1, 3}).contiguous().view(Shape{s * b, e});
  out = (*out_proj_)(out).view(Shape{s, b, e});
  return batch_first_ ? out.transpose(0, 1) : out;
}

TorchRMSNorm::TorchRMSNorm(std::int64_t features, std::optional<double> eps, bool affine)
    : Module("RMSNorm"), eps_(eps), affine_(affine) {
  if (affine) weight_ = add_parameter("weight", Shape{features}, 1.0, 1.0);
}

Tensor TorchRMSNorm::forward(const Tensor& x) {
  const double eps = eps_.value_or(x.dtype() == DType::BF16   ? 0.0078125
                                   : x.dtype() == DType::F16  ? 0.0009765625
                                   : x.dtype() == DType::F64  ? std::numeric_limits<double>::epsilon()
                                                              : std::numeric_limits<float>::epsilon());
  // rqrst_input = rsqrt(at::pow(input, 2).mean(dims, keepdim=True).add_(eps)); the add is in
  // place in ATen (here one [rows, 1] temporary more).
  Tensor result;
  {
    const Tensor r = rsqrt(add_scalar(mean_last(square(x)), eps));
    result = mul(x, r);
  }
  return affine_ ? mul(result, param(weight_)) : result;
}

ClassToken::ClassToken(std::int64_t embed_dim) : Module("ClassToken") {
  token_ = add_parameter("class_token", Shape{1, 1, embed_dim}, 0.0, 0.0);  // torch.zeros
}

Tensor ClassToken::forward(const Tensor& x) {
  if (x.dim() != 3 || x.size(2) != slots()[token_].shape[2]) {
    throw Error("ClassToken: expected [B, N, " + std::to_string(slots()[token_].shape[2]) + "], got " + x.shape().str());
  }
  const Tensor parts[] = {param(token_).expand(Shape{x.size(0), 1, x.size(2)}), x};
  return cat(parts, 1);
}

PositionEmbedding::PositionEmbedding(std::int64_t positions, std::int64_t embed_dim) : Module("PositionEmbedding") {
  embedding_ = add_parameter("pos_embedding", Shape{1, positions, embed_dim}, -0.02, 0.02);
}

Tensor PositionEmbedding::forward(const Tensor& x) {
  const Shape& p = slots()[embedding_].shape;
  if (x.dim() != 3 || x.size(1) != p[1] || x.size(2) != p[2]) {
    throw Error("PositionEmbedding: expected [B, " + std::to_string(p[1]) + ", " + std::to_string(p[2]) + "], got " +
                x.shape().str());
  }
  return add(x, param(embedding_));
}

SelectToken::SelectToken(std::int64_t dim, std::int64_t index) : Module("SelectToken"), dim_(dim), index_(index) {}

Tensor SelectToken::forward(const Tensor& x) {
  const auto n = static_cast<std::int64_t>(x.dim());
  const std::int64_t d = dim_ < 0 ? dim_ + n : dim_;
  if (d < 0 || d >= n || index_ < 0 || index_ >= x.size(d)) {
    throw Error("SelectToken: index " + std::to_string(index_) + " of dimension " + std::to_string(dim_) +
                " is outside " + x.shape().str());
  }
  Shape out;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i != d) out.push_back(x.size(i));
  }
  return x.narrow(d, index_, 1).view(out);
}

}  // namespace mem::nn
