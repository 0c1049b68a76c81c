// decoder.hpp — decoder-only transformers as Hugging Face transformers 5.17 writes them
// (LlamaForCausalLM, which Mistral and Qwen2 share; 4.50.3 where the runtime's Stack says
// so): RMSNorm, rotary embeddings, eager or SDPA attention with grouped keys, the SwiGLU
// MLP, the LM head, and LoRA adapters as PEFT 0.21 wraps a Linear. Each module's forward
// follows the Python line by line, so the runtime keeps for backward what PyTorch keeps and
// frees what Python's locals free.
//
//   mem::nn::DecoderConfig c;            // usually from a config.json (mem::models::HfConfig)
//   c.hidden = 2048; c.intermediate = 8192; c.layers = 16; c.heads = 32; c.kv_heads = 8;
//   auto body = mem::nn::build_decoder(c);   // model.embed_tokens ... lm_head
//
// What is modelled and what is assumed (docs/TRANSFORMERS.md): input_ids only (no
// attention_mask, as packed pre-training and fine-tuning batches), use_cache=False (what
// gradient checkpointing forces and fine-tuning scripts set), the loss of
// ForCausalLMLoss (logits.float(), then cross entropy over the flattened tokens).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn {

/// config._attn_implementation: "eager", or "sdpa" with the backend PyTorch picks (flash for
/// f16 / bf16 inputs, memory-efficient for f32) or one forced (sdpa_kernel(...)).
enum class AttentionImpl : std::uint8_t { Eager, Sdpa, SdpaFlash, SdpaEfficient };
/// "eager", "sdpa", "sdpa-flash", "sdpa-efficient".
std::string_view attention_name(AttentionImpl impl) noexcept;
/// Throws mem::Error listing the valid names.
AttentionImpl parse_attention(std::string_view name);

/// LoRA adapters (peft.LoraConfig, whose defaults these are: lora_alpha 8, lora_dropout 0,
/// q_proj and v_proj for llama, mistral and qwen2): rank r on the named projections.
struct LoraConfig {
  std::int64_t rank = 0;   ///< 0: no adapters (PEFT's default r is 8)
  double alpha = 8;
  double dropout = 0.0;
  /// Projection names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
  std::vector<std::string> targets{"q_proj", "v_proj"};
};

struct DecoderConfig {
  std::int64_t vocab = 32000;
  std::int64_t hidden = 4096;
  std::int64_t intermediate = 11008;
  std::int64_t layers = 32;
  std::int64_t heads = 32;
  std::int64_t kv_heads = 32;
  std::int64_t head_dim = 128;
  bool tie_embeddings = false;
  /// Constructed on the GPU (from_config under torch.device("cuda")): LlamaForCausalLM's
  /// __init__ makes lm_head's own weight there, and post_init's tie_weights() frees it
  /// after every parameter exists, leaving its block in the cache. Built on the CPU and
  /// moved (or loaded with from_pretrained), only the tied weight reaches the GPU.
  bool built_on_gpu = false;
  /// Liger's fused linear cross entropy computes the loss from the hidden states and lm_head's
  /// weight: lm_head's forward passes them through (Model::loss applies it).
  bool fused_linear_cross_entropy = false;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;  ///< the rotary base (values only: memory does not depend on it)
  /// How the eager causal mask is built: Llama's (full, triu, times a bool), or Mistral's and
  /// Qwen2's (full, times a bool; or-ed with a sliding-window bool when `sliding_window` > 0).
  bool mistral_mask = false;
  std::int64_t sliding_window = 0;
  bool qkv_bias = false;    ///< Qwen2: q, k, v projections with bias
  bool o_bias = false;
  bool mlp_bias = false;
  double attention_dropout = 0.0;
  AttentionImpl attention = AttentionImpl::Sdpa;
  /// gradient_checkpointing_enable(): every decoder layer's __call__ runs under checkpoint,
  /// reentrant or not as its kwargs say (without them: Stack::checkpoint_default()).
  CheckpointMark checkpoint = CheckpointMark::None;
  /// Fine-tuning: every base weight frozen (requires_grad_(False)), adapters trainable.
  LoraConfig lora;
  /// QLoRA: the seven projections of every layer as bitsandbytes Linear4bit (NF4, blocks of
  /// 64), with double quantization of the absmax statistics when `double_quant`.
  bool nf4 = false;
  bool double_quant = true;
};

/// Tensors LlamaModel.forward computes once and hands to every layer: the rotary cos and
/// sin, the eager causal mask. Set by DecoderInputs, dropped by the final norm (the end of
/// LlamaModel.forward); autograd keeps what it saved.
struct DecoderState {
  Tensor cos, sin, mask, cache_position, position_ids;
  /// Pipeline parallel: checkpointed layers keep each call's inputs until its recompute (several
  /// micro-batches' forwards run before their backwards); `step` is the schedule's step.
  bool per_call = false;
  std::uint64_t step = 0;
  void clear() noexcept { cos = sin = mask = cache_position = position_ids = Tensor{}; }
};

/// LlamaRMSNorm: x.to(f32); variance = x.pow(2).mean(-1, keepdim=True); x * rsqrt(variance
/// + eps); weight * x.to(input dtype). Keeps the f32 input, the f32 rstd per row and the
/// normalized input in the input's dtype.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(std::int64_t features, double eps = 1e-6);
  Tensor forward(const Tensor& input) override;

 private:
  std::size_t weight_;
  double eps_;
};

/// bitsandbytes' Linear4bit (bitsandbytes 0.45 nn/modules.py): the weight packed two
/// values per byte ([(n + 1) / 2] u8), its absmax per block of 64 (f32; or u8 with an f32
/// absmax per 256 of those and an f32 offset under double quantization) and its 16-value
/// f32 code. Counts as out x in parameters, all frozen.
class Linear4bit : public Module {
 public:
  Linear4bit(std::int64_t in, std::int64_t out, bool double_quant);
  Tensor forward(const Tensor& input) override;
  /// Also holds double quantization's shared 256-value map (the model's first 4-bit weight).
  void hold_dynamic_map();

 protected:
  void materialized(Runtime&, DType dtype) override { load_dtype_ = dtype; }

 private:
  std::int64_t in_, out_;
  bool double_quant_;
  std::size_t packed_, absmax_, nested_, offset_, code_;
  DType load_dtype_ = DType::BF16;
};

/// A Linear with a LoRA adapter (peft.tuners.lora.Linear): base_layer (frozen), then
/// result + lora_B(lora_A(lora_dropout(x))) * (alpha / r). Over a 4-bit base
/// (peft.tuners.lora.bnb.Linear4bit) the result is cloned and the update cast back to its
/// dtype before the sum.
class LoraLinear : public Module {
 public:
  LoraLinear(std::unique_ptr<Module> base, std::int64_t in, std::int64_t out, const LoraConfig& lora,
             bool quantized_base = false);
  Tensor forward(const Tensor& input) override;

 private:
  Module *base_, *dropout_, *a_, *b_;
  double scaling_;
  bool quantized_base_;
};

/// The decoder-only body: model.embed_tokens, the per-forward inputs (cache_position, the
/// eager causal mask, rotary cos / sin), model.layers.N, model.norm, lm_head (tied to
/// embed_tokens when the config says so). Throws mem::Error for an inconsistent config.
std::unique_ptr<Sequential> build_decoder(const DecoderConfig& config);

/// Parameters of the model a config describes, computed from its numbers (what the built
/// tree's parameter_count() must equal; the zoo's tests compare both with the published).
std::int64_t decoder_parameter_count(const DecoderConfig& config);

/// A decoder's attention heads, what tensor parallel splits over ranks. Throws mem::Error
/// when `attention` is not a decoder layer's self_attn.
struct AttentionHeads {
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  bool eager = false;  ///< eager attention, whose causal mask is built from the local sequence
};
AttentionHeads attention_heads(const Module& attention);
/// Sequence parallel: the hidden states reaching model.rotary_emb hold 1/`shards` of the
/// sequence, so the caller passes position_ids = arange(S) (transformers would derive the
/// positions from the local length) and cos and sin cover the whole sequence. Throws
/// mem::Error when `rotary` is not a decoder's.
void set_sequence_shards(Module& rotary, std::int64_t shards);
/// The end of a pipeline stage's forward that stops before model.norm: LlamaModel.forward's
/// locals (cache_position, cos, sin, the mask) die with the stage's return; autograd keeps
/// what it saved of them. Throws mem::Error when `rotary` is not a decoder's.
void release_decoder_inputs(Module& rotary);
/// Pipeline parallel: several micro-batches' forwards run before their backwards, so each
/// checkpointed layer keeps every call's inputs (cos, sin, the mask) for its recompute, in
/// order, as the closures of transformers' checkpointed calls hold them; a schedule's `step`
/// begins (what a call never recomputed left goes). Throws mem::Error when `rotary` is not a
/// decoder's.
void hold_inputs_per_call(Module& rotary, std::uint64_t step);

}  // namespace mem::nn
