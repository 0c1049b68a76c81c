// biased_lock.hpp — the allocator's lock: biased towards the thread that uses
// it first, so a single-threaded training loop pays no atomic instruction.
//
// Most programs allocate and free from one thread. For that thread (the owner,
// the first to lock) entering the lock is a plain store and two loads: it
// announces itself in owner_active_ and checks revoked_. The first time any
// other thread locks, it revokes the bias for good: it sets revoked_, forces a
// memory barrier on every thread of the process with membarrier(2)
// (MEMBARRIER_CMD_PRIVATE_EXPEDITED), and waits until the owner is out of its
// critical section — all while holding the spin lock, so that no other thread
// enters before the handshake is complete. This is the asymmetric Dekker handshake: either the owner's
// announcement is visible to the revoker (which then waits), or the revoker's
// flag is visible to the owner (which then takes the spin lock). From then on
// everyone uses the SpinLock. Where membarrier is unavailable (old kernels,
// valgrind) and under ThreadSanitizer (which cannot see membarrier's ordering)
// the bias is off and this is the SpinLock.
#pragma once

#include <atomic>
#include <cstdint>

#include "spin_lock.hpp"

namespace mem::detail {

/// True when MEMBARRIER_CMD_PRIVATE_EXPEDITED is registered for this process.
bool membarrier_available() noexcept;
/// Forces a full memory barrier on every running thread of this process.
void membarrier_all_threads() noexcept;

class BiasedLock {
 public:
  BiasedLock() noexcept : bias_enabled_(membarrier_available()) {}

  // The owner's entry inline, everything else (the first lock, other threads,
  // the spin lock) out of line: inlined whole, the entry cost the allocation's
  // and the free's callers a call with six register saves each (issue 35).
  [[gnu::always_inline]] void lock() noexcept {
    if (bias_enabled_ && !revoked_.load(std::memory_order_relaxed) &&
        owner_.load(std::memory_order_relaxed) == this_thread_tag()) [[likely]] {
      if (enter_biased()) [[likely]] return;
    }
    lock_slow();
  }

  void unlock() noexcept {
    if (biased_) {
      owner_active_.store(false, std::memory_order_release);
      return;
    }
    spin_.unlock();
  }

 private:
  // Unique among live threads. The thread pointer is one register read; a thread_local's
  // address costs a __tls_get_addr call in a shared library (libvramscope.so).
  static std::uintptr_t this_thread_tag() noexcept {
// (Clang before 14 crashes on it for x86-64: llvm/llvm-project#62986.)
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 11)
    return reinterpret_cast<std::uintptr_t>(__builtin_thread_pointer());
#else
    static thread_local char tag;
    return reinterpret_cast<std::uintptr_t>(&tag);
#endif
  }

  /// The owner announces itself and enters unless the bias was revoked meanwhile.
  [[gnu::always_inline]] bool enter_biased() noexcept {
    owner_active_.store(true, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // compiler barrier only
    if (!revoked_.load(std::memory_order_relaxed)) [[likely]] {
      std::atomic_thread_fence(std::memory_order_acquire);  // free on x86
      biased_ = true;
      return true;
    }
    owner_active_.store(false, std::memory_order_release);
    return false;
  }

  /// The first lock (which takes the bias), any other thread's, and every lock after
  /// the revocation.
  [[gnu::noinline]] void lock_slow() noexcept {
    if (bias_enabled_ && !revoked_.load(std::memory_order_relaxed)) {
      const std::uintptr_t me = this_thread_tag();
      std::uintptr_t owner = owner_.load(std::memory_order_relaxed);
      if (owner == 0 && owner_.compare_exchange_strong(owner, me, std::memory_order_relaxed)) {
        owner = me;  // the first thread to lock owns the bias
      }
      if (owner == me && enter_biased()) return;
    }
    spin_.lock();
    // The first spin-lock holder revokes the bias before touching anything, and
    // finishes the handshake while later holders wait on spin_: a thread that
    // merely saw revoked_ set must not enter while the owner may still be inside.
    if (bias_enabled_ && !revocation_done_) [[unlikely]] revoke();
    biased_ = false;
  }

  // Called with spin_ held, once.
  void revoke() noexcept {
    revoked_.store(true, std::memory_order_relaxed);
    membarrier_all_threads();  // the owner now sees revoked_, or we see owner_active_
    while (owner_active_.load(std::memory_order_acquire)) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    revocation_done_ = true;  // from here on the owner cannot enter without spin_
  }

  const bool bias_enabled_;
  std::atomic<bool> revoked_{false};
  std::atomic<std::uintptr_t> owner_{0};
  std::atomic<bool> owner_active_{false};
  bool biased_ = false;           // how the current holder entered; guarded by the lock itself
  bool revocation_done_ = false;  // guarded by spin_
  SpinLock spin_;
};

}  // namespace mem::detail
