// spin_lock.hpp — the allocator's lock: a test-and-test-and-set spin lock.
//
// Critical sections are a few hundred nanoseconds at most, so spinning beats a
// futex mutex: unlock is a plain release store (no atomic read-modify-write),
// which keeps an uncontended allocate+free pair at two atomic exchanges.
// Waiters back off to yield() so a descheduled owner does not burn a core.
#pragma once

#include <atomic>
#include <thread>

namespace mem::detail {

class SpinLock {
 public:
  void lock() noexcept {
    for (;;) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      int spins = 0;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins < 128) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace mem::detail
