// tensor_parallel.cpp — torchtitan's tensor + sequence parallel plan on a transformers
// decoder, one rank (see tensor_parallel.hpp for the plan and the sources of each buffer).
#include "parallel/tensor_parallel.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "engine/detail.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {
namespace {

std::size_t axis(const Tensor& x, int dim) {
  return static_cast<std::size_t>(dim < 0 ? static_cast<int>(x.dim()) + dim : dim);
}

/// A collective's transient buffer: allocated under "DTensor <what>", which the peak's
/// composition counts as a communication buffer (its output is the module's activation).
Tensor transient(Runtime& rt, const Shape& shape, DType dtype, const std::string& what) {
  ModuleScope scope(intern_context("DTensor " + what, current_phase()));
  return empty(rt, shape, dtype);
}

/// Shard(d) -> Replicate: all_gather_into_tensor stacks the ranks' pieces on dim 0; for
/// d != 0, torch.cat(chunk(gathered, t), dim=d) makes the tensor and the stack dies.
Tensor gather_raw(TensorParallel& tp, const Tensor& x, int dim, std::size_t t,
                  const std::string& what) {
  Runtime& rt = x.runtime();
  const std::size_t d = axis(x, dim);
  Shape stacked = x.shape(), full = x.shape();
  stacked[0] *= static_cast<std::int64_t>(t);
  full[d] *= static_cast<std::int64_t>(t);
  tp.count_sent(static_cast<double>(x.nbytes()) * static_cast<double>(t - 1));  // a ring: its shard to each other rank
  if (d == 0) {
    Tensor gathered = empty(rt, stacked, x.dtype());
    tp.record(what + " all-gather output", gathered.nbytes());
    return gathered;
  }
  Tensor gathered = transient(rt, stacked, x.dtype(), what + " all-gather output");
  const std::size_t entry = tp.record(what + " all-gather output", gathered.nbytes());
  Tensor out = empty(rt, full, x.dtype());
  tp.record(what + " all-gather cat", out.nbytes());
  gathered = Tensor{};
  tp.record_free(entry);
  return out;
}

/// Partial -> Shard(d): for d != 0 the input's chunks on d catted on dim 0 (a full copy), then
/// reduce_scatter_tensor's 1/t output; the copy dies.
Tensor reduce_scatter_raw(TensorParallel& tp, const Tensor& x, int dim, std::size_t t,
                          const std::string& what) {
  Runtime& rt = x.runtime();
  const std::size_t d = axis(x, dim);
  Shape local = x.shape();
  local[d] /= static_cast<std::int64_t>(t);
  // A ring: every other rank's chunk of the partial sums.
  tp.count_sent(static_cast<double>(x.nbytes()) * static_cast<double>(t - 1) / static_cast<double>(t));
  Tensor staged;
  std::size_t entry = 0;
  if (d != 0) {
    staged = transient(rt, x.shape(), x.dtype(), what + " reduce-scatter input");
    entry = tp.record(what + " reduce-scatter input", staged.nbytes());
  }
  Tensor out = empty(rt, local, x.dtype());
  tp.record(what + " reduce-scatter output", out.nbytes());
  if (d != 0) {
    staged = Tensor{};
    tp.record_free(entry);
  }
  return out;
}

/// RedistributeBackward of a gather: a Partial gradient (the column-wise products') is
/// reduce-scattered; a Replicate one (the loss's, on lm_head's logits) is chunked and the
/// rank's piece cloned contiguous.
class GatherBackward final : public Node {
 public:
  GatherBackward(TensorParallel& tp, int dim, std::size_t t, bool partial, std::string what)
      : tp_(&tp), dim_(dim), t_(t), partial_(partial), what_(std::move(what)) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    if (partial_) return {reduce_scatter_raw(*tp_, g, dim_, t_, what_)};
    Shape local = g.shape();
    local[axis(g, dim_)] /= static_cast<std::int64_t>(t_);
    Tensor out = empty(g.runtime(), local, g.dtype());
    tp_->record(what_ + " chunk", out.nbytes());
    return {out};
  }
  std::string_view name() const noexcept override { return "RedistributeBackward"; }

 private:
  TensorParallel* tp_;
  int dim_;
  std::size_t t_;
  bool partial_;
  std::string what_;
};

/// RedistributeBackward of a reduce-scatter: the Shard(d) gradient gathered (Replicate).
class ReduceScatterBackward final : public Node {
 public:
  ReduceScatterBackward(TensorParallel& tp, int dim, std::size_t t, std::string what)
      : tp_(&tp), dim_(dim), t_(t), what_(std::move(what)) {}
  TensorList apply(TensorList& grads) override {
    return {gather_raw(*tp_, grads[0], dim_, t_, what_)};
  }
  std::string_view name() const noexcept override { return "RedistributeBackward"; }

 private:
  TensorParallel* tp_;
  int dim_;
  std::size_t t_;
  std::string what_;
};

Tensor gather(TensorParallel& tp, const Tensor& x, int dim, std::size_t t, bool partial_grad,
              const std::string& what) {
  Tensor out = gather_raw(tp, x, dim, t, what);
  if (needs_grad({&x}))
    set_history(out,
                make_node<GatherBackward>({&x}, tp, dim, t, partial_grad, what + " (backward)"));
  return out;
}

Tensor reduce_scatter(TensorParallel& tp, const Tensor& x, int dim, std::size_t t,
                      const std::string& what) {
  Tensor out = reduce_scatter_raw(tp, x, dim, t, what);
  if (needs_grad({&x}))
    set_history(out, make_node<ReduceScatterBackward>({&x}, tp, dim, t, what + " (backward)"));
  return out;
}

/// EmbeddingBackward0 of the vocabulary-sharded lookup: embedding_dense_backward over the
/// whole table (its sharding strategy is Replicate), zeros then the sums.
class VocabEmbeddingBackward final : public Node {
 public:
  VocabEmbeddingBackward(Shape full, DType dtype) : full_(std::move(full)), dtype_(dtype) {}
  SavedTensor ids;
  TensorList apply(TensorList& grads) override {
    Tensor gw = empty(grads[0].runtime(), full_, dtype_);
    grads[0].runtime().add_flops(static_cast<double>(grads[0].numel()));
    return {gw, Tensor{}};
  }
  void release_variables() noexcept override { ids.reset(); }
  std::string_view name() const noexcept override { return "EmbeddingBackward0"; }

 private:
  Shape full_;
  DType dtype_;
};

Module* child(Module& parent, std::string_view name) {
  for (auto& [n, m] : parent.children()) {
    if (n == name) return m.get();
  }
  return nullptr;
}

/// _MaskPartial._partition_value over the ids (tensor/_ops/_embedding_ops.py), for the
/// embedding's lookup and loss parallel's targets alike: input_mask = (ids < offset) | (ids >=
/// offset + rows), the two comparisons dying with the or; masked = ids.clone() - offset, the
/// clone dying with the subtraction; masked[input_mask] = 0 is a masked fill (nothing
/// allocated); the offsets are host scalars.
struct PartitionedIds {
  Tensor mask;
  Tensor masked;
};
PartitionedIds partition_ids(Runtime& rt, const Shape& shape) {
  PartitionedIds out;
  {
    const Tensor below = empty(rt, shape, DType::Bool), above = empty(rt, shape, DType::Bool);
    out.mask = empty(rt, shape, DType::Bool);
  }
  {
    const Tensor copy = empty(rt, shape, DType::I64);
    out.masked = empty(rt, shape, DType::I64);
  }
  return out;
}

/// _nll_loss_forward's and its backward's safe target: torch.where(target != ignore_index,
/// target, 0), the comparison dying with it.
Tensor safe_targets(Runtime& rt, std::int64_t n) {
  const Tensor kept = empty(rt, Shape{n}, DType::Bool);
  return empty(rt, Shape{n}, DType::I64);
}

/// The backward of loss parallel's log_softmax + nll_loss (torch/distributed/tensor/parallel/
/// loss.py, _nll_loss_and_log_softmax_backward): the gradient is built from zeros, the targets'
/// -1 put in place and exp(log-probabilities) added, times the upstream gradient; then
/// LogSoftmaxBackward0 passes it on and the saved log-probabilities go.
class VocabParallelLossBackward final : public Node {
 public:
  SavedTensor log_probs;
  TensorList apply(TensorList& grads) override {
    const Tensor x = log_probs.unpack();
    Runtime& rt = x.runtime();
    const std::int64_t n = x.size(0);
    const Tensor scale =
        empty(grads[0].runtime(), Shape{}, DType::F32);  // grad_output / total_weight
    const Tensor safe_target = safe_targets(rt, n);
    Tensor grad = empty(rt, x.shape(), DType::F32);  // zeros_like(x)
    const PartitionedIds targets = partition_ids(rt, Shape{n});
    {
      const Tensor ones = empty(rt, Shape{n}, DType::F32);  // the -1 to put at each target
      const Tensor shifted = empty(rt, Shape{n}, DType::F32);
    }
    const Tensor rows = arange(rt, n);
    Tensor weights;
    {
      const Tensor kept = empty(rt, Shape{n}, DType::Bool);
      weights = empty(rt, Shape{n}, DType::F32);  // the upstream gradient where the target counts
    }
    Tensor out;
    {
      Tensor sum;
      {
        const Tensor softmax = empty(rt, x.shape(), DType::F32);  // exp(x)
        sum = empty(rt, x.shape(), DType::F32);                   // grad_input + exp(x)
      }
      out = empty(rt, x.shape(), DType::F32);  // * grad_output
    }
    rt.add_flops(3.0 * static_cast<double>(x.numel()));
    return {out};
  }
  void release_variables() noexcept override { log_probs.reset(); }
  std::string_view name() const noexcept override { return "NllLossBackward0"; }
};

}  // namespace

Tensor TensorParallel::causal_lm_loss(const Tensor& logits, const Tensor& labels) {
  Runtime& rt = logits.runtime();
  // ForCausalLMLoss on the vocabulary-sharded logits under loss_parallel(): logits.float(), the
  // labels padded and shifted (the padded copy lives until the loss returns), then
  // F.cross_entropy, which loss_parallel turns into _log_softmax and _nll_loss_forward over the
  // local vocabulary, with all-reduces of [tokens, 1] and [tokens] tensors.
  const Tensor local = to_dtype(logits, DType::F32);
  const Tensor x_in = local.view(Shape{-1, local.size(-1)});
  const std::int64_t n = x_in.size(0);
  const Tensor padded = empty(rt, Shape{labels.size(0), labels.size(1) + 1}, DType::I64);
  const Tensor shift_labels = empty(rt, labels.shape(), DType::I64);
  // _log_softmax: max, all-reduced (MAX); x - max; exp and its sum, all-reduced; log; the result.
  Tensor x;
  {
    Tensor max;
    {
      const Tensor local_max = empty(rt, Shape{n, 1}, DType::F32);
      max = empty(rt, Shape{n, 1}, DType::F32);
    }
    const Tensor shifted = empty(rt, x_in.shape(), DType::F32);
    Tensor sum;
    {
      Tensor local_sum;
      {
        const Tensor e = empty(rt, x_in.shape(), DType::F32);
        local_sum = empty(rt, Shape{n, 1}, DType::F32);
      }
      sum = empty(rt, Shape{n, 1}, DType::F32);
    }
    const Tensor log = empty(rt, Shape{n, 1}, DType::F32);
    x = empty(rt, x_in.shape(), DType::F32);
    rt.add_flops(4.0 * static_cast<double>(x_in.numel()));
  }
  // _nll_loss_forward: the targets out of this rank's vocabulary masked (_MaskPartial), the
  // log-probability at each target gathered and all-reduced, negated, the ignored ones zeroed,
  // summed and divided by the count.
  const Tensor safe_target = safe_targets(rt, n);
  PartitionedIds targets = partition_ids(rt, Shape{n});
  Tensor gathered = empty(rt, Shape{n}, DType::F32);
  targets.mask = Tensor{};  // released when the partial value is reduced
  const Tensor reduced = empty(rt, Shape{n}, DType::F32);
  Tensor per_token;
  {
    const Tensor negated = empty(rt, Shape{n}, DType::F32);
    const Tensor kept = empty(rt, Shape{n}, DType::Bool);
    per_token = empty(rt, Shape{n}, DType::F32);
  }
  Tensor total;
  {
    const Tensor kept = empty(rt, Shape{n}, DType::Bool);
    {
      const Tensor counted = empty(rt, Shape{n}, DType::I64);  // the mask summed as integers
      total = empty(rt, Shape{}, DType::I64);
    }
  }
  Tensor loss = empty(rt, Shape{}, DType::F32);
  if (needs_grad({&x_in})) {
    auto node = make_node<VocabParallelLossBackward>({&x_in});
    node->log_probs.save(x);
    set_history(loss, node);
  }
  return loss;
}

Tensor vocab_parallel_embedding(const Tensor& weight, const Tensor& ids, std::int64_t full_rows) {
  Runtime& rt = ids.runtime();
  PartitionedIds part = partition_ids(rt, ids.shape());
  Shape out_shape = ids.shape();
  out_shape.push_back(weight.size(1));
  Tensor out = empty(rt, out_shape, weight.dtype());  // index_select of the rank's rows
  part.masked = Tensor{};
  // _reduce_shard_value: output[mask] = 0 in place, then the mask buffer is released.
  part.mask = Tensor{};
  if (needs_grad({&weight})) {
    auto node = make_node<VocabEmbeddingBackward>({&weight, &ids}, Shape{full_rows, weight.size(1)},
                                                  weight.dtype());
    node->ids.save(ids);
    set_history(out, node);
  }
  return out;
}

TensorParallel::TensorParallel(const ParallelConfig& config, Module& root) : config_(config) {
  const std::size_t t = config.tensor_parallel;
  // The rank within the tensor-parallel group: the job's when tp is alone, else rank 0's.
  const std::size_t tp_rank = config.engine == ParallelEngine::None ? config.rank : 0;
  const auto fail = [](const std::string& why) {
    throw Error("tp: " + why +
                "; tensor parallel applies torchtitan's Llama plan to a transformers decoder "
                "(--hf-config of the llama, mistral or qwen2 families) with plain projections");
  };
  // A pipeline stage holds the embedding only on the first stage, lm_head only on the last
  // (torchtitan applies the plan to each model part).
  const bool staged = config.pipeline_parallel > 1;
  auto* embed = dynamic_cast<Embedding*>(child(root, "model.embed_tokens"));
  Module* head_module = child(root, "lm_head");
  auto* head = dynamic_cast<Linear*>(head_module);
  if (embed == nullptr && !staged) fail("the model has no model.embed_tokens embedding");
  if (head == nullptr && (!staged || head_module != nullptr))
    fail("the model has no lm_head of its own (tied embeddings are not modelled)");
  const auto divides = [&](std::int64_t n, const char* what, const char* why) {
    if (n % static_cast<std::int64_t>(t) != 0) {
      throw Error("tp:" + std::to_string(t) + ": " + what + " " + std::to_string(n) +
                  " is not a multiple of " + std::to_string(t) + " (" + why + ")");
    }
  };
  if (embed != nullptr) {
    const std::int64_t vocab = embed->weight_rows();
    divides(vocab, "vocab_size",
            "DTensor pads uneven shards of the gathered vocabulary, not modelled");
    embed->shard_vocab(vocab / static_cast<std::int64_t>(t));
    redistributed_.push_back(embed);
    hooked_.emplace_back(embed, Style::ReduceScatterOutput);
  }
  if (head != nullptr) {
    divides(head->slots().front().shape[0], "vocab_size",
            "DTensor pads uneven shards of the gathered vocabulary, not modelled");
    head->shard_columns(t, 0);
    hooked_.emplace_back(head, Style::Head);
  }

  const auto linear = [&](Module& parent, const char* name) -> Linear& {
    auto* l = dynamic_cast<Linear*>(child(parent, name));
    if (l == nullptr)
      fail(parent.path() + "." + name +
           " is not a plain nn.Linear (LoRA and 4-bit layers are not modelled)");
    return *l;
  };
  std::size_t layers = 0;
  for (auto& [name, layer] : root.children()) {
    if (layer->type_name() != "LlamaDecoderLayer") continue;
    ++layers;
    Module* attn = child(*layer, "self_attn");
    Module* mlp = child(*layer, "mlp");
    if (attn == nullptr || mlp == nullptr) fail(layer->path() + " has no self_attn and mlp");
    const AttentionHeads heads = attention_heads(*attn);
    if (heads.eager)
      fail(
          "eager attention builds its causal mask from the local sequence under sequence parallel");
    divides(heads.heads, "num_attention_heads",
            "each rank's q must hold whole heads, or its view into heads fails");
    divides(heads.kv_heads, "num_key_value_heads",
            "each rank's k and v must hold whole heads, or their view into heads fails");
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) linear(*attn, p).shard_columns(t, tp_rank);
    for (const char* p : {"gate_proj", "up_proj"}) linear(*mlp, p).shard_columns(t, tp_rank);
    for (Linear* row : {&linear(*attn, "o_proj"), &linear(*mlp, "down_proj")}) {
      if (row->has_bias())
        fail(row->path() + " has a bias (a row-wise bias is Replicate, not modelled)");
      row->shard_inputs(t, tp_rank);
      hooked_.emplace_back(row, Style::ReduceScatterOutput);
    }
    hooked_.emplace_back(attn, Style::GatherInput);
    hooked_.emplace_back(mlp, Style::GatherInput);
    for (const char* norm : {"input_layernorm", "post_attention_layernorm"}) {
      if (Module* m = child(*layer, norm)) redistributed_.push_back(m);
    }
  }
  if (layers == 0 && !staged) fail("the model has no LlamaDecoderLayer");
  Module* rotary = child(root, "model.rotary_emb");
  if (rotary == nullptr) fail("the model has no model.rotary_emb");
  set_sequence_shards(*rotary, static_cast<std::int64_t>(t));
  if (Module* norm = child(root, "model.norm")) redistributed_.push_back(norm);
  for (auto& [module, style] : hooked_) module->set_forward_hooks(this);
}

void TensorParallel::materialized() {
  for (Module* m : redistributed_) {
    for (const ParamSlot& slot : m->slots()) {
      if (!slot.is_buffer && slot.tensor.defined()) slot.tensor.impl()->redistributed_grad = true;
    }
  }
}

TensorParallel::~TensorParallel() {
  for (auto& [module, style] : hooked_) module->set_forward_hooks(nullptr);
}

std::string TensorParallel::stage() const {
  if (steps_ == 0) return "construction";
  const Phase phase = current_phase();
  return "step " + std::to_string(steps_) +
         (phase == Phase::Backward    ? " backward"
          : phase == Phase::Recompute ? " recompute"
          : phase == Phase::Optimizer ? " optimizer"
                                      : " forward");
}

std::size_t TensorParallel::record(const std::string& what, std::size_t bytes) {
  log_.push_back({what, bytes, "default", stage(), ""});
  return log_.size() - 1;
}

void TensorParallel::record_free(std::size_t entry) {
  if (entry < log_.size()) log_[entry].freed = stage();
}

Tensor TensorParallel::pre_forward(Module& module, const Tensor& input) {
  const auto it = std::find_if(hooked_.begin(), hooked_.end(),
                               [&](const auto& h) { return h.first == &module; });
  if (it == hooked_.end() || it->second == Style::ReduceScatterOutput) return input;
  // PrepareModuleInput / ColwiseParallel(input_layouts=Shard(1)): the sequence gathered; its
  // gradient comes back Partial from the column-wise products and is reduce-scattered.
  return gather(*this, input, 1, config_.tensor_parallel, true, module.path() + " input");
}

Tensor TensorParallel::post_forward(Module& module, const Tensor& output) {
  const auto it = std::find_if(hooked_.begin(), hooked_.end(),
                               [&](const auto& h) { return h.first == &module; });
  if (it == hooked_.end() || it->second == Style::GatherInput) return output;
  if (it->second == Style::Head) {
    // loss_parallel: output_layouts=Shard(-1), the logits stay the rank's vocabulary.
    if (config_.loss_parallel) return output;
    // output_layouts=Replicate(): the vocabulary-sharded logits gathered on the last dim; the
    // loss's gradient is Replicate, so backward keeps the rank's chunk.
    return gather(*this, output, -1, config_.tensor_parallel, false, module.path() + " output");
  }
  // The Trainer refuses a sequence that does not split over the ranks before any step.
  return reduce_scatter(*this, output, 1, config_.tensor_parallel, module.path() + " output");
}

}  // namespace mem::nn::detail
