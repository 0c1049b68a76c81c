// pipeline_parallel.cpp — a decoder's pipeline stage and torch.distributed.pipelining's
// GPipe and 1F1B schedules on one rank (see pipeline_parallel.hpp for what each holds, and
// the sources).
#include "parallel/pipeline_parallel.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>

#include "engine/detail.hpp"
#include "parallel/split_backward.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {
namespace {

constexpr std::string_view kLayerPrefix = "model.layers.";

}  // namespace

/// What a micro-batch holds between its forward and its backward (_ForwardChunkState).
struct PipelineParallel::MicroBatch {
  Tensor input;   ///< the receive buffer (the stage's leaf), or stage 0's view of the batch
  Tensor output;  ///< until its send is waited (the last stage: until its backward)
  Tensor edge;    ///< where backward starts once the output is dropped
  Tensor loss;    ///< the last stage's, until the step ends
  Tensor received_grad;  ///< the gradient of the output, received for the backward
  Tensor sending;        ///< the input's gradient, sent back until the send is waited
  // Between a zero-bubble schedule's I and W (the stage's backward_state):
  std::vector<ParamGroup> groups;  ///< the weights' groups, with the gradients stashed
  Tensor root;                     ///< the output (detached) or loss backward began from
  bool deferred = false;           ///< stage 0's I computes nothing: its W runs the whole backward
};

PipelineParallel::PipelineParallel(const ParallelConfig& config, Sequential& body, const Shape& input_shape)
    : config_(config) {
  if (input_shape.size() != 2) throw Error("pp: the decoder's input is not [batch, sequence]");
  batch_ = input_shape[0];
  seq_ = input_shape[1];
  const std::int64_t batch = batch_;
  const std::size_t stages = config.pipeline_parallel;
  std::size_t layers = 0;
  Module* embed = nullptr;
  bool norm = false, head = false, tied = false;
  for (const auto& [name, child] : body.children()) {
    if (name.starts_with(kLayerPrefix)) ++layers;
    if (name == "model.embed_tokens") embed = child.get();
    if (name == "model.rotary_emb") rotary_ = child.get();  // every stage keeps it
    norm = norm || name == "model.norm";
    head = head || name == "lm_head";
    tied = tied || (name == "lm_head" && dynamic_cast<const TiedLinear*>(child.get()) != nullptr);
  }
  if (embed == nullptr || rotary_ == nullptr || !norm || !head || layers == 0) {
    throw Error("pp splits a transformers decoder's layers into stages (torchtitan's split); this model is not one: "
                "give --hf-config");
  }
  if (embed->slots().empty() || embed->slots().front().shape.size() != 2) {
    throw Error("pp: the embedding's weight is not [vocab, hidden]");
  }
  if (config.stage >= stages) {
    throw Error("pp:" + std::to_string(stages) + " has stages 0 to " + std::to_string(stages - 1) + "; stage " +
                std::to_string(config.stage) + " is not one");
  }
  if (tied) {
    // The tied weight would be the first stage's embedding and the last stage's lm_head
    // (torchtitan's split keeps it on both; its gradient would need a sum across them).
    throw Error("pp with tied embeddings (tie_word_embeddings) is not modelled: the one weight would sit on the "
                "first and the last stage");
  }
  hidden_ = embed->slots().front().shape[1];
  const std::size_t per_rank = pipeline_stages_per_rank(config, layers);
  const auto split = pipeline_split(layers, stages * per_rank);
  microbatches_ = config.microbatches != 0 ? config.microbatches : static_cast<std::size_t>(batch);
  if (microbatches_ > kMaxMicrobatches) {
    // Each micro-batch is a forward and a backward of the stage: bound the work by what was typed.
    throw Error("pp: " + std::to_string(microbatches_) + " micro-batches (" +
                (config.microbatches != 0 ? "given" : "the batch, one sample each, when microbatches is not given") +
                "): at most " + std::to_string(kMaxMicrobatches) + " are modelled; give microbatches=M");
  }
  if (static_cast<std::int64_t>(microbatches_) <= batch && batch % static_cast<std::int64_t>(microbatches_) != 0) {
    // torch.tensor_split would make micro-batches of two sizes, and a stage's receive buffers
    // and metadata are micro-batch 0's: the smaller ones fail PipelineStage's shape checks.
    throw Error("pp: " + std::to_string(microbatches_) + " micro-batches do not divide the batch of " +
                std::to_string(batch) + " (PipelineStage's buffers have micro-batch 0's shape, so every "
                "micro-batch must have it); give a batch that is a multiple of " + std::to_string(microbatches_));
  }
  if (static_cast<std::int64_t>(microbatches_) > batch) {
    // microbatch.py: "Tensor size on dim 0 is smaller than the number of chunks".
    throw Error("pp: " + std::to_string(microbatches_) + " micro-batches of a batch of " + std::to_string(batch) +
                ": torch.tensor_split needs at least one sample each; give microbatches at most " +
                std::to_string(batch));
  }
  if (config.schedule == PipelineSchedule::DualPipeV && microbatches_ < 2 * stages) {
    // ScheduleDualPipeV.__init__'s ValueError.
    throw Error("pp:" + std::to_string(stages) + " with dualpipev: " + std::to_string(microbatches_) +
                " micro-batches for " + std::to_string(2 * stages) + " stages; DualPipeV needs at least as many "
                "micro-batches as stages: give microbatches=" + std::to_string(2 * stages) + " or more");
  }
  if (config.schedule == PipelineSchedule::OneF1B && microbatches_ < stages) {
    // Schedule1F1B.__init__'s ValueError.
    throw Error("pp:" + std::to_string(stages) + " with 1f1b: the number of micro-batches (" +
                std::to_string(microbatches_) + ") must be at least the number of stages; give microbatches=" +
                std::to_string(stages) + " or more (a batch of at least " + std::to_string(stages) + ")");
  }
  // Rank r holds stages r, r + P, ... (or a V's r and 2P - 1 - r), each its layers, the rotary
  // embedding, and the embedding (stage 0) or the final norm and lm_head (the last).
  std::vector<std::vector<std::string>> names(per_rank);
  std::vector<std::string> keep;
  for (std::size_t k = 0; k < per_rank; ++k) {
    LocalStage stage;
    stage.index = pipeline_stage_of(config.schedule, stages, config.stage, k);
    stage.first = stage.index == 0;
    stage.last = stage.index + 1 == stages * per_rank;
    names[k].emplace_back("model.rotary_emb");
    if (stage.first) names[k].emplace_back("model.embed_tokens");
    const auto [first_layer, end_layer] = split.at(stage.index);
    for (std::size_t l = first_layer; l < end_layer; ++l) names[k].push_back(std::string(kLayerPrefix) + std::to_string(l));
    if (stage.last) {
      names[k].emplace_back("model.norm");
      names[k].emplace_back("lm_head");
    }
    keep.insert(keep.end(), names[k].begin(), names[k].end());
    stages_.push_back(std::move(stage));
  }
  local_of_.assign(stages * per_rank, SIZE_MAX);
  for (std::size_t k = 0; k < per_rank; ++k) local_of_[stages_[k].index] = k;
  body.retain(keep);  // the modules kept stay where they are: rotary_ still points at one
  hold_inputs_per_call(*rotary_, 0);  // a decoder's rotary embedding, or mem::Error now
  // Each stage runs its part of the rank's modules.
  for (std::size_t k = 0; k < per_rank; ++k) {
    for (const auto& [name, child] : body.children()) {
      stages_[k].part.push_back(std::find(names[k].begin(), names[k].end(), name) != names[k].end());
    }
  }
  // The schedule's program, the same every step; a schedule the micro-batches do not allow
  // throws here.
  program_ = pipeline_program(config.schedule, stages, config.stage, microbatches_, per_rank);
  // The step's backward phase begins with the first gradient received, or the first backward,
  // after the last forward before the first backward (an interleaved rank can receive a
  // gradient while warm-up forwards are still to come: those stay in the forward phase).
  const auto first_backward = std::find_if(program_.begin(), program_.end(), [](const PipelineOp& op) {
    return op.step == PipelineStep::Backward || op.step == PipelineStep::BackwardInput;
  });
  auto begins = first_backward;
  while (begins != program_.begin() && std::prev(begins)->step != PipelineStep::Forward) --begins;
  while (begins != first_backward && begins->step != PipelineStep::ReceiveGradients) ++begins;
  backward_begins_ = static_cast<std::size_t>(begins - program_.begin());
}

std::vector<std::vector<bool>> PipelineParallel::parts() const {
  std::vector<std::vector<bool>> out;
  for (const LocalStage& stage : stages_) out.push_back(stage.part);
  return out;
}

Tensor PipelineParallel::stage_forward(Sequential& body, std::size_t local, const Tensor& input) const {
  if (stages_.size() == 1) return body(input);
  return body.forward_part(input, stages_.at(local).part);
}

std::vector<Tensor> PipelineParallel::stage_weights(Sequential& body, std::size_t local) const {
  const std::vector<bool>& part = stages_.at(local).part;
  std::vector<Tensor> out;
  std::size_t i = 0;
  for (const auto& [name, child] : body.children()) {
    if (stages_.size() == 1 || part[i]) {
      for (const Tensor& p : child->trainable_parameters()) out.push_back(p);
    }
    ++i;
  }
  return out;
}

std::size_t PipelineParallel::local_index(std::size_t stage) const {
  if (!holds(stage)) throw Error("pp: stage " + std::to_string(stage) + " is not on this rank");
  return local_of_[stage];
}

bool PipelineParallel::holds(std::size_t stage) const noexcept {
  return stage < local_of_.size() && local_of_[stage] != SIZE_MAX;
}

std::string PipelineParallel::which(std::size_t stage, std::size_t microbatch) const {
  return (stages_.size() == 1 ? "" : "stage " + std::to_string(stage) + ", ") + "micro-batch " +
         std::to_string(microbatch);
}

void PipelineParallel::record(const std::string& what, std::size_t stage, std::size_t microbatch,
                              const Tensor& tensor) {
  log_.push_back(CommunicationBuffer{what + " (" + which(stage, microbatch) + ")", tensor.nbytes(), "default", now_, ""});
  watched_.push_back({log_.size() - 1, {tensor.storage()}});
}

void PipelineParallel::record_all(const std::string& what, std::size_t stage, std::size_t microbatch,
                                  const std::vector<Tensor>& tensors) {
  std::vector<std::weak_ptr<Storage>> storages;
  std::unordered_set<const Storage*> seen;
  std::size_t bytes = 0;
  for (const Tensor& t : tensors) {
    if (!t.defined() || !seen.insert(t.storage().get()).second) continue;
    storages.push_back(t.storage());
    bytes += t.storage()->nbytes();
  }
  if (storages.empty()) return;
  log_.push_back(CommunicationBuffer{what + " (" + which(stage, microbatch) + ")", bytes, "default", now_, ""});
  watched_.push_back({log_.size() - 1, std::move(storages)});
}

void PipelineParallel::sweep() {
  // What has gone since the last look went during the action begun last (a weak reference's
  // finalizer, as the check on PyTorch's side reads it).
  std::erase_if(watched_, [&](const auto& watched) {
    if (std::any_of(watched.second.begin(), watched.second.end(), [](const auto& s) { return !s.expired(); })) {
      return false;
    }
    log_[watched.first].freed = now_;
    return true;
  });
}

void PipelineParallel::step(Runtime& rt, const Tensor& input, const Tensor& target, DType activation, const Calls& calls) {
  ++steps_;
  hold_inputs_per_call(*rotary_, steps_);
  // step() begins with clear_runtime_states: the last step's output chunks go.
  output_chunks_.clear();
  sweep();
  const std::size_t m_count = microbatches_;
  // torch.tensor_split on dim 0: views of B / M samples each.
  const std::int64_t rows = batch_ / static_cast<std::int64_t>(m_count);
  const auto begin = [&](const char* action, std::size_t stage, std::size_t m) {
    sweep();
    now_ = "step " + std::to_string(steps_) + " " +
           (stages_.size() == 1 ? std::string() : "stage " + std::to_string(stage) + " ") + action + " " +
           std::to_string(m);
  };
  // Each of the rank's stages keeps its own micro-batches' state (a PipelineStage each).
  std::vector<MicroBatch> mbs(stages_.size() * m_count);
  const auto state_of = [&](std::size_t stage, std::size_t microbatch) -> MicroBatch& {
    return mbs[local_index(stage) * m_count + microbatch];
  };
  const auto state = [&](const PipelineOp& op) -> MicroBatch& { return state_of(op.stage, op.microbatch); };
  const auto local = [&](const PipelineOp& op) -> const LocalStage& { return stages_[local_index(op.stage)]; };

  // A receive buffer: a fresh torch.empty each micro-batch (_RecvInfo.allocate_buffer).
  const auto receive = [&](const PipelineOp& op, const char* what, Phase phase) {
    ModuleScope scope(intern_context(std::string("PipelineStage ") + what, phase));
    // Under tensor + sequence parallel the residual stream is the rank's 1/t of the sequence.
    Tensor buffer = empty(rt, Shape{rows, seq_ / static_cast<std::int64_t>(config_.tensor_parallel), hidden_},
                          activation);
    record(what, op.stage, op.microbatch, buffer);
    return buffer;
  };
  const auto forward = [&](const PipelineOp& op) {
    PhaseGuard phase(Phase::Forward);
    MicroBatch& mb = state(op);
    const LocalStage& stage = local(op);
    const auto m = static_cast<std::int64_t>(op.microbatch);
    if (stage.first) mb.input = input.narrow(0, m * rows, rows);
    // The previous stage on this rank (a V's turn, set_local_fwd_input): its output, detached, is
    // the input, no buffer.
    if (!stage.first && holds(op.stage - 1)) mb.input = state_of(op.stage - 1, op.microbatch).output.detach();
    // forward_one_chunk: a received buffer becomes the stage's leaf.
    if (!stage.first) mb.input.set_requires_grad(true);
    begin("forward", op.stage, op.microbatch);
    mb.output = calls.forward(mb.input, local_index(op.stage));
    if (stage.last) {
      const Tensor target_mb = target.narrow(0, m * rows, rows);
      {
        ModuleScope scope("loss", Phase::Forward);
        BackwardContextGuard backward_scope(intern_context("loss", Phase::Backward));
        mb.loss = calls.loss(mb.output, target_mb);
      }
      record(config_.return_outputs ? "output chunk" : "output", op.stage, op.microbatch, mb.output);
      if (config_.return_outputs) output_chunks_.push_back(mb.output);
    } else {
      release_decoder_inputs(*rotary_);
      mb.edge = gradient_edge(mb.output);
      // Logged as made: an OVERLAP_F_B posts the send after its backward half.
      record(holds(op.stage + 1) ? "pass activations" : "send activations", op.stage, op.microbatch, mb.output);
    }
  };
  // What a backward leaves to the previous stage: its input's gradient, sent back, or handed to
  // the previous stage on this rank as its received gradient (get_local_bwd_output).
  const auto hand_back = [&](const PipelineOp& op, MicroBatch& mb, const Tensor& grad) {
    if (!holds(op.stage - 1)) {
      mb.sending = grad;
      return;
    }
    if (grad.defined()) record("pass gradients", op.stage, op.microbatch, grad);
    state_of(op.stage - 1, op.microbatch).received_grad = grad;
  };
  // backward_one_chunk: from the loss, or from the output's edge with the gradient received;
  // the forward state goes, and the input's .grad is kept to be sent back.
  const auto run_backward = [&](const PipelineOp& op) {
    PhaseGuard phase(Phase::Backward);
    begin("backward", op.stage, op.microbatch);
    MicroBatch& mb = state(op);
    const LocalStage& stage = local(op);
    if (stage.last) {
      backward(mb.loss);
      // backward_one_chunk detach_()es the last stage's outputs in place: a kept output chunk
      // holds none of the graph (nor the input buffer its AccumulateGrad holds).
      mb.output.impl()->grad_fn.reset();
      mb.output.impl()->requires_grad = false;
    } else {
      backward(mb.edge, mb.received_grad);
    }
    if (!stage.first) {
      hand_back(op, mb, mb.input.grad());
      mb.input.reset_grad();
    }
    mb.input = mb.output = mb.edge = mb.received_grad = Tensor{};
  };
  // I (backward_one_chunk(full_backward=False)): the input's gradient alone; the stage keeps
  // its input (whose .grad is that gradient), the gradient received, the root and the graph
  // with the weights' stash until W. Stage 0 computes nothing here.
  const auto backward_input_half = [&](const PipelineOp& op) {
    PhaseGuard phase(Phase::Backward);
    begin("backward input", op.stage, op.microbatch);
    MicroBatch& mb = state(op);
    const LocalStage& stage = local(op);
    // backward_state keeps the root: the loss, or the output (live while its send is pending).
    mb.root = stage.last ? mb.loss : mb.output;
    if (stage.first) {
      mb.deferred = true;
      return;
    }
    std::vector<GradientRoot> roots;
    if (stage.last) {
      // torch.ones_like(loss): the loss's gradient.
      roots.push_back({Edge{mb.loss.grad_fn(), mb.loss.output_nr()}, full(rt, mb.loss.shape(), 1.0, mb.loss.dtype())});
    } else {
      roots.push_back({Edge{mb.edge.grad_fn(), mb.edge.output_nr()}, mb.received_grad});
    }
    InputBackward half = backward_input(roots, mb.input, calls.weights(local_index(op.stage)));
    roots.clear();
    mb.groups = std::move(half.groups);
    TensorList stash;
    for (const ParamGroup& group : mb.groups) {
      for (const TensorList& grads : group.grads) stash.insert(stash.end(), grads.begin(), grads.end());
    }
    record_all("stashed gradients", op.stage, op.microbatch, stash);
    // stage_backward_input detach_()es the root (and the last stage its outputs): what only
    // the output side of the graph held goes now.
    for (Tensor* t : {&mb.root, &mb.output}) {
      if (t->defined()) {
        t->impl()->grad_fn.reset();
        t->impl()->requires_grad = false;
      }
    }
    mb.edge = Tensor{};
    hand_back(op, mb, half.input_grad);
    mb.output = Tensor{};  // the entry is gone: a stage's root holds its output until W
  };
  // W (backward_weight_one_chunk): the weights' gradients; backward_state goes with the graph.
  const auto backward_weight_half = [&](const PipelineOp& op) {
    PhaseGuard phase(Phase::Backward);
    begin("backward weight", op.stage, op.microbatch);
    MicroBatch& mb = state(op);
    if (mb.deferred) {
      // Stage 0: the whole backward from the output's edge (or the output kept live).
      backward(mb.edge, mb.received_grad);
      mb.deferred = false;
    } else {
      backward_weight(mb.groups);
    }
    mb.groups.clear();
    mb.input = mb.root = mb.output = mb.edge = mb.received_grad = Tensor{};
  };

  // FSDP: a stage's all-gathers issued by UNSHARD are waited before its next compute; a stage
  // whose REDUCE_GRAD ran (_finalized_stages) skips its next RESHARD, the reduction resharded it.
  std::vector<bool> gathering(stages_.size(), false), finalized(stages_.size(), false);
  const auto assert_unsharded = [&](const PipelineOp& op) {
    const std::size_t k = local_index(op.stage);
    if (!gathering[k]) return;
    gathering[k] = false;
    calls.wait_unshard(k);
  };
  // The rank's program (pipeline_schedule.hpp): the schedule's actions with their receives,
  // sends and the waits that drop what was sent.
  for (std::size_t i = 0; i < program_.size(); ++i) {
    const PipelineOp& op = program_[i];
    if (i == backward_begins_) calls.backward_begins();
    MicroBatch& mb = state(op);
    switch (op.step) {
      case PipelineStep::ReceiveActivations: mb.input = receive(op, "receive activations", Phase::Forward); break;
      case PipelineStep::Forward:
        assert_unsharded(op);
        forward(op);
        break;
      case PipelineStep::SendActivations:
        sent_ += static_cast<double>(mb.output.nbytes());
        break;
      // The send waited (_wait_and_release_fwd_send): the stage drops the output it sent.
      case PipelineStep::WaitActivationsSent: mb.output = Tensor{}; break;
      case PipelineStep::ReceiveGradients:
        mb.received_grad = receive(op, "receive gradients", Phase::Backward);
        break;
      case PipelineStep::Backward:
        assert_unsharded(op);
        run_backward(op);
        break;
      case PipelineStep::BackwardInput:
        assert_unsharded(op);
        backward_input_half(op);
        break;
      case PipelineStep::BackwardWeight:
        assert_unsharded(op);
        backward_weight_half(op);
        break;
      case PipelineStep::SendGradients:
        if (mb.sending.defined()) {
          record("send gradients", op.stage, op.microbatch, mb.sending);
          sent_ += static_cast<double>(mb.sending.nbytes());
        }
        break;
      case PipelineStep::WaitGradientsSent: mb.sending = Tensor{}; break;
      case PipelineStep::Unshard:
        if (calls.unshard) {
          calls.unshard(local_index(op.stage));
          gathering[local_index(op.stage)] = true;
        }
        break;
      // The runtime's window (three stages) moved on: the stage goes back to its shards, unless
      // its REDUCE_GRAD did that already.
      case PipelineStep::Reshard:
        if (finalized[local_index(op.stage)]) {
          finalized[local_index(op.stage)] = false;
        } else if (calls.reshard) {
          calls.reshard(local_index(op.stage));
        }
        break;
      case PipelineStep::ReduceGrad:
        if (calls.reduce_stage) {
          calls.reduce_stage(local_index(op.stage));
          finalized[local_index(op.stage)] = true;
        }
        break;
    }
  }
  // The losses go (_update_losses); perform_reduce_grad finalizes FSDP's gradient reduction,
  // then p.grad.div_(M), in place. The last stage returns torch.cat of its outputs, which the
  // training loop drops.
  for (MicroBatch& mb : mbs) mb.loss = Tensor{};
  if (calls.reduce_grads) calls.reduce_grads();
  if (stages_.back().last && config_.return_outputs) {
    ModuleScope scope("lm_head", Phase::Backward);
    Shape merged = output_chunks_.front().shape();
    merged[0] = batch_;
    const Tensor cat = empty(rt, merged, output_chunks_.front().dtype());
    log_.push_back(CommunicationBuffer{"merged output", cat.nbytes(), "default", now_, now_});
  }
  sweep();
}

}  // namespace mem::nn::detail
