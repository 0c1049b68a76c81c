// ops_attention.cpp — torch.nn.functional.scaled_dot_product_attention on its fused CUDA
// backends (flash and memory-efficient): what each allocates, saves and takes as
// workspace. Eager attention is not here: it is matmul, softmax and dropout, written
// out by the modules that use it, as Hugging Face writes it.
#include <cmath>
#include <limits>

#include "engine/detail.hpp"

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

/// _scaled_dot_product_{flash,efficient}_attention backward. Saves query, key, value,
/// output and logsumexp (derivatives.yaml), plus the philox seed and offset when dropout
/// is on. Backward allocates dq, dk, dv in [B, S, H, d] and the backend's f32 workspace
/// for the duration of the kernel (see workspace()).
class SdpaBackward final : public Node {
 public:
  SdpaBackward(SdpaBackend backend, bool causal, double scale) : backend_(backend), causal_(causal), scale_(scale) {}
  SavedTensor q_, k_, v_, out_, lse_;
  TensorList apply(TensorList& grads) override {
    const Tensor& go = grads[0];
    const Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), o = out_.unpack();
    Runtime& rt = go.runtime();
    const std::int64_t b = q.size(0), h = q.size(1), s = q.size(2), d = q.size(3);
    // _flash_attention_backward takes out.contiguous() in [B, S, H, d]: a copy for the
    // duration when the output is not in that layout (HF's contiguous q makes it [B, H, S, d]).
    const bool bshd_dense = o.strides()[3] == 1 && o.strides()[1] == d && o.strides()[2] == h * d &&
                            o.strides()[0] == s * h * d;
    [[maybe_unused]] Tensor out_copy;
    if (backend_ == SdpaBackend::Flash && !bshd_dense) out_copy = empty_like(o);
    std::vector<Tensor> work = workspace(rt, b, h, s, d);
    Tensor gq = like(q), gk = like(k), gv = like(v);
    rt.add_flops(10.0 * static_cast<double>(b * h * s * k.size(2) * d));
    if (rt.computing()) {
      detail::dispatch(q.dtype(), [&](auto tag) { compute<decltype(tag)>(go, q, k, v, o, gq, gk, gv); });
    }
    return {gq, gk, gv};
  }
  void release_variables() noexcept override {
    for (SavedTensor* t : {&q_, &k_, &v_, &out_, &lse_}) t->reset();
  }
  std::string_view name() const noexcept override {
    return backend_ == SdpaBackend::Flash ? "ScaledDotProductFlashAttentionBackward0"
                                          : "ScaledDotProductEfficientAttentionBackward0";
  }

 private:
  /// Flash (flash_api.cpp, mha_bwd): softmax_d {B, H, S rounded to 128} and dq_accum
  /// {B, S rounded to 128, H, d rounded to 32 (64 above 128)}, both f32. Efficient
  /// (attention_backward.cu, _efficient_attention_backward): delta {B, H, S} f32; its
  /// kernel-dependent byte workspace (gradient accumulators per key block) is not modelled.
  std::vector<Tensor> workspace(Runtime& rt, std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const {
    std::vector<Tensor> w;
    if (backend_ == SdpaBackend::Flash) {
      w.push_back(empty(rt, Shape{b, h, round_up(s, 128)}, DType::F32));
      w.push_back(empty(rt, Shape{b, round_up(s, 128), h, round_up(d, d <= 128 ? 32 : 64)}, DType::F32));
    } else {
      w.push_back(empty(rt, Shape{b, h, s}, DType::F32));
    }
    return w;
  }

  template <class T>
  void compute(const Tensor& go, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
               const Tensor& gq, const Tensor& gk, const Tensor& gv) const {
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
            p[j] = causal_ && j > i ? -std::numeric_limits<T>::infinity() : dot * static_cast<T>(scale_);
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
            dp[j] = p[j] * (dot - delta) * static_cast<T>(scale_);
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

  SdpaBackend backend_;
  bool causal_;
  double scale_;
};

}  // namespace

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
    auto node = detail::make_node<SdpaBackward>({&q, &k, &v}, backend, causal, scale);
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
