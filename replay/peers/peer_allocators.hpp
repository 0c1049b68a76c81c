// peer_allocators.hpp — vramscope's allocator, CUB's CachingDeviceAllocator
// and glibc malloc behind one shape, so one benchmark body runs on each.
//
//   auto device = mem::bench::make_bench_device();
//   mem::bench::CubAdaptor cub{device, mem::bench::CubBins::Growth2};
//   void* p = cub.allocate(1 << 20, 0);
//   cub.deallocate(p, 1 << 20);
//   cub.counters().device_allocs;
//
// Every adaptor has: name(), allocate(bytes, stream) (throws std::bad_alloc
// when the device is full), deallocate(ptr, bytes) noexcept, counters(),
// reset_peaks(). Benchmarks take them as template parameters: no virtual call
// sits on the measured path. CUB is included only by cub_peer.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/replay/replay.hpp"

namespace mem::bench {

/// What an allocator took from the device (zeros for glibc, which has none).
struct PeerCounters {
  std::size_t reserved = 0;       ///< bytes held from the device now
  std::size_t peak_reserved = 0;  ///< since construction or reset_peaks()
  std::uint64_t device_allocs = 0;  ///< cudaMalloc calls since construction or reset_peaks()
};

/// The simulated GPU every peer runs on in the benchmarks: the a100-80g preset
/// (address-only backing) with a 512 B driver granularity.
std::shared_ptr<SimDevice> make_bench_device();

/// vramscope's CachingAllocator.
class VramscopeAdaptor {
 public:
  explicit VramscopeAdaptor(std::shared_ptr<SimDevice> device, AllocatorConfig config = {})
      : alloc_(std::move(device), config) {}
  static std::string name() { return "vramscope"; }
  void* allocate(std::size_t bytes, StreamId stream = 0) { return alloc_.allocate(bytes, stream); }
  void deallocate(void* ptr, std::size_t /*bytes*/) noexcept {
    try {
      alloc_.deallocate(ptr);
    } catch (...) {
    }
  }
  PeerCounters counters() const;
  void reset_peaks();
  CachingAllocator& allocator() noexcept { return alloc_; }

 private:
  CachingAllocator alloc_;
  std::int64_t device_allocs_base_ = 0;
};

/// CUB's bin layouts.
enum class CubBins {
  Default,  ///< CachingDeviceAllocator(): growth 8, bins 512 B..2 MiB, caches at most 6 MiB
  Growth2,  ///< growth 2 from 512 B, no largest bin, no cache limit: caches every size
};

/// cub::CachingDeviceAllocator from the installed CUDA toolkit, on the
/// simulated CUDA runtime. One CubAdaptor at a time (the runtime is global).
class CubAdaptor {
 public:
  CubAdaptor(std::shared_ptr<SimDevice> device, CubBins bins);
  ~CubAdaptor();
  CubAdaptor(const CubAdaptor&) = delete;
  CubAdaptor& operator=(const CubAdaptor&) = delete;
  std::string name() const;
  /// Streams are simulated-device stream ids (0: the default stream).
  void* allocate(std::size_t bytes, StreamId stream = 0);
  void deallocate(void* ptr, std::size_t bytes) noexcept;
  PeerCounters counters() const;
  void reset_peaks();
  /// CUB's own books: bytes cached free and handed out.
  std::size_t cached_free_bytes() const;
  std::size_t live_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// glibc malloc/free: the yardstick (no device, no streams).
class GlibcAdaptor {
 public:
  explicit GlibcAdaptor(std::shared_ptr<SimDevice> = nullptr) {}
  static std::string name() { return "glibc"; }
  void* allocate(std::size_t bytes, StreamId = 0) {
    void* p = std::malloc(bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr, std::size_t) noexcept { std::free(ptr); }
  PeerCounters counters() const { return {}; }
  void reset_peaks() {}
};

// --- the allocators under test, default-constructible for benchmark templates --
// (BM_FastPath<Vramscope>, ...): each on its own bench device.

struct OnBenchDevice {  // a base, so it is constructed before the adaptor
  std::shared_ptr<SimDevice> device_ = make_bench_device();
  double driver_us() const { return device_->driver_time_us(); }
};

struct Vramscope : OnBenchDevice, VramscopeAdaptor {
  Vramscope() : VramscopeAdaptor(device_) {}
};
/// With expandable_segments:True: the cache-hit path should cost what it costs without.
struct VramscopeExpandable : OnBenchDevice, VramscopeAdaptor {
  VramscopeExpandable() : VramscopeAdaptor(device_, AllocatorConfig::parse("expandable_segments:True")) {}
};

#if VRAMSCOPE_HAVE_CUB_PEER
struct Cub : OnBenchDevice, CubAdaptor {
  Cub() : CubAdaptor(device_, CubBins::Default) {}
};
struct CubGrowth2 : OnBenchDevice, CubAdaptor {
  CubGrowth2() : CubAdaptor(device_, CubBins::Growth2) {}
};
#endif

struct Glibc : GlibcAdaptor {
  double driver_us() const { return 0; }
};

template <class A>
constexpr bool kHasDevice = !std::is_same_v<A, Glibc>;

/// Drives a CubAdaptor from mem::replay_on; trace stream handles become
/// simulated streams on first use.
class CubReplayTarget final : public ReplayTarget {
 public:
  CubReplayTarget(std::shared_ptr<SimDevice> device, CubBins bins);
  ~CubReplayTarget() override;
  std::string name() const override;
  void* allocate(std::size_t bytes, std::uint64_t stream) override;
  void deallocate(void* ptr, std::size_t bytes, std::uint64_t stream) noexcept override;
  std::size_t reserved_bytes() const override;
  std::size_t device_used_bytes() const override;
  std::uint64_t device_allocs() const override;

 private:
  std::shared_ptr<SimDevice> device_;
  CubAdaptor cub_;
  std::unordered_map<std::uint64_t, StreamId> streams_;  ///< trace handle -> sim stream
};

}  // namespace mem::bench
