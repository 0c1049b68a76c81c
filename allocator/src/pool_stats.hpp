// pool_stats.hpp — the per-pool statistics as the allocator updates them (internal).
//
// PyTorch keeps each statistic three times (all, small pool, large pool), and
// every transition updates two of them: current, peak, and the accumulated
// allocated or freed counter. On the fast path that is some fifty stores per
// allocate+free pair, the largest part of its cost. Here a transition touches
// only its own pool: an increase updates the pool's current, peak and allocated
// counter and the "all" peak, a decrease only the pool's current. "all"'s
// current and accumulated counters are sums over the pools, and `freed` follows
// from allocated - freed = current - (current when the counters were reset).
// DeviceStats' arrays are built from this when someone reads them; the figures
// are the ones the three-entry update gives, exactly.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "vramscope/allocator/stats.hpp"

namespace mem::detail {

/// Pool indices of a PoolStat.
inline constexpr std::size_t kSmallPoolIndex = 0;
inline constexpr std::size_t kLargePoolIndex = 1;

class PoolStat {
 public:
  void increase(std::size_t pool, std::int64_t amount) noexcept {
    Entry& e = pools_[pool];
    e.current += amount;
    if (e.current > e.peak) e.peak = e.current;
    e.allocated += amount;
    const std::int64_t all = pools_[0].current + pools_[1].current;
    if (all > all_peak_) all_peak_ = all;
  }
  void decrease(std::size_t pool, std::int64_t amount) noexcept { pools_[pool].current -= amount; }
  /// increase(delta) or decrease(-delta), whichever `delta`'s sign says, without a branch
  /// on it: where the sign is the data's (a free's net change in split blocks), the
  /// branch is a coin toss on a random workload. A decrease cannot raise a peak, and adds
  /// nothing to `allocated`.
  void add(std::size_t pool, std::int64_t delta) noexcept {
    Entry& e = pools_[pool];
    e.current += delta;
    e.peak = std::max(e.peak, e.current);
    e.allocated += std::max(delta, std::int64_t{0});
    all_peak_ = std::max(all_peak_, pools_[0].current + pools_[1].current);
  }

  /// "all"'s current value.
  std::int64_t current() const noexcept { return pools_[0].current + pools_[1].current; }

  /// As DeviceStats holds it: all, small_pool, large_pool.
  StatArray read() const noexcept {
    StatArray out{};
    Stat& all = out[static_cast<std::size_t>(StatType::All)];
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      const Entry& e = pools_[p];
      Stat& s = out[p == kSmallPoolIndex ? static_cast<std::size_t>(StatType::SmallPool)
                                         : static_cast<std::size_t>(StatType::LargePool)];
      s.current = e.current;
      s.peak = e.peak;
      s.allocated = e.allocated;
      s.freed = e.allocated - (e.current - e.base);
      all.current += s.current;
      all.allocated += s.allocated;
      all.freed += s.freed;
    }
    all.peak = all_peak_;
    return out;
  }

  void reset_peak() noexcept {
    for (Entry& e : pools_) e.peak = e.current;
    all_peak_ = current();
  }
  void reset_accumulated() noexcept {
    for (Entry& e : pools_) {
      e.allocated = 0;
      e.base = e.current;
    }
  }

 private:
  struct Entry {
    std::int64_t current = 0;
    std::int64_t peak = 0;
    std::int64_t allocated = 0;  // increases since the last reset_accumulated
    std::int64_t base = 0;       // current at the last reset_accumulated
  };
  std::array<Entry, 2> pools_{};
  std::int64_t all_peak_ = 0;
};

/// Every per-pool statistic of DeviceStats, by the same names.
struct PoolStats {
#define VRAMSCOPE_DECLARE_POOL_STAT(name) PoolStat name;
  VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_DECLARE_POOL_STAT)
#undef VRAMSCOPE_DECLARE_POOL_STAT

  /// Whether `active` and `active_bytes` are kept apart. A block is active from its
  /// allocation until its free completes, which is the moment of its free() unless it
  /// waits for stream events (record_stream). Until a block first waits, active equals
  /// allocation in every figure (current, peaks, counters), and active_bytes equals
  /// allocated_bytes: only those are updated, two statistics fewer on every allocation
  /// and free. From then on all four are (track_active).
  bool active_tracked = false;
  /// Called before the first block waits: active takes allocation's figures, which it
  /// has equalled so far.
  void track_active() noexcept {
    active = allocation;
    active_bytes = allocated_bytes;
    active_tracked = true;
  }

  /// Fills the arrays of `out` (its other fields are left as they are).
  void read_into(DeviceStats& out) const noexcept {
#define VRAMSCOPE_READ_POOL_STAT(name) out.name = name.read();
    VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_READ_POOL_STAT)
#undef VRAMSCOPE_READ_POOL_STAT
    if (!active_tracked) {
      out.active = out.allocation;
      out.active_bytes = out.allocated_bytes;
    }
  }
  void reset_peaks() noexcept {
#define VRAMSCOPE_RESET_POOL_STAT(name) name.reset_peak();
    VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_RESET_POOL_STAT)
#undef VRAMSCOPE_RESET_POOL_STAT
  }
  void reset_accumulated() noexcept {
#define VRAMSCOPE_RESET_POOL_STAT(name) name.reset_accumulated();
    VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_RESET_POOL_STAT)
#undef VRAMSCOPE_RESET_POOL_STAT
  }
};

}  // namespace mem::detail
