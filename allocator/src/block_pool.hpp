// block_pool.hpp — the free blocks of one pool, indexed for best fit (internal).
//
// PyTorch keeps a pool's free blocks in one std::set ordered by (stream, size,
// address), so lower_bound is best fit. We keep exactly that order, split by
// stream and then into size classes (as in TLSF: exact 512 B steps below
// 64 KiB, then 32 classes per power of two), each class its own small tree
// (block_tree.hpp, linked through the Blocks), with a bitmap of the classes
// that hold blocks. best_fit() looks in the request's class and otherwise
// takes the first block of the next non-empty class: the block PyTorch's
// lower_bound finds, from a tree of a few blocks instead of one holding every
// free block. Not thread-safe: the allocator's lock guards it.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "block.hpp"
#include "block_tree.hpp"

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

/// One stream's free blocks in one pool: a tree per size class, stored inline
/// (one load fewer on every lookup) and left uninitialized until a block
/// enters the class, and a two-level bitmap of the non-empty classes. A new
/// stream costs a bitmap, not a thousand tree headers (short replays make many).
class StreamClasses {
 public:
  static constexpr std::size_t kNone = ~std::size_t{0};
  static constexpr std::size_t kWords = (kNumSizeClasses + 63) / 64;
  static_assert(kWords <= 64, "the summary word has one bit per bitmap word");

  explicit StreamClasses(StreamId stream) : stream_(stream) {}
  StreamClasses(const StreamClasses&) = delete;
  StreamClasses& operator=(const StreamClasses&) = delete;

  StreamId stream() const noexcept { return stream_; }
  std::size_t count = 0;  // blocks in this stream's classes
  /// Class c's tree; meaningful only while has(c).
  BlockTree& tree(std::size_t c) noexcept { return trees_[c]; }
  const BlockTree& tree(std::size_t c) const noexcept { return trees_[c]; }
  /// Class c's tree, emptied first if the class holds nothing yet.
  BlockTree& tree_for_insert(std::size_t c) noexcept {
    if (!has(c)) trees_[c].reset();
    return trees_[c];
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
  StreamId stream_;
  std::size_t lowest_ = kNumSizeClasses;
  std::uint64_t summary_ = 0;                      // bit w: nonempty_[w] != 0
  std::array<std::uint64_t, kWords> nonempty_{};  // bit c: tree(c) holds blocks
  std::array<BlockTree, kNumSizeClasses> trees_;  // uninitialized: see tree()
};

struct PrivatePool;

class BlockPool {
  static constexpr StreamId kNoStream = ~StreamId{0};

 public:
  explicit BlockPool(bool small);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  const bool is_small;
  PrivatePool* owner = nullptr;  // the private pool it is half of (PyTorch's owner_PrivatePool), or null
  bool tracks_age = false;  // garbage collection configured: blocks record their age
  std::uint64_t get_free_blocks_call_count = 0;  // gc age clock

  /// Best fit: the first free block of `stream` in (size, address) order
  /// whose size is at least `size`, or nullptr.
  Block* best_fit(StreamId stream, std::size_t size) const noexcept {
    const StreamClasses* sc = find(stream);
    if (sc == nullptr) return nullptr;
    std::size_t c = class_of(size);
    if (c < sc->lowest()) {
      return sc->lowest() < kNumSizeClasses ? sc->tree(sc->lowest()).first() : nullptr;
    }
    if (sc->has(c)) {
      const BlockTree& tree = sc->tree(c);
      Block* b = tree.first();
      // Up to 64 KiB a class holds one size, so its first block fits.
      if (b->size < size) b = tree.lower_bound(size);
      if (b != nullptr) return b;
    }
    c = sc->next_nonempty(c + 1);
    return c == StreamClasses::kNone ? nullptr : sc->tree(c).first();
  }

  [[gnu::always_inline]] void insert(Block* b) {
    if (tracks_age) b->gc_count_base = get_free_blocks_call_count;
    StreamClasses& sc = find_or_add(b->stream);
    const std::size_t c = class_of(b->size);
    b->pool_class = static_cast<std::uint16_t>(c);
    sc.tree_for_insert(c).insert(b);
    sc.mark(c);
    ++sc.count;
    ++size_;
  }

  /// Removes pooled block `b` of `stream`. The caller passes the stream (its
  /// segment's): reading it from a neighbour would load the neighbour's
  /// second cache line.
  void erase(Block* b, StreamId stream) noexcept {
    StreamClasses& sc = *find(stream);
    BlockTree& tree = sc.tree(b->pool_class);
    tree.erase(b);
    if (tree.empty()) sc.unmark(b->pool_class);
    --sc.count;
    --size_;
  }

  /// Moves pooled block `b` of `stream` to a new address and size; the result
  /// equals erase + insert. It stays where it is in its tree when its class
  /// and order still hold (the common split/merge case: inline, a few
  /// compares and two stores) and is moved otherwise (rekey_slow).
  void rekey(Block* b, StreamId stream, std::uintptr_t ptr, std::size_t size) {
    if (tracks_age) b->gc_count_base = get_free_blocks_call_count;
    StreamClasses& sc = *find(stream);
    if (class_of(size) == b->pool_class && order_holds(sc.tree(b->pool_class), b, ptr, size))
        [[likely]] {
      b->ptr = ptr;
      b->size = size;
      return;
    }
    rekey_slow(sc, b, ptr, size);
  }

  /// The largest free block of `stream`, or nullptr.
  Block* largest(StreamId stream) const noexcept;
  /// The size of the largest free block of any stream (0: none); a look at each stream's
  /// highest size class, not a walk over the blocks.
  std::size_t largest_size() const noexcept;
  /// The block just before `b` in (size, address) order among its stream's, or nullptr.
  Block* before(const Block* b) const noexcept;
  /// The block just after `b` in (size, address) order among its stream's, or nullptr.
  Block* after(const Block* b) const noexcept;

  /// Unmapped blocks of expandable segments, by (stream, address) as PyTorch's
  /// BlockComparatorAddress orders them: where a segment can grow, lowest first.
  struct ByStreamAddress {
    bool operator()(const Block* a, const Block* b) const noexcept {
      return a->stream != b->stream ? a->stream < b->stream : a->ptr < b->ptr;
    }
  };
  std::set<Block*, ByStreamAddress> unmapped;

  /// Every free block, in PyTorch's set order (stream, size, address). `f` may
  /// erase the block it is handed, and nothing else.
  template <class F>
  void for_each(F&& f) const {
    for (const auto& sc : streams_) {
      for (std::size_t c = sc->next_nonempty(0); c != StreamClasses::kNone;
           c = sc->next_nonempty(c + 1)) {
        const BlockTree& tree = sc->tree(c);
        for (Block* b = tree.first(); b != nullptr;) {
          Block* following = tree.next(b);  // erasing b leaves it in place
          f(b);
          b = following;
        }
      }
    }
  }

  std::size_t size() const noexcept { return size_; }
  /// Whether `b` is in this pool under its own key.
  bool contains(const Block* b) const;
  /// The first inconsistency in the index (blocks against their trees and
  /// classes, the trees' shape, the bitmaps, the count), or an empty string.
  std::string check() const;

 private:
  static std::size_t class_of(std::size_t size) noexcept { return size_class(size); }
  StreamClasses* find(StreamId stream) const noexcept {
    if (cached_stream_ == stream) [[likely]] return cached_;
    return find_slow(stream);
  }
  StreamClasses* find_slow(StreamId stream) const noexcept;
  /// Whether `b`, given the key (size, ptr), keeps its place in `tree`. Alone
  /// in its class (a segment's one free block) it does. Else a shrinking block
  /// can only move left past its predecessor, a growing one only right past
  /// its successor: one neighbour to look at, not two.
  static bool order_holds(const BlockTree& tree, const Block* b, std::uintptr_t ptr,
                          std::size_t size) noexcept {
    if (tree.alone(b)) return true;
    if (size <= b->size) {
      const Block* before = tree.prev(b);
      if (before != nullptr && !block_less(before->size, before->ptr, size, ptr)) return false;
    }
    if (size >= b->size) {
      const Block* after = tree.next(b);
      return after == nullptr || block_less(size, ptr, after->size, after->ptr);
    }
    return true;
  }
  /// rekey's other case: the block changes class or passes a neighbour.
  void rekey_slow(StreamClasses& sc, Block* b, std::uintptr_t ptr, std::size_t size) noexcept;
  StreamClasses& find_or_add(StreamId stream) {
    StreamClasses* sc = find(stream);
    return sc != nullptr ? *sc : add(stream);
  }
  StreamClasses& add(StreamId stream);

  std::vector<std::unique_ptr<StreamClasses>> streams_;  // by stream
  // The stream looked up last, kept here so a lookup's compare needs no load
  // through a pointer.
  mutable StreamId cached_stream_ = kNoStream;  // no stream: cached_ is null
  mutable StreamClasses* cached_ = nullptr;
  std::size_t size_ = 0;
};

// Inline at each re-key (nine in ten splits and merges move their block to another
// class): out of line it was a call with six register saves each time.
[[gnu::always_inline]] inline void BlockPool::rekey_slow(StreamClasses& sc, Block* b, std::uintptr_t ptr,
                           std::size_t size) noexcept {
  const std::size_t from = b->pool_class;
  const std::size_t to = class_of(size);
  BlockTree& tree = sc.tree(from);
  // The new key can be set first: erase only relinks, it compares no keys.
  b->ptr = ptr;
  b->size = size;
  b->pool_class = static_cast<std::uint16_t>(to);
  if (from != to && tree.alone(b) && !sc.has(to)) {
    // Alone in its class and moving to an empty one (a segment's one free
    // block after a split or merge): the tree moves with it, O(1).
    sc.tree(to) = tree;
    sc.mark(to);  // first, so a shrinking block's class becomes the lowest without a search
    sc.unmark(from);
    return;
  }
  tree.erase(b);
  if (tree.empty()) sc.unmark(from);
  sc.tree_for_insert(to).insert(b);
  sc.mark(to);
}

}  // namespace mem::detail
