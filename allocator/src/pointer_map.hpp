// pointer_map.hpp — address -> Block* for the blocks handed out.
//
// Open addressing with linear probing and backward-shift deletion: no node
// allocations and one or two cache lines per lookup, which is what the free
// path needs (std::unordered_map costs a malloc per insert).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mem::detail {

template <class V>
class PointerMap {
 public:
  PointerMap() { slots_.resize(kInitialCapacity); }

  std::size_t size() const noexcept { return size_; }

  /// Inserts or overwrites. Key 0 is reserved for empty slots.
  void insert(std::uintptr_t key, V value) {
    // At most an eighth full up to 1 MiB of slots, a quarter above: on a random
    // free/allocate workload the probe runs and the backward shifts of a fuller table
    // are mispredicted branches (half full to a quarter: a tenth of the pair; a quarter
    // to an eighth: 5% more, issue 35), while a larger table mostly adds cache misses.
    const std::size_t slots_per_entry = slots_.size() < kSparseUpTo ? 8 : 4;
    if ((size_ + 1) * slots_per_entry > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = index_of(key);
    while (slots_[i].key != 0 && slots_[i].key != key) i = (i + 1) & mask();
    if (slots_[i].key == 0) ++size_;
    slots_[i] = Slot{key, value};
  }

  V* find(std::uintptr_t key) noexcept {
    if (key == 0) return nullptr;
    std::size_t i = index_of(key);
    while (slots_[i].key != 0) {
      if (slots_[i].key == key) return &slots_[i].value;
      i = (i + 1) & mask();
    }
    return nullptr;
  }
  const V* find(std::uintptr_t key) const noexcept {
    return const_cast<PointerMap*>(this)->find(key);
  }

  bool erase(std::uintptr_t key) noexcept {
    if (key == 0) return false;
    std::size_t i = index_of(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return false;
      i = (i + 1) & mask();
    }
    erase_index(i);
    return true;
  }

  /// Erases the entry whose value find() returned, without probing again.
  void erase_found(V* value) noexcept {
    const auto* slot = reinterpret_cast<const Slot*>(reinterpret_cast<const char*>(value) -
                                                     offsetof(Slot, value));
    erase_index(static_cast<std::size_t>(slot - slots_.data()));
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_) {
      if (s.key != 0) f(s.key, s.value);
    }
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    V value{};
  };
  static constexpr std::size_t kInitialCapacity = 1024;
  static constexpr std::size_t kSparseUpTo = std::size_t{1} << 16;  // slots (1 MiB)

  void erase_index(std::size_t i) noexcept {
    // Backward shift: pull later members of the probe run into the hole.
    std::size_t hole = i;
    std::size_t j = i;
    for (;;) {
      j = (j + 1) & mask();
      if (slots_[j].key == 0) break;
      const std::size_t home = index_of(slots_[j].key);
      // Move j into the hole if its home is not in (hole, j] cyclically.
      const bool stays = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  std::size_t mask() const noexcept { return slots_.size() - 1; }
  std::size_t index_of(std::uintptr_t key) const noexcept {
    // Blocks are 512 B aligned: drop those bits, then Fibonacci hashing.
    const std::uint64_t h = (static_cast<std::uint64_t>(key) >> 9) * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(h >> 20) & mask();
  }
  void rehash(std::size_t capacity) {
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != 0) insert(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace mem::detail
