// sim_cuda_runtime.hpp — a simulated CUDA runtime for peers that call cudart
// (CUB's CachingDeviceAllocator): cudaMalloc/cudaFree, device selection,
// events and errors, backed by a mem::SimDevice. One device (ordinal 0).
//
//   mem::bench::sim_cuda_install(std::make_shared<mem::SimDevice>(cfg));
//   ... CUB allocates through the simulated runtime ...
//   mem::bench::sim_cuda_counters().mallocs;
//
// The functions themselves (vramscope_sim_cuda*) are declared by the CUDA
// headers through sim_cuda_names.hpp; this header is CUDA-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "vramscope/allocator/sim_device.hpp"

namespace mem::bench {

/// What the peer asked of the driver since install or reset.
struct SimCudaCounters {
  std::uint64_t mallocs = 0;       ///< successful cudaMalloc calls
  std::uint64_t frees = 0;         ///< cudaFree calls
  std::uint64_t failed_mallocs = 0;
  std::size_t bytes_in_use = 0;    ///< cudaMalloc'd and not freed
  std::size_t peak_bytes_in_use = 0;
};

/// Makes `device` the simulated runtime's device 0 (replacing any previous one;
/// allocations still live on the old device must be freed first).
void sim_cuda_install(std::shared_ptr<SimDevice> device);
/// The installed device, or null.
SimDevice* sim_cuda_device() noexcept;
SimCudaCounters sim_cuda_counters() noexcept;
/// Peak := current, counts := 0.
void sim_cuda_reset_counters() noexcept;

}  // namespace mem::bench
