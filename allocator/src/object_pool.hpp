// object_pool.hpp — free-list storage for the allocator's own bookkeeping.
//
// Every split creates a Block and every coalesce destroys one. Recycling them
// from a free list keeps malloc off the allocator's fast path. Not thread-safe:
// used under the allocator's lock.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

namespace mem::detail {

/// Objects that are recycled without being destroyed: a released object keeps
/// its (empty) members, so acquiring it again is a pop, not a construction that
/// zeroes every field. T needs a `T* next` member, used as the free-list link
/// while the object is released; callers set every other field they rely on.
/// New objects are constructed in slabs, on demand.
template <class T>
class RecyclingPool {
 public:
  RecyclingPool() = default;
  RecyclingPool(const RecyclingPool&) = delete;
  RecyclingPool& operator=(const RecyclingPool&) = delete;
  ~RecyclingPool() {
    while (free_ != nullptr) {
      T* p = free_;
      free_ = p->next;
      p->~T();
    }
    while (slabs_ != nullptr) {
      void* older = *static_cast<void**>(slabs_);
      ::operator delete(slabs_);
      slabs_ = older;
    }
  }

  T* acquire() {
    if (free_ != nullptr) {
      T* p = free_;
      free_ = p->next;
      return p;
    }
    if (unused_ == unused_end_) grow();
    T* p = new (unused_) T();
    unused_ += sizeof(T);
    return p;
  }
  void release(T* p) noexcept {
    p->next = free_;
    free_ = p;
  }

  static constexpr std::size_t kPerSlab = 256;

 private:
  // A slab is carved on demand, not threaded onto the free list up front: a
  // fresh allocator touches only the objects it uses (a short trace replay
  // spent a tenth of its instructions linking 256 chunks per slab). It is one
  // plain operator new, aligned by hand (aligned new costs three times a
  // malloc), whose first word links the slabs for the destructor. A Block is
  // line-aligned, so it never straddles two cache lines.
  void grow() {
    constexpr std::size_t bytes = sizeof(T) * kPerSlab;
    std::size_t space = alignof(T) - 1 + bytes;
    auto* raw = static_cast<char*>(::operator new(sizeof(void*) + space));
    *reinterpret_cast<void**>(raw) = slabs_;
    slabs_ = raw;
    void* first = raw + sizeof(void*);
    unused_ = static_cast<char*>(std::align(alignof(T), bytes, first, space));
    unused_end_ = unused_ + bytes;
  }

  T* free_ = nullptr;       // released objects, reused first, newest first
  char* unused_ = nullptr;  // the newest slab's space not yet handed out
  char* unused_end_ = nullptr;
  void* slabs_ = nullptr;  // the newest slab; each begins with the one before
};

}  // namespace mem::detail
