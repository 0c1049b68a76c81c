// block_tree.cpp — the red-black tree's rebalancing and its self-check.
#include "block_tree.hpp"

namespace mem::detail {
namespace {

bool is_red(const Block* b) noexcept { return b != nullptr && b->tree_red; }

Block* leftmost(Block* b) noexcept {
  while (b->tree_left != nullptr) b = b->tree_left;
  return b;
}
Block* rightmost(Block* b) noexcept {
  while (b->tree_right != nullptr) b = b->tree_right;
  return b;
}

}  // namespace

Block* BlockTree::next(const Block* b) noexcept {
  if (b->tree_right != nullptr) return leftmost(b->tree_right);
  Block* parent = b->tree_parent;
  while (parent != nullptr && b == parent->tree_right) {
    b = parent;
    parent = parent->tree_parent;
  }
  return parent;
}

Block* BlockTree::prev(const Block* b) noexcept {
  if (b->tree_left != nullptr) return rightmost(b->tree_left);
  Block* parent = b->tree_parent;
  while (parent != nullptr && b == parent->tree_left) {
    b = parent;
    parent = parent->tree_parent;
  }
  return parent;
}

void BlockTree::replace_child(Block* parent, Block* from, Block* to) noexcept {
  if (parent == nullptr) {
    root_ = to;
  } else if (parent->tree_left == from) {
    parent->tree_left = to;
  } else {
    parent->tree_right = to;
  }
}

void BlockTree::rotate_left(Block* x) noexcept {
  Block* y = x->tree_right;
  x->tree_right = y->tree_left;
  if (y->tree_left != nullptr) y->tree_left->tree_parent = x;
  y->tree_parent = x->tree_parent;
  replace_child(x->tree_parent, x, y);
  y->tree_left = x;
  x->tree_parent = y;
}

void BlockTree::rotate_right(Block* x) noexcept {
  Block* y = x->tree_left;
  x->tree_left = y->tree_right;
  if (y->tree_right != nullptr) y->tree_right->tree_parent = x;
  y->tree_parent = x->tree_parent;
  replace_child(x->tree_parent, x, y);
  y->tree_right = x;
  x->tree_parent = y;
}

void BlockTree::insert(Block* b) noexcept {
  Block* parent = nullptr;
  Block** link = &root_;
  bool leftmost_so_far = true;
  while (*link != nullptr) {
    parent = *link;
    if (block_less(b, parent)) {
      link = &parent->tree_left;
    } else {
      link = &parent->tree_right;
      leftmost_so_far = false;
    }
  }
  b->tree_parent = parent;
  b->tree_left = nullptr;
  b->tree_right = nullptr;
  b->tree_red = true;
  *link = b;
  if (leftmost_so_far) first_ = b;
  insert_fixup(b);
}

void BlockTree::insert_fixup(Block* b) noexcept {
  // b is red; the only possible violation is a red parent.
  while (is_red(b->tree_parent)) {
    Block* parent = b->tree_parent;
    Block* grand = parent->tree_parent;  // exists: the root is black
    if (parent == grand->tree_left) {
      Block* uncle = grand->tree_right;
      if (is_red(uncle)) {  // recolour and move the problem up
        parent->tree_red = false;
        uncle->tree_red = false;
        grand->tree_red = true;
        b = grand;
        continue;
      }
      if (b == parent->tree_right) {
        rotate_left(parent);
        b = parent;
        parent = b->tree_parent;
      }
      parent->tree_red = false;
      grand->tree_red = true;
      rotate_right(grand);
    } else {
      Block* uncle = grand->tree_left;
      if (is_red(uncle)) {
        parent->tree_red = false;
        uncle->tree_red = false;
        grand->tree_red = true;
        b = grand;
        continue;
      }
      if (b == parent->tree_left) {
        rotate_right(parent);
        b = parent;
        parent = b->tree_parent;
      }
      parent->tree_red = false;
      grand->tree_red = true;
      rotate_left(grand);
    }
  }
  root_->tree_red = false;
}

void BlockTree::erase(Block* b) noexcept {
  if (b == first_) first_ = next(b);
  Block* x;         // what takes the removed black's place (may be null)
  Block* x_parent;  // its parent
  bool removed_black;
  if (b->tree_left == nullptr || b->tree_right == nullptr) {
    // At most one child: it takes b's place.
    x = b->tree_left != nullptr ? b->tree_left : b->tree_right;
    x_parent = b->tree_parent;
    removed_black = !b->tree_red;
    replace_child(b->tree_parent, b, x);
    if (x != nullptr) x->tree_parent = x_parent;
  } else {
    // Two children: b's successor (no left child) takes b's place and colour,
    // and the successor's right child takes the successor's.
    Block* s = leftmost(b->tree_right);
    removed_black = !s->tree_red;
    x = s->tree_right;
    if (s->tree_parent == b) {
      x_parent = s;
    } else {
      x_parent = s->tree_parent;
      x_parent->tree_left = x;
      if (x != nullptr) x->tree_parent = x_parent;
      s->tree_right = b->tree_right;
      s->tree_right->tree_parent = s;
    }
    replace_child(b->tree_parent, b, s);
    s->tree_parent = b->tree_parent;
    s->tree_left = b->tree_left;
    s->tree_left->tree_parent = s;
    s->tree_red = b->tree_red;
  }
  if (removed_black) erase_fixup(x, x_parent);
}

void BlockTree::erase_fixup(Block* x, Block* parent) noexcept {
  // The path through x lacks one black. x's sibling exists while x is not
  // the root: the other side had a black more than x's to begin with.
  while (x != root_ && !is_red(x)) {
    if (x == parent->tree_left) {
      Block* sibling = parent->tree_right;
      if (sibling->tree_red) {
        sibling->tree_red = false;
        parent->tree_red = true;
        rotate_left(parent);
        sibling = parent->tree_right;
      }
      if (!is_red(sibling->tree_left) && !is_red(sibling->tree_right)) {
        sibling->tree_red = true;  // both sides short: move the deficit up
        x = parent;
        parent = x->tree_parent;
        continue;
      }
      if (!is_red(sibling->tree_right)) {
        sibling->tree_left->tree_red = false;
        sibling->tree_red = true;
        rotate_right(sibling);
        sibling = parent->tree_right;
      }
      sibling->tree_red = parent->tree_red;
      parent->tree_red = false;
      sibling->tree_right->tree_red = false;
      rotate_left(parent);
      x = root_;
    } else {
      Block* sibling = parent->tree_left;
      if (sibling->tree_red) {
        sibling->tree_red = false;
        parent->tree_red = true;
        rotate_right(parent);
        sibling = parent->tree_left;
      }
      if (!is_red(sibling->tree_left) && !is_red(sibling->tree_right)) {
        sibling->tree_red = true;
        x = parent;
        parent = x->tree_parent;
        continue;
      }
      if (!is_red(sibling->tree_left)) {
        sibling->tree_right->tree_red = false;
        sibling->tree_red = true;
        rotate_left(sibling);
        sibling = parent->tree_left;
      }
      sibling->tree_red = parent->tree_red;
      parent->tree_red = false;
      sibling->tree_left->tree_red = false;
      rotate_right(parent);
      x = root_;
    }
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
  if (b->tree_red && (is_red(b->tree_left) || is_red(b->tree_right))) {
    error = "a red free block has a red child";
    return -1;
  }
  const int left = check_subtree(b->tree_left, b, lo, b, count, error);
  if (left < 0) return -1;
  const int right = check_subtree(b->tree_right, b, b, hi, count, error);
  if (right < 0) return -1;
  if (left != right) {
    error = "a size class's tree has unequal black heights";
    return -1;
  }
  return left + (b->tree_red ? 0 : 1);
}

}  // namespace

const char* BlockTree::check(std::size_t& count) const {
  if (root_ == nullptr) {
    return first_ == nullptr ? nullptr : "an empty size class has a first block";
  }
  if (root_->tree_red) return "a size class's tree has a red root";
  const char* error = nullptr;
  if (check_subtree(root_, nullptr, nullptr, nullptr, count, error) < 0) return error;
  if (first_ != leftmost(root_)) return "a size class's first block is stale";
  return nullptr;
}

}  // namespace mem::detail
