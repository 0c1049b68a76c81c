// pipeline_parallel.hpp — one rank of pipeline parallel (internal): a transformers decoder
// split into stages as torchtitan splits it, run through torch.distributed.pipelining's
// schedules (PyTorch 2.15, read in pipelining/schedules.py and stage.py, measured with the CPU
// profiler on the fake process group: tests/models/check_pipeline_parallel.py).
//
// The split (torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part with
// input_weight = output_weight = 1): the embedding and the final norm + lm_head each count as a
// layer, the L + 2 "layers" are dealt evenly (the first stages one more when they do not
// divide); stage 0 holds embed_tokens, the last norm and lm_head, every stage the rotary
// embedding (each stage's forward computes its cos and sin, as LlamaModel.forward does).
//
// What the schedule holds on a rank, per micro-batch (PipelineStage, stage.py):
//   - the input: on stage 0 a view of the batch (torch.tensor_split, no copy); elsewhere a
//     receive buffer [b, S, H] made just before the forward (_recv_buffers.py, a fresh
//     torch.empty each micro-batch and step), which becomes the stage's leaf requiring grad
//     and lives until the micro-batch's backward;
//   - the output: sent (its detach()), then dropped once the send is waited
//     (release_fwd_send_outputs): backward starts from its GradientEdge. ScheduleGPipe waits
//     for every send after the last forward; Schedule1F1B after the next forward in warm-up,
//     before each backward in the steady state;
//   - on the last stage the output stays in output_chunks (return_outputs=True, step()'s
//     default) until the next step() begins, and step() returns torch.cat of them (freed at
//     once by a loop that drops it); the loss of each micro-batch until the step ends;
//   - in backward a receive buffer for the output's gradient (not on the last stage), made just
//     before the backward and dropped after it; the input's gradient is sent: ScheduleGPipe
//     drops it when the next backward's receive is prepared, Schedule1F1B after the next
//     backward.
// Activations in flight: every micro-batch's under GPipe; min(M, P - s) on stage s under 1F1B
// (stage 0 keeps the most). The gradients are scaled by 1 / M in place at the end
// (perform_reduce_grad: div_, no allocation).
//
// Interleaved 1F1B (ScheduleInterleaved1F1B, _PipelineScheduleRuntime): rank r holds stages
// r, r + P, ... of P x V, split as above over all of them, each stage a PipelineStage of its
// own. The runtime's lowered actions (pipeline_schedule.hpp) post each receive when the
// neighbour's send is scheduled, so a receive buffer can come several actions before its
// compute; a forward's send is waited right after that stage's own backward of the micro-batch
// (the output lives until then) and every gradient's send at the end of the step (each input
// gradient sent lives until the step ends).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/pipeline_schedule.hpp"
#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

class PipelineParallel {
 public:
  /// The stage's part of the model, before it is materialized: `body` keeps only the stage's
  /// modules. Throws mem::Error for a model that is not a transformers decoder, a batch the
  /// micro-batches do not divide, or a schedule the stages and micro-batches do not allow.
  PipelineParallel(const ParallelConfig& config, Sequential& body, const Shape& input_shape);

  /// The rank's stages (one, or V under an interleaved schedule).
  std::size_t stages_per_rank() const noexcept { return stages_.size(); }
  /// Local stage `local`'s forward on `body`, the rank's modules: all of them with one stage
  /// per rank, else the stage's own (its layers, and the embedding or the norm and lm_head).
  Tensor stage_forward(Sequential& body, std::size_t local, const Tensor& input) const;

  /// What the schedule calls on the stage.
  struct Calls {
    /// Local stage `local`'s module's forward on one micro-batch (FSDP's root hooks around
    /// stage_forward).
    std::function<Tensor(const Tensor& input, std::size_t local)> forward;
    /// The schedule's loss_fn (the last stage).
    std::function<Tensor(const Tensor& output, const Tensor& target)> loss;
    /// Before the first backward: where the step's forward phase ends.
    std::function<void()> backward_begins;
    /// perform_reduce_grad's FSDP finalization, after the last backward; empty without FSDP.
    std::function<void()> reduce_grads;
    /// An interleaved schedule's FSDP actions on local stage `local` (empty without FSDP): UNSHARD,
    /// the wait for it before the stage's next compute (_assert_unsharded), REDUCE_GRAD.
    std::function<void(std::size_t local)> unshard, wait_unshard, reduce_stage, reshard;
    /// Local stage `local`'s weights requiring grad (a zero-bubble schedule's I groups them).
    std::function<std::vector<Tensor>(std::size_t local)> weights;
  };
  /// The weights requiring grad of local stage `local` among `body`'s modules.
  std::vector<Tensor> stage_weights(Sequential& body, std::size_t local) const;
  /// Which of the rank's modules each local stage runs (the body's children).
  std::vector<std::vector<bool>> parts() const;
  /// schedule.step(): what the last step left (its output chunks) goes, then every micro-batch
  /// runs in the schedule's order; `input` on stage 0 and `target` on the last are the whole
  /// batch. `activation` is the hidden states' dtype.
  void step(Runtime& rt, const Tensor& input, const Tensor& target, DType activation, const Calls& calls);
  /// The action begun last ("step 1 backward 3"; "construction" before the first step).
  const std::string& action() const noexcept { return now_; }
  /// Bytes sent to the neighbouring stages so far (hidden states on, their gradients back).
  double sent() const noexcept { return sent_; }
  /// What the schedule held so far, in order: the receive buffers, the outputs sent and the
  /// gradients sent (until their send is waited), the last stage's outputs; each with the
  /// action ("step 1 forward 0") begun last when it was made and when it was dropped.
  const std::vector<CommunicationBuffer>& buffers() const noexcept { return log_; }

 private:
  struct MicroBatch;
  /// One of the rank's stages: its index among all, and which of the body's children it runs.
  struct LocalStage {
    std::size_t index = 0;
    std::vector<bool> part;
    bool first = false, last = false;
  };
  /// Which of the rank's stages stage `stage` is; whether the rank holds it.
  std::size_t local_index(std::size_t stage) const;
  bool holds(std::size_t stage) const noexcept;
  /// "micro-batch 3", or "stage 5, micro-batch 3" when the rank holds several stages.
  std::string which(std::size_t stage, std::size_t microbatch) const;
  /// Logs `tensor` made now, watched until its storage goes.
  void record(const std::string& what, std::size_t stage, std::size_t microbatch, const Tensor& tensor);
  /// Logs the distinct storages of `tensors` as one entry, freed when the last goes.
  void record_all(const std::string& what, std::size_t stage, std::size_t microbatch, const std::vector<Tensor>& tensors);
  /// Marks the watched storages gone by now as freed in the action begun last.
  void sweep();

  ParallelConfig config_;
  std::vector<LocalStage> stages_;
  std::vector<std::size_t> local_of_;  ///< each stage's local index, SIZE_MAX if not here
  std::vector<PipelineOp> program_;  ///< what the rank does each step, in order
  std::size_t backward_begins_ = 0;  ///< the op of program_ where the backward phase begins
  std::size_t microbatches_ = 1;
  std::int64_t batch_ = 0, seq_ = 0, hidden_ = 0;
  Module* rotary_ = nullptr;
  std::vector<Tensor> output_chunks_;  ///< the last stage's outputs of the last step
  /// Log entries not freed yet, with the storages they wait for.
  std::vector<std::pair<std::size_t, std::vector<std::weak_ptr<Storage>>>> watched_;
  std::string now_ = "construction";  ///< the action begun last
  std::vector<CommunicationBuffer> log_;
  std::size_t steps_ = 0;
  double sent_ = 0;
};

}  // namespace mem::nn::detail
