// stats.hpp — allocator statistics with PyTorch's names and meanings.
//
// Every per-pool statistic is listed once in VRAMSCOPE_STAT_ARRAYS; that list
// generates the struct, the reset code and the name tables used by exports.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mem {

/// One counter: current value, its peak since the last reset, and the running
/// totals of increases (allocated) and decreases (freed).
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) noexcept {
    current += amount;
    if (current > peak) peak = current;
    allocated += amount;
  }
  void decrease(std::int64_t amount) noexcept {
    current -= amount;
    freed += amount;
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept { allocated = freed = 0; }
  bool operator==(const Stat&) const = default;
};

/// Index into a StatArray, as PyTorch's StatType.
enum class StatType : std::size_t { All = 0, SmallPool = 1, LargePool = 2 };
inline constexpr std::size_t kNumStatTypes = 3;
inline constexpr std::array<std::string_view, kNumStatTypes> kStatTypeNames = {
    "all", "small_pool", "large_pool"};

using StatArray = std::array<Stat, kNumStatTypes>;

// clang-format off
#define VRAMSCOPE_STAT_ARRAYS(X) \
  X(allocation)                  \
  X(segment)                     \
  X(active)                      \
  X(inactive_split)              \
  X(allocated_bytes)             \
  X(reserved_bytes)              \
  X(active_bytes)                \
  X(inactive_split_bytes)        \
  X(requested_bytes)

#define VRAMSCOPE_STAT_COUNTERS(X) \
  X(num_alloc_retries)             \
  X(num_ooms)                      \
  X(num_sync_all_streams)          \
  X(num_device_alloc)              \
  X(num_device_free)
// clang-format on

/// PyTorch's DeviceStats plus the device view (what nvidia-smi would show).
struct DeviceStats {
#define VRAMSCOPE_DECLARE_ARRAY(name) StatArray name{};
  VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_DECLARE_ARRAY)
#undef VRAMSCOPE_DECLARE_ARRAY
#define VRAMSCOPE_DECLARE_COUNTER(name) std::int64_t name = 0;
  VRAMSCOPE_STAT_COUNTERS(VRAMSCOPE_DECLARE_COUNTER)
#undef VRAMSCOPE_DECLARE_COUNTER
  Stat oversize_allocations;  ///< live blocks >= max_split_size
  Stat oversize_segments;     ///< segments >= max_split_size
  std::int64_t max_split_size = 0;

  // The device view, beside PyTorch's figures.
  Stat device_used_bytes;           ///< context + segments at driver granularity (nvidia-smi)
  std::int64_t device_total_bytes = 0;
  std::int64_t context_bytes = 0;   ///< the context assumption included in device_used_bytes
  double driver_time_us = 0;        ///< device time spent in segment allocs/frees

  void reset_peaks() noexcept;
  void reset_accumulated() noexcept;
  bool operator==(const DeviceStats&) const = default;
};

/// Names of the per-pool arrays in declaration order ("allocation", ...).
inline constexpr std::array<std::string_view, 9> kStatArrayNames = {
#define VRAMSCOPE_NAME(name) #name,
    VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_NAME)
#undef VRAMSCOPE_NAME
};

/// Visits every per-pool array as (name, StatArray&) in declaration order.
template <class Stats, class F>
void for_each_stat_array(Stats& stats, F&& f) {
#define VRAMSCOPE_VISIT(name) f(std::string_view{#name}, stats.name);
  VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_VISIT)
#undef VRAMSCOPE_VISIT
}

/// Visits every scalar counter as (name, std::int64_t&).
template <class Stats, class F>
void for_each_stat_counter(Stats& stats, F&& f) {
#define VRAMSCOPE_VISIT(name) f(std::string_view{#name}, stats.name);
  VRAMSCOPE_STAT_COUNTERS(VRAMSCOPE_VISIT)
#undef VRAMSCOPE_VISIT
}

}  // namespace mem
