// cub_peer.cpp — the only file that includes CUB: CubAdaptor on
// cub::CachingDeviceAllocator, calling the simulated CUDA runtime.
#include "sim_cuda_names.hpp"  // first: CUB's cudart calls go to the simulation

#include <cub/util_allocator.cuh>

#include <new>
#include <unordered_map>

#include "peer_allocators.hpp"
#include "sim_cuda_runtime.hpp"

namespace mem::bench {

struct CubAdaptor::Impl {
  explicit Impl(CubBins b)
      : bins(b),
        cub(b == CubBins::Default
                ? cub::CachingDeviceAllocator()
                : cub::CachingDeviceAllocator(2, 9, cub::CachingDeviceAllocator::INVALID_BIN,
                                              cub::CachingDeviceAllocator::INVALID_SIZE)) {}
  CubBins bins;
  cub::CachingDeviceAllocator cub;
  std::uint64_t mallocs_base = 0;
};

namespace {
cudaStream_t to_stream(StreamId s) { return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(s)); }
}  // namespace

CubAdaptor::CubAdaptor(std::shared_ptr<SimDevice> device, CubBins bins) {
  sim_cuda_install(std::move(device));
  impl_ = std::make_unique<Impl>(bins);
}

CubAdaptor::~CubAdaptor() {
  impl_->cub.FreeAllCached();
  impl_.reset();
}

std::string CubAdaptor::name() const {
  return impl_->bins == CubBins::Default ? "cub" : "cub-growth2";
}

void* CubAdaptor::allocate(std::size_t bytes, StreamId stream) {
  void* p = nullptr;
  if (impl_->cub.DeviceAllocate(&p, bytes, to_stream(stream)) != cudaSuccess || p == nullptr) {
    cudaGetLastError();
    throw std::bad_alloc();
  }
  return p;
}

void CubAdaptor::deallocate(void* ptr, std::size_t /*bytes*/) noexcept { impl_->cub.DeviceFree(ptr); }

PeerCounters CubAdaptor::counters() const {
  const SimCudaCounters c = sim_cuda_counters();
  return PeerCounters{c.bytes_in_use, c.peak_bytes_in_use, c.mallocs};
}

void CubAdaptor::reset_peaks() { sim_cuda_reset_counters(); }

std::size_t CubAdaptor::cached_free_bytes() const {
  auto it = impl_->cub.cached_bytes.find(0);
  return it == impl_->cub.cached_bytes.end() ? 0 : it->second.free;
}

std::size_t CubAdaptor::live_bytes() const {
  auto it = impl_->cub.cached_bytes.find(0);
  return it == impl_->cub.cached_bytes.end() ? 0 : it->second.live;
}

}  // namespace mem::bench
