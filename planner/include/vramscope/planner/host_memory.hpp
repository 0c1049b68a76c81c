// host_memory.hpp — a --compute run's simulated GPU is host memory (backing=host): before
// any arithmetic, its need is measured with a dry run and checked against what the
// machine has, so a run that cannot fit says so instead of swapping or being killed.
#pragma once

#include <cstddef>

#include "vramscope/allocator/device.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::planner {

/// Host memory available to this process: $VRAMSCOPE_HOST_MEMORY (bytes or "16GiB", for
/// containers whose limit /proc/meminfo does not show, and for tests), else MemAvailable.
std::size_t available_host_memory();

/// Throws RunFailed when `cfg` in compute mode would reserve more host memory (its
/// device's peak reserved, which a dry run reproduces exactly) than is available.
void check_host_memory_for_compute(const nn::TrainConfig& cfg, const DeviceInfo& device);

}  // namespace mem::planner
