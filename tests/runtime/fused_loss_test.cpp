// fused_loss_test.cpp — Liger's fused linear cross entropy (issue 49: the loss as a plan
// change): its bytes as fused_linear_cross_entropy_forward allocates them, derived by hand
// from liger-kernel's ops/fused_linear_cross_entropy.py; its loss and gradients against the
// plain linear + cross entropy; a decoder with loss=liger-flce keeping no logits.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::nn {
namespace {

// BT = 128 tokens, H = 64, V = 256: inc_factor = cdiv(256, 64) = 4, chunk_size =
// next_power_of_2(cdiv(128, 4)) = 32, so 4 chunks. Every tensor a multiple of 512 B.
constexpr std::int64_t BT = 128, H = 64, V = 256, kChunk = 32;

struct Figures {
  std::int64_t peak = 0;  ///< above what was allocated before the loss
  std::int64_t kept = 0;  ///< after it, while the loss lives (the saved gradients and the loss)
};

Figures run_loss(DType dtype, bool weight_trains) {
  test::Env env(ExecMode::DryRun);
  const Tensor x = empty(env.rt, Shape{BT, H}, dtype).set_requires_grad(true);
  Tensor w = empty(env.rt, Shape{V, H}, dtype);
  if (weight_trains) w.set_requires_grad(true);
  const Tensor target = empty(env.rt, Shape{BT}, DType::I64);
  const std::int64_t before = env.allocated();
  env.alloc.reset_peak_stats();
  const Tensor loss = fused_linear_cross_entropy(x, w, target);
  return {env.peak() - before, env.allocated() - before};
}

TEST(FusedLinearCrossEntropy, Bf16FrozenWeightAllocatesWhatLigersForwardDoes) {
  // grad_input = zeros_like(_input) (BT x H bf16), loss_1d (BT f32), target_mask (BT bool: a
  // 512 B block), its sum (a 512 B block, freed by .item()), then one logits buffer of
  // chunk_size x V bf16 reused by every chunk; after the loop the buffer goes and the loss
  // scalar comes, and loss_1d and the mask go when the function returns.
  const std::int64_t grad_input = BT * H * 2, logits = kChunk * V * 2;
  const Figures f = run_loss(DType::BF16, false);
  EXPECT_EQ(f.peak, grad_input + 512 + 512 + logits);
  EXPECT_EQ(f.kept, grad_input + 512);  // saved for backward, and the loss
}

TEST(FusedLinearCrossEntropy, ATrainedWeightAddsItsGradientComputedInTheForward) {
  const std::int64_t grad_input = BT * H * 2, grad_weight = V * H * 2, logits = kChunk * V * 2;
  // bf16: addmm(grad_weight, grad_logits.t(), input_chunk, out=grad_weight) in place (sm >= 80).
  const Figures bf16 = run_loss(DType::BF16, true);
  EXPECT_EQ(bf16.peak, grad_input + grad_weight + 512 + 512 + logits);
  EXPECT_EQ(bf16.kept, grad_input + grad_weight + 512);
  // f32 without autocast: grad_weight += torch.mm(grad_logits.t(), input_chunk).float(), a
  // V x H f32 product per chunk beside the f32 logits buffer.
  const Figures f32 = run_loss(DType::F32, true);
  EXPECT_EQ(f32.peak, 2 * grad_input + 2 * grad_weight + 512 + 512 + 2 * logits + 2 * grad_weight);
  EXPECT_EQ(f32.kept, 2 * grad_input + 2 * grad_weight + 512);
}

TEST(FusedLinearCrossEntropy, UnderAutocastEachChunkHasItsOwnLogits) {
  // amp-bf16: f32 hidden states and an f32 weight that trains. _can_use_mm_out is false (the
  // autocast dtype is not the input's), so each chunk's `_input_chunk @ weight.t()` casts the
  // chunk (freed after the matmul) and allocates its own bf16 logits; the weight's bf16 copy is
  // autocast's cached cast of a parameter, alive for the region. grad_input's slice is a bf16
  // product copied in; grad_weight's addmm(out_dtype=float32) casts the f32 chunk to bf16.
  test::Env env(ExecMode::DryRun);
  const Tensor x = empty(env.rt, Shape{BT, H}, DType::F32).set_requires_grad(true);
  Tensor w = empty(env.rt, Shape{V, H}, DType::F32);
  w.set_requires_grad(true);
  const Tensor target = empty(env.rt, Shape{BT}, DType::I64);
  AutocastRegion region(env.rt, DType::BF16);
  const std::int64_t before = env.allocated();
  env.alloc.reset_peak_stats();
  const Tensor loss = fused_linear_cross_entropy(x, w, target);
  const std::int64_t grad_input = BT * H * 4, grad_weight = V * H * 4, cached = V * H * 2;
  const std::int64_t logits = kChunk * V * 2, chunk_cast = kChunk * H * 2;
  EXPECT_EQ(env.peak() - before, grad_input + grad_weight + 512 + 512 + cached + logits + chunk_cast);
  EXPECT_EQ(env.allocated() - before, grad_input + grad_weight + 512 + cached);
}

TEST(FusedLinearCrossEntropy, LossAndGradientsEqualTheLinearThenCrossEntropy) {
  constexpr std::int64_t n = 24, h = 8, v = 40;  // chunk_size next_power_of_2(cdiv(24, 5)) = 8: 3 chunks
  const auto run = [&](bool fused, double scale) {
    test::Env env(ExecMode::Compute, 7);
    Tensor x = uniform(env.rt, Shape{n, h}, -1, 1, DType::F32, 1);
    x.set_requires_grad(true);
    Tensor w = uniform(env.rt, Shape{v, h}, -1, 1, DType::F32, 2);
    w.set_requires_grad(true);
    const Tensor target = uniform(env.rt, Shape{n}, 0, static_cast<double>(v) - 1e-9, DType::I64, 3);
    const Tensor loss = fused ? fused_linear_cross_entropy(x, w, target) : cross_entropy(linear(x, w), target);
    backward(mul_scalar(loss, scale));
    std::vector<double> out{to_values(loss)[0]};
    for (const Tensor& t : {x.grad(), w.grad()}) {
      const std::vector<double> g = to_values(t);
      out.insert(out.end(), g.begin(), g.end());
    }
    return out;
  };
  for (const double scale : {1.0, 0.25}) {  // 0.25: backward scales the saved gradients in place
    const std::vector<double> fused = run(true, scale), plain = run(false, scale);
    ASSERT_EQ(fused.size(), plain.size());
    for (std::size_t i = 0; i < fused.size(); ++i) EXPECT_NEAR(fused[i], plain[i], 1e-5) << i;
  }
}

TEST(FusedLinearCrossEntropy, ADecoderWithLigersLossKeepsNoLogits) {
  // llama-3.2-1b's shape at a large vocabulary share: the logits (B x S x 128256, bf16, then
  // their f32 upcast and its log-softmax) are most of the plain loss's peak.
  TrainConfig cfg;
  cfg.model = models::find("llama-3.2-1b");
  cfg.model_options = ModelOptions::parse("batch=1,seq=1024,lora=8,checkpoint=non-reentrant");
  cfg.precision = Precision::BF16;
  cfg.device = "sim:h100-80g";
  cfg.steps = 2;
  const TrainReport plain = train(cfg);
  cfg.model_options.loss = "liger-flce";
  const TrainReport fused = train(cfg);
  // The plain loss holds the bf16 logits, their f32 copy and its log-softmax: 1024 x 128256 x
  // (2 + 4 + 4) B; Liger's, grad_input (1024 x 2048 bf16) and a 128 x 128256 bf16 chunk.
  EXPECT_LT(fused.peak_allocated + 1024ll * 128256 * 6, plain.peak_allocated);
  // A loss it does not know is refused by name, with the valid ones.
  cfg.model_options.loss = "fused";
  try {
    (void)train(cfg);
    FAIL() << "loss=fused was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: hf"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mem::nn
