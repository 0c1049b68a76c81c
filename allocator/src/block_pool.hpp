// block_pool.hpp — the free blocks of one pool, indexed for best fit (internal).
//
// PyTorch keeps a pool's free blocks in one std::set ordered by (stream, size,
// address), so lower_bound is best fit. We keep exactly that order, split by
// stream and then into size classes (as in TLSF: exact 512 B steps below
// 64 KiB, then 32 classes per power of two), each class its own small set,
// with a bitmap of the classes that hold blocks. best_fit() looks in the
// request's class and otherwise takes the first block of the next non-empty
// class: the block PyTorch's lower_bound finds, from a tree of a few entries
// instead of one holding every free block. Not thread-safe: the allocator's
// lock guards it.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "block.hpp"

namespace mem::detail {

/// Size classes for sizes >= 1. Monotone: a <= b implies size_class(a) <=
/// size_class(b), so every block of a higher class is larger than every block
/// of a lower one. A class is a half-open range (lo, hi] whose top is a round
/// size (2 MiB, 20 MiB): a segment that lends out a small block stays in its
/// class, and its node in its set.
inline constexpr std::size_t kLinearClassLimit = std::size_t{1} << 16;  // 64 KiB
inline constexpr unsigned kClassesPerOctaveLog2 = 5;                   // 32 per octave
inline constexpr unsigned kMaxClassOctave = 50;                        // 1 PiB; larger share the top class
inline constexpr std::size_t kNumSizeClasses =
    (kLinearClassLimit >> 9) + (kMaxClassOctave - 15) * (std::size_t{1} << kClassesPerOctaveLog2);

constexpr std::size_t size_class(std::size_t size) noexcept {
  const std::size_t below = size - 1;
  if (below < kLinearClassLimit) return below >> 9;  // one class per 512 B step
  const unsigned octave = static_cast<unsigned>(std::bit_width(below)) - 1;  // >= 16
  if (octave > kMaxClassOctave) return kNumSizeClasses - 1;
  const std::size_t sub = (below >> (octave - kClassesPerOctaveLog2)) &
                          ((std::size_t{1} << kClassesPerOctaveLog2) - 1);
  return (kLinearClassLimit >> 9) + ((octave - 16) << kClassesPerOctaveLog2) + sub;
}

/// One stream's free blocks in one pool: a set per size class, stored right
/// after this header (one load fewer on every lookup), and a two-level bitmap
/// of the non-empty classes. Made by create(), ended by destroy().
class StreamClasses {
 public:
  static constexpr std::size_t kNone = ~std::size_t{0};
  static constexpr std::size_t kWords = (kNumSizeClasses + 63) / 64;
  static_assert(kWords <= 64, "the summary word has one bit per bitmap word");

  static StreamClasses* create(StreamId stream, FreeListArena* arena);
  static void destroy(StreamClasses* sc) noexcept;
  StreamClasses(const StreamClasses&) = delete;
  StreamClasses& operator=(const StreamClasses&) = delete;
  struct Deleter {
    void operator()(StreamClasses* sc) const noexcept { destroy(sc); }
  };

  StreamId stream() const noexcept { return stream_; }
  std::size_t count = 0;  // blocks in this stream's classes
  /// Class c's set; it exists once a block has entered the class (built()).
  BlockSet& set(std::size_t c) noexcept { return sets()[c]; }
  const BlockSet& set(std::size_t c) const noexcept { return sets()[c]; }
  bool built(std::size_t c) const noexcept { return (built_[c >> 6] >> (c & 63)) & 1; }
  /// Class c's set, built on first use: a new stream costs two bitmaps, not
  /// a thousand set constructions (short replays make many).
  BlockSet& set_for_insert(std::size_t c) {
    if (!built(c)) [[unlikely]] build(c);
    return sets()[c];
  }

  bool has(std::size_t c) const noexcept { return (nonempty_[c >> 6] >> (c & 63)) & 1; }
  /// The smallest non-empty class, or kNumSizeClasses when there is none. A
  /// request below it (common: a pool holding a few segments' free tails)
  /// needs no bitmap search.
  std::size_t lowest() const noexcept { return lowest_; }
  void mark(std::size_t c) noexcept {
    nonempty_[c >> 6] |= std::uint64_t{1} << (c & 63);
    summary_ |= std::uint64_t{1} << (c >> 6);
    if (c < lowest_) lowest_ = c;
  }
  void unmark(std::size_t c) noexcept {
    nonempty_[c >> 6] &= ~(std::uint64_t{1} << (c & 63));
    if (nonempty_[c >> 6] == 0) summary_ &= ~(std::uint64_t{1} << (c >> 6));
    if (c == lowest_) {
      const std::size_t next = next_nonempty(c + 1);
      lowest_ = next == kNone ? kNumSizeClasses : next;
    }
  }
  bool summary_bit(std::size_t w) const noexcept { return (summary_ >> w) & 1; }
  std::uint64_t word(std::size_t w) const noexcept { return nonempty_[w]; }
  std::uint64_t built_word(std::size_t w) const noexcept { return built_[w]; }

  /// The first non-empty class at or above c, or kNone.
  std::size_t next_nonempty(std::size_t c) const noexcept {
    if (c >= kNumSizeClasses) return kNone;
    std::size_t w = c >> 6;
    const std::uint64_t here = nonempty_[w] & (~std::uint64_t{0} << (c & 63));
    if (here != 0) return (w << 6) + static_cast<std::size_t>(__builtin_ctzll(here));
    const std::uint64_t above = w + 1 < 64 ? summary_ & (~std::uint64_t{0} << (w + 1)) : 0;
    if (above == 0) return kNone;
    w = static_cast<std::size_t>(__builtin_ctzll(above));
    return (w << 6) + static_cast<std::size_t>(__builtin_ctzll(nonempty_[w]));
  }
  /// The last non-empty class at or below c, or kNone.
  std::size_t prev_nonempty(std::size_t c) const noexcept {
    std::size_t w = c >> 6;
    const std::uint64_t here = nonempty_[w] & (~std::uint64_t{0} >> (63 - (c & 63)));
    if (here != 0) return (w << 6) + 63 - static_cast<std::size_t>(__builtin_clzll(here));
    const std::uint64_t below = summary_ & ((std::uint64_t{1} << w) - 1);
    if (below == 0) return kNone;
    w = 63 - static_cast<std::size_t>(__builtin_clzll(below));
    return (w << 6) + 63 - static_cast<std::size_t>(__builtin_clzll(nonempty_[w]));
  }

 private:
  StreamClasses(StreamId stream, FreeListArena* arena) : stream_(stream), arena_(arena) {}
  void build(std::size_t c);
  BlockSet* sets() const noexcept {
    return std::launder(reinterpret_cast<BlockSet*>(const_cast<StreamClasses*>(this) + 1));
  }

  StreamId stream_;
  std::size_t lowest_ = kNumSizeClasses;
  std::uint64_t summary_ = 0;                      // bit w: nonempty_[w] != 0
  std::array<std::uint64_t, kWords> nonempty_{};  // bit c: set(c) holds blocks
  std::array<std::uint64_t, kWords> built_{};     // bit c: set(c) is constructed
  FreeListArena* arena_;                          // the sets' nodes
  // followed by kNumSizeClasses BlockSets, built on first use
};
static_assert(sizeof(StreamClasses) % alignof(BlockSet) == 0);

class BlockPool {
  static constexpr StreamId kNoStream = ~StreamId{0};

 public:
  explicit BlockPool(bool small);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  const bool is_small;
  bool tracks_age = false;  // garbage collection configured: blocks record their age
  std::uint64_t get_free_blocks_call_count = 0;  // gc age clock

  /// Best fit: the entry of the first free block of `stream` in (size,
  /// address) order whose size is at least `size`, or nullptr.
  const PoolEntry* best_fit(StreamId stream, std::size_t size) const noexcept {
    const StreamClasses* sc = find(stream);
    if (sc == nullptr) return nullptr;
    std::size_t c = class_of(size);
    if (c < sc->lowest()) {
      return sc->lowest() < kNumSizeClasses ? &*sc->set(sc->lowest()).begin() : nullptr;
    }
    if (sc->has(c)) {
      const BlockSet& set = sc->set(c);
      auto it = set.begin();
      // Up to 64 KiB a class holds one size, so its first block fits.
      if (it->size < size) it = set.lower_bound(PoolEntry{size, 0, nullptr});
      if (it != set.end()) return &*it;
    }
    c = sc->next_nonempty(c + 1);
    return c == StreamClasses::kNone ? nullptr : &*sc->set(c).begin();
  }

  void insert(Block* b) {
    if (tracks_age) b->gc_count_base = get_free_blocks_call_count;
    StreamClasses& sc = find_or_add(b->stream);
    const std::size_t c = class_of(b->size);
    b->pool_class = static_cast<std::uint16_t>(c);
    b->pool_it = sc.set_for_insert(c).insert(PoolEntry{b->size, b->ptr, b}).first;
    sc.mark(c);
    ++sc.count;
    ++size_;
  }

  void erase(Block* b) noexcept {
    StreamClasses& sc = *find(b->stream);
    BlockSet& set = sc.set(b->pool_class);
    set.erase(b->pool_it);
    if (set.empty()) sc.unmark(b->pool_class);
    --sc.count;
    --size_;
  }

  /// Moves a pooled block to a new address and size; the result equals erase +
  /// insert. Its tree node stays put when its class and order still hold (the
  /// common split/merge case: inline, a few compares and four stores) and is
  /// handed over or moved, not reallocated, when they do not (rekey_slow). The
  /// key is built from the arguments, not re-read from the block, which avoids
  /// a store-forwarding stall.
  void rekey(Block* b, std::uintptr_t ptr, std::size_t size) {
    if (tracks_age) b->gc_count_base = get_free_blocks_call_count;
    if (class_of(size) == b->pool_class &&
        order_holds(find(b->stream)->set(b->pool_class), b, ptr, size)) [[likely]] {
      update_in_place(b, ptr, size);
      return;
    }
    rekey_slow(b, ptr, size);
  }

  /// The largest free block of `stream`, or nullptr.
  Block* largest(StreamId stream) const noexcept;
  /// The block just before `b` in (size, address) order among its stream's, or nullptr.
  Block* before(const Block* b) const noexcept;

  /// Every free block, in PyTorch's set order (stream, size, address). `f` may
  /// erase the block it is handed, and nothing else.
  template <class F>
  void for_each(F&& f) const {
    for (const auto& sc : streams_) {
      for (std::size_t c = sc->next_nonempty(0); c != StreamClasses::kNone;
           c = sc->next_nonempty(c + 1)) {
        const BlockSet& set = sc->set(c);
        for (auto it = set.begin(); it != set.end();) {
          Block* b = it->block;
          ++it;
          f(b);
        }
      }
    }
  }

  std::size_t size() const noexcept { return size_; }
  /// Whether `b` has an entry under its own key.
  bool contains(const Block* b) const;
  /// The first inconsistency in the index (entries against their blocks and
  /// classes, the bitmaps, the count), or an empty string.
  std::string check() const;

 private:
  static std::size_t class_of(std::size_t size) noexcept { return size_class(size); }
  StreamClasses* find(StreamId stream) const noexcept {
    if (cached_stream_ == stream) [[likely]] return cached_;
    return find_slow(stream);
  }
  StreamClasses* find_slow(StreamId stream) const noexcept;
  /// Whether `b`, given the key (size, ptr), keeps its place in `set`. Alone in
  /// its class (a segment's one free block) it does. Else a shrinking block can
  /// only move left past its predecessor, a growing one only right past its
  /// successor: one neighbour to look at, not two.
  static bool order_holds(const BlockSet& set, const Block* b, std::uintptr_t ptr, std::size_t size) {
    if (set.size() == 1) return true;
    const PoolEntryLess less;
    const PoolEntry key{size, ptr, nullptr};
    const auto it = b->pool_it;
    if (size <= b->size && it != set.begin() && !less(*std::prev(it), key)) return false;
    if (size >= b->size) {
      const auto next = std::next(it);
      return next == set.end() || less(key, *next);
    }
    return true;
  }
  /// The node's storage is not const; with the order unchanged, updating the key
  /// in place leaves a valid tree.
  static void update_in_place(Block* b, std::uintptr_t ptr, std::size_t size) noexcept {
    auto& entry = const_cast<PoolEntry&>(*b->pool_it);
    entry.size = size;
    entry.ptr = ptr;
    b->ptr = ptr;
    b->size = size;
  }
  /// rekey's other cases: the block changes class or passes a neighbour.
  void rekey_slow(Block* b, std::uintptr_t ptr, std::size_t size);
  StreamClasses& find_or_add(StreamId stream) {
    StreamClasses* sc = find(stream);
    return sc != nullptr ? *sc : add(stream);
  }
  StreamClasses& add(StreamId stream);

  FreeListArena arena_;  // the sets' nodes; must outlive streams_
  std::vector<std::unique_ptr<StreamClasses, StreamClasses::Deleter>> streams_;  // by stream
  // The stream looked up last, kept here so a lookup's compare needs no load
  // through a pointer.
  mutable StreamId cached_stream_ = kNoStream;  // no stream: cached_ is null
  mutable StreamClasses* cached_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mem::detail
