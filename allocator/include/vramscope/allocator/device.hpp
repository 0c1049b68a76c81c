// device.hpp — the one seam between the allocator and a GPU.
//
// Everything the caching allocator needs from CUDA, and nothing more:
// cudaMalloc/cudaFree of whole segments, the virtual-memory calls expandable
// segments grow by, cudaMemGetInfo, the per-process figure nvidia-smi prints,
// and streams and events for deferred reuse.
// SimDevice implements it without a GPU; CudaDevice on the CUDA runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace mem {

using StreamId = std::uint64_t;  ///< 0 is the default (legacy) stream
using EventId = std::uint64_t;

/// What a device is, for reports: every simulated assumption is spelled out.
struct DeviceInfo {
  std::string name;               ///< "sim:a100-80g", "cuda:0 (NVIDIA H100 80GB HBM3)"
  std::size_t total_bytes = 0;    ///< capacity as cudaMemGetInfo reports it
  std::size_t context_bytes = 0;  ///< CUDA context overhead nvidia-smi shows before any allocation
  std::size_t granularity = 0;    ///< driver rounding of a segment in nvidia-smi's view
  bool simulated = true;
  int compute_capability = 0;     ///< major * 10 + minor (75 Turing, 80 A100, 90 H100); 0 unknown
  int multiprocessors = 0;        ///< SMs (cudaDeviceProp::multiProcessorCount); 0 unknown
  int max_threads_per_multiprocessor = 0;  ///< cudaDeviceProp::maxThreadsPerMultiProcessor; 0 unknown
  /// Device memory CUDA's lazy loading adds, outside any allocator, when cuBLAS's and
  /// cuDNN's kernels first run (Device::load_module). 0 on a real GPU, which loads its own.
  std::size_t cublas_bytes = 0, cudnn_bytes = 0;
  std::string assumptions;        ///< one line to print beside any figure from this device
};

struct DeviceMemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

/// A GPU as the allocator sees it. Implementations are thread-safe.
class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;

  /// cudaMalloc: returns nullptr when the device is out of memory (never throws for that).
  virtual void* allocate_segment(std::size_t bytes) = 0;
  /// cudaFree of a pointer allocate_segment returned, with the size it was asked for.
  virtual void free_segment(void* ptr, std::size_t bytes) noexcept = 0;

  /// Virtual memory management, what expandable segments grow by (the driver's cuMemAddressReserve,
  /// cuMemCreate + cuMemMap + cuMemSetAccess, cuMemUnmap + cuMemRelease, cuMemAddressFree).
  /// A device without it keeps the defaults: it supports none and refuses every call.
  virtual bool supports_virtual_memory() const { return false; }
  /// Reserves `bytes` of addresses, no memory: nullptr when no range is left.
  virtual void* reserve_address_range(std::size_t /*bytes*/) { return nullptr; }
  /// Gives back a range reserve_address_range returned, every page in it unmapped first.
  virtual void release_address_range(void* /*base*/, std::size_t /*bytes*/) noexcept {}
  /// Creates `bytes` of physical memory (a multiple of the granularity) and maps it at
  /// `address` inside a reserved range, readable and writable: false when the device is
  /// out of memory (nothing was mapped). Counts in the nvidia-smi view like a segment.
  virtual bool map_memory(void* /*address*/, std::size_t /*bytes*/) { return false; }
  /// Unmaps and releases what one map_memory call mapped at `address`, with its size.
  virtual void unmap_memory(void* /*address*/, std::size_t /*bytes*/) noexcept {}
  /// Maps `count` consecutive pages of `page` bytes from `address`, one map_memory call per
  /// page (PyTorch's expandable segments create one handle per page): true when all are
  /// mapped; false when the device ran out part way, with the pages mapped so far unmapped
  /// again. A driver error (thrown) also leaves nothing of the call mapped. A simulated
  /// device may account for the calls at once, with the same clock and counters.
  virtual bool map_pages(void* address, std::size_t count, std::size_t page);
  /// Unmaps `count` pages of `page` bytes from `address`, each mapped by its own call.
  virtual void unmap_pages(void* address, std::size_t count, std::size_t page) noexcept;

  /// Device memory a library's kernels take when it first runs (CUDA's lazy module
  /// loading: cuBLAS's and cuDNN's kernels), outside any allocator: nvidia-smi shows it
  /// and cudaMemGetInfo counts it, from then on. Returns the bytes the device now holds for
  /// it, nullopt when they do not fit. A simulated device holds `bytes` at its granularity,
  /// once per `name` (a process loads a library once); a real GPU loads its libraries when
  /// their kernels run: 0, nothing to do.
  virtual std::optional<std::size_t> load_module(std::string_view name, std::size_t bytes) {
    (void)name;
    (void)bytes;
    return 0;
  }
  /// The bytes load_module holds so far (what a new allocator on this device starts from,
  /// beside the context).
  virtual std::size_t module_bytes() const { return 0; }
  /// cudaMemGetInfo.
  virtual DeviceMemInfo mem_get_info() const = 0;
  /// Bytes this process uses as nvidia-smi shows them (context + segments at driver granularity).
  virtual std::size_t process_used_bytes() const = 0;

  virtual StreamId create_stream() = 0;
  virtual void destroy_stream(StreamId stream) noexcept = 0;
  /// True for the default stream 0 and every stream created and not yet destroyed.
  virtual bool has_stream(StreamId stream) const = 0;
  /// A stream this device did not create, given by its native handle (a cudaStream_t that
  /// PyTorch or another framework owns): the id to allocate and record_stream with. The
  /// device records events on it and never destroys it; handle 0 is the default stream.
  /// The caller keeps the handle-to-id map. A simulated device has no native streams, so
  /// by default a new stream stands for the handle.
  virtual StreamId adopt_native_stream(std::uintptr_t handle) {
    return handle == 0 ? 0 : create_stream();
  }
  virtual EventId create_event() = 0;
  virtual void destroy_event(EventId event) noexcept = 0;
  virtual void record_event(EventId event, StreamId stream) = 0;
  /// cudaEventQuery: true once the work recorded before the event has completed.
  virtual bool query_event(EventId event) = 0;
  virtual void synchronize_event(EventId event) = 0;
  virtual void synchronize() = 0;

  /// Virtual driver time spent in segment allocations and frees, in microseconds
  /// (simulated latency model; a real device reports measured wall time).
  virtual double driver_time_us() const = 0;
};

/// Builds a device from a spec: "auto", "sim", "sim:<preset>", "sim:capacity=8GiB,context=400MiB",
/// "cuda", "cuda:N". "auto" picks cuda:0 when a GPU is present, else the simulated default.
/// Throws mem::Error listing the valid forms for anything else.
std::shared_ptr<Device> make_device(const std::string& spec);

/// Number of CUDA GPUs usable by this build (0 when built without CUDA or none present).
int cuda_device_count() noexcept;

}  // namespace mem
