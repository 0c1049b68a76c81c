// block_tree.hpp — one size class's free blocks in (size, address) order: a
// sorted ring while few, an intrusive red-black tree when many (internal).
//
// The order is PyTorch's pool order within one stream. The tree's links live
// in the Blocks themselves (block.hpp), in the cache line a neighbour's split
// or merge already loads: a block entering, leaving or moving between classes
// allocates nothing, and finding its place costs no load beside the block's
// own. The tree's insert and erase are the textbook algorithms (CLRS, without
// a sentinel node); both shapes keep the first block, which best fit takes
// most often.
#pragma once

#include <cstddef>
#include <cstdint>

#include "block.hpp"

namespace mem::detail {

/// PyTorch's order among one stream's free blocks. Addresses are unique, so
/// no two blocks compare equal.
inline bool block_less(std::size_t size_a, std::uintptr_t ptr_a, std::size_t size_b,
                       std::uintptr_t ptr_b) noexcept {
  // One 128-bit compare (cmp, sbb): size in the high half, address in the low.
  __extension__ using Key = unsigned __int128;
  return ((Key{size_a} << 64) | ptr_a) < ((Key{size_b} << 64) | ptr_b);
}
inline bool block_less(const Block* a, const Block* b) noexcept {
  return block_less(a->size, a->ptr, b->size, b->ptr);
}

/// Sides of a tree node: Block::tree_child[kLeft] holds the smaller keys.
/// Indexing by side lets each rebalancing case be written once for both
/// mirror images.
inline constexpr int kLeft = 0;
inline constexpr int kRight = 1;

/// Trivial on purpose: a pool's classes are an uninitialized array, and a
/// class's set means something only while its pool marks it non-empty (an
/// insert into an unmarked class calls reset() first).
///
/// Two shapes, by size. Most classes hold a few blocks (a random workload of
/// 1,000 live blocks leaves one or two in most of them), where a red-black
/// tree's descents and rebalancing are mostly unpredictable branches; there
/// the blocks form a sorted ring, doubly linked through tree_child (kLeft: the
/// previous block, kRight: the next; the last links back to the first), which
/// inserts after a short walk and erases by relinking two neighbours. A ring that would
/// pass kMaxRing blocks becomes a balanced red-black tree, and a tree that
/// falls to kRingAgain blocks a ring again (far apart, so a class on the line
/// does not flip back and forth).
class BlockTree {
 public:
  static constexpr std::uint32_t kMaxRing = 32;
  static constexpr std::uint32_t kRingAgain = 16;

  void reset() noexcept {
    root_ = first_ = nullptr;
    count_ = 0;
  }
  bool empty() const noexcept { return first_ == nullptr; }
  std::size_t size() const noexcept { return count_; }
  /// Whether the blocks are a tree (else a ring).
  bool is_tree() const noexcept { return root_ != nullptr; }
  /// The smallest block, or nullptr.
  Block* first() const noexcept { return first_; }
  /// The largest block, or nullptr.
  Block* last() const noexcept {
    if (root_ != nullptr) return outermost(root_, kRight);
    return first_ == nullptr ? nullptr : first_->tree_child[kLeft];
  }
  /// Whether `b`, one of this set's blocks, is its only one.
  bool alone(const Block* b) const noexcept { return count_ == 1 && first_ == b; }
  /// The first block whose size is at least `size`, or nullptr.
  Block* lower_bound(std::size_t size) const noexcept {
    if (root_ == nullptr) {
      for (Block* b = first_; b != nullptr; b = next(b)) {
        if (b->size >= size) return b;
      }
      return nullptr;
    }
    Block* found = nullptr;
    for (Block* b = root_; b != nullptr;) {
      if (b->size >= size) {
        found = b;
        b = b->tree_child[kLeft];
      } else {
        b = b->tree_child[kRight];
      }
    }
    return found;
  }
  /// The block with exactly this key, or nullptr.
  Block* find(std::size_t size, std::uintptr_t ptr) const noexcept {
    if (root_ == nullptr) {
      for (Block* b = first_; b != nullptr; b = next(b)) {
        if (b->size == size && b->ptr == ptr) return b;
      }
      return nullptr;
    }
    for (Block* b = root_; b != nullptr;) {
      if (b->size == size && b->ptr == ptr) return b;
      b = b->tree_child[block_less(size, ptr, b->size, b->ptr) ? kLeft : kRight];
    }
    return nullptr;
  }
  /// The neighbours of `b`, one of this set's blocks, in order, or nullptr.
  Block* next(const Block* b) const noexcept {
    if (root_ != nullptr) return neighbour(b, kRight);
    Block* n = b->tree_child[kRight];
    return n == first_ ? nullptr : n;
  }
  Block* prev(const Block* b) const noexcept {
    if (root_ != nullptr) return neighbour(b, kLeft);
    return b == first_ ? nullptr : b->tree_child[kLeft];
  }

  /// Adds `b` under its current (size, ptr); no block may have that key.
  void insert(Block* b) noexcept {
    if (root_ == nullptr && count_ < kMaxRing) {
      ++count_;
      if (first_ == nullptr) {
        b->tree_child[kLeft] = b->tree_child[kRight] = first_ = b;
        return;
      }
      ring_insert(b);
      return;
    }
    tree_insert(b);
  }
  /// Removes `b`, which must be one of this set's blocks.
  void erase(Block* b) noexcept {
    if (root_ == nullptr) {
      --count_;
      Block* before = b->tree_child[kLeft];
      Block* after = b->tree_child[kRight];
      before->tree_child[kRight] = after;
      after->tree_child[kLeft] = before;
      if (b == first_) first_ = after == b ? nullptr : after;
      return;
    }
    tree_erase(b);
  }

  /// The first broken invariant (order, links, colours, black heights, the
  /// first block, the count and the shape for it), or nullptr. Counts the
  /// blocks into `count`.
  const char* check(std::size_t& count) const;

 private:
  /// The last block down `b`'s spine on `side` (b itself if it has no such child).
  static Block* outermost(Block* b, int side) noexcept {
    while (b->tree_child[side] != nullptr) b = b->tree_child[side];
    return b;
  }
  /// A tree's adjacent block on `side` in key order, or nullptr.
  static Block* neighbour(const Block* b, int side) noexcept;
  /// Links `b` into the ring (not empty) before the first larger block.
  void ring_insert(Block* b) noexcept;
  void tree_insert(Block* b) noexcept;
  void tree_erase(Block* b) noexcept;
  /// The ring becomes a balanced red-black tree, and back.
  void ring_to_tree() noexcept;
  void tree_to_ring() noexcept;
  /// Lowers `x` to its `side`: its child on the other side takes its place.
  void rotate(Block* x, int side) noexcept;
  /// Puts `to` where `from` hangs (its parent's child, or the root).
  void replace_child(Block* parent, const Block* from, Block* to) noexcept;
  void insert_fixup(Block* b) noexcept;
  /// Restores the black heights after a black block left above `x` (which
  /// may be null, hence its parent is passed).
  void erase_fixup(Block* x, Block* parent) noexcept;
  const char* check_ring(std::size_t& count) const;

  Block* root_;   // the tree's root; nullptr while the blocks are a ring
  Block* first_;  // the smallest block (the ring's start)
  std::uint32_t count_;
};

}  // namespace mem::detail
