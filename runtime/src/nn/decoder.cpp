// decoder.cpp — LlamaForCausalLM's modules as transformers 5.17 writes them, 4.50.3 where
// the runtime's Stack asks (src/transformers/models/llama/modeling_llama.py,
// integrations/sdpa_attention.py) and PEFT's LoRA Linear (0.14 and 0.21 alike)
// (src/peft/tuners/lora/layer.py). Python's locals are mirrored by C++ locals, so a
// temporary is freed where Python drops its last reference.
#include "vramscope/runtime/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "engine/checkpoint_frame.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {
namespace {

using State = std::shared_ptr<DecoderState>;

/// The per-forward inputs LlamaModel.forward makes before the first layer: cache_position
/// (torch.arange(S), i64), the eager causal mask (_prepare_4d_causal_attention_mask_with_
/// cache_position: full [S, S + 1] of the dtype's min, triu, times arange(S + 1) >
/// cache_position; sdpa passes no mask and is_causal=True instead), and
/// LlamaRotaryEmbedding's cos and sin [1, S, head_dim] in the hidden states' dtype.
class DecoderInputs final : public Module {
 public:
  void set_sequence_shards(std::int64_t shards) noexcept { shards_ = shards; }
  void release() noexcept { state_->clear(); }
  void hold_per_call(std::uint64_t step) noexcept {
    state_->per_call = true;
    state_->step = step;
  }
  DecoderInputs(const DecoderConfig& c, State state, double theta)
      : Module("LlamaRotaryEmbedding"), eager_(c.attention == AttentionImpl::Eager), mistral_mask_(c.mistral_mask),
        window_(c.sliding_window), dim_(c.head_dim),
        theta_(theta), state_(std::move(state)) {
    // register_buffer("inv_freq", ..., persistent=False): [head_dim / 2] floats, f32 under
    // any model dtype (rope_init_fn computes it with dtype=torch.float, and from_config's
    // dtype only sets the default dtype).
    inv_freq_ = add_typed_buffer("inv_freq", Shape{c.head_dim / 2}, DType::F32);
  }

  void materialized(Runtime& runtime, DType) override {
    // transformers 5: original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False), a
    // second buffer (4.50.3 kept `self.original_inv_freq = self.inv_freq`, the same tensor).
    const bool added = slots().size() > inv_freq_ + 1;  // materialized before: the slot is there
    if (runtime.stack().rotary_original_inv_freq_buffer() && !added) {
      const std::size_t slot = add_typed_buffer("original_inv_freq", slots()[inv_freq_].shape, DType::F32);
      param(slot) = clone(param(inv_freq_));
      param(slot).set_name(path() + ".original_inv_freq");
    }
  }

  /// LlamaModel.forward calls rotary_emb(hidden_states, position_ids) for its cos and sin;
  /// the hidden states go on to the layers untouched.
  bool passes_input_through() const noexcept override { return true; }

  Tensor forward(const Tensor& x) override {
    Runtime& rt = x.runtime();
    const std::int64_t s = x.size(1) * shards_, half = dim_ / 2;
    state_->cache_position = arange(rt, x.size(1));
    // Sequence parallel: the caller's position_ids, arange(S) of the whole sequence.
    if (shards_ > 1) state_->position_ids = arange(rt, s);
    if (eager_) state_->mask = causal_mask(rt, s, x.dtype(), mistral_mask_, window_);
    // rotary_emb(hidden_states, position_ids), under autocast disabled: position_ids
    // .float() [1, 1, S], freqs = inv_freq @ positions [1, half, S], emb = cat((freqs,
    // freqs)) [1, S, d], cos and sin of it, each times attention_scaling, then .to(dtype).
    const Tensor pos = empty(rt, Shape{1, 1, s}, DType::F32);
    const Tensor freqs = empty(rt, Shape{1, half, s}, DType::F32);
    const Tensor emb = empty(rt, Shape{1, s, dim_}, DType::F32);
    Tensor cos = empty(rt, Shape{1, s, dim_}, DType::F32);
    Tensor sin = empty(rt, Shape{1, s, dim_}, DType::F32);
    cos = empty(rt, Shape{1, s, dim_}, DType::F32);  // cos * attention_scaling
    sin = empty(rt, Shape{1, s, dim_}, DType::F32);
    if (rt.computing()) fill_rotary(cos, sin);
    state_->cos = to_dtype(cos, x.dtype());
    state_->sin = to_dtype(sin, x.dtype());
    return x;
  }

 private:
  static Tensor causal_mask(Runtime& rt, std::int64_t s, DType dtype, bool mistral, std::int64_t window) {
    Tensor mask;
    if (mistral) {
      // modeling_mistral.py / modeling_qwen2.py: full, then a bool [S, S+1] (or-ed in place
      // with the sliding window's), then causal_mask *= it, in place; the bools die on return.
      mask = empty(rt, Shape{s, s + 1}, dtype);
      const Tensor arange = empty(rt, Shape{s + 1}, DType::I64);
      const Tensor diagonal = empty(rt, Shape{s, s + 1}, DType::Bool);
      if (window > 0) {
        const Tensor arange2 = empty(rt, Shape{s + 1}, DType::I64);
        const Tensor shifted = empty(rt, Shape{s, 1}, DType::I64);  // cache_position.reshape(-1, 1) - window
        const Tensor sliding = empty(rt, Shape{s, s + 1}, DType::Bool);
      }
    } else {
      {
        const Tensor full_min = empty(rt, Shape{s, s + 1}, dtype);  // torch.full
        mask = empty(rt, Shape{s, s + 1}, dtype);                   // torch.triu
      }
      const Tensor arange = empty(rt, Shape{s + 1}, DType::I64);
      const Tensor above = empty(rt, Shape{s, s + 1}, DType::Bool);  // arange > cache_position
    }                                                                // causal_mask *= above: in place
    if (rt.computing()) {
      std::vector<double> v(static_cast<std::size_t>(s * (s + 1)));
      for (std::int64_t i = 0; i < s; ++i) {
        for (std::int64_t j = 0; j <= s; ++j) v[static_cast<std::size_t>(i * (s + 1) + j)] = j > i ? finfo_min(dtype) : 0;
      }
      mask = from_values(rt, Shape{s, s + 1}, v, dtype);
    }
    return mask;
  }

  void fill_rotary(Tensor& cos, Tensor& sin) const {
    const std::int64_t s = cos.size(1), half = dim_ / 2;
    std::vector<double> c(static_cast<std::size_t>(s * dim_)), n(c.size());
    for (std::int64_t p = 0; p < s; ++p) {
      for (std::int64_t i = 0; i < dim_; ++i) {
        const double inv = std::pow(theta_, -2.0 * static_cast<double>(i % half) / static_cast<double>(dim_));
        c[static_cast<std::size_t>(p * dim_ + i)] = std::cos(static_cast<double>(p) * inv);
        n[static_cast<std::size_t>(p * dim_ + i)] = std::sin(static_cast<double>(p) * inv);
      }
    }
    Runtime& rt = cos.runtime();
    cos = from_values(rt, cos.shape(), c, DType::F32);
    sin = from_values(rt, sin.shape(), n, DType::F32);
  }

  std::size_t inv_freq_ = 0;
  std::int64_t shards_ = 1;
  bool eager_, mistral_mask_;
  std::int64_t window_;
  std::int64_t dim_;
  double theta_;
  State state_;
};

/// rotate_half: torch.cat((-x2, x1), dim=-1) of the two halves of the last dimension.
Tensor rotate_half(const Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  const Tensor x1 = x.narrow(-1, 0, half);
  const Tensor x2 = x.narrow(-1, half, half);
  const Tensor parts[] = {neg(x2), x1};
  return cat(parts, -1);
}

/// (x * cos) + (rotate_half(x) * sin), cos and sin unsqueezed to [1, 1, S, d].
Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const Tensor by_cos = mul(x, cos);
  Tensor by_sin;
  {
    const Tensor rotated = rotate_half(x);
    by_sin = mul(rotated, sin);
  }
  return add(by_cos, by_sin);
}

/// repeat_kv: x[:, :, None].expand(B, KV, n_rep, S, d).reshape(B, KV * n_rep, S, d), a copy
/// when n_rep > 1.
Tensor repeat_kv(const Tensor& x, std::int64_t n_rep) {
  if (n_rep == 1) return x;
  const std::int64_t b = x.size(0), kv = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand(Shape{b, kv, n_rep, s, d}).reshape(Shape{b, kv * n_rep, s, d});
}

/// A projection: nn.Linear, or LoRA's wrapper around one when the config targets it.
std::unique_ptr<Module> projection(const DecoderConfig& c, const std::string& name, std::int64_t in,
                                   std::int64_t out, bool bias) {
  if (c.nf4 && bias) throw Error("4-bit projections with a bias are not modelled (" + name + ")");
  std::unique_ptr<Module> base;
  if (c.nf4) {
    base = std::make_unique<Linear4bit>(in, out, c.double_quant);
  } else {
    base = std::make_unique<Linear>(in, out, bias);
  }
  const auto& t = c.lora.targets;
  if (c.lora.rank > 0) {
    base->freeze();
    if (std::find(t.begin(), t.end(), name) != t.end()) {
      return std::make_unique<LoraLinear>(std::move(base), in, out, c.lora, c.nf4);
    }
  }
  return base;
}

/// LlamaAttention.forward with eager_attention_forward or sdpa_attention_forward.
class Attention final : public Module {
 public:
  explicit Attention(const DecoderConfig& c)
      : Module("LlamaAttention"), heads_(c.heads), kv_heads_(c.kv_heads), dim_(c.head_dim),
        dropout_(c.attention_dropout), impl_(c.attention) {
    q_ = &add_module("q_proj", projection(c, "q_proj", c.hidden, c.heads * c.head_dim, c.qkv_bias));
    k_ = &add_module("k_proj", projection(c, "k_proj", c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    v_ = &add_module("v_proj", projection(c, "v_proj", c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    o_ = &add_module("o_proj", projection(c, "o_proj", c.heads * c.head_dim, c.hidden, c.o_bias));
  }

  /// The mask and rotary tensors of the next call (LlamaAttention.forward's other arguments).
  void set_args(const DecoderState* args) noexcept { args_ = args; }
  /// Drops the eager attention weights LlamaAttention.forward returned, which its decoder
  /// layer holds (`hidden_states, self_attn_weights = self.self_attn(...)`) until it returns.
  void drop_weights() noexcept { weights_ = Tensor{}; }

  Tensor forward(const Tensor& x) override {
    if (args_ == nullptr) throw Error("internal: LlamaAttention runs through its decoder layer");
    const DecoderState& args = *args_;
    const std::int64_t b = x.size(0), s = x.size(1);
    const Shape hidden{b, s, -1, dim_};
    Tensor q = (*q_)(x).view(hidden).transpose(1, 2);
    Tensor k = (*k_)(x).view(hidden).transpose(1, 2);
    const Tensor v = (*v_)(x).view(hidden).transpose(1, 2);
    {
      // query_states, key_states = apply_rotary_pos_emb(...): the q before rotary lives
      // until both are rotated.
      const Tensor cos = args.cos.unsqueeze(1), sin = args.sin.unsqueeze(1);
      Tensor q_rot = apply_rotary(q, cos, sin);
      Tensor k_rot = apply_rotary(k, cos, sin);
      q = std::move(q_rot);
      k = std::move(k_rot);
    }
    Tensor out = impl_ == AttentionImpl::Eager ? eager(q, k, v, args.mask) : sdpa(q, k, v);
    out = out.reshape(Shape{b, s, -1});  // .reshape(*input_shape, -1).contiguous(): a view
    return (*o_)(out);
  }

 private:
  /// eager_attention_forward.
  Tensor eager(const Tensor& q, const Tensor& k_in, const Tensor& v_in, const Tensor& mask) {
    const Tensor k = repeat_kv(k_in, heads_ / kv_heads_);
    const Tensor v = repeat_kv(v_in, heads_ / kv_heads_);
    const std::int64_t s = q.size(2);
    Tensor w = mul_scalar(matmul(q, k.transpose(2, 3)), 1.0 / std::sqrt(static_cast<double>(dim_)));
    w = add(w, mask.narrow(1, 0, s).unsqueeze(0).unsqueeze(0));  // attention_mask[:, :, :, :S]
    w = to_dtype(softmax(w, DType::F32), q.dtype());
    w = dropout(w, dropout_, training());
    Tensor out = matmul(w, v).transpose(1, 2).contiguous();
    weights_ = std::move(w);  // returned with the output
    return out;
  }

  /// sdpa_attention_forward. transformers 4.x: repeat_kv, .contiguous() on q, k and v
  /// (copies of the views that are not). 5.x: no mask, so k and v go in with their key
  /// heads (enable_gqa=True) and q, k, v in the projections' [B, S, H, d] layout (stack.cpp).
  /// Then scaled_dot_product_attention(is_causal=True) and transpose(1, 2).contiguous(): a
  /// copy of flash's output when it follows a contiguous q, a view when it follows the
  /// projection's layout or comes from the memory-efficient kernel ([B, S, H, d]).
  Tensor sdpa(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in) {
    const Stack& stack = q_in.runtime().stack();
    // use_gqa_in_sdpa: no mask (causal SDPA here) and a head dim of at most 256 on CUDA.
    const std::int64_t groups = stack.sdpa_enable_gqa() && dim_ <= 256 ? 1 : heads_ / kv_heads_;
    const bool contiguous = stack.sdpa_contiguous_inputs();
    const Tensor k = contiguous ? repeat_kv(k_in, groups).contiguous() : repeat_kv(k_in, groups);
    const Tensor v = contiguous ? repeat_kv(v_in, groups).contiguous() : repeat_kv(v_in, groups);
    const Tensor q = contiguous ? q_in.contiguous() : q_in;
    // Under autocast the kernel sees half inputs (scaled_dot_product_attention is on the
    // lower-precision list), so the backend is picked by the dtype it will run in.
    const DType runs_in = q.runtime().autocast().value_or(q.dtype());
    const bool flash = impl_ == AttentionImpl::SdpaFlash || (impl_ == AttentionImpl::Sdpa && flash_supports(runs_in, dim_));
    const SdpaBackend backend = flash ? SdpaBackend::Flash : SdpaBackend::Efficient;
    return scaled_dot_product_attention(q, k, v, backend, true, dropout_, training()).transpose(1, 2).contiguous();
  }

  std::int64_t heads_, kv_heads_, dim_;
  double dropout_;
  AttentionImpl impl_;
  friend AttentionHeads mem::nn::attention_heads(const Module&);
  Module *q_, *k_, *v_, *o_;
  const DecoderState* args_ = nullptr;
  Tensor weights_;
};

/// Hands a decoder layer's attention its arguments for one call, and takes them (and the
/// eager weights the layer held) back when the layer returns or unwinds.
class AttentionCall {
 public:
  AttentionCall(Attention& attn, const DecoderState& args) noexcept : attn_(attn) { attn_.set_args(&args); }
  ~AttentionCall() {
    attn_.set_args(nullptr);
    attn_.drop_weights();
  }
  AttentionCall(const AttentionCall&) = delete;
  AttentionCall& operator=(const AttentionCall&) = delete;

 private:
  Attention& attn_;
};

/// LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = ACT2FN["silu"], a
/// module of its own (activations.py, SiLUActivation), so what silu saves is act_fn's.
class Mlp final : public Module {
 public:
  explicit Mlp(const DecoderConfig& c) : Module("LlamaMLP") {
    gate_ = &add_module("gate_proj", projection(c, "gate_proj", c.hidden, c.intermediate, c.mlp_bias));
    up_ = &add_module("up_proj", projection(c, "up_proj", c.hidden, c.intermediate, c.mlp_bias));
    down_ = &add_module("down_proj", projection(c, "down_proj", c.intermediate, c.hidden, c.mlp_bias));
    act_ = &add_module("act_fn", std::make_unique<SiLU>(false));
  }
  Tensor forward(const Tensor& x) override {
    Tensor gated;
    {
      const Tensor act = (*act_)((*gate_)(x));
      gated = mul(act, (*up_)(x));
    }
    return (*down_)(gated);
  }

 private:
  Module *gate_, *up_, *down_, *act_;
};

/// LlamaDecoderLayer: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm).
class DecoderLayer final : public Module {
 public:
  DecoderLayer(const DecoderConfig& c, State state) : Module("LlamaDecoderLayer"), state_(std::move(state)) {
    attn_ = &add_module("self_attn", std::make_unique<Attention>(c));
    mlp_ = &add_module("mlp", std::make_unique<Mlp>(c));
    ln1_ = &add_module("input_layernorm", std::make_unique<RMSNorm>(c.hidden, c.rms_eps));
    ln2_ = &add_module("post_attention_layernorm", std::make_unique<RMSNorm>(c.hidden, c.rms_eps));
    if (c.lora.rank > 0) {
      ln1_->freeze();
      ln2_->freeze();
    }
  }

  Tensor forward(const Tensor& x) override {
    DecoderState args;
    if (state_->cos.defined()) {
      args = *state_;
      // Under checkpoint(), the layer's arguments (mask, cos and sin) stay with the checkpoint
      // until it recomputes in backward, after LlamaModel.forward returned. One forward's
      // worth: a second forward before the backward replaces them; under pipeline parallel
      // each micro-batch's call keeps its own, recomputed in the order they ran.
      if (checkpointed_call()) {
        if (!state_->per_call) held_.clear();
        held_.emplace_back(state_->step, args);
      }
    } else if (const DecoderState* again = rerun_args()) {
      args = *again;
    } else {
      while (!held_.empty() && held_.front().first != state_->step) held_.pop_front();  // a step's leftovers
      if (held_.empty()) throw Error("internal: " + path() + " ran without LlamaModel's inputs");
      args = std::move(held_.front().second);
      held_.pop_front();
      // A rerun inside a backward that keeps its graph (a zero-bubble schedule's I) is not the
      // checkpoint's last: its W reruns the segment with the same arguments, which torch's
      // checkpoint keeps with its frame until the frame goes.
      if (detail::retaining_graph()) rerun_args_.emplace_back(detail::save_hook().frame->weak_from_this(), args);
    }
    AttentionCall call(static_cast<Attention&>(*attn_), args);
    Tensor h;
    {
      Tensor attended;
      {
        // hidden_states = self_attn(input_layernorm(x)): the norm's output is dropped when
        // the name is rebound, before the residual sum.
        const Tensor normed = (*ln1_)(x);
        attended = (*attn_)(normed);
      }
      h = add(x, attended);
    }
    Tensor normed = (*ln2_)(h);
    normed = (*mlp_)(normed);
    return add(h, normed);
  }

 private:
  /// The arguments an earlier rerun of this rerun's checkpoint took, if one kept them.
  const DecoderState* rerun_args() {
    std::erase_if(rerun_args_, [](const auto& kept) { return kept.first.expired(); });
    const detail::CheckpointFrame* frame = detail::save_hook().frame;
    for (const auto& [kept, args] : rerun_args_) {
      if (kept.lock().get() == frame) return &args;
    }
    return nullptr;
  }

  State state_;
  std::deque<std::pair<std::uint64_t, DecoderState>> held_;  ///< (step, inputs) of calls not recomputed yet
  /// Arguments kept for a checkpoint's later reruns, while its frame lives.
  std::vector<std::pair<std::weak_ptr<detail::CheckpointFrame>, DecoderState>> rerun_args_;
  Module *attn_, *mlp_, *ln1_, *ln2_;
};

/// model.norm, where LlamaModel.forward returns and drops its locals.
class ModelNorm final : public RMSNorm {
 public:
  ModelNorm(std::int64_t features, double eps, State state) : RMSNorm(features, eps), state_(std::move(state)) {}
  Tensor forward(const Tensor& x) override {
    Tensor out = RMSNorm::forward(x);
    state_->clear();
    return out;
  }

 private:
  State state_;
};

}  // namespace

std::string_view attention_name(AttentionImpl impl) noexcept {
  switch (impl) {
    case AttentionImpl::Eager: return "eager";
    case AttentionImpl::Sdpa: return "sdpa";
    case AttentionImpl::SdpaFlash: return "sdpa-flash";
    case AttentionImpl::SdpaEfficient: return "sdpa-efficient";
  }
  return "?";
}

AttentionImpl parse_attention(std::string_view name) {
  if (name == "eager") return AttentionImpl::Eager;
  if (name == "sdpa") return AttentionImpl::Sdpa;
  if (name == "sdpa-flash") return AttentionImpl::SdpaFlash;
  if (name == "sdpa-efficient") return AttentionImpl::SdpaEfficient;
  throw Error("unknown attention '" + std::string(name) +
              "'; valid: eager, sdpa (flash for f16 / bf16, efficient for f32), sdpa-flash, sdpa-efficient");
}

RMSNorm::RMSNorm(std::int64_t features, double eps) : Module("LlamaRMSNorm"), eps_(eps) {
  weight_ = add_parameter("weight", Shape{features}, 1.0, 1.0);  // torch.ones
}

Tensor RMSNorm::forward(const Tensor& input) {
  const DType input_dtype = input.dtype();
  Tensor hidden = to_dtype(input, DType::F32);
  const Tensor variance = mean_last(square(hidden));
  hidden = mul(hidden, rsqrt(add_scalar(variance, eps_)));
  return mul(param(weight_), to_dtype(hidden, input_dtype));
}

Linear4bit::Linear4bit(std::int64_t in, std::int64_t out, bool double_quant)
    : Module("Linear4bit"), in_(in), out_(out), double_quant_(double_quant) {
  const std::int64_t n = in * out;  // checked by decoder_parameter_count before any build
  const std::int64_t blocks = n / 64 + (n % 64 != 0);
  packed_ = add_packed_parameter("weight", n / 2 + n % 2, n);
  absmax_ = add_typed_buffer("quant_state.absmax", Shape{blocks}, double_quant ? DType::U8 : DType::F32);
  if (double_quant) {
    nested_ = add_typed_buffer("quant_state.nested_absmax", Shape{blocks / 256 + (blocks % 256 != 0)}, DType::F32);
    offset_ = add_typed_buffer("quant_state.offset", Shape{}, DType::F32);
  } else {
    nested_ = offset_ = 0;
  }
  code_ = add_typed_buffer("quant_state.code", Shape{16}, DType::F32);
}

void Linear4bit::hold_dynamic_map() { add_typed_buffer("bnb_dynamic_map", Shape{256}, DType::F32); }

Tensor Linear4bit::forward(const Tensor& x) {
  Nf4Weight w;
  w.packed = param(packed_);
  w.absmax = param(absmax_);
  if (double_quant_) {
    w.nested_absmax = param(nested_);
    w.offset = param(offset_);
  }
  w.code = param(code_);
  w.out = out_;
  w.in = in_;
  w.dtype = load_dtype_;
  w.double_quant = double_quant_;
  return matmul_4bit(x, w);
}

LoraLinear::LoraLinear(std::unique_ptr<Module> base, std::int64_t in, std::int64_t out, const LoraConfig& lora,
                       bool quantized_base)
    : Module("lora.Linear"), scaling_(lora.alpha / static_cast<double>(lora.rank)), quantized_base_(quantized_base) {
  base_ = &add_module("base_layer", std::move(base));
  // lora_dropout is nn.Identity when p == 0 (LoraLayer.update_layer).
  std::unique_ptr<Module> drop;
  if (lora.dropout > 0) {
    drop = std::make_unique<Dropout>(lora.dropout);
  } else {
    drop = std::make_unique<Identity>();
  }
  dropout_ = &add_module("lora_dropout.default", std::move(drop));
  a_ = &add_module("lora_A.default", std::make_unique<Linear>(in, lora.rank, false));
  b_ = &add_module("lora_B.default", std::make_unique<Linear>(lora.rank, out, false));
  // get_peft_model(autocast_adapter_dtype=True) makes f16 / bf16 adapters f32.
  a_->keep_f32();
  b_->keep_f32();
}

Tensor LoraLinear::forward(const Tensor& x_in) {
  if (quantized_base_) {
    // peft/tuners/lora/bnb.py, Linear4bit.forward: result.clone() ("for 4bit, we need to
    // defensively clone here"); x cast to the adapters' dtype unless autocast is on; the
    // update cast to the result's dtype before the sum.
    Tensor result = clone((*base_)(x_in));
    const bool convert = !x_in.runtime().autocast().has_value();
    const Tensor x = convert ? to_dtype(x_in, static_cast<Linear&>(*a_).weight().dtype()) : x_in;
    Tensor update;
    {
      const Tensor down = (*a_)((*dropout_)(x));
      update = to_dtype(mul_scalar((*b_)(down), scaling_), result.dtype());
    }
    return add(result, update);
  }
  Tensor result = (*base_)(x_in);
  const DType result_dtype = result.dtype();
  // x = x.to(lora_A.weight.dtype): an f32 copy under a bf16 or f16 model.
  const Tensor x = to_dtype(x_in, static_cast<Linear&>(*a_).weight().dtype());
  {
    // result = result + lora_B(lora_A(dropout(x))) * scaling: the temporaries die with the
    // statement, before .to(); the sum is f32 when the adapters are.
    const Tensor down = (*a_)((*dropout_)(x));
    const Tensor update = mul_scalar((*b_)(down), scaling_);
    result = add(result, update);
  }
  return to_dtype(result, result_dtype);
}

namespace {

/// a * b, or an error naming what overflowed: a config's sizes are untrusted.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw Error(std::string(what) + ": " + std::to_string(a) + " x " + std::to_string(b) +
                " overflows; no device holds such a model");
  }
  return out;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) throw Error(std::string(what) + ": the parameter count overflows");
  return out;
}

}  // namespace

AttentionHeads attention_heads(const Module& attention) {
  const auto* a = dynamic_cast<const Attention*>(&attention);
  if (a == nullptr) throw Error(attention.path() + " is not a decoder's attention");
  return {a->heads_, a->kv_heads_, a->impl_ == AttentionImpl::Eager};
}

void set_sequence_shards(Module& rotary, std::int64_t shards) {
  auto* inputs = dynamic_cast<DecoderInputs*>(&rotary);
  if (inputs == nullptr) throw Error(rotary.path() + " is not a decoder's rotary embedding");
  inputs->set_sequence_shards(shards);
}

void hold_inputs_per_call(Module& rotary, std::uint64_t step) {
  auto* inputs = dynamic_cast<DecoderInputs*>(&rotary);
  if (inputs == nullptr) throw Error(rotary.path() + " is not a decoder's rotary embedding");
  inputs->hold_per_call(step);
}

void release_decoder_inputs(Module& rotary) {
  auto* inputs = dynamic_cast<DecoderInputs*>(&rotary);
  if (inputs == nullptr) throw Error(rotary.path() + " is not a decoder's rotary embedding");
  inputs->release();
}

std::unique_ptr<Sequential> build_decoder(const DecoderConfig& c) {
  const auto positive = [](const char* key, std::int64_t v) {
    if (v <= 0) throw Error(std::string(key) + ": expected a positive integer, got " + std::to_string(v));
  };
  positive("vocab_size", c.vocab);
  positive("hidden_size", c.hidden);
  positive("intermediate_size", c.intermediate);
  positive("num_hidden_layers", c.layers);
  positive("num_attention_heads", c.heads);
  positive("num_key_value_heads", c.kv_heads);
  positive("head_dim", c.head_dim);
  if (c.heads % c.kv_heads != 0) {
    throw Error("num_attention_heads " + std::to_string(c.heads) + " is not a multiple of num_key_value_heads " +
                std::to_string(c.kv_heads));
  }
  if (c.head_dim % 2 != 0) throw Error("head_dim " + std::to_string(c.head_dim) + " is odd; rotary needs halves");
  // Every weight's element count must be a number before a module is built.
  (void)decoder_parameter_count(c);
  const bool lora = c.lora.rank > 0;
  auto state = std::make_shared<DecoderState>();
  auto body = std::make_unique<Sequential>();
  auto& embed = static_cast<Embedding&>(
      body->append("model.embed_tokens", std::make_unique<Embedding>(c.vocab, c.hidden, 0.02 * std::sqrt(3.0))));
  // gradient_checkpointing_enable() on a PEFT model calls enable_input_require_grads(): a
  // forward hook makes the frozen embedding's output require grad, so the checkpointed layers
  // see an input that does.
  if (lora && c.checkpoint != CheckpointMark::None) embed.set_output_requires_grad();
  body->append("model.rotary_emb", std::make_unique<DecoderInputs>(c, state, c.rope_theta));
  for (std::int64_t i = 0; i < c.layers; ++i) {
    Module& layer = body->append("model.layers." + std::to_string(i), std::make_unique<DecoderLayer>(c, state));
    layer.set_checkpoint(c.checkpoint);
  }
  body->append("model.norm", std::make_unique<ModelNorm>(c.hidden, c.rms_eps, state));
  if (c.tie_embeddings) {
    auto& head = static_cast<TiedLinear&>(body->append("lm_head", std::make_unique<TiedLinear>(embed, c.built_on_gpu)));
    if (c.fused_linear_cross_entropy) head.apply_in_loss();
  } else {
    auto& head = static_cast<Linear&>(body->append("lm_head", std::make_unique<Linear>(c.hidden, c.vocab, false)));
    if (c.fused_linear_cross_entropy) head.apply_in_loss();
  }
  if (c.nf4 && c.double_quant) {
    // Double quantization's code, bitsandbytes' "dynamic" map: 256 f32 shared by every 4-bit
    // weight (functional.py, name2qmap), on the device with the first one quantized.
    const std::function<Linear4bit*(Module&)> first = [&](Module& m) -> Linear4bit* {
      if (auto* q = dynamic_cast<Linear4bit*>(&m)) return q;
      for (auto& [name, child] : m.children()) {
        if (Linear4bit* q = first(*child)) return q;
      }
      return nullptr;
    };
    if (Linear4bit* q = first(*body)) q->hold_dynamic_map();
  }
  if (lora) {
    embed.freeze();
    body->at(body->size() - 2).freeze();
    body->at(body->size() - 1).freeze();
  }
  return body;
}

std::int64_t decoder_parameter_count(const DecoderConfig& c) {
  const char* what = "decoder size";
  const std::int64_t q = checked_mul(c.heads, c.head_dim, what), kv = checked_mul(c.kv_heads, c.head_dim, what);
  const auto weight = [&](std::int64_t in, std::int64_t out) { return checked_mul(in, out, what); };
  std::int64_t attn = checked_add(checked_add(weight(c.hidden, q), checked_mul(2, weight(c.hidden, kv), what), what),
                                  weight(q, c.hidden), what);
  if (c.qkv_bias) attn = checked_add(attn, checked_add(q, checked_mul(2, kv, what), what), what);
  if (c.o_bias) attn = checked_add(attn, c.hidden, what);
  std::int64_t mlp = checked_mul(3, weight(c.hidden, c.intermediate), what);
  if (c.mlp_bias) mlp = checked_add(mlp, checked_add(checked_mul(2, c.intermediate, what), c.hidden, what), what);
  std::int64_t lora = 0;
  if (c.lora.rank > 0) {
    const auto adapter = [&](const char* name, std::int64_t in, std::int64_t out) -> std::int64_t {
      const auto& t = c.lora.targets;
      return std::find(t.begin(), t.end(), name) != t.end() ? checked_mul(c.lora.rank, checked_add(in, out, what), what)
                                                            : 0;
    };
    for (const auto& [name, in, out] : {std::tuple{"q_proj", c.hidden, q}, std::tuple{"k_proj", c.hidden, kv},
                                        std::tuple{"v_proj", c.hidden, kv}, std::tuple{"o_proj", q, c.hidden},
                                        std::tuple{"gate_proj", c.hidden, c.intermediate},
                                        std::tuple{"up_proj", c.hidden, c.intermediate},
                                        std::tuple{"down_proj", c.intermediate, c.hidden}}) {
      lora = checked_add(lora, adapter(name, in, out), what);
    }
  }
  const std::int64_t layer = checked_add(checked_add(attn, mlp, what), checked_add(2 * c.hidden, lora, what), what);
  const std::int64_t embeddings = checked_mul(weight(c.vocab, c.hidden), c.tie_embeddings ? 1 : 2, what);
  return checked_add(checked_add(embeddings, checked_mul(c.layers, layer, what), what), c.hidden, what);
}

}  // namespace mem::nn
