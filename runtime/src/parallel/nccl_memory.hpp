// nccl_memory.hpp — the seam where an engine's first collective makes NCCL's communicator
// memory appear on the device (internal).
#pragma once

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

/// NCCL_RUNTIME_CONNECT=1: the communicator's buffers are made at the first collective that
/// needs them; they hold the device outside the caching allocator (nvidia-smi shows them).
/// Once per process: later calls hold nothing more. Throws OutOfMemoryError when they do not fit.
void first_collective(Runtime& runtime, const ParallelConfig& config);

}  // namespace mem::nn::detail
