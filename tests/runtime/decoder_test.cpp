// decoder_test.cpp — the Hugging Face decoders (issue 19): the bytes one decoder layer
// keeps for backward, derived by hand from the Python of transformers 5.17 (and 4.50.3
// where they differ) and PEFT for each attention implementation, precision and LoRA; the zoo's parameter counts
// against the published ones; eager and SDPA attention giving the same gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "test_util.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/zoo.hpp"
#include "vramscope/runtime/decoder.hpp"

namespace mem::nn {
namespace {

// A small decoder whose every tensor is a multiple of 512 B (no allocator rounding):
// B = 2, S = 64 (T = 128 tokens), hidden h = 64, 4 heads of d = 16 (Hd = 64) over 2 kv
// heads, intermediate I = 128, vocab 32.
constexpr std::int64_t B = 2, S = 64, T = B * S, h = 64, H = 4, Hd = 64, I = 128;

DecoderConfig small(std::int64_t layers, AttentionImpl attention) {
  DecoderConfig c;
  c.vocab = 32;
  c.hidden = h;
  c.intermediate = I;
  c.layers = layers;
  c.heads = H;
  c.kv_heads = 2;
  c.head_dim = Hd / H;
  c.attention = attention;
  return c;
}

// transformers 4.50.3 (sdpa_attention_forward repeats k and v and makes q, k, v contiguous)
// and 5.x (enable_gqa, the projections' layout kept): stack.cpp.
const Stack kTransformers4 = Stack::parse("transformers=4.50");
const Stack kTransformers5 = Stack::parse("transformers=5.17");

/// Bytes the graph of one forward keeps once its output is dropped (under autocast to
/// `autocast` when given), under `stack`.
std::int64_t kept_after_forward(DecoderConfig c, DType dtype, std::optional<DType> autocast, const Stack& stack) {
  test::Env env(ExecMode::DryRun);
  env.rt.set_stack(stack);
  env.rt.gemm_workspace(/*lt=*/true);
  auto body = build_decoder(c);
  body->set_path("");
  body->materialize(env.rt, dtype);
  const Tensor ids = empty(env.rt, Shape{B, S}, DType::I64);
  const std::int64_t before = env.allocated();
  AutocastRegion region(env.rt, autocast);
  Tensor out = (*body)(ids);
  const std::shared_ptr<Node> graph = out.grad_fn();
  out = Tensor{};
  return env.allocated() - before;
}

/// One decoder layer's kept bytes: a model of two layers against one of one layer.
std::int64_t kept_by_one_layer(const DecoderConfig& c, DType dtype, std::optional<DType> autocast = std::nullopt,
                               const Stack& stack = kTransformers5) {
  DecoderConfig one = c, two = c;
  one.layers = 1;
  two.layers = 2;
  return kept_after_forward(two, dtype, autocast, stack) - kept_after_forward(one, dtype, autocast, stack);
}
std::int64_t kept_by_one_layer(const DecoderConfig& c, DType dtype, const Stack& stack) {
  return kept_by_one_layer(c, dtype, std::nullopt, stack);
}

// RMSNorm of a bf16 input (LlamaRMSNorm.forward): x.to(f32) saved by pow, rsqrt's f32
// result per row, x_hat.to(bf16) saved by weight * x_hat, and the output saved by the
// projections that read it: 4Th + 4T + 2Th + 2Th bytes.
constexpr std::int64_t kNormBf16 = 4 * T * h + 4 * T + 2 * T * h + 2 * T * h;

TEST(DecoderLayerKeeps, Bf16WithSdpaFlash) {
  // transformers 5: q after rotary stays in q_proj's [B, S, H, d] layout, k and v keep
  // their 2 key heads (enable_gqa); flash saves q, k, v, its output (in q's layout, so
  // transpose(1, 2).contiguous() is a view: o_proj saves the same storage) and the f32
  // logsumexp [B, H, S]: q + k + v + output = 3 [T, Hd] bf16.
  const std::int64_t attention = 3 * 2 * T * Hd + 4 * B * H * S;
  // LlamaMLP: gate (saved by silu), silu's output and up (saved by the product), the
  // product (saved by down_proj): four [T, I] bf16.
  const std::int64_t mlp = 4 * 2 * T * I;
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::BF16), 2 * kNormBf16 + attention + mlp);
}

TEST(DecoderLayerKeeps, Bf16WithSdpaFlashUnderTransformers4) {
  // 4.50.3: .contiguous() copies q out of q_proj's layout; repeat_kv copies k and v to H
  // heads; flash saves those three, its output (in the contiguous q's layout, [B, H, S, d])
  // and the logsumexp; transpose(1, 2).contiguous() of the output is a copy, o_proj's input.
  const std::int64_t attention = 5 * 2 * T * Hd + 4 * B * H * S;
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::BF16, kTransformers4),
            2 * kNormBf16 + attention + 4 * 2 * T * I);
}

TEST(DecoderLayerKeeps, Bf16WithEagerAttention) {
  // eager_attention_forward: matmul copies q (its layout does not fold to [B H, S, d]) and
  // saves it with k's repeat_kv copy; softmax(dtype=f32) of bf16 scores saves its f32
  // output [B, H, S, S]; .to(bf16) of it is saved by the matmul with v (and v's copy);
  // transpose(1, 2).contiguous() of the result is o_proj's saved input.
  const std::int64_t attention = 4 * 2 * T * Hd + 4 * B * H * S * S + 2 * B * H * S * S;
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Eager), DType::BF16),
            2 * kNormBf16 + attention + 4 * 2 * T * I);
}

TEST(DecoderLayerKeeps, F32WithSdpaEfficient) {
  // In f32, x.to(f32) is x itself: each norm saves its input (the layer's input, counted
  // as the previous layer's output, and the residual sum), rsqrt's result, x_hat and its
  // output. SDPA picks the memory-efficient kernel for f32; its logsumexp is [B, H, S]
  // rounded up to 32 (S = 64 already is).
  const std::int64_t norms = 2 * (4 * T + 4 * T * h + 4 * T * h);
  const std::int64_t residual_and_output = 2 * 4 * T * h;
  // transformers 5: q, k and v (half of q each: 2 key heads) as they come, the output in
  // [B, S, H, d] (o_proj's input is a view of it). 4.50.3: q's contiguous copy, k and v
  // repeated to H heads, the output.
  const std::int64_t attention5 = 3 * 4 * T * Hd + 4 * B * H * S;
  const std::int64_t attention4 = 4 * 4 * T * Hd + 4 * B * H * S;
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::F32),
            norms + residual_and_output + attention5 + 4 * 4 * T * I);
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::F32, kTransformers4),
            norms + residual_and_output + attention4 + 4 * 4 * T * I);
}

TEST(DecoderLayerKeeps, Bf16WithLoraOnQueryAndValue) {
  // Frozen base weights save nothing for their own gradient, so a norm keeps only the f32
  // copy of its input and rsqrt's result, and no projection keeps its input. PEFT's f32
  // adapters (autocast_adapter_dtype) each keep an f32 copy of x (x.to(lora_A.weight.dtype))
  // and lora_A's f32 output [T, r] saved by lora_B. SDPA keeps what it keeps without
  // LoRA; the frozen MLP keeps gate's output, silu's and up's (the product's operands).
  DecoderConfig c = small(2, AttentionImpl::Sdpa);
  c.lora.rank = 8;
  c.lora.dropout = 0;
  c.lora.targets = {"q_proj", "v_proj"};
  const std::int64_t norms = 2 * (4 * T * h + 4 * T);
  const std::int64_t adapters = 2 * (4 * T * h + 4 * T * 8);
  // The frozen o_proj keeps no input, so the output is kept once, by SDPA, under both:
  // 5.x q + k + v + output = 3 [T, Hd]; 4.50.3 the q copy, k and v repeated, the output.
  const std::int64_t attention = 3 * 2 * T * Hd + 4 * B * H * S;
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16), norms + adapters + attention + 3 * 2 * T * I);
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16, kTransformers4),
            norms + adapters + attention + 2 * T * Hd + 3 * 2 * T * I);
}

// Two layers tests/models/check_transformers.py measures on transformers' own decoder
// layers (today's release, with PEFT for LoRA): f32 eager, and bf16 eager with LoRA. Eager
// attention is the same under 4.50.3 and 5.x.
TEST(DecoderLayerKeeps, F32EagerAndBf16LoraEagerAsTransformersKeepThem) {
  // f32: each norm keeps rstd, x_hat and its output (its input is the layer's input or the
  // residual sum, both kept); eager attention the q copy, k and v, the merged output and the
  // f32 probabilities (softmax and the matmul with v save the same tensor).
  const std::int64_t f32 = 2 * (4 * T + 4 * T * h + 4 * T * h) + 2 * 4 * T * h + 4 * 4 * T * Hd +
                           4 * B * H * S * S + 4 * 4 * T * I;
  EXPECT_EQ(f32, 721920);
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Eager), DType::F32), f32);
  // bf16 LoRA on q and v: the frozen o_proj does not keep the merged output.
  DecoderConfig c = small(2, AttentionImpl::Eager);
  c.lora.rank = 8;
  c.lora.dropout = 0;
  c.lora.targets = {"q_proj", "v_proj"};
  const std::int64_t lora = 2 * (4 * T * h + 4 * T) + 2 * (4 * T * h + 4 * T * 8) + 3 * 2 * T * Hd +
                            4 * B * H * S * S + 2 * B * H * S * S + 3 * 2 * T * I;
  EXPECT_EQ(lora, 484352);
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16), lora);
}

// Under autocast (amp-bf16: f32 weights, f32 residual stream): every projection casts its
// input to bf16 (a copy each, no caching for activations) and its weight (cached per
// forward, kept by the graph); rotary mixes the bf16 q and k with f32 cos and sin into f32;
// SDPA casts them back to bf16 (scaled_dot_product_attention is on the lower-precision list).
TEST(DecoderLayerKeeps, AmpBf16WithSdpa) {
  const std::int64_t weights = 2 * (h * Hd + 2 * h * (Hd / 2) + Hd * h + 3 * h * I);  // bf16 casts
  const std::int64_t norms = 2 * (4 * T + 4 * T * h);             // rstd and x_hat (f32)
  const std::int64_t casts = 5 * 2 * T * h;                       // q, k, v, gate, up inputs
  const std::int64_t residual_and_output = 2 * 4 * T * h;         // f32, saved by the next norms
  // 5.x: the bf16 casts of q and k (in q_proj's layout), v as v_proj made it, the output
  // (a view for o_proj); 4.50.3: bf16 q, k, v repeated, the output and its copy.
  const std::int64_t attention5 = 3 * 2 * T * Hd + 4 * B * H * S;
  const std::int64_t attention4 = 5 * 2 * T * Hd + 4 * B * H * S;
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::F32, DType::BF16),
            weights + norms + casts + attention5 + residual_and_output + 4 * 2 * T * I);
  EXPECT_EQ(kept_by_one_layer(small(2, AttentionImpl::Sdpa), DType::F32, DType::BF16, kTransformers4),
            weights + norms + casts + attention4 + residual_and_output + 4 * 2 * T * I);
}

TEST(DecoderLayerKeeps, QloraKeepsWhatLoraKeeps) {
  // MatMul4Bit saves only the packed weight (ctx.tensors = (None, B)), as a frozen Linear
  // saves only its weight; bnb's LoRA clones the base output and casts the update, which
  // are temporaries. So a QLoRA layer keeps exactly what a LoRA layer does.
  DecoderConfig c = small(2, AttentionImpl::Sdpa);
  c.lora.rank = 8;
  c.lora.dropout = 0;
  c.lora.targets = {"q_proj", "v_proj"};
  c.nf4 = true;
  const std::int64_t norms = 2 * (4 * T * h + 4 * T);
  const std::int64_t adapters = 2 * (4 * T * h + 4 * T * 8);
  const std::int64_t attention = 3 * 2 * T * Hd + 4 * B * H * S;
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16), norms + adapters + attention + 3 * 2 * T * I);
}

// bitsandbytes' storage of a 4096 x 4096 weight (functional.py, quantize_4bit): packed
// [n / 2] u8, absmax per 64 values, its 16-value f32 code; with double quantization the
// absmax is u8 with an f32 absmax per 256 blocks and an f32 offset.
TEST(Linear4bit, StoresWhatBitsandbytesStores) {
  constexpr std::int64_t n = 4096 * 4096, blocks = n / 64;
  const auto stored = [&](bool double_quant) {
    test::Env env(ExecMode::DryRun);
    Linear4bit w(4096, 4096, double_quant);
    w.set_path("w");
    w.materialize(env.rt, DType::BF16);
    EXPECT_EQ(w.parameter_count(), n);
    return env.allocated();
  };
  // Blocks under 512 B take 512 B (the allocator's rounding).
  EXPECT_EQ(stored(true), n / 2 + blocks + blocks / 256 * 4 + 512 + 512);
  EXPECT_EQ(stored(false), n / 2 + blocks * 4 + 512);
}

// Each 4-bit matmul dequantizes the whole weight into a temporary in the load dtype, after
// the f32 absmax it rebuilds: forward peaks at the weight plus the larger of the two.
TEST(Linear4bit, ForwardDequantizesTheWholeWeightForTheMatmul) {
  test::Env env(ExecMode::DryRun);
  env.rt.gemm_workspace(/*lt=*/true);
  Linear4bit w(4096, 4096, true);
  w.set_path("w");
  w.materialize(env.rt, DType::BF16);
  Tensor x = empty(env.rt, Shape{128, 4096}, DType::BF16);
  x.set_requires_grad(true);
  const std::int64_t before = env.allocated();
  const std::int64_t peak_before = env.peak();
  Tensor y = w(x);
  EXPECT_EQ(env.allocated() - before, 128 * 4096 * 2);  // the output; nothing saved
  EXPECT_EQ(env.peak() - std::max(peak_before, before), 4096 * 4096 * 2 + 128 * 4096 * 2);
}

TEST(DecoderLayerKeeps, LoraDropoutAddsItsOutputAndMaskPerAdapter) {
  DecoderConfig c = small(2, AttentionImpl::Sdpa);
  c.lora.rank = 8;
  c.lora.targets = {"q_proj", "v_proj"};
  c.lora.dropout = 0;
  const std::int64_t without = kept_by_one_layer(c, DType::BF16);
  c.lora.dropout = 0.1;
  // nn.Dropout on the f32 copy: its output (saved by lora_A instead of the copy, which is
  // then freed) and a bool mask, per adapter.
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16) - without, 2 * (T * h));
}

TEST(DecoderLayerKeeps, CheckpointedLayersKeepOnlyTheirInput) {
  DecoderConfig c = small(2, AttentionImpl::Sdpa);
  c.checkpoint = CheckpointMark::NonReentrant;
  // The layer's input, which its checkpoint keeps, is the previous layer's output: bf16
  // [T, h]. Nothing inside the layer is kept.
  EXPECT_EQ(kept_by_one_layer(c, DType::BF16), 2 * T * h);
}

// The zoo's configs, against the parameter counts their model cards publish.
TEST(HfZoo, ParameterCountsAreThePublishedOnes) {
  const std::pair<const char*, std::int64_t> published[] = {
      {"llama-3.2-1b", 1'235'814'400},  {"llama-3.2-3b", 3'212'749'824}, {"llama-3.1-8b", 8'030'261'248},
      {"llama-3.1-70b", 70'553'706'496}, {"llama-3.1-405b", 405'853'388'800}, {"mistral-7b", 7'241'732'096},  {"qwen2.5-0.5b", 494'032'768},
      {"qwen2.5-7b", 7'615'616'512}};
  for (const auto& [name, count] : published) {
    const auto source = models::find(name);
    EXPECT_EQ(source->describe().parameters, count) << name;
    const auto& hf = dynamic_cast<const models::HfConfig&>(*source);
    EXPECT_EQ(decoder_parameter_count(hf.decoder()), count) << name;
  }
  // GPT-2 (GPT2LMHeadModel, lm_head tied to wte), read from the same kind of file.
  const std::pair<const char*, std::int64_t> gpt2[] = {
      {"gpt2", 124'439'808}, {"gpt2-medium", 354'823'168}, {"gpt2-large", 774'030'080}, {"gpt2-xl", 1'557'611'200}};
  for (const auto& [name, count] : gpt2) EXPECT_EQ(models::find(name)->describe().parameters, count) << name;
}

TEST(HfZoo, LoraAddsRankTimesInPlusOutPerAdaptedProjection) {
  const auto source = models::find("llama-3.2-1b");
  // q_proj 2048 -> 2048 and v_proj 2048 -> 512 in each of 16 layers, r = 16.
  const std::int64_t adapters = 16 * 16 * ((2048 + 2048) + (2048 + 512));
  EXPECT_EQ(source->describe(ModelOptions::parse("lora=16")).parameters, 1'235'814'400 + adapters);
}

// What the peak is made of, read from the blocks' contexts: it sums to max_allocated, its
// weights are the parameters (blocks: the embedding's gets its segment's last 1 MiB, which
// the allocator does not split off), its optimizer state Adam's two moments, and at
// step 2's peak (in the loss, at sequence 2048) no gradient is alive (zero_grad(set_to_none)).
TEST(PeakComposition, SumsToTheStepPeakAndNamesWhatHoldsIt) {
  TrainConfig cfg;
  cfg.model = models::find("llama-3.2-1b");
  cfg.precision = Precision::BF16;
  const TrainReport r = train(cfg);
  const MemoryComposition& c = r.peak_composition;
  EXPECT_EQ(c.total(), r.peak_allocated);
  constexpr std::int64_t slack = 4 << 20;
  EXPECT_GE(c.of(MemoryKind::Weights), r.parameter_bytes);
  EXPECT_LT(c.of(MemoryKind::Weights), r.parameter_bytes + slack);
  EXPECT_GE(c.of(MemoryKind::OptimizerState), r.optimizer_state_bytes);
  EXPECT_LT(c.of(MemoryKind::OptimizerState), r.optimizer_state_bytes + slack);
  EXPECT_EQ(c.of(MemoryKind::Gradients), 0);
  // The logits [1, 2048, 128256] in bf16, their f32 copy and log_softmax's f32 output.
  const std::int64_t logits = std::int64_t{2048} * 128256;
  EXPECT_GE(c.of(MemoryKind::Logits), logits * (2 + 4 + 4));
  EXPECT_GT(c.of(MemoryKind::Activations), 0);
}

// bitsandbytes' Adam8bit keeps u8 moments and an f32 absmax per 256 values for parameters
// of 4096 elements or more, f32 moments for smaller ones, and two 256-value maps.
TEST(Adam8bit, KeepsBitsandbytesStateLayout) {
  TrainConfig cfg;
  cfg.model = models::find("llama-3.2-1b");
  cfg.model_options = ModelOptions::parse("seq=128,lora=16,lora_targets=all");
  cfg.precision = Precision::BF16;
  cfg.optimizer.kind = OptimizerKind::Adam8bit;
  cfg.steps = 1;
  const TrainReport r = train(cfg);
  // Adapters (f32, PEFT): per layer lora_A [16, in] and lora_B [out, 16] for q, k, v, o,
  // gate, up, down; every one has 4096 elements or more.
  std::int64_t want = 2 * 1024;  // the two maps
  const std::int64_t in_out[][2] = {{2048, 2048}, {2048, 512}, {2048, 512}, {2048, 2048},
                                     {2048, 8192}, {2048, 8192}, {8192, 2048}};
  const auto state = [](std::int64_t n) { return 2 * n + 2 * ((n + 255) / 256) * 4; };  // tensor bytes
  for (const auto& p : in_out) want += 16 * (state(16 * p[0]) + state(p[1] * 16));
  EXPECT_EQ(r.optimizer_state_bytes, want);
}

/// Loss and every parameter's gradient of one compute-mode step in f64.
std::vector<std::vector<double>> gradients(DecoderConfig c) {
  test::Env env(ExecMode::Compute, 7);
  auto body = build_decoder(c);
  body->set_path("");
  body->materialize(env.rt, DType::F64);
  std::vector<double> ids(static_cast<std::size_t>(B * 8));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<double>((i * 7) % 32);
  const Tensor input = from_values(env.rt, Shape{B, 8}, ids, DType::I64);
  const Tensor loss = sum((*body)(input));
  backward(loss);
  std::vector<std::vector<double>> out{{to_values(loss)}};
  for (const Tensor& p : body->parameters()) out.push_back(p.grad().defined() ? to_values(p.grad()) : std::vector<double>{});
  return out;
}

TEST(DecoderGradients, EagerAndSdpaAgree) {
  DecoderConfig eager = small(2, AttentionImpl::Eager), sdpa = small(2, AttentionImpl::SdpaEfficient);
  const auto a = gradients(eager), b = gradients(sdpa);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << "tensor " << i;
    // Eager's softmax(dtype=float32) rounds the f64 scores to f32: agreement to f32 precision.
    for (std::size_t j = 0; j < a[i].size(); ++j) {
      EXPECT_NEAR(a[i][j], b[i][j], 1e-5 * (1 + std::abs(a[i][j]))) << "tensor " << i << " element " << j;
    }
  }
}

TEST(DecoderGradients, CheckpointedLayersGiveTheSameGradients) {
  DecoderConfig plain = small(2, AttentionImpl::Eager), marked = plain;
  marked.checkpoint = CheckpointMark::NonReentrant;
  EXPECT_EQ(gradients(plain), gradients(marked));
  marked.checkpoint = CheckpointMark::Reentrant;
  EXPECT_EQ(gradients(plain), gradients(marked));
}

}  // namespace
}  // namespace mem::nn
