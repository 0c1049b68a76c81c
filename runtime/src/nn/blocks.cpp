// blocks.cpp — composite layers: GPT-2's attention and transformer block, written
// the way their Python is, so that every copy and temporary PyTorch makes is made
// here too. (torchvision's residual blocks are model files: models/zoo/resnet*.json.)
#include <cmath>
#include <limits>

#include "engine/detail.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/stack.hpp"

namespace mem::nn {
CausalSelfAttention::CausalSelfAttention(std::int64_t embed, std::int64_t heads, double dropout, double resid_dropout)
    : CausalSelfAttention(embed, heads, dropout, resid_dropout, AttentionImpl::Eager) {}

CausalSelfAttention::CausalSelfAttention(std::int64_t embed, std::int64_t heads, double dropout, double resid_dropout,
                                         AttentionImpl attention)
    : Module("GPT2Attention"), embed_(embed), heads_(heads), dropout_(dropout), attention_(attention) {
  if (embed % heads != 0) throw Error("attention: width " + std::to_string(embed) + " not divisible by heads");
  c_attn_ = &add_module("c_attn", std::make_unique<Linear>(embed, 3 * embed, true, true));
  c_proj_ = &add_module("c_proj", std::make_unique<Linear>(embed, embed, true, true));
  attn_dropout_ = &add_module("attn_dropout", std::make_unique<Dropout>(dropout));
  resid_dropout_ = &add_module("resid_dropout", std::make_unique<Dropout>(resid_dropout < 0 ? dropout : resid_dropout));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  const std::int64_t b = x.size(0), t = x.size(1), c = embed_, h = heads_, d = embed_ / heads_;
  const Tensor qkv = (*c_attn_)(x);
  const std::int64_t sizes[] = {c, c, c};
  const std::vector<Tensor> parts = split(qkv, sizes, 2);
  // _split_heads: view + permute, no copies yet.
  const Tensor q = parts[0].view(Shape{b, t, h, d}).permute({0, 2, 1, 3});
  const Tensor k = parts[1].view(Shape{b, t, h, d}).permute({0, 2, 1, 3});
  const Tensor v = parts[2].view(Shape{b, t, h, d}).permute({0, 2, 1, 3});
  if (attention_ != AttentionImpl::Eager) {
    // attn_output.reshape(*shape[:-2], -1).contiguous(): a view of the contiguous output.
    return (*resid_dropout_)((*c_proj_)(sdpa(q, k, v).view(Shape{b, t, c})));
  }
  // matmul folds batch dims with reshape: copies of the permuted q and k^T.
  Tensor att = matmul(q, k.transpose(-1, -2));
  att = mul_scalar(att, 1.0 / std::sqrt(static_cast<double>(d)));  // / torch.full([], sqrt(d))
  att = causal_mask(att, finfo_min(att.dtype()));                      // torch.where(mask, att, min)
  att = softmax(att);
  att = to_dtype(att, v.dtype());                                   // .type(value.dtype)
  att = (*attn_dropout_)(att);
  Tensor y = matmul(att, v);
  y = y.permute({0, 2, 1, 3}).contiguous().view(Shape{b, t, c});   // _merge_heads
  y = (*c_proj_)(y);
  return (*resid_dropout_)(y);
}

/// sdpa_attention_forward (transformers 5): q, k, v go in as the views of c_attn's output (4.x:
/// .contiguous() copies of them), no mask, so is_causal=True, dropout_p = attn_pdrop in
/// training; then transpose(1, 2).contiguous(), a view where the output has q's [B, S, H, d]
/// layout. The backend as for the decoders (decoder.cpp's sdpa).
Tensor CausalSelfAttention::sdpa(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in) const {
  const bool contiguous = q_in.runtime().stack().sdpa_contiguous_inputs();
  const Tensor q = contiguous ? q_in.contiguous() : q_in;
  const Tensor k = contiguous ? k_in.contiguous() : k_in;
  const Tensor v = contiguous ? v_in.contiguous() : v_in;
  const DType runs_in = q.runtime().autocast().value_or(q.dtype());
  const bool flash = attention_ == AttentionImpl::SdpaFlash ||
                     (attention_ == AttentionImpl::Sdpa && flash_supports(runs_in, embed_ / heads_));
  return scaled_dot_product_attention(q, k, v, flash ? SdpaBackend::Flash : SdpaBackend::Efficient, true, dropout_,
                                      training())
      .transpose(1, 2)
      .contiguous();
}

TransformerBlock::TransformerBlock(std::int64_t embed, std::int64_t heads, double dropout)
    : TransformerBlock(embed, heads, 0, 1e-5, dropout, dropout) {}

TransformerBlock::TransformerBlock(std::int64_t embed, std::int64_t heads, std::int64_t inner, double eps,
                                   double attn_dropout, double resid_dropout)
    : TransformerBlock(embed, heads, inner, eps, attn_dropout, resid_dropout, nullptr, AttentionImpl::Eager) {}

TransformerBlock::TransformerBlock(std::int64_t embed, std::int64_t heads, std::int64_t inner, double eps,
                                   double attn_dropout, double resid_dropout, std::unique_ptr<Module> activation,
                                   AttentionImpl attention)
    : Module("GPT2Block") {
  const std::int64_t width = inner > 0 ? inner : 4 * embed;
  ln_1_ = &add_module("ln_1", std::make_unique<LayerNorm>(embed, eps));
  attn_ = &add_module("attn", std::make_unique<CausalSelfAttention>(embed, heads, attn_dropout, resid_dropout,
                                                                    attention));
  ln_2_ = &add_module("ln_2", std::make_unique<LayerNorm>(embed, eps));
  auto mlp = std::make_unique<Sequential>();
  mlp->append("c_fc", std::make_unique<Linear>(embed, width, true, true));
  if (!activation) activation = std::make_unique<NewGELU>();  // GPT-2's "gelu_new"
  mlp->append("act", std::move(activation));
  mlp->append("c_proj", std::make_unique<Linear>(width, embed, true, true));
  mlp->append("dropout", std::make_unique<Dropout>(resid_dropout));
  mlp_ = &add_module("mlp", std::move(mlp));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  Tensor hidden = add((*attn_)((*ln_1_)(x)), x);     // attn_output + residual
  return add(hidden, (*mlp_)((*ln_2_)(hidden)));     // residual + feed_forward
}

}  // namespace mem::nn
