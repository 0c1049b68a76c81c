// biased_lock.cpp — membarrier(2) for BiasedLock's revocation.
#include "biased_lock.hpp"

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mem::detail {

bool membarrier_available() noexcept {
#if defined(__SANITIZE_THREAD__)
  return false;  // TSan does not model membarrier's ordering
#elif defined(__linux__) && defined(__NR_membarrier)
  // Registration is per process and needed once before PRIVATE_EXPEDITED.
  static const bool available = [] {
    const long supported = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
    return syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  }();
  return available;
#else
  return false;
#endif
}

void membarrier_all_threads() noexcept {
#if defined(__linux__) && defined(__NR_membarrier)
  // Only reached when membarrier_available() registered the command; it
  // cannot fail then. A full fence keeps this thread's side ordered too.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace mem::detail
