// tensor_parallel.hpp — one rank of tensor + sequence parallel (internal): torchtitan's Llama
// plan, applied by torch.distributed.tensor.parallel.parallelize_module to a transformers
// decoder's modules:
//
//   embed_tokens              RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
//   input_layernorm, post_attention_layernorm, norm     SequenceParallel()
//   self_attn, mlp            PrepareModuleInput(Shard(1) -> Replicate())
//   q_proj k_proj v_proj gate_proj up_proj              ColwiseParallel()
//   o_proj down_proj          RowwiseParallel(output_layouts=Shard(1))
//   lm_head                   ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
//                             the loss under loss_parallel() (torchtitan's default); without
//                             it output_layouts=Replicate(), the logits gathered whole
//
// Each rank holds 1/t of every projection, of the embedding's rows and of lm_head's; the
// residual stream and the norms run on 1/t of the sequence. DTensor's redistributions make
// the buffers below, each measured on torch 2.15 (the CPU profiler's allocations on the fake
// process group, tests/models/check_tensor_parallel.py) and read in
// torch/distributed/_functional_collectives.py and tensor/_redistribute.py:
//   - Shard(d) -> Replicate (all_gather_tensor): the gathered tensor, stacked on dim 0, then,
//     for d != 0, torch.cat of its chunks on d (a second full copy), the first then freed;
//   - Partial -> Shard(d) (reduce_scatter_tensor): for d != 0 torch.cat of the input's chunks
//     on dim 0 (a full copy), then the 1/t output, the copy then freed;
//   - Replicate -> Shard(d) in a backward: the rank's chunk, cloned contiguous.
// Backward runs each redistribution's reverse: a gather's Partial gradient (from the
// column-wise products) is reduce-scattered, a reduce-scatter's gradient gathered.
// The vocabulary-sharded embedding (_MaskPartial, tensor/_ops/_embedding_ops.py) masks the
// ids out of the rank's rows and, in backward, computes the gradient of the whole table
// (embedding_dense_backward's output is Replicate): its .grad is the full table on every rank,
// and each foreach op of the optimizer that reads it copies the rank's rows out first (under
// FSDP2, its reduce-scatter takes them instead). Under loss_parallel() the causal LM loss runs
// on the vocabulary shards (tensor/parallel/loss.py): log-softmax with the max and the sum
// all-reduced per token, the targets masked to the rank's vocabulary, a fused backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

class TensorParallel final : public ForwardHooks {
 public:
  /// parallelize_module with the plan above, before the model is materialized: each
  /// projection's, the embedding's and lm_head's declared shapes become the rank's shard.
  /// Throws mem::Error for a model that is not a transformers decoder, or sizes the plan
  /// cannot split evenly.
  TensorParallel(const ParallelConfig& config, Module& root);
  ~TensorParallel() override;
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;

  /// Once the parameters exist: the embedding's weight (whose gradient is the whole table,
  /// Replicate) and the sequence-parallel norms' (whose gradients stay Partial, torch 2.15)
  /// get gradients of another placement than their own (TensorImpl::redistributed_grad).
  void materialized();
  /// loss_parallel: lm_head's logits stay sharded on the vocabulary (its output is not
  /// gathered) and the causal LM loss is computed on them.
  bool loss_parallel() const noexcept { return config_.loss_parallel; }
  /// ForCausalLMLoss of the rank's vocabulary-sharded logits [B, S, V / N] under
  /// loss_parallel() (torch/distributed/tensor/parallel/loss.py, torch 2.15).
  Tensor causal_lm_loss(const Tensor& logits, const Tensor& labels);
  /// A step begins (names the buffers of its forward and backward).
  void begin_step() noexcept { ++steps_; }
  Tensor pre_forward(Module& module, const Tensor& input) override;
  Tensor post_forward(Module& module, const Tensor& output) override;

  /// Every collective's buffer so far, in order: the transient ones with when they were
  /// freed, the outputs (which live on as activations or gradients) with "".
  const std::vector<CommunicationBuffer>& buffers() const noexcept { return log_; }
  /// Records a buffer made now ("step 1 forward", ...); returns its entry.
  std::size_t record(const std::string& what, std::size_t bytes);
  void record_free(std::size_t entry);
  /// A collective sent `bytes` from this rank; sent() is the sum so far.
  void count_sent(double bytes) noexcept { sent_ += bytes; }
  double sent() const noexcept { return sent_; }

 private:
  /// What the plan does around a module's call.
  enum class Style : std::uint8_t {
    GatherInput,          ///< PrepareModuleInput(Shard(1) -> Replicate()): self_attn, mlp
    ReduceScatterOutput,  ///< RowwiseParallel(output_layouts=Shard(1)): o_proj, down_proj,
                          ///< embed_tokens
    Head,                 ///< lm_head: its input gathered, and its logits unless loss_parallel
  };
  std::string stage() const;

  ParallelConfig config_;
  std::vector<std::pair<Module*, Style>> hooked_;
  std::vector<Module*> redistributed_;  ///< modules whose weight's gradient is of another placement
  std::vector<CommunicationBuffer> log_;
  std::size_t steps_ = 0;
  double sent_ = 0;
};

/// The vocabulary-sharded lookup of RowwiseParallel on an nn.Embedding: `weight` holds this
/// rank's rows (rank 0's: the first), `full_rows` the table's; the output is the whole
/// [..., dim] of which the rank's rows are filled (a Partial DTensor's local tensor).
Tensor vocab_parallel_embedding(const Tensor& weight, const Tensor& ids, std::int64_t full_rows);

}  // namespace mem::nn::detail
