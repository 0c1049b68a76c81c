// fully_shard.hpp — FSDP2's side of one rank's step (internal): fully_shard on each block
// and then on the root, as torchtitan and the FSDP2 tutorial apply it; the sharded
// parameters; each group's all-gather and copy-out before it runs, its reshard after; the
// reduce-scatter of its gradients in backward, on FSDP's streams. Each fact carries its
// PyTorch source (torch/distributed/fsdp/_fully_shard/, 2.11 unless a version is named).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/models.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

class FullyShard final : public ForwardHooks {
 public:
  /// fully_shard(block) for each block, then fully_shard(root): every parameter becomes a
  /// padded dim-0 shard (the model built whole on the GPU frees its parameters then; built
  /// on the meta device, it never held them).
  /// `plan`: the engine's own fully_shard calls, in order, when the model records them
  /// (ModelInfo::fsdp_groups: transformers' under expert parallel, the experts over the efsdp
  /// mesh of world / ep ranks, a group of several modules such as [norm, lm_head]); empty: each
  /// repeated block, then the root.
  FullyShard(const ParallelConfig& config, Module& root, Runtime& runtime,
             const std::vector<ModelInfo::ShardGroup>& plan = {});
  ~FullyShard() override;
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;

  /// model.parameters() after fully_shard: the local shards, what the optimizer gets
  /// (those that require grad).
  const std::vector<Tensor>& parameters() const noexcept { return parameters_; }
  /// A training step begins (the root's first forward of it): the gradients the last step's
  /// reduce-scatters left were set to None since. root_pre_forward calls it outside a pipeline.
  void begin_step();
  /// The root's pre-forward hook (the model's input, cast to param_dtype if one is set); under
  /// an interleaved schedule local stage `stage`'s root's.
  Tensor root_pre_forward(const Tensor& input, std::optional<std::size_t> stage = std::nullopt);
  /// The root's post-forward hook on what its forward returned (a causal LM's loss and
  /// logits); returns the tensors the caller keeps.
  std::vector<Tensor> root_post_forward(std::vector<Tensor> outputs, std::optional<std::size_t> stage = std::nullopt);
  /// The blocks' hooks (ForwardHooks).
  Tensor pre_forward(Module& module, const Tensor& input) override;
  Tensor post_forward(Module& module, const Tensor& output) override;

  /// Every buffer it allocated so far, in order, with its lifetime.
  const std::vector<CommunicationBuffer>& buffers() const noexcept { return log_; }

  // In a pipeline stage (torch.distributed.pipelining's PipelineStage on an FSDPModule, torch
  // 2.15 stage.py): every micro-batch's backward runs with set_requires_gradient_sync(False)
  // and set_reshard_after_backward(False), so the parameters stay gathered and the gradients
  // accumulate on the unsharded parameters; perform_reduce_grad finalizes once per step.
  /// perform_reduce_grad: FSDPState.finalize_backward, then wait_for_gradient_reduction.
  void finalize_backward();

  // Under an interleaved schedule (_PipelineScheduleRuntime, torch 2.15 schedules.py) each of
  // the rank's stages is an FSDP root of its own (torchtitan's apply_fsdp on each model part),
  // and the runtime drives them: UNSHARD all-gathers a stage's modules ahead (async_op=True),
  // the compute waits for it, RESHARD frees them when the stage leaves the runtime's window of
  // three, REDUCE_GRAD reduce-scatters the stage's gradients after its last backward
  // (finalize_backward, then the wait).
  /// Which local stage each group belongs to: a block by the body's child it is, the root's
  /// parameters by their modules (the embedding's stage, or the norm's and lm_head's; a V's rank
  /// 0 holds both, each stage a root of its own); `parts[k]` marks the body's children stage k
  /// runs.
  void assign_stages(const Module& body, const std::vector<std::vector<bool>>& parts);
  /// Whether local stage `local` holds the root's parameters (its forward runs the root's hooks).
  bool stage_has_root(std::size_t local) const noexcept;
  /// UNSHARD: each of the stage's FSDP modules (the stage's root first, then its layers) issues
  /// its all-gather outside forward.
  void unshard_stage(std::size_t local);
  /// _assert_unsharded: the stage's all-gathers waited, in the same order (each copy-out frees
  /// its all-gather output at once: the group is not in forward).
  void wait_stage(std::size_t local);
  /// REDUCE_GRAD: start_gradient_reduction and wait_for_gradient_reduction for the stage's root.
  void reduce_stage(std::size_t local);
  /// RESHARD of a stage leaving the runtime's window before its gradients are reduced: each of
  /// its FSDP modules' reshard() (the unsharded parameters go; the gradients kept on them stay).
  void reshard_stage(std::size_t local);
  /// Log entries name the pipeline's action begun last ("step 1 backward 3") instead of the phase.
  void label_with(const std::string* action) noexcept { action_ = action; }
  /// Bytes sent in its all-gathers and reduce-scatters so far ((n - 1) / n of each gathered tensor).
  double sent() const noexcept { return sent_; }
  /// CPUOffloadPolicy: the shards, the sharded gradients and the optimizer live on the host.
  bool offloads() const noexcept { return config_.cpu_offload; }

 private:
  enum class State : std::uint8_t { Idle, Forward, PreBackward, PostBackward };
  struct Param {
    Module* module = nullptr;
    std::size_t slot = 0;
    std::int64_t chunk_rows = 0;   // ceil(dim0 / N): every rank's padded shard
    std::int64_t row_numel = 1;    // elements per dim-0 row
    DType unsharded_dtype = DType::F32;  // param_dtype, or the parameter's own
    bool wider_grad = false;       // its gradients accumulate in a wider dtype than it computes in
    Tensor sharded;                // leaf: this rank's rows of the padded shard
    Tensor unsharded;              // leaf in the module's slot; its block lives while unsharded
    Tensor post_forward;           // reshard_after_forward=k: its 1/k slice, from forward to backward
    ContextId weight_context = 0;
    std::int64_t padded_unsharded_numel(std::size_t world) const noexcept {
      return chunk_rows * static_cast<std::int64_t>(world) * row_numel;
    }
  };
  struct Group {
    Module* module = nullptr;      // its first module
    std::vector<Module*> members;  // fully_shard's modules (one, or a list such as [norm, lm_head])
    std::size_t to_run = 0;        // a list's modules yet to run in this forward pass
    std::string path;              // "" for the root; a list's paths joined by "+"
    std::size_t ranks = 1;         // its mesh: FSDP's world, or expert parallel's efsdp
    std::size_t rank = 0;          // this rank's place in it
    bool experts = false;          // expert parallel's experts (set_gradient_divide_factor)
    std::vector<Param> params;
    bool reshard_after_forward = true;
    std::size_t post_forward_ranks = 0;  // reshard_after_forward=k: k; 0 otherwise
    bool sharded_post_forward = false;
    State state = State::Idle;
    bool unsharded = false;
    bool post_backward_pending = false;  // _post_backward_pending: gradients kept to reduce later
    std::size_t gradients_log = SIZE_MAX; // a pipeline's accumulated unsharded gradients
    Tensor all_gather_output;      // an unshard waiting for its copy-out
    std::size_t all_gather_log = SIZE_MAX;
    std::size_t unsharded_log = SIZE_MAX;
    std::size_t post_forward_log = SIZE_MAX;
    std::vector<std::size_t> post_forward_indices;
    std::size_t stage = 0;         // the local stage whose root it is under (interleaved schedules)
  };

  Group& group_of(Module& module);
  void unshard(Group& group);
  void wait_for_unshard(Group& group);
  void reshard(Group& group);
  void reshard_post_forward(Group& group);
  /// The post-forward slices go (to_unsharded or _to_sharded), their log entry marked freed.
  void drop_post_forward(Group& group);
  void pre_backward(Group& group);
  void post_backward(Group& group);
  /// _set_unsharded_grad_dtypes: before a backward (`defer`) a gradient kept from an earlier
  /// micro-batch takes the next ones in place; after it, one made narrower is cast up.
  void set_unsharded_grad_dtypes(Group& group, bool defer);
  void foreach_reduce(Group& group, std::vector<std::pair<Param*, Tensor>>& grads);
  void root_post_backward_final_callback();
  /// _end_backward_iteration: the last reduce-scatter input and any kept all-gather output go,
  /// and the post-forward order starts again (of one local stage's root; nullopt: every root).
  void end_backward_iteration(std::optional<std::size_t> stage = std::nullopt);
  /// perform_reduce_grad's finalization of one local stage's root (nullopt: every group): the
  /// groups' pending post-backwards, the last block first, the root last; then the wait.
  void finalize_root(std::optional<std::size_t> stage);
  void release_all_gather_state();
  /// The blocks' pre-forward and the root's: cast, unshard, the post-backward node.
  Tensor group_pre_forward(Group& group, const Tensor& input);
  /// post_forward of a group: the reshard, the post-forward order, the pre-backward hooks on
  /// what it returned.
  std::vector<Tensor> group_post_forward(Group& group, std::vector<Tensor> outputs);
  void order_parameters(Module& root);
  /// The copy kernels' device metadata (split_with_sizes_copy, chunk_cat): a short-lived
  /// int64 tensor, allocated and freed on the current stream.
  void kernel_metadata(std::int64_t int64s);
  Tensor make(const std::string& what, std::size_t bytes, const std::string& stream, std::size_t& entry);
  void release(Tensor& tensor, std::size_t entry);
  std::string stage() const;
  static std::string label(const Group& group);
  /// The bytes of the group's padded shards (what its fully_shard call made).
  static std::size_t shard_bytes(const Group& group);

  ParallelConfig config_;
  Runtime& runtime_;
  ContextId context_;                    // where its buffers are attributed
  StreamId copy_in_stream_ = 0;          // all_gather_copy_in_stream
  StreamId reduce_scatter_stream_ = 0;
  std::vector<Group> groups_;            // blocks in forward order, then the root (last)
  std::unordered_map<const Module*, std::size_t> group_index_;
  Tensor all_gather_state_;              // comm_ctx.all_gather_state: kept for the next copy-out
  std::size_t all_gather_state_log_ = SIZE_MAX;
  Tensor reduce_scatter_state_;          // comm_ctx.reduce_scatter_state: the last RS input
  std::size_t reduce_scatter_state_log_ = SIZE_MAX;
  /// Reduce-scatter outputs the sharded gradients still view: their log entry is marked freed
  /// when the gradients go (zero_grad(set_to_none)), seen at the next forward.
  std::vector<std::pair<std::weak_ptr<Storage>, std::size_t>> gradient_outputs_;
  /// Per root (a local stage; one without an interleaved schedule): its groups, as their
  /// post-forwards ran (comm_ctx.post_forward_order), which backward prefetching follows.
  std::vector<std::vector<std::size_t>> post_forward_orders_{1};
  std::size_t callback_stage_ = 0;        // the root whose backward queued the final callback
  bool staged_ = false;                   // assign_stages ran: the roots are the local stages
  /// The root groups, last in groups_: one, or two when a V's rank holds the first and the last
  /// stage (torchtitan's fully_shard on each model part).
  std::size_t root_count_ = 1;
  /// Local stage `stage`'s root group; without a stage (or one holding no root), the last.
  Group& root_group(std::optional<std::size_t> stage);
  /// The groups of local stage `local` in `stage.submod.modules()` order (the root, then the layers).
  std::vector<std::size_t> stage_groups(std::size_t local) const;
  bool callback_queued_ = false;
  std::size_t steps_ = 0;
  bool in_backward_ = false;
  bool pipelined_ = false;                // a pipeline stage's root: manual backward finalization
  bool finalizing_ = false;               // inside finalize_backward: gradients sync now
  const std::string* action_ = nullptr;   // the pipeline's action begun last, for log_
  std::vector<std::size_t> host_shards_;  // CPUOffloadPolicy: each shard's pinned host block
  /// CPUOffloadPolicy: the sharded gradients' pinned host blocks, given back when the gradient goes.
  std::vector<std::pair<std::weak_ptr<Storage>, std::size_t>> host_gradients_;
  void release_host_gradients(bool all);
  double sent_ = 0;                       // bytes sent over collectives
  std::vector<Tensor> parameters_;       // the shards in named_parameters order
  std::vector<CommunicationBuffer> log_;
};

}  // namespace mem::nn::detail
