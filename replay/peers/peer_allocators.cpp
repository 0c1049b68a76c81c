// peer_allocators.cpp — the bench device, vramscope's counters and the CUB
// replay target (CUB itself stays in cub_peer.cpp).
#include "peer_allocators.hpp"

#include <unordered_map>

namespace mem::bench {

std::shared_ptr<SimDevice> make_bench_device() {
  // 512 B driver granularity: the real driver packs small cudaMallocs, so CUB's
  // many small device allocations must not be charged a 2 MiB page each here.
  // vramscope's segments are multiples of 2 MiB, so its figures do not change.
  SimDeviceConfig config = sim_preset("a100-80g");
  config.granularity = 512;
  return std::make_shared<SimDevice>(config);
}

PeerCounters VramscopeAdaptor::counters() const {
  const DeviceStats s = alloc_.stats();
  return PeerCounters{static_cast<std::size_t>(s.reserved_bytes[0].current),
                      static_cast<std::size_t>(s.reserved_bytes[0].peak),
                      static_cast<std::uint64_t>(s.num_device_alloc - device_allocs_base_)};
}

void VramscopeAdaptor::reset_peaks() {
  alloc_.reset_peak_stats();
  device_allocs_base_ = alloc_.stats().num_device_alloc;
}

CubReplayTarget::CubReplayTarget(std::shared_ptr<SimDevice> device, CubBins bins)
    : device_(device), cub_(device, bins) {}

CubReplayTarget::~CubReplayTarget() = default;

std::string CubReplayTarget::name() const { return cub_.name(); }

void* CubReplayTarget::allocate(std::size_t bytes, std::uint64_t stream) {
  StreamId s = 0;
  if (stream != 0) {
    auto [it, inserted] = streams_.try_emplace(stream, 0);
    if (inserted) it->second = device_->create_stream();
    s = it->second;
  }
  try {
    return cub_.allocate(bytes, s);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

void CubReplayTarget::deallocate(void* ptr, std::size_t bytes, std::uint64_t) noexcept {
  cub_.deallocate(ptr, bytes);
}

std::size_t CubReplayTarget::reserved_bytes() const { return cub_.counters().reserved; }
std::size_t CubReplayTarget::device_used_bytes() const { return device_->process_used_bytes(); }
std::uint64_t CubReplayTarget::device_allocs() const { return cub_.counters().device_allocs; }

}  // namespace mem::bench
