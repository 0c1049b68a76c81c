// ops_attention.cpp — torch.nn.functional.scaled_dot_product_attention on its fused CUDA
// backends (flash and memory-efficient): what each allocates, saves and takes as
// workspace. Eager attention is not here: it is matmul, softmax and dropout, written
// out by the modules that use it, as Hugging Face writes it.
#include <cmath>
#include <limits>
#include <optional>

#include "engine/detail.hpp"
#include "ops/sdpa_kernels.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

/// Shape of the logsumexp each backend keeps, f32. Flash: softmax_lse {B, H, S}
/// (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_fwd). Efficient:
/// {B, H, ceil(S / 32) * 32} (attention.cu, _efficient_attention_forward, kAlignLSE = 32).
Shape lse_shape(SdpaBackend backend, std::int64_t b, std::int64_t h, std::int64_t s) {
  return backend == SdpaBackend::Flash ? Shape{b, h, s} : Shape{b, h, round_up(s, 32)};
}

/// [B, S, H, d] storage seen as [B, H, S, d]: the memory-efficient kernel's output
/// (_efficient_attention_forward: at::empty({B, M, num_heads, Kv}), returned transposed).
Tensor bshd(Runtime& rt, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, DType dtype) {
  Tensor t = empty(rt, Shape{b, s, h, d}, dtype);
  return t.transpose(1, 2);
}

/// A tensor of `like`'s shape in `like`'s memory layout (at::empty_like, preserve_format): the
/// flash kernel's output (mha_fwd: empty_like(q) of q transposed to [B, S, H, d]) and both
/// backends' gradients of q, k and v (empty_like / empty_strided of the inputs).
Tensor like(const Tensor& t) { return detail::empty_following(t, t.shape(), t.dtype()); }

/// Reference math of causal or full attention with grouped keys (head i of q reads head
/// i / (H / H_kv) of k and v), in compute mode only: out and the row logsumexp.
template <class T>
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                       const Tensor& out, const Tensor& lse) {
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3), hk = k.size(1), sk = k.size(2);
  HostIn<T> Q(q), K(k), V(v);
  std::vector<T> o(static_cast<std::size_t>(q.numel())), l(static_cast<std::size_t>(b * h * s));
  std::vector<T> p(static_cast<std::size_t>(sk));
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t hi = 0; hi < h; ++hi) {
      const std::int64_t kh = hi / (h / hk);
      for (std::int64_t i = 0; i < s; ++i) {
        const T* qr = &Q[((bi * h + hi) * s + i) * d];
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < sk; ++j) {
          const T* kr = &K[((bi * hk + kh) * sk + j) * d];
          T dot{0};
          for (std::int64_t c = 0; c < d; ++c) dot += qr[c] * kr[c];
          p[j] = causal && j > i ? -std::numeric_limits<T>::infinity() : dot * static_cast<T>(scale);
          mx = std::max(mx, p[j]);
        }
        T sum{0};
        for (std::int64_t j = 0; j < sk; ++j) sum += p[j] = std::exp(p[j] - mx);
        l[((bi * h + hi) * s + i)] = mx + std::log(sum);
        T* orow = &o[((bi * h + hi) * s + i) * d];
        for (std::int64_t j = 0; j < sk; ++j) {
          const T* vr = &V[((bi * hk + kh) * sk + j) * d];
          for (std::int64_t c = 0; c < d; ++c) orow[c] += p[j] / sum * vr[c];
        }
      }
    }
  }
  detail::store_logical(out, o);
  if (!lse.defined()) return;
  HostOut<T> L(lse);
  for (std::int64_t bi = 0; bi < b * h; ++bi) {
    for (std::int64_t i = 0; i < s; ++i) L[bi * lse.size(2) + i] = l[bi * s + i];
  }
}

template <class T>
void attention_backward(const Tensor& go, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                      bool causal, double scale, const Tensor& gq, const Tensor& gk, const Tensor& gv) {
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3), hk = k.size(1), sk = k.size(2);
  HostIn<T> Q(q), K(k), V(v), O(o), G(go);
  std::vector<T> dq(static_cast<std::size_t>(q.numel())), dk(static_cast<std::size_t>(k.numel())),
      dv(static_cast<std::size_t>(v.numel())), p(static_cast<std::size_t>(sk)), dp(static_cast<std::size_t>(sk));
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t hi = 0; hi < h; ++hi) {
      const std::int64_t kh = hi / (h / hk);
      for (std::int64_t i = 0; i < s; ++i) {
        const std::int64_t qi = ((bi * h + hi) * s + i) * d;
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < sk; ++j) {
          T dot{0};
          for (std::int64_t c = 0; c < d; ++c) dot += Q[qi + c] * K[((bi * hk + kh) * sk + j) * d + c];
          p[j] = causal && j > i ? -std::numeric_limits<T>::infinity() : dot * static_cast<T>(scale);
          mx = std::max(mx, p[j]);
        }
        T sum{0};
        for (std::int64_t j = 0; j < sk; ++j) sum += p[j] = std::exp(p[j] - mx);
        T delta{0};
        for (std::int64_t c = 0; c < d; ++c) delta += G[qi + c] * O[qi + c];
        for (std::int64_t j = 0; j < sk; ++j) {
          p[j] /= sum;
          const std::int64_t kv = ((bi * hk + kh) * sk + j) * d;
          T dot{0};
          for (std::int64_t c = 0; c < d; ++c) {
            dot += G[qi + c] * V[kv + c];
            dv[kv + c] += p[j] * G[qi + c];
          }
          dp[j] = p[j] * (dot - delta) * static_cast<T>(scale);
          for (std::int64_t c = 0; c < d; ++c) {
            dq[qi + c] += dp[j] * K[kv + c];
            dk[kv + c] += dp[j] * Q[qi + c];
          }
        }
      }
    }
  }
  detail::store_logical(gq, dq);
  detail::store_logical(gk, dk);
  detail::store_logical(gv, dv);
}


/// Whether `t` [B, H, S, d] is a dense [B, S, H, d] tensor seen through transpose(1, 2): the
/// layout the flash kernel reads, so .contiguous() of its transpose copies nothing.
bool bshd_dense(const Tensor& t) {
  const std::int64_t s = t.size(2), h = t.size(1), d = t.size(3);
  return t.strides()[3] == 1 && t.strides()[1] == d && t.strides()[2] == h * d && t.strides()[0] == s * h * d;
}

/// _scaled_dot_product_{flash,efficient}_attention backward. Saves query, key, value,
/// output and logsumexp (derivatives.yaml); under context parallel the ring's merged output
/// and logsumexp, and the rng state of the kernel call the ring returns.
class SdpaBackward final : public Node {
 public:
  SdpaBackward(SdpaBackend backend, bool causal, std::optional<ContextParallel> ring)
      : backend_(backend), causal_(causal), ring_(ring) {}
  SavedTensor q_, k_, v_, out_, lse_;
  std::vector<SavedTensor> rng_;
  TensorList apply(TensorList& grads) override {
    // Unpacked in this order (a checkpointed layer's recompute starts at the first).
    const Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), out = out_.unpack();
    std::vector<Tensor> g =
        ring_ ? detail::ring_attention_backward(grads[0], q, k, v, out, lse_.unpack(), backend_, causal_, *ring_)
              : detail::sdpa_backward_kernel(grads[0], q, k, v, out, backend_, causal_);
    return {g[0], g[1], g[2]};
  }
  void release_variables() noexcept override {
    for (SavedTensor* t : {&q_, &k_, &v_, &out_, &lse_}) t->reset();
    for (SavedTensor& t : rng_) t.reset();
  }
  std::string_view name() const noexcept override {
    return backend_ == SdpaBackend::Flash ? "ScaledDotProductFlashAttentionBackward0"
                                          : "ScaledDotProductEfficientAttentionBackward0";
  }

 private:
  SdpaBackend backend_;
  bool causal_;
  std::optional<ContextParallel> ring_;
};

/// flash_api.cpp's num_splits_heuristic: how many blocks of keys the forward kernel splits a
/// query block's work into when batch x heads x query blocks of 64 leave the SMs (two blocks
/// each) under 80% busy: the split count whose waves are within 85% of the best efficiency.
int flash_num_splits(std::int64_t batch_heads_mblocks, std::int64_t sm_slots, std::int64_t n_blocks) {
  if (static_cast<double>(batch_heads_mblocks) >= 0.8 * static_cast<double>(sm_slots)) return 1;
  const std::int64_t max_splits = std::min({std::int64_t{128}, sm_slots, n_blocks});
  const auto ceildiv = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const auto eligible = [&](std::int64_t n) { return n == 1 || ceildiv(n_blocks, n) != ceildiv(n_blocks, n - 1); };
  std::vector<double> efficiency;
  double best = 0;
  for (std::int64_t n = 1; n <= max_splits; ++n) {
    const double waves = static_cast<double>(batch_heads_mblocks * n) / static_cast<double>(sm_slots);
    efficiency.push_back(eligible(n) ? waves / std::ceil(waves) : 0.0);
    best = std::max(best, efficiency.back());
  }
  for (std::int64_t n = 1; n <= max_splits; ++n) {
    if (eligible(n) && efficiency[static_cast<std::size_t>(n - 1)] >= 0.85 * best) return static_cast<int>(n);
  }
  return 1;
}

}  // namespace

namespace detail {

SdpaOutputs sdpa_forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v, SdpaBackend backend, bool causal,
                                bool need_lse, double dropout) {
  Runtime& rt = q.runtime();
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3);
  SdpaOutputs o;
  o.out = backend == SdpaBackend::Flash ? like(q) : bshd(rt, b, h, s, d, q.dtype());
  if (backend == SdpaBackend::Flash || need_lse) o.lse = empty(rt, lse_shape(backend, b, h, s), DType::F32);
  // Split-KV (set_params_splitkv, no dropout): partial results per split, softmax_lse_accum
  // {splits, B, H, Sq} and out_accum {splits, B, H, Sq, d rounded}, f32, for the kernel's
  // duration; blocks of 256 keys up to a head dim of 64, 128 up to 128, else 64.
  Tensor lse_accum, out_accum;
  if (const int sms = rt.allocator().device().info().multiprocessors; backend == SdpaBackend::Flash && sms > 0 && dropout == 0) {
    const std::int64_t block_n = d <= 64 ? 256 : d <= 128 ? 128 : 64;
    const int splits =
        flash_num_splits(b * h * ((s + 63) / 64), 2 * std::int64_t{sms}, (k.size(2) + block_n - 1) / block_n);
    if (splits > 1) {
      lse_accum = empty(rt, Shape{splits, b, h, s}, DType::F32);
      out_accum = empty(rt, Shape{splits, b, h, s, round_up(d, d <= 128 ? 32 : 64)}, DType::F32);
    }
  }
  if (backend == SdpaBackend::Flash) {
    // rng_state = at::empty({2}, kUInt64) and `unused` = at::empty({}, kUInt64), on the device.
    o.rng.push_back(empty(rt, Shape{2}, DType::I64));
    o.rng.push_back(empty(rt, Shape{}, DType::I64));
  }
  lse_accum = Tensor{};
  out_accum = Tensor{};
  rt.add_flops(4.0 * static_cast<double>(b * h * s * k.size(2) * d));
  if (rt.computing()) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    dispatch(q.dtype(), [&](auto tag) { attention_forward<decltype(tag)>(q, k, v, causal, scale, o.out, o.lse); });
  }
  return o;
}

std::vector<Tensor> sdpa_backward_kernel(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, SdpaBackend backend, bool causal) {
  Runtime& rt = grad_out.runtime();
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3);
  std::vector<Tensor> g(3);
  if (backend == SdpaBackend::Flash) {
    // _flash_attention_backward takes grad_out.contiguous() and out.contiguous() in [B, S, H, d]
    // (a copy each for the duration when not in that layout: HF's 4.x contiguous q makes the
    // output [B, H, S, d]); mha_bwd then makes dq, dk, dv (empty_like), softmax_d {B, H, S
    // rounded to 128} and dq_accum {B, S rounded to 128, H, d rounded to 32 (64 above 128)},
    // both f32 (flash_api.cpp), freed in reverse: the order an H200 shows (PyTorch 2.11).
    Tensor dout_copy = bshd_dense(grad_out) ? Tensor{} : empty_like(grad_out);
    Tensor out_copy = bshd_dense(out) ? Tensor{} : empty_like(out);
    g = {like(q), like(k), like(v)};
    Tensor softmax_d = empty(rt, Shape{b, h, round_up(s, 128)}, DType::F32);
    Tensor dq_accum = empty(rt, Shape{b, round_up(s, 128), h, round_up(d, d <= 128 ? 32 : 64)}, DType::F32);
    dq_accum = Tensor{};
    softmax_d = Tensor{};
  } else {
    // _efficient_attention_backward: delta {B, H, S} f32 first; its kernel-dependent byte
    // workspace (gradient accumulators per key block) is not modelled.
    Tensor delta = empty(rt, Shape{b, h, s}, DType::F32);
    g = {like(q), like(k), like(v)};
  }
  rt.add_flops(10.0 * static_cast<double>(b * h * s * k.size(2) * d));
  if (rt.computing()) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    dispatch(q.dtype(), [&](auto tag) {
      attention_backward<decltype(tag)>(grad_out, q, k, v, out, causal, scale, g[0], g[1], g[2]);
    });
  }
  return g;
}

}  // namespace detail

bool flash_supports(DType dtype, std::int64_t head_dim) noexcept {
  // sdp_utils.cpp, check_head_dim_size_flash / check_flash_attention_datatype (PyTorch 2.5).
  return is_half(dtype) && head_dim % 8 == 0 && head_dim <= 256;
}

std::string_view sdpa_backend_name(SdpaBackend backend) noexcept {
  return backend == SdpaBackend::Flash ? "flash" : "efficient";
}

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, SdpaBackend backend,
                                    bool causal, double dropout, bool training) {
  detail::OutputCache cache = detail::take_output_cache();  // a selective checkpoint's kept outputs
  // Autocast runs it in the half type (autocast_mode.cpp: lower-precision list): f32 inputs
  // are cast first, one copy each.
  const Tensor q = detail::autocast_half(q_in), k = detail::autocast_half(k_in), v = detail::autocast_half(v_in);
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || !(k.shape() == v.shape()) || q.size(0) != k.size(0) ||
      q.size(3) != k.size(3) || k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    throw Error("scaled_dot_product_attention: query " + q.shape().str() + ", key " + k.shape().str() +
                " and value " + v.shape().str() + " are not [B, H, S, d] with H a multiple of the key heads");
  }
  if (backend == SdpaBackend::Flash && !flash_supports(q.dtype(), q.size(3))) {
    throw Error("scaled_dot_product_attention: the flash backend takes f16 or bf16 inputs with a head dim that is a "
                "multiple of 8 up to 256, not " + std::string(dtype_name(q.dtype())) + " with " +
                std::to_string(q.size(3)) + "; use the efficient backend or eager attention");
  }
  Runtime& rt = q.runtime();
  // On sm90 and later PyTorch 2.11 runs SDPA on cuDNN's attention kernels: on the H100 a
  // process that ran only SDPA and GEMMs shows cuDNN's kernels after the step
  // (../shared/gpu-reference; sim_device.cpp). Elsewhere flash and the memory-efficient
  // kernel live in libtorch_cuda itself.
  if (rt.allocator().device().info().compute_capability >= 90) rt.uses_cudnn();
  // Inside context_parallel(): the rank's share of the sequence attends around the ring.
  if (const std::optional<ContextParallel>& ring = rt.context_parallel()) {
    if (cache.reused() || cache.kept != nullptr) {
      throw Error("scaled_dot_product_attention: a selective checkpoint policy's kept attention outputs under "
                  "context parallel are not modelled yet; checkpoint whole layers (--gradient-checkpointing)");
    }
    detail::SdpaOutputs result = detail::ring_attention_forward(q, k, v, backend, causal, training ? dropout : 0.0, *ring);
    if (needs_grad({&q, &k, &v})) {
      auto node = detail::make_node<SdpaBackward>({&q, &k, &v}, backend, causal, ring);
      node->q_.save(q);
      node->k_.save(k);
      node->v_.save(v);
      node->lse_.save(result.lse);
      for (const Tensor& t : result.rng) node->rng_.emplace_back().save(t);
      set_history(result.out, node);
      node->out_.save_output(result.out);
    }
    return result.out;
  }
  if (training && dropout > 0 && rt.computing()) {
    throw Error("scaled_dot_product_attention: dropout is simulated in dry runs only; use eager attention to compute");
  }
  const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const bool grad = needs_grad({&q, &k, &v});
  Tensor out = cache.output(0, [&] { return backend == SdpaBackend::Flash ? like(q) : bshd(rt, b, h, s, d, q.dtype()); });
  // Flash always writes softmax_lse; the efficient kernel only when a gradient will need it
  // (compute_logsumexp: logsumexp_dim is 0 otherwise).
  Tensor lse = cache.output(1, [&] {
    return backend == SdpaBackend::Flash || grad ? empty(rt, lse_shape(backend, b, h, s), DType::F32) : Tensor{};
  });
  // The philox seed and offset that regenerate the dropout mask in backward are 0-dim i64
  // tensors on the host in PyTorch 2.5 (flash_api.cpp and attention.cu, `at::empty({},
  // at::dtype(at::kLong))` outside CUDA-graph capture): no device memory.
  if (!cache.reused()) rt.add_flops(4.0 * static_cast<double>(b * h * s * k.size(2) * d));
  if (rt.computing() && !cache.reused()) {
    detail::dispatch(q.dtype(), [&](auto tag) {
      attention_forward<decltype(tag)>(q, k, v, causal, scale, out, lse);
    });
  }
  if (grad) {
    auto node = detail::make_node<SdpaBackward>({&q, &k, &v}, backend, causal, std::nullopt);
    node->q_.save(q);
    node->k_.save(k);
    node->v_.save(v);
    node->lse_.save(lse);
    set_history(out, node);
    node->out_.save_output(out);
  }
  return out;
}

}  // namespace mem::nn
