// object_pool.hpp — free-list storage for the allocator's own bookkeeping.
//
// Every split creates a Block and every coalesce destroys one. Recycling them
// from a free list keeps malloc off the allocator's fast path. Not thread-safe: used under the allocator's lock.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <utility>

namespace mem::detail {

/// Fixed-size chunks from slabs. The first size asked for becomes the chunk
/// size; any other size falls through to operator new (never happens for the
/// node-based containers it serves, which allocate one node type).
class FreeListArena {
 public:
  FreeListArena() = default;
  FreeListArena(const FreeListArena&) = delete;
  FreeListArena& operator=(const FreeListArena&) = delete;
  ~FreeListArena() {
    while (slabs_ != nullptr) {
      void* older = *static_cast<void**>(slabs_);
      ::operator delete(slabs_);
      slabs_ = older;
    }
  }

  void* allocate(std::size_t bytes) {
    if (chunk_size_ == 0) chunk_size_ = round_chunk(bytes);
    if (round_chunk(bytes) != chunk_size_) return ::operator new(bytes);
    if (head_ != nullptr) {
      FreeNode* node = head_;
      head_ = node->next;
      return node;
    }
    if (unused_ == unused_end_) grow();
    void* chunk = unused_;
    unused_ += chunk_size_;
    return chunk;
  }

  void deallocate(void* p, std::size_t bytes) noexcept {
    if (round_chunk(bytes) != chunk_size_) {
      ::operator delete(p);
      return;
    }
    auto* node = static_cast<FreeNode*>(p);
    node->next = head_;
    head_ = node;
  }

 private:
  struct FreeNode {
    FreeNode* next;
  };
  static constexpr std::size_t kChunksPerSlab = 256;

 public:
  /// Slabs start on a cache line, so a chunk that is a multiple of 64 bytes (a
  /// tree node, a Block) never straddles two lines.
  static constexpr std::size_t kSlabAlignment = 64;

 private:

  static std::size_t round_chunk(std::size_t bytes) {
    const std::size_t a = alignof(std::max_align_t);
    const std::size_t b = bytes < sizeof(FreeNode) ? sizeof(FreeNode) : bytes;
    return (b + a - 1) / a * a;
  }

  // A new slab is carved on demand, not threaded onto the free list up front:
  // a fresh allocator touches only the chunks it uses (a short trace replay
  // spent a tenth of its instructions linking 256 chunks per slab). A slab is
  // one plain operator new, aligned by hand (aligned new costs three times a
  // malloc), whose first word links the slabs for the destructor.
  void grow() {
    const std::size_t bytes = chunk_size_ * kChunksPerSlab;
    std::size_t space = kSlabAlignment - 1 + bytes;
    auto* raw = static_cast<char*>(::operator new(sizeof(void*) + space));
    *reinterpret_cast<void**>(raw) = slabs_;
    slabs_ = raw;
    void* first = raw + sizeof(void*);
    unused_ = static_cast<char*>(std::align(kSlabAlignment, bytes, first, space));
    unused_end_ = unused_ + bytes;
  }

  FreeNode* head_ = nullptr;       // released chunks, reused first
  char* unused_ = nullptr;         // the newest slab's chunks not yet handed out
  char* unused_end_ = nullptr;
  std::size_t chunk_size_ = 0;
  void* slabs_ = nullptr;          // the newest slab; each begins with the one before
};

/// Objects that are recycled without being destroyed: a released object keeps
/// its (empty) members, so acquiring it again is a pop, not a construction that
/// zeroes every field. T needs a `T* next` member, used as the free-list link
/// while the object is released; callers set every other field they rely on.
template <class T>
class RecyclingPool {
  static_assert(alignof(T) <= FreeListArena::kSlabAlignment &&
                sizeof(T) % alignof(T) == 0);

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
  }

  T* acquire() {
    if (free_ != nullptr) {
      T* p = free_;
      free_ = p->next;
      return p;
    }
    return new (arena_.allocate(sizeof(T))) T();
  }
  void release(T* p) noexcept {
    p->next = free_;
    free_ = p;
  }

 private:
  FreeListArena arena_;
  T* free_ = nullptr;
};

}  // namespace mem::detail
