// block_tree.hpp — one size class's free blocks: an intrusive red-black tree
// in (size, address) order (internal).
//
// The order is PyTorch's pool order within one stream. The tree's links live
// in the Blocks themselves (block.hpp), in the cache line a neighbour's split
// or merge already loads: a block entering, leaving or moving between classes
// allocates nothing, and finding its place costs no load beside the block's
// own. Insert and erase are the textbook algorithms (CLRS, without a sentinel
// node); the tree also keeps its first block, which best fit takes most often.
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
/// class's tree means something only while its pool marks it non-empty (an
/// insert into an unmarked class calls reset() first).
class BlockTree {
 public:
  void reset() noexcept { root_ = first_ = nullptr; }
  bool empty() const noexcept { return root_ == nullptr; }
  /// The smallest block, or nullptr.
  Block* first() const noexcept { return first_; }
  /// The largest block, or nullptr (a walk down the right spine).
  Block* last() const noexcept { return root_ == nullptr ? nullptr : outermost(root_, kRight); }
  /// Whether `b` is this tree's only block.
  bool alone(const Block* b) const noexcept {
    return root_ == b && b->tree_child[kLeft] == nullptr && b->tree_child[kRight] == nullptr;
  }
  /// The first block whose size is at least `size`, or nullptr.
  Block* lower_bound(std::size_t size) const noexcept {
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
    for (Block* b = root_; b != nullptr;) {
      if (b->size == size && b->ptr == ptr) return b;
      b = b->tree_child[block_less(size, ptr, b->size, b->ptr) ? kLeft : kRight];
    }
    return nullptr;
  }
  /// The neighbours of `b` in order, or nullptr.
  static Block* next(const Block* b) noexcept { return neighbour(b, kRight); }
  static Block* prev(const Block* b) noexcept { return neighbour(b, kLeft); }

  /// Adds `b` under its current (size, ptr); no block may have that key.
  void insert(Block* b) noexcept;
  /// Removes `b`, which must be in this tree.
  void erase(Block* b) noexcept;

  /// The first broken invariant (order, links, colours, black heights, the
  /// first block), or nullptr. Counts the blocks into `count`.
  const char* check(std::size_t& count) const;

 private:
  /// The last block down `b`'s spine on `side` (b itself if it has no such child).
  static Block* outermost(Block* b, int side) noexcept {
    while (b->tree_child[side] != nullptr) b = b->tree_child[side];
    return b;
  }
  /// The adjacent block on `side` in key order, or nullptr.
  static Block* neighbour(const Block* b, int side) noexcept;
  /// Lowers `x` to its `side`: its child on the other side takes its place.
  void rotate(Block* x, int side) noexcept;
  /// Puts `to` where `from` hangs (its parent's child, or the root).
  void replace_child(Block* parent, const Block* from, Block* to) noexcept;
  void insert_fixup(Block* b) noexcept;
  /// Restores the black heights after a black block left above `x` (which
  /// may be null, hence its parent is passed).
  void erase_fixup(Block* x, Block* parent) noexcept;

  Block* root_;
  Block* first_;
};

}  // namespace mem::detail
