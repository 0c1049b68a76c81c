// pipeline_schedule.cpp — torchtitan's split of a decoder into stages, the schedules' compute
// orders, and the lowered program a rank runs (see pipeline_schedule.hpp; torch 2.15's
// torch/distributed/pipelining/schedules.py and torchtitan/distributed/pipeline_parallel.py).
#include "parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <array>
#include <deque>
#include <string>

#include "vramscope/allocator/errors.hpp"

namespace mem::nn {
namespace {

using Compute = PipelineCompute;

/// _get_1f1b_rank_ops for ScheduleInterleaved1F1B and, with `zero_bubble`,
/// ScheduleInterleavedZeroBubble (ZB1P), without the None padding (the lowering drops it).
std::vector<PipelineAction> interleaved_actions(std::size_t ranks, std::size_t rank, std::size_t microbatches,
                                                std::size_t per_rank, bool zero_bubble) {
  // Flexible rounds: n_microbatches need not be a multiple of the ranks, only of the rounds.
  const std::size_t rounds = std::max<std::size_t>(1, microbatches / ranks);
  if (microbatches % rounds != 0) {
    throw Error(std::string(zero_bubble ? "interleavedzerobubble" : "interleaved1f1b") + ": " +
                std::to_string(microbatches) + " micro-batches are not a multiple of the " + std::to_string(rounds) +
                " rounds (max(1, M / P), the schedule's ValueError); give microbatches that the pipeline's " +
                std::to_string(ranks) + " ranks divide");
  }
  const std::size_t per_round = microbatches / rounds;
  // _get_warmup_ops: the last rank warms up with (V - 1) rounds, each rank before it 2 more
  // (1 more under zero bubble: multiply_factor=1).
  const std::size_t factor = zero_bubble ? 1 : 2;
  const std::size_t warmup =
      std::min((per_rank - 1) * per_round + factor * (ranks - 1 - rank), microbatches * per_rank);
  const std::size_t ops = microbatches * per_rank;
  const auto forward_stage = [&](std::size_t op) { return (op / per_round) % per_rank * ranks + rank; };
  const auto backward_stage = [&](std::size_t op) {
    return (per_rank - 1 - (op - warmup) / per_round % per_rank) * ranks + rank;
  };
  // The next micro-batch of each local stage, per kind of action.
  std::vector<std::size_t> forwards(per_rank), backwards(per_rank), weights(per_rank);
  std::vector<std::size_t> backward_ops;  // the ops whose backward ran, for their W in turn
  std::size_t weights_done = 0;
  std::vector<PipelineAction> out;
  out.reserve(3 * ops);
  const auto weight = [&] {
    const std::size_t stage = backward_stage(backward_ops[weights_done++]);
    out.push_back({Compute::BackwardWeight, weights[stage / ranks]++, stage});
  };
  for (std::size_t op = 0; op < warmup + ops; ++op) {
    if (op < ops) {  // warm-up, then the steady state's forward
      const std::size_t stage = forward_stage(op);
      out.push_back({Compute::Forward, forwards[stage / ranks]++, stage});
    }
    if (op >= warmup) {  // the steady state's backward, then the cool-down
      const std::size_t stage = backward_stage(op);
      out.push_back({zero_bubble ? Compute::BackwardInput : Compute::Backward, backwards[stage / ranks]++, stage});
      backward_ops.push_back(op);
      // ZB1P: rank r delays its weight halves by r backwards (num_1f1b_microbatches = rank).
      if (zero_bubble && op - warmup >= rank) weight();
    }
  }
  while (zero_bubble && weights_done < backward_ops.size()) weight();
  return out;
}

/// ScheduleZBVZeroBubble._calculate_single_rank_operations: rank r's stages r (chunk 0) and
/// 2P - 1 - r (chunk 1); the micro-batches past M dropped as the schedule drops them.
std::vector<PipelineAction> zbv_actions(std::size_t ranks, std::size_t rank, std::size_t microbatches) {
  const std::size_t n = std::max(2 * ranks - 1, microbatches);
  const std::size_t s0 = rank, s1 = 2 * ranks - 1 - rank;
  std::size_t f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  std::vector<PipelineAction> out;
  const auto add = [&](Compute compute, std::size_t stage, std::size_t mb) {
    if (mb < microbatches) out.push_back({compute, mb, stage});
  };
  for (std::size_t i = 0; i < 2 * (ranks - rank) - 1; ++i) add(Compute::Forward, s0, f0++);
  for (std::size_t i = 0; i < rank; ++i) {
    add(Compute::Forward, s1, f1++);
    add(Compute::Forward, s0, f0++);
  }
  for (std::size_t i = 0; i < ranks - rank; ++i) {
    add(Compute::Forward, s1, f1++);
    add(Compute::BackwardInput, s1, b1);
    add(Compute::BackwardWeight, s1, b1++);
  }
  while (f1 < f0 || f0 < n) {  // the stable phase
    if (f0 < n) add(Compute::Forward, s0, f0++);
    add(Compute::BackwardInput, s0, b0);
    add(Compute::BackwardWeight, s0, b0++);
    add(Compute::Forward, s1, f1++);
    add(Compute::BackwardInput, s1, b1);
    add(Compute::BackwardWeight, s1, b1++);
  }
  std::size_t w0 = b0, w1 = b1;  // the cool-down
  for (std::size_t i = 0; i < rank; ++i) {
    add(Compute::BackwardInput, s0, b0++);
    add(Compute::BackwardInput, s1, b1++);
  }
  for (std::size_t i = 0; i < ranks - rank; ++i) {
    add(Compute::BackwardInput, s0, b0++);
    add(Compute::BackwardWeight, s0, w0++);
  }
  while (w1 < b1) add(Compute::BackwardWeight, s1, w1++);
  while (w0 < b0) add(Compute::BackwardWeight, s0, w0++);
  return out;
}

/// ScheduleDualPipeV._calculate_single_rank_operations: rank r's stages r and 2P - 1 - r, the
/// steady state's forward and whole backward of the other stage overlapped (OVERLAP_F_B), the
/// weight halves of the split backwards run from a queue in order.
std::vector<PipelineAction> dualpipev_actions(std::size_t ranks, std::size_t rank, std::size_t microbatches) {
  const std::size_t s0 = rank, s1 = 2 * ranks - 1 - rank;
  std::array<std::size_t, 2> forwards{}, inputs{};  // the next micro-batch per stage (chunk 0, 1)
  const auto chunk = [&](std::size_t stage) { return stage == s0 ? 0 : 1; };
  std::deque<std::pair<std::size_t, std::size_t>> weights;  // I's waiting for their W: stage, micro-batch
  std::vector<PipelineAction> out;
  const auto add = [&](std::size_t stage, Compute compute) {
    std::size_t& next = compute == Compute::Forward ? forwards[chunk(stage)] : inputs[chunk(stage)];
    out.push_back({compute, next, stage});
    if (compute == Compute::BackwardInput) weights.emplace_back(stage, next);
    ++next;
  };
  const auto overlap = [&](std::size_t forward_stage, std::size_t backward_stage) {
    out.push_back({Compute::Forward, forwards[chunk(forward_stage)]++, forward_stage, true});
    out.push_back({Compute::Backward, inputs[chunk(backward_stage)]++, backward_stage});
  };
  const auto weight = [&] {
    if (weights.empty()) return;
    out.push_back({Compute::BackwardWeight, weights.front().second, weights.front().first});
    weights.pop_front();
  };
  const std::size_t p = ranks, r = rank;
  for (std::size_t i = 0; i < 2 * (p - r - 1); ++i) add(s0, Compute::Forward);  // F0
  for (std::size_t i = 0; i < r + 1; ++i) {                                       // F0 F1
    add(s0, Compute::Forward);
    add(s1, Compute::Forward);
  }
  for (std::size_t i = 0; i < p - r - 1; ++i) {  // I1 W F1
    add(s1, Compute::BackwardInput);
    weight();
    add(s1, Compute::Forward);
  }
  for (std::size_t i = 0; i + 2 * p < microbatches + r + 1; ++i) {  // the main step: F0B1, F1B0
    if (i == 0 && r == p - 1) {
      add(s0, Compute::Forward);  // not overlapped, to shrink the bubble
      add(s1, Compute::Backward);
    } else {
      overlap(s0, s1);
    }
    overlap(s1, s0);
  }
  for (std::size_t i = 0; i < p - r - 1; ++i) {  // B1, F1B0
    add(s1, Compute::Backward);
    overlap(s1, s0);
  }
  bool split = false;  // the second half of the last backwards split into I and W
  for (std::size_t i = 0; i < r + 1; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) split = true;
    add(s1, split ? Compute::BackwardInput : Compute::Backward);
    if (i == (r + 1) / 2 && r % 2 == 0) split = true;
    add(s0, split ? Compute::BackwardInput : Compute::Backward);
  }
  for (std::size_t i = 0; i < p - r - 1; ++i) {  // W B0
    weight();
    add(s0, split ? Compute::BackwardInput : Compute::Backward);
  }
  for (std::size_t i = 0; i < r + 1; ++i) weight();  // W
  return out;
}

}  // namespace

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, std::size_t ranks, std::size_t rank,
                                             std::size_t microbatches, std::size_t stages_per_rank) {
  if (schedule == PipelineSchedule::Interleaved1F1B || schedule == PipelineSchedule::InterleavedZeroBubble) {
    return interleaved_actions(ranks, rank, microbatches, stages_per_rank,
                               schedule == PipelineSchedule::InterleavedZeroBubble);
  }
  if (schedule == PipelineSchedule::ZBVZeroBubble) return zbv_actions(ranks, rank, microbatches);
  if (schedule == PipelineSchedule::DualPipeV) return dualpipev_actions(ranks, rank, microbatches);
  std::vector<PipelineAction> out;
  if (schedule == PipelineSchedule::GPipe) {
    for (std::size_t m = 0; m < microbatches; ++m) out.push_back({Compute::Forward, m, rank});
    for (std::size_t m = 0; m < microbatches; ++m) out.push_back({Compute::Backward, m, rank});
    return out;
  }
  // Schedule1F1B._step_microbatches: the last stage warms up with 1 forward, stage 0 with P.
  const std::size_t warmup = std::min(microbatches, ranks - rank);
  std::size_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({Compute::Forward, f, rank});
  while (b < microbatches) {
    out.push_back({Compute::Backward, b++, rank});
    if (f < microbatches) out.push_back({Compute::Forward, f++, rank});
  }
  return out;
}

std::vector<std::pair<std::size_t, std::size_t>> pipeline_split(std::size_t layers, std::size_t stages) {
  // generate_llm_fqn_per_model_part(stages, layers, input_weight=1, output_weight=1).
  if (stages == 1) return {{0, layers}};
  const std::size_t effective = layers + 2;
  const std::size_t per_stage = effective / stages, extra = effective % stages;
  if (per_stage == 0) {
    throw Error("pp: " + std::to_string(stages) + " stages: torchtitan's split counts the embedding and the final "
                "norm with lm_head as a layer each, and " + std::to_string(layers) + " layers + 2 leave a stage "
                "empty; give at most " + std::to_string(effective) + " stages");
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

std::size_t pipeline_stages_per_rank(const ParallelConfig& config, std::size_t layers) {
  const bool interleaved = multi_stage(config.schedule);
  const std::size_t ranks = config.pipeline_parallel;
  if (config.layers_per_stage == 0) return interleaved ? 2 : 1;  // pipeline_llm's default
  const std::size_t stages = (layers + 2 + config.layers_per_stage - 1) / config.layers_per_stage;
  const std::string given = std::to_string(layers) + " layers + 2 at layers_per_stage=" +
                            std::to_string(config.layers_per_stage) + " make " + std::to_string(stages) + " stages";
  if (stages % ranks != 0) {
    throw Error("pp:" + std::to_string(ranks) + ": " + given + ", which the " + std::to_string(ranks) +
                " ranks do not divide (torchtitan's ValueError); give a layers_per_stage that makes a multiple of " +
                std::to_string(ranks));
  }
  const std::size_t per_rank = stages / ranks;
  if (!interleaved && per_rank != 1) {
    throw Error("pp:" + std::to_string(ranks) + " with " + std::string(schedule_name(config.schedule)) + ": " + given +
                ", " + std::to_string(per_rank) + " per rank, and a single-stage schedule runs one; give "
                "schedule=interleaved1f1b or layers_per_stage=" + std::to_string((layers + 2 + ranks - 1) / ranks));
  }
  if (v_shaped(config.schedule) && per_rank != 2) {
    throw Error("pp:" + std::to_string(ranks) + " with " + std::string(schedule_name(config.schedule)) + ": " + given +
                ", " + std::to_string(per_rank) + " per rank, and a V runs exactly two (its ValueError); give "
                "layers_per_stage=" +
                std::to_string((layers + 2 + 2 * ranks - 1) / (2 * ranks)));
  }
  if (interleaved && per_rank < 2) {
    throw Error("pp:" + std::to_string(ranks) + " with " + std::string(schedule_name(config.schedule)) + ": " + given +
                ", one per rank, and a "
                "multi-stage schedule runs at least two; give a smaller layers_per_stage");
  }
  return per_rank;
}

}  // namespace mem::nn

namespace mem::nn::detail {
namespace {

using Step = PipelineStep;

/// ScheduleGPipe's and Schedule1F1B's loops (PipelineScheduleSingle._step_microbatches), their
/// receives, sends and waits written out: GPipe waits for every forward's send before the first
/// backward; 1F1B for a forward's after the next forward in warm-up, then before each backward.
/// Both drop the gradient sent last when the next one is taken, and the last at the end.
std::vector<PipelineOp> single_stage_program(PipelineSchedule schedule, std::size_t ranks, std::size_t stage,
                                             std::size_t microbatches) {
  const bool first = stage == 0, last = stage + 1 == ranks, gpipe = schedule == PipelineSchedule::GPipe;
  std::vector<PipelineOp> out;
  const auto add = [&](Step step, std::size_t m) { out.push_back({step, stage, m}); };
  bool warming_up = true, sent_gradient = false;
  std::size_t last_forward = 0, last_backward = 0;
  for (const PipelineAction& action : pipeline_actions(schedule, ranks, stage, microbatches)) {
    const std::size_t m = action.microbatch;
    if (action.compute == PipelineCompute::Forward) {
      if (!first) add(Step::ReceiveActivations, m);
      add(Step::Forward, m);
      if (!last) add(Step::SendActivations, m);
      if (!gpipe && warming_up && m > 0 && !last) add(Step::WaitActivationsSent, m - 1);
      last_forward = m;
      continue;
    }
    if (gpipe && warming_up && !last) {
      for (std::size_t f = 0; f < microbatches; ++f) add(Step::WaitActivationsSent, f);
    }
    warming_up = false;
    if (!last) add(Step::ReceiveGradients, m);
    if (gpipe && sent_gradient) add(Step::WaitGradientsSent, last_backward);
    if (!gpipe && !last) add(Step::WaitActivationsSent, last_forward);
    add(Step::Backward, m);
    if (!gpipe && sent_gradient) add(Step::WaitGradientsSent, last_backward);
    sent_gradient = false;
    if (!first) {
      add(Step::SendGradients, m);
      sent_gradient = true;
    }
    last_backward = m;
  }
  if (sent_gradient) add(Step::WaitGradientsSent, last_backward);
  return out;
}

/// An action of _PipelineScheduleRuntime's IR, as the lowering passes see it.
enum class Kind : std::uint8_t { F, B, I, W, Unshard, Reshard, ReduceGrad, WaitReduceGrad, SendF, SendB, RecvF, RecvB };
struct Act {
  Kind kind;
  std::size_t stage;
  std::size_t mb;
  bool overlapped = false;  ///< one OVERLAP_F_B with the next action
};

Kind kind_of(PipelineCompute compute) noexcept {
  switch (compute) {
    case PipelineCompute::Forward: return Kind::F;
    case PipelineCompute::Backward: return Kind::B;
    case PipelineCompute::BackwardInput: return Kind::I;
    case PipelineCompute::BackwardWeight: return Kind::W;
  }
  return Kind::F;
}

/// The atomic action starting at `i` (an OVERLAP_F_B's two halves, or one): its length.
std::size_t atomic(const std::vector<Act>& acts, std::size_t i) { return acts[i].overlapped ? 2 : 1; }

/// _add_unshard_reshard(max_active_stages=3, unshard_lookahead="full"): before each compute
/// action, the stages not among the next three distinct ones are resharded and those among them
/// not yet unsharded are unsharded (an OVERLAP_F_B's stages together, so the window can hold one
/// more). The runtime makes them no-ops without FSDP, but the lowering's simulation spends a turn
/// on each, which moves where the neighbours' receives land.
std::vector<Act> add_unshard_reshard(const std::vector<Act>& compute) {
  constexpr std::size_t kActive = 3;
  std::vector<std::size_t> all;  // the rank's stages: a window never holds more
  for (const Act& a : compute) {
    if (std::find(all.begin(), all.end(), a.stage) == all.end()) all.push_back(a.stage);
  }
  // next_stage_indices: the distinct stages of the atomic actions from `i` on, until three.
  const auto window = [&](std::size_t i) {
    std::vector<std::size_t> ret;
    while (i < compute.size() && ret.size() < std::min(kActive, all.size())) {
      const std::size_t n = atomic(compute, i);
      for (std::size_t k = i; k < i + n; ++k) {
        if (std::find(ret.begin(), ret.end(), compute[k].stage) == ret.end()) ret.push_back(compute[k].stage);
      }
      i += n;
    }
    return ret;
  };
  std::vector<std::size_t> active;  // in the order unsharded (a dict's)
  std::vector<Act> out;
  for (std::size_t i = 0; i < compute.size(); i += atomic(compute, i)) {
    const std::vector<std::size_t> ahead = window(i);
    const auto in = [](const std::vector<std::size_t>& v, std::size_t s) { return std::find(v.begin(), v.end(), s) != v.end(); };
    std::vector<std::size_t> evict, fetch;
    for (std::size_t s : active) {
      if (!in(ahead, s)) evict.push_back(s);
    }
    for (std::size_t s : ahead) {
      if (!in(active, s)) fetch.push_back(s);
    }
    for (std::size_t s : evict) {
      std::erase(active, s);
      out.push_back({Kind::Reshard, s, 0});
    }
    for (std::size_t s : fetch) {
      active.push_back(s);
      out.push_back({Kind::Unshard, s, 0});
    }
    for (std::size_t k = i; k < i + atomic(compute, i); ++k) out.push_back(compute[k]);
  }
  for (std::size_t s : active) out.push_back({Kind::Reshard, s, 0});
  return out;
}

/// _add_reduce_grad: after a stage's last backward (B or W), REDUCE_GRAD and its wait.
std::vector<Act> add_reduce_grad(const std::vector<Act>& actions, std::size_t microbatches, std::size_t stages) {
  std::vector<std::size_t> backwards(stages);
  std::vector<Act> out;
  std::vector<std::size_t> done;  // stages whose last backward the atomic action ran
  for (const Act& a : actions) {
    out.push_back(a);
    if ((a.kind == Kind::B || a.kind == Kind::W) && ++backwards[a.stage] == microbatches) done.push_back(a.stage);
    if (a.overlapped) continue;  // after the whole OVERLAP_F_B
    for (std::size_t stage : done) {
      out.push_back({Kind::ReduceGrad, stage, 0});
      out.push_back({Kind::WaitReduceGrad, stage, 0});
    }
    done.clear();
  }
  return out;
}

/// _add_send_recv: the ranks take turns in order; each schedules its next action once its input
/// has arrived (a receive another rank's send put in its list), appending its send and the
/// receiver's receive as it does.
std::vector<std::vector<Act>> add_send_recv(const std::vector<std::vector<Act>>& lists, PipelineSchedule schedule,
                                            std::size_t ranks, std::size_t stages, std::size_t microbatches) {
  const auto rank_of = [&](std::size_t s) { return pipeline_rank_of(schedule, ranks, s); };
  const auto at = [&](std::size_t s, std::size_t mb) { return s * microbatches + mb; };
  std::vector<char> forwarded(stages * microbatches), backwarded(stages * microbatches);
  std::vector<char> received_f(stages * microbatches), received_b(stages * microbatches);
  const auto ready = [&](const Act& a) {
    if (a.kind == Kind::F && a.stage != 0) {
      return received_f[at(a.stage, a.mb)] != 0 ||
             (rank_of(a.stage - 1) == rank_of(a.stage) && forwarded[at(a.stage - 1, a.mb)] != 0);
    }
    if ((a.kind == Kind::B || a.kind == Kind::I) && a.stage + 1 != stages) {
      return received_b[at(a.stage, a.mb)] != 0 ||
             (rank_of(a.stage + 1) == rank_of(a.stage) && backwarded[at(a.stage + 1, a.mb)] != 0);
    }
    return true;
  };
  std::vector<std::vector<Act>> out(ranks);
  std::vector<std::size_t> next(ranks);
  std::size_t left = 0;
  for (const auto& list : lists) left += list.size();
  while (left > 0) {
    bool progress = false;
    for (std::size_t r = 0; r < ranks; ++r) {
      if (next[r] == lists[r].size()) continue;
      // An OVERLAP_F_B waits until both halves can run; it is added whole, then its sends.
      const std::size_t n = atomic(lists[r], next[r]);
      bool all_ready = true;
      for (std::size_t k = next[r]; k < next[r] + n; ++k) all_ready = all_ready && ready(lists[r][k]);
      if (!all_ready) continue;
      const std::size_t first = next[r];
      next[r] += n;
      left -= n;
      progress = true;
      for (std::size_t k = first; k < first + n; ++k) out[r].push_back(lists[r][k]);
      for (std::size_t k = first; k < first + n; ++k) {
        const Act& a = lists[r][k];
        if (a.kind == Kind::F) {
          forwarded[at(a.stage, a.mb)] = 1;
          if (a.stage + 1 != stages && rank_of(a.stage + 1) != r) {
            out[r].push_back({Kind::SendF, a.stage, a.mb});
            out[rank_of(a.stage + 1)].push_back({Kind::RecvF, a.stage + 1, a.mb});
            received_f[at(a.stage + 1, a.mb)] = 1;
          }
        } else if (a.kind == Kind::B || a.kind == Kind::I) {
          backwarded[at(a.stage, a.mb)] = 1;
          if (a.stage != 0 && rank_of(a.stage - 1) != r) {
            out[r].push_back({Kind::SendB, a.stage, a.mb});
            out[rank_of(a.stage - 1)].push_back({Kind::RecvB, a.stage - 1, a.mb});
            received_b[at(a.stage - 1, a.mb)] = 1;
          }
        }
      }
    }
    if (!progress) throw Error("pp: the schedule's actions cannot be ordered with their sends and receives");
  }
  return out;
}

/// _PipelineScheduleRuntime's lowering of a multi-stage schedule, then rank `rank`'s list with
/// _add_wait_send's waits: a forward's send is waited right after the stage's own backward
/// (B or I) of that micro-batch, every gradient's send at the end of the step.
std::vector<PipelineOp> runtime_program(PipelineSchedule schedule, std::size_t ranks, std::size_t rank,
                                        std::size_t microbatches, std::size_t per_rank) {
  const std::size_t stages = ranks * per_rank;
  std::vector<std::vector<Act>> lists(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    std::vector<Act> compute;
    for (const PipelineAction& a : pipeline_actions(schedule, ranks, r, microbatches, per_rank)) {
      compute.push_back({kind_of(a.compute), a.stage, a.microbatch, a.overlapped});
    }
    lists[r] = add_reduce_grad(add_unshard_reshard(compute), microbatches, stages);
  }
  const std::vector<Act> mine = add_send_recv(lists, schedule, ranks, stages, microbatches)[rank];
  std::vector<PipelineOp> out;
  std::vector<PipelineOp> pending;  // sends not waited yet, in the order posted
  for (const Act& a : mine) {
    switch (a.kind) {
      case Kind::RecvF: out.push_back({Step::ReceiveActivations, a.stage, a.mb}); break;
      case Kind::F: out.push_back({Step::Forward, a.stage, a.mb}); break;
      case Kind::SendF:
        out.push_back({Step::SendActivations, a.stage, a.mb});
        pending.push_back({Step::WaitActivationsSent, a.stage, a.mb});
        break;
      case Kind::RecvB: out.push_back({Step::ReceiveGradients, a.stage, a.mb}); break;
      case Kind::B:
      case Kind::I: {
        out.push_back({a.kind == Kind::B ? Step::Backward : Step::BackwardInput, a.stage, a.mb});
        const PipelineOp wait{Step::WaitActivationsSent, a.stage, a.mb};
        if (std::erase(pending, wait) > 0) out.push_back(wait);
        break;
      }
      case Kind::W: out.push_back({Step::BackwardWeight, a.stage, a.mb}); break;
      case Kind::SendB:
        out.push_back({Step::SendGradients, a.stage, a.mb});
        pending.push_back({Step::WaitGradientsSent, a.stage, a.mb});
        break;
      // FSDP's actions (the stage's step does nothing with them without FSDP); the wait of a
      // gradient reduction directly follows it.
      case Kind::Unshard: out.push_back({Step::Unshard, a.stage, 0}); break;
      case Kind::Reshard: out.push_back({Step::Reshard, a.stage, 0}); break;
      case Kind::ReduceGrad: out.push_back({Step::ReduceGrad, a.stage, 0}); break;
      default: break;
    }
  }
  out.insert(out.end(), pending.begin(), pending.end());
  return out;
}

}  // namespace

std::vector<PipelineOp> pipeline_program(PipelineSchedule schedule, std::size_t ranks, std::size_t rank,
                                         std::size_t microbatches, std::size_t stages_per_rank) {
  if (multi_stage(schedule)) return runtime_program(schedule, ranks, rank, microbatches, stages_per_rank);
  return single_stage_program(schedule, ranks, rank, microbatches);
}

}  // namespace mem::nn::detail
