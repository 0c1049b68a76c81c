// sim_cuda_runtime.cpp — the simulated CUDA runtime functions CUB calls,
// defined under the names sim_cuda_names.hpp gives them.
#include "sim_cuda_names.hpp"  // first: renames the declarations below

#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "sim_cuda_runtime.hpp"

namespace mem::bench {
namespace {

struct Runtime {
  std::mutex mutex;
  std::shared_ptr<SimDevice> device;
  std::unordered_map<void*, std::size_t> sizes;  // cudaFree takes no size; SimDevice wants it
  SimCudaCounters counters;
};

Runtime& runtime() {
  static Runtime r;
  return r;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

mem::EventId event_id(cudaEvent_t e) { return static_cast<mem::EventId>(reinterpret_cast<std::uintptr_t>(e)); }
mem::StreamId stream_id(cudaStream_t s) { return static_cast<mem::StreamId>(reinterpret_cast<std::uintptr_t>(s)); }

}  // namespace

void sim_cuda_install(std::shared_ptr<SimDevice> device) {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  r.device = std::move(device);
  r.sizes.clear();
  r.counters = {};
}

SimDevice* sim_cuda_device() noexcept { return runtime().device.get(); }

SimCudaCounters sim_cuda_counters() noexcept {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  return r.counters;
}

void sim_cuda_reset_counters() noexcept {
  Runtime& r = runtime();
  std::lock_guard lock(r.mutex);
  const std::size_t in_use = r.counters.bytes_in_use;
  r.counters = {};
  r.counters.bytes_in_use = r.counters.peak_bytes_in_use = in_use;
}

}  // namespace mem::bench

using mem::SimDevice;
using mem::bench::runtime;

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  auto& r = runtime();
  SimDevice* device = r.device.get();
  if (device == nullptr) return mem::bench::fail(cudaErrorNoDevice);
  void* p = device->allocate_segment(bytes);
  std::lock_guard lock(r.mutex);
  if (p == nullptr) {
    ++r.counters.failed_mallocs;
    return mem::bench::fail(cudaErrorMemoryAllocation);
  }
  r.sizes[p] = bytes;
  ++r.counters.mallocs;
  r.counters.bytes_in_use += bytes;
  if (r.counters.bytes_in_use > r.counters.peak_bytes_in_use)
    r.counters.peak_bytes_in_use = r.counters.bytes_in_use;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  auto& r = runtime();
  std::size_t bytes = 0;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.sizes.find(ptr);
    if (it == r.sizes.end()) return mem::bench::fail(cudaErrorInvalidValue);
    bytes = it->second;
    r.sizes.erase(it);
    ++r.counters.frees;
    r.counters.bytes_in_use -= bytes;
  }
  r.device->free_segment(ptr, bytes);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = mem::bench::current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return mem::bench::fail(cudaErrorInvalidDevice);
  mem::bench::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  SimDevice* device = runtime().device.get();
  if (device == nullptr) return mem::bench::fail(cudaErrorNoDevice);
  *event = reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(device->create_event()));
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  try {
    runtime().device->record_event(mem::bench::event_id(event), mem::bench::stream_id(stream));
  } catch (const std::exception&) {
    return mem::bench::fail(cudaErrorInvalidResourceHandle);
  }
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  try {
    return runtime().device->query_event(mem::bench::event_id(event)) ? cudaSuccess : cudaErrorNotReady;
  } catch (const std::exception&) {
    return mem::bench::fail(cudaErrorInvalidResourceHandle);
  }
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (SimDevice* device = runtime().device.get()) device->destroy_event(mem::bench::event_id(event));
  return cudaSuccess;
}

cudaError_t cudaGetLastError() { return std::exchange(mem::bench::last_error, cudaSuccess); }

cudaError_t cudaPeekAtLastError() { return mem::bench::last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error (simulated runtime)";
    case cudaErrorMemoryAllocation: return "out of memory (simulated runtime)";
    case cudaErrorInvalidValue: return "invalid argument (simulated runtime)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (simulated runtime)";
    case cudaErrorNoDevice: return "no simulated device installed";
    case cudaErrorNotReady: return "device not ready (simulated runtime)";
    default: return "error (simulated runtime)";
  }
}
