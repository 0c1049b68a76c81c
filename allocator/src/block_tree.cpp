// block_tree.cpp — the ring's insert, the red-black tree's rebalancing, the
// changes of shape between them, and the self-check.
//
// The tree's are the textbook algorithms (CLRS), each case written once: `side`
// names where the case happens, 1 - side its mirror image.
#include "block_tree.hpp"

#include <bit>

namespace mem::detail {
namespace {

bool is_red(const Block* b) noexcept { return b != nullptr && b->tree_red; }

/// The side of `parent` that `child` hangs on (child may be null when the
/// other side is not).
int side_of(const Block* parent, const Block* child) noexcept {
  return parent->tree_child[kLeft] == child ? kLeft : kRight;
}

}  // namespace

Block* BlockTree::neighbour(const Block* b, int side) noexcept {
  if (b->tree_child[side] != nullptr) return outermost(b->tree_child[side], 1 - side);
  // Climb while we come from `side`: the first ancestor reached from the
  // other side is the neighbour.
  Block* parent = b->tree_parent;
  while (parent != nullptr && b == parent->tree_child[side]) {
    b = parent;
    parent = parent->tree_parent;
  }
  return parent;
}

void BlockTree::replace_child(Block* parent, const Block* from, Block* to) noexcept {
  if (parent == nullptr) {
    root_ = to;
  } else {
    parent->tree_child[side_of(parent, from)] = to;
  }
}

void BlockTree::rotate(Block* x, int side) noexcept {
  const int other = 1 - side;
  Block* y = x->tree_child[other];
  x->tree_child[other] = y->tree_child[side];
  if (y->tree_child[side] != nullptr) y->tree_child[side]->tree_parent = x;
  y->tree_parent = x->tree_parent;
  replace_child(x->tree_parent, x, y);
  y->tree_child[side] = x;
  x->tree_parent = y;
}

void BlockTree::ring_insert(Block* b) noexcept {
  Block* at = first_;  // the first larger block; first_ again when b is the largest
  do {
    if (block_less(b, at)) break;
    at = at->tree_child[kRight];
  } while (at != first_);
  Block* before = at->tree_child[kLeft];
  b->tree_child[kLeft] = before;
  b->tree_child[kRight] = at;
  before->tree_child[kRight] = b;
  at->tree_child[kLeft] = b;
  if (block_less(b, first_)) first_ = b;
}

namespace {

/// A balanced tree of sorted[lo, hi) under `parent`: the middle block at the top, so
/// subtrees differ by one block at most and every path ends at the deepest level or the
/// one above. Blocks on the deepest level are red, the others black: equal black heights.
Block* build_balanced(Block* const* sorted, std::uint32_t lo, std::uint32_t hi, Block* parent,
                      int depth, int red_depth) noexcept {
  if (lo == hi) return nullptr;
  const std::uint32_t mid = lo + (hi - lo) / 2;
  Block* b = sorted[mid];
  b->tree_parent = parent;
  b->tree_red = depth == red_depth && depth > 0;
  b->tree_child[kLeft] = build_balanced(sorted, lo, mid, b, depth + 1, red_depth);
  b->tree_child[kRight] = build_balanced(sorted, mid + 1, hi, b, depth + 1, red_depth);
  return b;
}

}  // namespace

void BlockTree::ring_to_tree() noexcept {
  Block* sorted[kMaxRing];
  std::uint32_t n = 0;
  Block* b = first_;
  do {
    sorted[n++] = b;
    b = b->tree_child[kRight];
  } while (b != first_);
  root_ = build_balanced(sorted, 0, n, nullptr, 0, static_cast<int>(std::bit_width(n)) - 1);
}

void BlockTree::tree_to_ring() noexcept {
  Block* sorted[kRingAgain];
  std::uint32_t n = 0;
  for (Block* b = first_; b != nullptr; b = neighbour(b, kRight)) sorted[n++] = b;
  for (std::uint32_t i = 0; i < n; ++i) {
    sorted[i]->tree_child[kRight] = sorted[i + 1 == n ? 0 : i + 1];
    sorted[i]->tree_child[kLeft] = sorted[i == 0 ? n - 1 : i - 1];
  }
  root_ = nullptr;
}

void BlockTree::tree_insert(Block* b) noexcept {
  if (root_ == nullptr) ring_to_tree();  // the ring is full
  ++count_;
  Block* parent = nullptr;
  Block** link = &root_;
  while (*link != nullptr) {
    parent = *link;
    // A branch, not an index computed from the compare: when the way down is
    // predictable (a block freed back where it came from) the next load then
    // starts before the compare is done.
    if (block_less(b, parent)) {
      link = &parent->tree_child[kLeft];
    } else {
      link = &parent->tree_child[kRight];
    }
  }
  b->tree_parent = parent;
  b->tree_child[kLeft] = b->tree_child[kRight] = nullptr;
  b->tree_red = true;
  *link = b;
  // A new smallest block lands left of the old smallest (or in an empty tree).
  if (parent == nullptr || (parent == first_ && link == &parent->tree_child[kLeft])) first_ = b;
  insert_fixup(b);
}

void BlockTree::insert_fixup(Block* b) noexcept {
  // b is red; the only possible violation is a red parent.
  while (is_red(b->tree_parent)) {
    Block* parent = b->tree_parent;
    Block* grand = parent->tree_parent;  // exists: the root is black
    const int side = side_of(grand, parent);
    Block* uncle = grand->tree_child[1 - side];
    if (is_red(uncle)) {  // recolour and move the problem up
      parent->tree_red = false;
      uncle->tree_red = false;
      grand->tree_red = true;
      b = grand;
      continue;
    }
    if (b == parent->tree_child[1 - side]) {  // an inner grandchild: make it outer
      rotate(parent, side);
      b = parent;
      parent = b->tree_parent;
    }
    parent->tree_red = false;
    grand->tree_red = true;
    rotate(grand, 1 - side);
  }
  root_->tree_red = false;
}

void BlockTree::tree_erase(Block* b) noexcept {
  if (b == first_) first_ = neighbour(b, kRight);
  Block* x;         // what takes the removed black's place (may be null)
  Block* x_parent;  // its parent
  bool removed_black;
  Block* left = b->tree_child[kLeft];
  Block* right = b->tree_child[kRight];
  if (left == nullptr || right == nullptr) {
    // At most one child: it takes b's place.
    x = left != nullptr ? left : right;
    x_parent = b->tree_parent;
    removed_black = !b->tree_red;
    replace_child(b->tree_parent, b, x);
    if (x != nullptr) x->tree_parent = x_parent;
  } else {
    // Two children: b's successor (no left child) takes b's place and colour,
    // and the successor's right child takes the successor's.
    Block* s = outermost(right, kLeft);
    removed_black = !s->tree_red;
    x = s->tree_child[kRight];
    if (s->tree_parent == b) {
      x_parent = s;
    } else {
      x_parent = s->tree_parent;
      x_parent->tree_child[kLeft] = x;
      if (x != nullptr) x->tree_parent = x_parent;
      s->tree_child[kRight] = right;
      right->tree_parent = s;
    }
    replace_child(b->tree_parent, b, s);
    s->tree_parent = b->tree_parent;
    s->tree_child[kLeft] = left;
    left->tree_parent = s;
    s->tree_red = b->tree_red;
  }
  if (removed_black) erase_fixup(x, x_parent);
  if (--count_ == kRingAgain) tree_to_ring();
}

void BlockTree::erase_fixup(Block* x, Block* parent) noexcept {
  // The path through x lacks one black. x's sibling exists while x is not
  // the root: the other side had a black more than x's to begin with.
  while (x != root_ && !is_red(x)) {
    const int side = side_of(parent, x);
    const int other = 1 - side;
    Block* sibling = parent->tree_child[other];
    if (sibling->tree_red) {
      sibling->tree_red = false;
      parent->tree_red = true;
      rotate(parent, side);
      sibling = parent->tree_child[other];
    }
    if (!is_red(sibling->tree_child[kLeft]) && !is_red(sibling->tree_child[kRight])) {
      sibling->tree_red = true;  // both sides short: move the deficit up
      x = parent;
      parent = x->tree_parent;
      continue;
    }
    if (!is_red(sibling->tree_child[other])) {  // the red nephew is the inner one
      sibling->tree_child[side]->tree_red = false;
      sibling->tree_red = true;
      rotate(sibling, other);
      sibling = parent->tree_child[other];
    }
    sibling->tree_red = parent->tree_red;
    parent->tree_red = false;
    sibling->tree_child[other]->tree_red = false;
    rotate(parent, side);
    x = root_;
  }
  if (x != nullptr) x->tree_red = false;
}

namespace {

/// Checks the subtree under `b` (whose parent must be `parent`), keys strictly
/// between `lo` and `hi` where given; returns its black height, or -1 with
/// `error` set.
int check_subtree(const Block* b, const Block* parent, const Block* lo, const Block* hi,
                  std::size_t& count, const char*& error) {
  if (b == nullptr) return 1;
  ++count;
  if (b->tree_parent != parent) {
    error = "a free block's tree parent link is wrong";
    return -1;
  }
  if ((lo != nullptr && !block_less(lo, b)) || (hi != nullptr && !block_less(b, hi))) {
    error = "free blocks are out of (size, address) order";
    return -1;
  }
  const Block* left = b->tree_child[kLeft];
  const Block* right = b->tree_child[kRight];
  if (b->tree_red && (is_red(left) || is_red(right))) {
    error = "a red free block has a red child";
    return -1;
  }
  const int left_height = check_subtree(left, b, lo, b, count, error);
  if (left_height < 0) return -1;
  const int right_height = check_subtree(right, b, b, hi, count, error);
  if (right_height < 0) return -1;
  if (left_height != right_height) {
    error = "a size class's tree has unequal black heights";
    return -1;
  }
  return left_height + (b->tree_red ? 0 : 1);
}

}  // namespace

const char* BlockTree::check_ring(std::size_t& count) const {
  if (first_ == nullptr) return count_ == 0 ? nullptr : "an empty size class counts blocks";
  std::size_t walked = 0;
  const Block* b = first_;
  do {
    const Block* after = b->tree_child[kRight];
    if (after == nullptr || after->tree_child[kLeft] != b) return "a size class's ring links are broken";
    if (after != first_ && !block_less(b, after)) return "free blocks are out of (size, address) order";
    if (++walked > kMaxRing) return "a size class's ring is longer than a ring may be";
    b = after;
  } while (b != first_);
  count += walked;
  return walked == count_ ? nullptr : "a size class's count disagrees with its ring";
}

const char* BlockTree::check(std::size_t& count) const {
  if (root_ == nullptr) return check_ring(count);
  if (root_->tree_red) return "a size class's tree has a red root";
  const char* error = nullptr;
  std::size_t in_tree = 0;
  if (check_subtree(root_, nullptr, nullptr, nullptr, in_tree, error) < 0) return error;
  if (first_ != outermost(root_, kLeft)) return "a size class's first block is stale";
  if (in_tree != count_) return "a size class's count disagrees with its tree";
  if (in_tree <= kRingAgain) return "a size class is a tree with blocks few enough for a ring";
  count += in_tree;
  return nullptr;
}

}  // namespace mem::detail
