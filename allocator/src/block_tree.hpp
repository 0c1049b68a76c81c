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
  return size_a != size_b ? size_a < size_b : ptr_a < ptr_b;
}
inline bool block_less(const Block* a, const Block* b) noexcept {
  return block_less(a->size, a->ptr, b->size, b->ptr);
}

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
  Block* last() const noexcept {
    Block* b = root_;
    if (b != nullptr) {
      while (b->tree_right != nullptr) b = b->tree_right;
    }
    return b;
  }
  /// Whether `b` is this tree's only block.
  bool alone(const Block* b) const noexcept {
    return root_ == b && b->tree_left == nullptr && b->tree_right == nullptr;
  }
  /// The first block whose size is at least `size`, or nullptr.
  Block* lower_bound(std::size_t size) const noexcept {
    Block* found = nullptr;
    for (Block* b = root_; b != nullptr;) {
      if (b->size >= size) {
        found = b;
        b = b->tree_left;
      } else {
        b = b->tree_right;
      }
    }
    return found;
  }
  /// The block with exactly this key, or nullptr.
  Block* find(std::size_t size, std::uintptr_t ptr) const noexcept {
    for (Block* b = root_; b != nullptr;) {
      if (block_less(size, ptr, b->size, b->ptr)) {
        b = b->tree_left;
      } else if (block_less(b->size, b->ptr, size, ptr)) {
        b = b->tree_right;
      } else {
        return b;
      }
    }
    return nullptr;
  }
  /// The neighbours of `b` in order, or nullptr.
  static Block* next(const Block* b) noexcept;
  static Block* prev(const Block* b) noexcept;

  /// Adds `b` under its current (size, ptr); no block may have that key.
  void insert(Block* b) noexcept;
  /// Removes `b`, which must be in this tree.
  void erase(Block* b) noexcept;

  /// The first broken invariant (order, links, colours, black heights, the
  /// first block), or nullptr. Counts the blocks into `count`.
  const char* check(std::size_t& count) const;

 private:
  void rotate_left(Block* x) noexcept;
  void rotate_right(Block* x) noexcept;
  /// Puts `to` where `from` hangs (its parent's child, or the root).
  void replace_child(Block* parent, Block* from, Block* to) noexcept;
  void insert_fixup(Block* b) noexcept;
  /// Restores the black heights after a black block left above `x` (which
  /// may be null, hence its parent is passed).
  void erase_fixup(Block* x, Block* parent) noexcept;

  Block* root_;
  Block* first_;
};

}  // namespace mem::detail
