// pipeline_parallel.cpp — a decoder's pipeline stage and torch.distributed.pipelining's
// GPipe and 1F1B schedules on one rank (see pipeline_parallel.hpp for what each holds, and
// the sources).
#include "parallel/pipeline_parallel.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "engine/detail.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/decoder.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn {

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, std::size_t stages, std::size_t stage,
                                             std::size_t microbatches) {
  std::vector<PipelineAction> out;
  if (schedule == PipelineSchedule::GPipe) {
    for (std::size_t m = 0; m < microbatches; ++m) out.push_back({true, m});
    for (std::size_t m = 0; m < microbatches; ++m) out.push_back({false, m});
    return out;
  }
  // Schedule1F1B._step_microbatches: the last stage warms up with 1 forward, stage 0 with P.
  const std::size_t warmup = std::min(microbatches, stages - stage);
  std::size_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({true, f});
  while (b < microbatches) {
    out.push_back({false, b++});
    if (f < microbatches) out.push_back({true, f++});
  }
  return out;
}

std::vector<std::pair<std::size_t, std::size_t>> pipeline_split(std::size_t layers, std::size_t stages) {
  // generate_llm_fqn_per_model_part(stages, layers, input_weight=1, output_weight=1).
  if (stages == 1) return {{0, layers}};
  const std::size_t effective = layers + 2;
  const std::size_t per_stage = effective / stages, extra = effective % stages;
  if (per_stage == 0) {
    throw Error("pp:" + std::to_string(stages) + ": torchtitan's split counts the embedding and the final norm with "
                "lm_head as a layer each, and " + std::to_string(layers) + " layers + 2 leave a stage empty; give at "
                "most " + std::to_string(effective) + " stages");
  }
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t current = 0;
  for (std::size_t s = 0; s < stages; ++s) {
    std::size_t count = per_stage + (s < extra ? 1 : 0);
    if (s == 0 || s + 1 == stages) --count;  // the embedding's, or the norm's and lm_head's, share
    const std::size_t first = current;
    current = std::min(layers, current + count);
    out.emplace_back(first, current);
  }
  return out;
}

}  // namespace mem::nn

namespace mem::nn::detail {
namespace {

constexpr std::string_view kLayerPrefix = "model.layers.";

/// torch.autograd.graph.GradientEdge of an output whose tensor is dropped: backward starts
/// from its node without its storage (a stage's sent output, stage.py's output release).
Tensor gradient_edge(const Tensor& output) {
  auto edge = std::make_shared<TensorImpl>();
  const TensorImpl& of = *output.impl();
  edge->storage = std::make_shared<Storage>(output.runtime(), 0);
  edge->shape = of.shape;
  edge->strides = of.strides;
  edge->dtype = of.dtype;
  edge->requires_grad = of.requires_grad;
  edge->grad_fn = of.grad_fn;
  edge->output_nr = of.output_nr;
  return Tensor(std::move(edge));
}

}  // namespace

/// What a micro-batch holds between its forward and its backward (_ForwardChunkState).
struct PipelineParallel::MicroBatch {
  Tensor input;   ///< the receive buffer (the stage's leaf), or stage 0's view of the batch
  Tensor output;  ///< until its send is waited (the last stage: until its backward)
  Tensor edge;    ///< where backward starts once the output is dropped
  Tensor loss;    ///< the last stage's, until the step ends
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
  const auto [first_layer, end_layer] = pipeline_split(layers, stages).at(config.stage);
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
  if (config.schedule == PipelineSchedule::OneF1B && microbatches_ < stages) {
    // Schedule1F1B.__init__'s ValueError.
    throw Error("pp:" + std::to_string(stages) + " with 1f1b: the number of micro-batches (" +
                std::to_string(microbatches_) + ") must be at least the number of stages; give microbatches=" +
                std::to_string(stages) + " or more (a batch of at least " + std::to_string(stages) + ")");
  }
  std::vector<std::string> keep{"model.rotary_emb"};
  if (first()) keep.emplace_back("model.embed_tokens");
  for (std::size_t l = first_layer; l < end_layer; ++l) keep.push_back(std::string(kLayerPrefix) + std::to_string(l));
  if (last()) {
    keep.emplace_back("model.norm");
    keep.emplace_back("lm_head");
  }
  body.retain(keep);  // the modules kept stay where they are: rotary_ still points at one
  hold_inputs_per_call(*rotary_, 0);  // a decoder's rotary embedding, or mem::Error now
}

void PipelineParallel::record(const std::string& what, std::size_t microbatch, const Tensor& tensor) {
  log_.push_back(CommunicationBuffer{what + " (micro-batch " + std::to_string(microbatch) + ")", tensor.nbytes(),
                                     "default", now_, ""});
  watched_.emplace_back(log_.size() - 1, tensor.storage());
}

void PipelineParallel::sweep() {
  // What has gone since the last look went during the action begun last (a weak reference's
  // finalizer, as the check on PyTorch's side reads it).
  std::erase_if(watched_, [&](const auto& watched) {
    if (!watched.second.expired()) return false;
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
  const auto begin = [&](const char* action, std::size_t m) {
    sweep();
    now_ = "step " + std::to_string(steps_) + " " + action + " " + std::to_string(m);
  };
  std::vector<MicroBatch> mbs(m_count);
  bool backward_started = false;

  // A receive buffer: a fresh torch.empty each micro-batch (_RecvInfo.allocate_buffer).
  const auto receive = [&](std::size_t m, const char* what, Phase phase) {
    ModuleScope scope(intern_context(std::string("PipelineStage ") + what, phase));
    // Under tensor + sequence parallel the residual stream is the rank's 1/t of the sequence.
    Tensor buffer = empty(rt, Shape{rows, seq_ / static_cast<std::int64_t>(config_.tensor_parallel), hidden_},
                          activation);
    record(what, m, buffer);
    return buffer;
  };
  const auto forward = [&](std::size_t m) {
    PhaseGuard phase(Phase::Forward);
    MicroBatch& mb = mbs[m];
    if (first()) {
      mb.input = input.narrow(0, static_cast<std::int64_t>(m) * rows, rows);
    } else {
      // get_fwd_recv_ops, then forward_one_chunk: the buffer becomes the stage's leaf.
      mb.input = receive(m, "receive activations", Phase::Forward);
      mb.input.set_requires_grad(true);
    }
    begin("forward", m);
    mb.output = calls.forward(mb.input);
    if (last()) {
      const Tensor target_mb = target.narrow(0, static_cast<std::int64_t>(m) * rows, rows);
      {
        ModuleScope scope("loss", Phase::Forward);
        BackwardContextGuard backward_scope(intern_context("loss", Phase::Backward));
        mb.loss = calls.loss(mb.output, target_mb);
      }
      record(config_.return_outputs ? "output chunk" : "output", m, mb.output);
      if (config_.return_outputs) output_chunks_.push_back(mb.output);
    } else {
      release_decoder_inputs(*rotary_);
      mb.edge = gradient_edge(mb.output);
      record("send activations", m, mb.output);
      sent_ += static_cast<double>(mb.output.nbytes());
    }
  };
  // The send waited (_wait_and_release_fwd_send): the stage drops the output it sent.
  const auto release = [&](std::size_t m) {
    if (!last()) mbs[m].output = Tensor{};
  };
  Tensor received_grad, sending;  // the gradient received for the next backward; the one being sent
  const auto receive_grad = [&](std::size_t m) {
    if (!backward_started) {
      backward_started = true;
      calls.backward_begins();
    }
    if (last()) return;
    received_grad = receive(m, "receive gradients", Phase::Backward);
  };
  // The send list of the last backward replaced: its input gradient goes.
  const auto sent = [&] { sending = Tensor{}; };
  // backward_one_chunk: from the loss, or from the output's edge with the gradient received;
  // the forward state goes, and the input's .grad is taken to be sent back.
  const auto run_backward = [&](std::size_t m) {
    PhaseGuard phase(Phase::Backward);
    begin("backward", m);
    MicroBatch& mb = mbs[m];
    if (last()) {
      backward(mb.loss);
    } else {
      backward(mb.edge, received_grad);
    }
    if (last()) {
      // backward_one_chunk detach_()es the last stage's outputs in place: a kept output chunk
      // holds none of the graph (nor the input buffer its AccumulateGrad holds).
      mb.output.impl()->grad_fn.reset();
      mb.output.impl()->requires_grad = false;
    }
    Tensor grad;
    if (!first()) {
      grad = mb.input.grad();
      mb.input.reset_grad();
    }
    mb.input = mb.output = mb.edge = received_grad = Tensor{};
    return grad;
  };
  const auto send_back = [&](Tensor grad, std::size_t m) {
    sent();
    if (!grad.defined()) return;
    sending = std::move(grad);
    record("send gradients", m, sending);
    sent_ += static_cast<double>(sending.nbytes());
  };

  // The schedule's order (pipeline_actions), with where each loop waits for its sends:
  // ScheduleGPipe._step_microbatches waits for every forward's send before the first backward
  // and drops a gradient sent when the next backward's receive is made; Schedule1F1B's waits
  // for a forward's send after the next forward in warm-up, then after each backward's receive,
  // and drops a gradient sent when the next backward's is taken.
  const bool gpipe = config_.schedule == PipelineSchedule::GPipe;
  bool warming_up = true;
  std::size_t last_forward = 0;
  for (const PipelineAction& action : pipeline_actions(config_.schedule, config_.pipeline_parallel, config_.stage, m_count)) {
    const std::size_t m = action.microbatch;
    if (action.forward) {
      forward(m);
      if (!gpipe && warming_up && m > 0) release(m - 1);
      last_forward = m;
      continue;
    }
    if (gpipe && warming_up) {
      for (std::size_t f = 0; f < m_count; ++f) release(f);
    }
    warming_up = false;
    receive_grad(m);
    if (gpipe) {
      sent();
    } else {
      release(last_forward);  // a no-op once released (the cool-down)
    }
    Tensor grad = run_backward(m);
    send_back(std::move(grad), m);
  }
  sent();
  // The losses go (_update_losses); perform_reduce_grad finalizes FSDP's gradient reduction,
  // then p.grad.div_(M), in place. The last stage returns torch.cat of its outputs, which the
  // training loop drops.
  for (MicroBatch& mb : mbs) mb.loss = Tensor{};
  if (calls.reduce_grads) calls.reduce_grads();
  if (last() && config_.return_outputs) {
    ModuleScope scope("lm_head", Phase::Backward);
    Shape merged = output_chunks_.front().shape();
    merged[0] = batch_;
    const Tensor cat = empty(rt, merged, output_chunks_.front().dtype());
    log_.push_back(CommunicationBuffer{"merged output", cat.nbytes(), "default", now_, now_});
  }
  sweep();
}

}  // namespace mem::nn::detail
