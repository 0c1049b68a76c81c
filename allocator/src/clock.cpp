// clock.cpp — calibration of the tick counter against steady_clock.
#include "vramscope/allocator/clock.hpp"

#include <thread>

namespace mem::detail {

double ticks_per_us() noexcept {
#if defined(VRAMSCOPE_HAVE_TSC)
  // Calibrated once against steady_clock over ~2 ms of busy wait; the TSC
  // runs at a constant rate, so one measurement serves the whole process.
  static const double rate = [] {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    const std::uint64_t c0 = __rdtsc();
    auto t1 = t0;
    while (t1 - t0 < std::chrono::milliseconds(2)) t1 = clock::now();
    const std::uint64_t c1 = __rdtsc();
    const double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    const double r = static_cast<double>(c1 - c0) / us;
    return r > 0 ? r : 1000.0;
  }();
  return rate;
#else
  return 1000.0;  // ticks are nanoseconds
#endif
}

}  // namespace mem::detail
