// clock.hpp — the cheap timestamp recorders take inside allocator callbacks.
//
// On x86-64 the time-stamp counter (a few cycles, invariant on every CPU
// since 2008) converted to microseconds when read back; elsewhere steady_clock.
// Recorders store raw ticks so that on_event stays a handful of instructions.
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
