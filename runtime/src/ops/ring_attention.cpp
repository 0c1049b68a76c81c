// ring_attention.cpp — F.scaled_dot_product_attention inside context_parallel(): one rank's ring
// attention, written out as PyTorch writes it (torch/distributed/tensor/experimental/
// _context_parallel/_attention.py, _templated_ring_attention and its backward, 2.11 and 2.15).
//
// Each rank holds 1/world of the sequence. The world steps of the ring each run the fused
// kernel on the rank's queries and one rank's keys and values, and an _SDPAMerger folds each
// step's output into a running f32 output by the logsumexps. Every Python variable is a
// Tensor here, assigned and dropped where Python assigns and drops it, so the allocator sees
// each buffer made and freed in PyTorch's order: the sequences of an H200 (PyTorch 2.11),
// tests/data/h200-context-parallel-2026-11-29, are reproduced request for request
// (context_parallel_test.cpp). Dry runs only: the other ranks' keys are not here to compute.
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "engine/detail.hpp"
#include "ops/sdpa_kernels.hpp"

namespace mem::nn::detail {
namespace {

/// torch.cat([a.flatten(), b.flatten()]): one new flat buffer.
Tensor flat_cat(const Tensor& a, const Tensor& b) {
  return empty(a.runtime(), Shape{a.numel() + b.numel()}, a.dtype());
}

/// buffer[offset : offset + like.numel()].reshape(like.shape): a view.
Tensor slice_as(const Tensor& buffer, std::int64_t offset, const Tensor& like) {
  return buffer.narrow(0, offset, like.numel()).view(like.shape());
}

/// _partial_update(original, new, dim=2, n_chunks=2, idx, add): chunk idx replaced by (or,
/// in place, increased by) `update`, then torch.cat of the chunks: a new contiguous tensor.
Tensor partial_update(const Tensor& original) {
  return empty(original.runtime(), original.shape(), original.dtype());
}

/// _AllGatherRotater and _AllToAllRotater: where step i's keys and values come from.
class Rotater {
 public:
  Rotater(const ContextParallel& ring, bool all_to_all) : ring_(ring), all_to_all_(all_to_all) {}
  /// exchange_buffers: all_to_all permutes the buffer to the next rank (a new receive buffer
  /// each step, the last one dropped when it is replaced); all_gather gathers the first one
  /// from every rank, once, into world x its size.
  void exchange(const Tensor& buffer) {
    Runtime& rt = buffer.runtime();
    if (all_to_all_) {
      buffer_ = empty(rt, buffer.shape(), buffer.dtype());
      rt.count_collective_sent(static_cast<double>(buffer.nbytes()));  // to the next rank
      return;
    }
    ++index_;
    if (!gathered_.defined()) {
      rt.count_collective_sent(static_cast<double>(buffer.nbytes()) * static_cast<double>(ring_.world - 1));
      gathered_ = empty(buffer.runtime(), Shape{static_cast<std::int64_t>(ring_.world) * buffer.numel()},
                        buffer.dtype());
    }
  }
  /// next_buffer: the received buffer, or chunk (rank - i) mod world of the gathered one.
  Tensor next() const {
    if (all_to_all_) return buffer_;
    const auto world = static_cast<std::int64_t>(ring_.world);
    const std::int64_t chunk = gathered_.numel() / world;
    const std::int64_t index = ((static_cast<std::int64_t>(ring_.rank) - index_) % world + world) % world;
    return gathered_.narrow(0, index * chunk, chunk);
  }

 private:
  ContextParallel ring_;
  bool all_to_all_;
  Tensor buffer_, gathered_;
  std::int64_t index_ = 0;
};

enum class Causal { Skip, Causal, Full };

/// _is_causal_behavior: step 0 is the rank's own block (causal); a block from an earlier rank
/// is attended in full; a later rank's is skipped unless the chunks are load-balanced.
Causal behavior(const ContextParallel& ring, std::size_t i, bool causal) {
  if (!causal) return Causal::Full;
  if (i == 0) return Causal::Causal;
  const std::size_t source = (ring.rank + ring.world - i) % ring.world;
  return source < ring.rank || ring.load_balance ? Causal::Full : Causal::Skip;
}

/// _SDPAMerger with convert_to_f32 (the default): the running output in f32 and its
/// logsumexp [B, H, S, 1], merged as out - sigmoid(lse_b - lse) * (out - out_b) and
/// lse - logsigmoid(lse - lse_b), each temporary dropped as Python drops it.
class Merger {
 public:
  void step(const Tensor& block_out_in, const Tensor& block_lse_in, bool partial) {
    out_dtype_ = block_out_in.dtype();
    const Tensor block_out = to_dtype(block_out_in, DType::F32);  // a copy (the lse is f32)
    const Tensor block_lse = block_lse_in.unsqueeze(-1);
    if (!lse_.defined()) {
      lse_ = block_lse;
      out_ = block_out;
      return;
    }
    const std::int64_t half = out_.size(2) / 2;
    Tensor lse = partial ? lse_.narrow(2, half, lse_.size(2) - half) : lse_;
    Tensor out = partial ? out_.narrow(2, half, out_.size(2) - half) : out_;
    {  // out = out - F.sigmoid(block_lse - lse) * (out - block_out)
      Tensor difference = empty_following(block_lse, block_lse.shape(), DType::F32);
      Tensor weight = empty_following(difference, difference.shape(), DType::F32);
      difference = Tensor{};
      Tensor delta = empty_following(out, out.shape(), DType::F32);
      Tensor product = empty_following(delta, delta.shape(), DType::F32);
      weight = Tensor{};
      delta = Tensor{};
      out = empty_following(out, out.shape(), DType::F32);
    }
    {  // lse = lse - F.logsigmoid(lse - block_lse); log_sigmoid_forward's buffer is empty on CUDA
      Tensor difference = empty_following(lse, lse.shape(), DType::F32);
      Tensor log_weight = empty_following(difference, difference.shape(), DType::F32);
      difference = Tensor{};
      lse = empty_following(lse, lse.shape(), DType::F32);
    }
    if (partial) {
      lse_ = partial_update(lse_);
      out_ = partial_update(out_);
      lse = Tensor{};  // _merge_one's locals, in their order
      out = Tensor{};
    } else {
      lse_ = std::move(lse);
      out_ = std::move(out);
    }
  }
  /// results(): the output cast back to the kernel's dtype, the logsumexp squeezed (a view).
  std::pair<Tensor, Tensor> results() const {
    Tensor out = to_dtype(out_, out_dtype_);
    return {out, lse_.narrow(3, 0, 1).view(Shape{lse_.size(0), lse_.size(1), lse_.size(2)})};
  }

 private:
  Tensor out_, lse_;
  DType out_dtype_ = DType::F32;
};

/// _templated_ring_attention: the merged output and logsumexp, and the rng state of the
/// kernel call PyTorch returns with them (the last in 2.11, the first in 2.15).
SdpaOutputs ring_forward(const Tensor& query, Tensor key, Tensor value, SdpaBackend backend, bool causal,
                         double dropout, const ContextParallel& ring, bool first_rng) {
  key = key.contiguous();
  value = value.contiguous();
  Tensor next_kv;
  std::optional<Merger> merger(std::in_place);
  std::vector<Tensor> rest, saved_rest;
  Tensor out, logsumexp;
  std::optional<Rotater> rotater(std::in_place, ring, ring.all_to_all);
  Tensor q, k, v;  // Python's loop variables outlive their step
  for (std::size_t i = 0; i < ring.world; ++i) {
    if (i > 0) {
      next_kv = rotater->next();
      key = slice_as(next_kv, 0, key);
      value = slice_as(next_kv, key.numel(), value);
    }
    if (i + 1 < ring.world) {
      next_kv = flat_cat(key, value);
      rotater->exchange(next_kv);
      next_kv = Tensor{};  // exchange_buffers returns None
    }
    const Causal how = behavior(ring, i, causal);
    if (how == Causal::Skip) continue;
    q = query;
    k = key;
    v = value;
    bool partial = false;
    if (i > 0 && ring.load_balance && causal) {
      if (i <= ring.rank) {  // the first half of the other rank's keys
        k = key.narrow(2, 0, key.size(2) / 2);
        v = value.narrow(2, 0, value.size(2) / 2);
      } else {  // the second half of the queries against all of them
        q = query.narrow(2, query.size(2) / 2, query.size(2) - query.size(2) / 2);
        partial = true;
      }
    }
    SdpaOutputs step = sdpa_forward_kernel(q, k, v, backend, how == Causal::Causal, true, dropout);
    out = std::move(step.out);
    logsumexp = std::move(step.lse);
    while (!rest.empty()) rest.pop_back();  // the old list's items, last first
    rest = std::move(step.rng);
    if (first_rng && saved_rest.empty()) saved_rest = rest;
    merger->step(out, logsumexp, partial);
  }
  auto [merged_out, merged_lse] = merger->results();
  // The frame's locals go in their order (a buffer goes with its last reference): the
  // arguments, next_kv, the merger, the rotater, the loop's views, the last step's output and
  // logsumexp.
  for (Tensor* t : {&key, &value, &next_kv}) *t = Tensor{};
  merger.reset();
  rotater.reset();
  for (Tensor* t : {&q, &k, &v, &out, &logsumexp}) *t = Tensor{};
  return {std::move(merged_out), std::move(merged_lse), first_rng ? std::move(saved_rest) : std::move(rest)};
}

}  // namespace

// _templated_ring_attention_backward: f32 accumulators, the keys and values gathered again,
// and their gradients sent around the ring by all-to-all (whatever the rotate method).
std::vector<Tensor> ring_attention_backward(const Tensor& grad_out, const Tensor& query, Tensor key, Tensor value,
                                  const Tensor& out, const Tensor& logsumexp, SdpaBackend backend, bool causal,
                                  const ContextParallel& ring) {
  Tensor next_kv, next_grad_kv, grad_query_, grad_key_, grad_value_;
  Tensor grad_query = empty_following(query, query.shape(), DType::F32);
  Tensor grad_key = empty_following(key, key.shape(), DType::F32);
  Tensor grad_value = empty_following(value, value.shape(), DType::F32);
  key = key.contiguous();
  value = value.contiguous();
  std::optional<Rotater> kv_rotater(std::in_place, ring, ring.all_to_all);
  std::optional<Rotater> dkv_rotater(std::in_place, ring, true);
  // Python's loop variables outlive their step; lse is a contiguous copy of the logsumexp's
  // second half in partial steps.
  Tensor buffer, q, k, v, out_, dout, lse;
  for (std::size_t i = 0; i < ring.world; ++i) {
    if (i > 0) {
      buffer = kv_rotater->next();
      key = slice_as(buffer, 0, key);
      value = slice_as(buffer, key.numel(), value);
    }
    if (i + 1 != ring.world) {
      next_kv = flat_cat(key, value);
      kv_rotater->exchange(next_kv);
    }
    const Causal how = behavior(ring, i, causal);
    if (how != Causal::Skip) {
      // Python builds the whole tuple (the logsumexp's copy included) before assigning it.
      Tensor q_next = query, k_next = key, v_next = value, out_next = out, dout_next = grad_out, lse_next = logsumexp;
      if (i > 0 && ring.load_balance && causal) {
        if (i <= ring.rank) {
          k_next = key.narrow(2, 0, key.size(2) / 2);
          v_next = value.narrow(2, 0, value.size(2) / 2);
        } else {
          const std::int64_t half = query.size(2) / 2, rest = query.size(2) - half;
          q_next = query.narrow(2, half, rest);
          out_next = out.narrow(2, half, rest);
          dout_next = grad_out.narrow(2, half, rest);
          lse_next = logsumexp.narrow(2, half, rest).contiguous();
        }
      }
      q = std::move(q_next);
      k = std::move(k_next);
      v = std::move(v_next);
      out_ = std::move(out_next);
      dout = std::move(dout_next);
      lse = std::move(lse_next);
      std::vector<Tensor> g = sdpa_backward_kernel(dout, q, k, v, out_, backend, how == Causal::Causal);
      grad_query_ = std::move(g[0]);
      grad_key_ = std::move(g[1]);
      grad_value_ = std::move(g[2]);
    } else {
      grad_query_ = empty_following(query, query.shape(), DType::F32);
      grad_key_ = empty_following(key, key.shape(), DType::F32);
      grad_value_ = empty_following(value, value.shape(), DType::F32);
    }
    if (i > 0) {
      next_grad_kv = dkv_rotater->next();
      grad_key = slice_as(next_grad_kv, 0, grad_key);
      grad_value = slice_as(next_grad_kv, grad_key.numel(), grad_value);
      if (i <= ring.rank && ring.load_balance) {
        grad_key = partial_update(grad_key);
        grad_value = partial_update(grad_value);
      }
    }
    next_grad_kv = flat_cat(grad_key, grad_value);
    dkv_rotater->exchange(next_grad_kv);
    if (i > ring.rank && ring.load_balance) grad_query = partial_update(grad_query);
  }
  grad_query = to_dtype(grad_query, query.dtype());
  next_grad_kv = to_dtype(dkv_rotater->next(), key.dtype());
  grad_key = slice_as(next_grad_kv, 0, grad_key);
  grad_value = slice_as(next_grad_kv, grad_key.numel(), grad_value);
  // The frame's locals in their order (a buffer goes with its last reference).
  for (Tensor* t : {&key, &value, &next_kv, &grad_query_, &grad_key_, &grad_value_}) *t = Tensor{};
  kv_rotater.reset();
  dkv_rotater.reset();
  for (Tensor* t : {&buffer, &q, &k, &v, &out_, &dout, &lse}) *t = Tensor{};
  return {grad_query, grad_key, grad_value};
}

SdpaOutputs ring_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, SdpaBackend backend,
                                   bool causal, double dropout, const ContextParallel& ring) {
  Runtime& rt = q.runtime();
  if (rt.computing()) {
    throw Error("context parallel's ring attention is simulated in dry runs only: the other ranks' keys and values "
                "are not here to compute with");
  }
  if (ring.world < 2 || ring.rank >= ring.world) {
    throw Error("ring attention: rank " + std::to_string(ring.rank) + " of " + std::to_string(ring.world) +
                " ranks is not a ring");
  }
  if (ring.load_balance && causal && (q.size(2) % 2 != 0 || k.size(2) % 2 != 0)) {
    throw Error("ring attention: a load-balanced rank holds two chunks of the sequence, so its share (" +
                std::to_string(q.size(2)) + " positions) must be even");
  }
  return ring_forward(q, k, v, backend, causal, dropout, ring, rt.stack().torch >= Version{2, 15});
}

}  // namespace mem::nn::detail
