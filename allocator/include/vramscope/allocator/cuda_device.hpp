// cuda_device.hpp — the Device seam on a real GPU through the CUDA runtime.
//
// Only cuda_device.cpp includes CUDA headers: CUDA handles stay behind a pimpl, so
// this header is plain C++ and code using it compiles without the toolkit. The class is
// defined only in builds with VRAMSCOPE_HAVE_CUDA; elsewhere use make_device("cuda:N"),
// which reports that the build has no CUDA support.
//
//   if (mem::cuda_device_count() > 0) {
//     auto gpu = std::make_shared<mem::CudaDevice>(0);
//     mem::CachingAllocator alloc{gpu};
//   }
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "vramscope/allocator/device.hpp"

namespace mem {

namespace detail {
struct CudaDeviceState;  // CUDA handles and the NVML binding; defined in cuda_device.cpp
}

/// A CUDA GPU. Streams and events are real cudaStream_t / cudaEvent_t (timing disabled);
/// StreamId 0 is the legacy default stream. process_used_bytes() asks NVML (loaded at run
/// time, so the binary needs no NVIDIA driver to start) for this process's figure, and
/// falls back to total - free of the whole device when NVML or the process entry is
/// missing; info().assumptions says which one is in use.
class CudaDevice final : public Device {
 public:
  /// Opens GPU `ordinal` (as CUDA numbers them, after CUDA_VISIBLE_DEVICES) and creates
  /// its context. `note` is appended to info().name, e.g. "(auto)". Throws mem::Error
  /// when there is no such GPU or the CUDA runtime cannot start.
  explicit CudaDevice(int ordinal, const std::string& note = {});
  ~CudaDevice() override;  ///< destroys the streams and events this object created
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  /// cudaGetDeviceCount, 0 on any error (no driver, no device, insufficient driver).
  static int device_count() noexcept;

  const DeviceInfo& info() const override { return info_; }
  int ordinal() const noexcept { return ordinal_; }

  void* allocate_segment(std::size_t bytes) override;
  void free_segment(void* ptr, std::size_t bytes) noexcept override;
  /// Through the driver's cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess /
  /// cuMemUnmap / cuMemRelease, when the driver has them and the GPU supports them.
  bool supports_virtual_memory() const override;
  void* reserve_address_range(std::size_t bytes) override;
  void release_address_range(void* base, std::size_t bytes) noexcept override;
  bool map_memory(void* address, std::size_t bytes) override;
  void unmap_memory(void* address, std::size_t bytes) noexcept override;
  DeviceMemInfo mem_get_info() const override;
  std::size_t process_used_bytes() const override;

  StreamId create_stream() override;
  void destroy_stream(StreamId stream) noexcept override;
  bool has_stream(StreamId stream) const override;
  /// Registers a cudaStream_t owned elsewhere (PyTorch's streams under the plugin).
  StreamId adopt_native_stream(std::uintptr_t handle) override;
  EventId create_event() override;
  void destroy_event(EventId event) noexcept override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void synchronize() override;
  /// Measured wall time spent inside cudaMalloc and cudaFree, in microseconds.
  double driver_time_us() const override;

 private:
  int ordinal_;
  DeviceInfo info_;
  std::unique_ptr<detail::CudaDeviceState> state_;
  std::atomic<std::int64_t> driver_time_ns_{0};
};

}  // namespace mem
