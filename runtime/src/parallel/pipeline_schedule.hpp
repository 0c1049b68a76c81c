// pipeline_schedule.hpp — what one pipeline rank does in a step, in order (internal): its
// compute actions and the receives, sends and waits around them, as torch.distributed.pipelining
// (PyTorch 2.15, schedules.py) runs them.
//
// ScheduleGPipe and Schedule1F1B (PipelineScheduleSingle) post their receives, sends and waits
// from their own loops; the program below writes those loops' order out. Interleaved 1F1B and
// the zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) run through
// _PipelineScheduleRuntime: every rank's compute actions are lowered together
// (_prepare_schedule_with_comms: _add_unshard_reshard, _add_reduce_grad, _add_send_recv, then
// _add_wait_send), and a rank executes its lowered list. Where a receive lands in a rank's list
// depends on when its neighbour sends, so the lowering simulates every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"

namespace mem::nn::detail {

/// One action of a rank's lowered schedule.
enum class PipelineStep : std::uint8_t {
  ReceiveActivations,  ///< RECV_F: a fresh buffer for the stage's input (_RecvInfo.allocate_buffer)
  Forward,             ///< F: forward_one_chunk (and the loss on the last stage)
  SendActivations,     ///< SEND_F: the output goes to the next stage's rank
  WaitActivationsSent, ///< WAIT_SEND_F: release_fwd_send_outputs drops the output sent
  ReceiveGradients,    ///< RECV_B: a fresh buffer for the gradient of the stage's output
  Backward,            ///< B: backward_one_chunk (full backward)
  BackwardInput,       ///< I: backward_one_chunk(full_backward=False): the input's gradient only
  BackwardWeight,      ///< W: backward_weight_one_chunk: the weights' gradients of that I
  SendGradients,       ///< SEND_B: the input's gradient goes to the previous stage's rank
  WaitGradientsSent,   ///< WAIT_SEND_B: the gradient sent is dropped
  // The runtime's FSDP actions (interleaved schedules only; nothing without FSDP):
  Unshard,             ///< UNSHARD: the stage's FSDP modules all-gather (async; waited before its compute)
  Reshard,             ///< RESHARD: the stage's parameters go back to their shards (a no-op once reduced)
  ReduceGrad,          ///< REDUCE_GRAD (+ its wait): the stage's gradients reduce-scattered, after its last backward
};

struct PipelineOp {
  PipelineStep step = PipelineStep::Forward;
  std::size_t stage = 0;  ///< the stage's index among all ranks x stages_per_rank
  std::size_t microbatch = 0;
  friend bool operator==(const PipelineOp&, const PipelineOp&) = default;
};

/// Rank `rank`'s program for one step of `schedule` over `ranks` pipeline ranks holding
/// `stages_per_rank` stages each (stage r + k x ranks on rank r) and `microbatches`
/// micro-batches. Throws mem::Error for a schedule the micro-batches do not allow.
std::vector<PipelineOp> pipeline_program(PipelineSchedule schedule, std::size_t ranks, std::size_t rank,
                                         std::size_t microbatches, std::size_t stages_per_rank);

}  // namespace mem::nn::detail
