// blocks.cpp — composite layers: GPT-2's attention and transformer block, written
// the way their Python is, so that every copy and temporary PyTorch makes is made
// here too. (torchvision's residual blocks are model files: models/zoo/resnet*.json.)
#include <cmath>
#include <limits>

#include "engine/detail.hpp"
#include "vramscope/runtime/modules.hpp"

namespace mem::nn {
CausalSelfAttention::CausalSelfAttention(std::int64_t embed, std::int64_t heads, double dropout, double resid_dropout)
    : Module("GPT2Attention"), embed_(embed), heads_(heads) {
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

TransformerBlock::TransformerBlock(std::int64_t embed, std::int64_t heads, double dropout)
    : TransformerBlock(embed, heads, 0, 1e-5, dropout, dropout) {}

TransformerBlock::TransformerBlock(std::int64_t embed, std::int64_t heads, std::int64_t inner, double eps,
                                   double attn_dropout, double resid_dropout, std::unique_ptr<Module> activation)
    : Module("GPT2Block") {
  const std::int64_t width = inner > 0 ? inner : 4 * embed;
  ln_1_ = &add_module("ln_1", std::make_unique<LayerNorm>(embed, eps));
  attn_ = &add_module("attn", std::make_unique<CausalSelfAttention>(embed, heads, attn_dropout, resid_dropout));
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
