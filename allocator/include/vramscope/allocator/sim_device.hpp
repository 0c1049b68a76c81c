// sim_device.hpp — a simulated GPU: capacity, context overhead, driver
// granularity, cudaMalloc latency, optional host backing and fault injection.
//
//   auto dev = std::make_shared<mem::SimDevice>(mem::sim_preset("a100-80g"));
//   mem::CachingAllocator alloc{dev};
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vramscope/allocator/device.hpp"

namespace mem {

enum class SimBacking {
  None,  ///< addresses only: no host memory behind segments (dry runs)
  Host,  ///< real host memory behind every segment, reserved lazily (compute mode)
};

struct SimDeviceConfig {
  std::string name = "sim";
  std::size_t capacity = 0;                  ///< cudaMemGetInfo total
  std::size_t context_bytes = 0;             ///< CUDA context + runtime, shown by nvidia-smi
  std::size_t granularity = std::size_t{2} << 20;  ///< segments counted in 2 MiB pages
  SimBacking backing = SimBacking::None;
  double malloc_latency_us = 0;              ///< virtual cost of one cudaMalloc
  double free_latency_us = 0;                ///< virtual cost of one cudaFree (implies a sync)
  int compute_capability = 0;                ///< "sm=90": which GPU generation; 0 unknown
  int multiprocessors = 0;                   ///< SMs of a preset; 0 unknown (a custom GPU)
  int max_threads_per_multiprocessor = 0;    ///< of a preset; 0 unknown
  /// Kernels loaded on first use (lazy loading), outside the allocator: "cublas=", "cudnn="
  /// (presets and specs: 224 MiB and 16 MiB, measured on an H100; a bare config: none).
  std::size_t cublas_bytes = 0;
  std::size_t cudnn_bytes = 0;
  std::string description;                   ///< where the preset's numbers come from
};

/// Named presets of real GPUs. Throws mem::Error listing the names for an unknown one.
SimDeviceConfig sim_preset(const std::string& name);
/// All preset names in a stable order.
std::vector<std::string> sim_preset_names();
/// The default simulated device (the one "sim" and "auto" without a GPU pick).
std::string default_sim_preset();
/// Parses the part after "sim:": a preset name, "key=value,..." (capacity, context,
/// granularity, backing, malloc_us, free_us) or a preset followed by overrides
/// ("a100-80g,backing=host"). Keys a spec without a preset leaves out take generic
/// values: context 0 B, granularity 2 MiB, backing none, malloc_us 25, free_us 40.
/// Throws mem::Error on anything malformed.
SimDeviceConfig parse_sim_spec(const std::string& spec);

class SimDevice final : public Device {
 public:
  explicit SimDevice(SimDeviceConfig config);
  ~SimDevice() override;
  SimDevice(const SimDevice&) = delete;
  SimDevice& operator=(const SimDevice&) = delete;

  const DeviceInfo& info() const override { return info_; }
  const SimDeviceConfig& config() const { return config_; }

  void* allocate_segment(std::size_t bytes) override;
  void free_segment(void* ptr, std::size_t bytes) noexcept override;
  bool supports_virtual_memory() const override { return true; }
  void* reserve_address_range(std::size_t bytes) override;
  void release_address_range(void* base, std::size_t bytes) noexcept override;
  bool map_memory(void* address, std::size_t bytes) override;
  void unmap_memory(void* address, std::size_t bytes) noexcept override;
  bool map_pages(void* address, std::size_t count, std::size_t page) override;
  void unmap_pages(void* address, std::size_t count, std::size_t page) noexcept override;
  std::optional<std::size_t> load_module(std::string_view name, std::size_t bytes) override;
  std::size_t module_bytes() const override;
  DeviceMemInfo mem_get_info() const override;
  std::size_t process_used_bytes() const override;

  StreamId create_stream() override;
  void destroy_stream(StreamId stream) noexcept override;
  bool has_stream(StreamId stream) const override;
  EventId create_event() override;
  void destroy_event(EventId event) noexcept override;
  void record_event(EventId event, StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void synchronize() override;
  double driver_time_us() const override;

  // --- test controls -------------------------------------------------------
  /// Fail the nth segment allocation from now (1 = the next one); 0 disables.
  void fail_nth_allocation(std::uint64_t n);
  /// Fail the nth segment allocation from now and every one after it (a device that
  /// stays full), so the allocator's free-the-cache-and-retry cannot hide it; 0 disables.
  void fail_allocations_from(std::uint64_t n);
  /// Fail each segment allocation with this probability, from a seeded generator.
  void fail_with_probability(double p, std::uint64_t seed);
  /// While held, recorded events stay pending until release_events() or synchronize().
  void hold_events(bool hold);
  void release_events();

  // --- counters for reports and tests -----------------------------------------
  std::size_t used_bytes() const;           ///< sum of live segment and mapping sizes
  std::uint64_t segment_allocs() const;     ///< successful cudaMalloc and map calls
  std::uint64_t segment_frees() const;      ///< cudaFree and unmap calls
  std::size_t address_ranges() const;      ///< reserved ranges not yet released
  std::uint64_t failed_allocs() const;      ///< injected or capacity failures

 private:
  std::size_t pages_of(std::size_t bytes) const;
  /// A driver allocation of `bytes` (cudaMalloc or cuMemCreate): charges its latency, applies
  /// the injected failures and the capacity; false when refused.
  bool take_memory_locked(std::size_t bytes);
  /// Undoes take_memory_locked for an allocation that failed after it (no addresses, no
  /// host pages): counted as a refusal.
  void refuse_taken_locked(std::size_t bytes) noexcept;
  void give_back_memory_locked(std::size_t bytes) noexcept;
  void* map_segment_locked(std::size_t bytes);
  /// Virtual memory: the checks of one map call (throw mem::Error on misuse), the mapped
  /// runs kept coalesced, and a run of pages accounted as its calls would be.
  void check_page_locked(std::size_t bytes) const;
  void check_mappable_locked(std::uintptr_t at, std::size_t bytes) const;
  bool mapped_overlaps_locked(std::uintptr_t at, std::size_t bytes) const noexcept;
  void add_mapping_locked(std::uintptr_t at, std::size_t bytes);
  bool remove_mapping_locked(std::uintptr_t at, std::size_t bytes);
  bool map_pages_at_once_locked(std::uintptr_t at, std::size_t count, std::size_t page);
  void unmap_segment_locked(std::uintptr_t address, std::size_t bytes) noexcept;

  SimDeviceConfig config_;
  DeviceInfo info_;
  mutable std::mutex mutex_;
  std::vector<std::string> modules_;  ///< libraries whose kernels load_module brought on (lazy loading)
  // Invariant: used_rounded_ == sum over live_ of pages_of(bytes) * granularity, and
  // context_bytes + used_rounded_ <= capacity (the driver's view: free never goes negative).
  std::size_t used_ = 0;          ///< sum of segment sizes as asked for
  std::size_t used_rounded_ = 0;  ///< sum rounded to granularity (what cudaMemGetInfo subtracts)
  /// Segments are placed by offset the same way in both backings (bump pointer
  /// plus lowest-fitting freed range), so best-fit ties between equal blocks break
  /// identically and a dry run matches a compute run byte for byte. Address-only:
  /// address = address_base_ + offset, in a window of [2^48, 2^53) no other live
  /// device uses. Host: address = host_base_ + offset inside one PROT_NONE
  /// reservation whose pages are made accessible per segment.
  std::uintptr_t address_base_ = 0;  ///< where offset 0 lies in the 2^48 space
  std::uintptr_t next_address_ = 0;  ///< bump pointer (an address in the 2^48 space)
  std::uintptr_t host_base_ = 0;  ///< host reservation (backing Host), 0 otherwise
  std::size_t host_span_ = 0;     ///< its size: the offsets both backings may use
  /// Address-only backing: freed ranges below next_address_, by start, coalesced, reused
  /// lowest-first like the driver's VA allocator so long runs never exhaust the space.
  std::map<std::uintptr_t, std::size_t> free_ranges_;
  std::unordered_map<std::uintptr_t, std::size_t> live_;  ///< segment -> bytes
  /// Virtual memory: reserved ranges (start -> bytes; address-only ranges are windows of
  /// their own, host ones PROT_NONE mappings) and the mappings inside them.
  std::map<std::uintptr_t, std::size_t> reserved_;
  std::map<std::uintptr_t, std::size_t> mapped_;  ///< maximal mapped runs: start -> bytes
  std::uint64_t allocs_ = 0, frees_ = 0, failures_ = 0;
  std::uint64_t fail_countdown_ = 0;
  bool fail_sticky_ = false;  ///< once the countdown hits, keep failing
  double fail_probability_ = 0;
  std::mt19937_64 rng_;
  double driver_time_us_ = 0;
  bool hold_events_ = false;
  StreamId next_stream_ = 1;
  EventId next_event_ = 1;
  std::unordered_set<StreamId> streams_;      ///< created and not destroyed (0 is implicit)
  std::unordered_map<EventId, bool> events_;  ///< event -> complete
};

}  // namespace mem
