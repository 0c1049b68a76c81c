// clock.hpp — the cheap timestamp that event rings and observers take under the allocator lock.
//
// On x86-64 the time-stamp counter (invariant on every CPU since 2008),
// converted to microseconds when read back; elsewhere steady_clock. Recorders
// store raw ticks so that recording stays a handful of instructions. It is
// still the dearest of them: about 9 ns per read back to back on the AMD EPYC
// VMs we measure on, 3.5 ns when overlapped with an allocation.
#pragma once

#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <x86intrin.h>
#define VRAMSCOPE_HAVE_TSC 1
#endif

namespace mem::detail {

inline std::uint64_t ticks() noexcept {
#if defined(VRAMSCOPE_HAVE_TSC)
  return __rdtsc();
#else
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now().time_since_epoch())
          .count());
#endif
}

/// Ticks per microsecond, measured once per process (about 2 ms the first time).
double ticks_per_us() noexcept;

/// Microseconds between two tick readings (0 if `to` precedes `from`).
inline double ticks_to_us(std::uint64_t from, std::uint64_t to) noexcept {
  return to > from ? static_cast<double>(to - from) / ticks_per_us() : 0.0;
}

}  // namespace mem::detail
