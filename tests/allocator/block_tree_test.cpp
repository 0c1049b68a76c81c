// block_tree_test.cpp — one size class's blocks, white-box: thousands of blocks
// in one tree (deeper than the pool's classes usually grow), then sets that
// grow and shrink across the ring/tree line, random inserts and erases against
// a std::set in (size, address) order, with the set's own check() (order,
// links, colours, black heights, count, shape) and every query compared along
// the way.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "block_tree.hpp"

namespace mem::detail {
namespace {

using Key = std::pair<std::size_t, std::uintptr_t>;

class BlockTreeTest : public ::testing::Test {
 protected:
  void SetUp() override { tree_.reset(); }
  Block* make(std::size_t size, std::uintptr_t ptr) {
    storage_.push_back(std::make_unique<Block>());
    storage_.back()->size = size;
    storage_.back()->ptr = ptr;
    return storage_.back().get();
  }
  void expect_matches_reference() {
    std::size_t count = 0;
    const char* error = tree_.check(count);
    ASSERT_EQ(error, nullptr) << error;
    ASSERT_EQ(count, ref_.size());
    // Forwards and backwards, the walk is the reference's order.
    auto it = ref_.begin();
    for (const Block* b = tree_.first(); b != nullptr; b = tree_.next(b), ++it) {
      ASSERT_NE(it, ref_.end());
      ASSERT_EQ(Key(b->size, b->ptr), *it);
    }
    ASSERT_EQ(it, ref_.end());
    auto rit = ref_.rbegin();
    for (const Block* b = tree_.last(); b != nullptr; b = tree_.prev(b), ++rit) {
      ASSERT_NE(rit, ref_.rend());
      ASSERT_EQ(Key(b->size, b->ptr), *rit);
    }
    ASSERT_EQ(rit, ref_.rend());
  }

  BlockTree tree_;
  std::set<Key> ref_;
  std::vector<std::unique_ptr<Block>> storage_;
};

TEST_F(BlockTreeTest, MatchesAnOrderedSetUnderRandomInsertsAndErases) {
  std::mt19937_64 rng(17);
  std::vector<Block*> in_tree;
  std::uintptr_t next_ptr = 1 << 20;
  // Few sizes, so most order decisions fall to the address, and ascending
  // addresses, so inserts lean right (rotations on one side), then random ones.
  auto insert = [&](std::uintptr_t ptr) {
    Block* b = make(512 * (1 + rng() % 8), ptr);
    if (!ref_.emplace(b->size, b->ptr).second) return;
    tree_.insert(b);
    in_tree.push_back(b);
  };
  for (int i = 0; i < 5000; ++i) insert(next_ptr += 512);
  expect_matches_reference();
  for (int step = 0; step < 100000; ++step) {
    if (rng() % 2 == 0 || in_tree.empty()) {
      insert(512 * (rng() % (1u << 30)));
    } else {
      const std::size_t k = rng() % in_tree.size();
      Block* b = in_tree[k];
      tree_.erase(b);
      ref_.erase(Key(b->size, b->ptr));
      in_tree[k] = in_tree.back();
      in_tree.pop_back();
    }
    if (step % 1000 == 0) {
      expect_matches_reference();
      const std::size_t want = 512 * (rng() % 10);
      const auto lb = ref_.lower_bound(Key(want, 0));
      const Block* found = tree_.lower_bound(want);
      if (lb == ref_.end()) {
        EXPECT_EQ(found, nullptr);
      } else {
        ASSERT_NE(found, nullptr);
        EXPECT_EQ(Key(found->size, found->ptr), *lb);
      }
      if (!in_tree.empty()) {
        const Block* b = in_tree[rng() % in_tree.size()];
        EXPECT_EQ(tree_.find(b->size, b->ptr), b);
        EXPECT_EQ(tree_.find(b->size, b->ptr + 1), nullptr);
      }
    }
  }
  expect_matches_reference();
  // Emptied smallest first (erase's first-block update every time), then the rest.
  std::sort(in_tree.begin(), in_tree.end(),
            [](const Block* a, const Block* b) { return block_less(a, b); });
  for (std::size_t i = 0; i < in_tree.size() / 2; ++i) {
    ASSERT_EQ(tree_.first(), in_tree[i]);
    tree_.erase(in_tree[i]);
    ref_.erase(Key(in_tree[i]->size, in_tree[i]->ptr));
  }
  expect_matches_reference();
  for (std::size_t i = in_tree.size(); i-- > in_tree.size() / 2;) {
    tree_.erase(in_tree[i]);
    ref_.erase(Key(in_tree[i]->size, in_tree[i]->ptr));
  }
  expect_matches_reference();
  EXPECT_TRUE(tree_.empty());
  EXPECT_EQ(tree_.first(), nullptr);
}

TEST_F(BlockTreeTest, AloneMeansTheOnlyBlock) {
  Block* a = make(4096, 1 << 20);
  Block* b = make(4096, 2 << 20);
  tree_.insert(a);
  EXPECT_TRUE(tree_.alone(a));
  tree_.insert(b);
  EXPECT_FALSE(tree_.alone(a));
  EXPECT_FALSE(tree_.alone(b));
  tree_.erase(a);
  EXPECT_TRUE(tree_.alone(b));
  EXPECT_EQ(tree_.first(), b);
  EXPECT_EQ(tree_.last(), b);
}

TEST_F(BlockTreeTest, SmallSetsChangeShapeAcrossTheLine) {
  // Sizes drift between empty and three times a full ring, so the set turns from a ring
  // into a tree and back hundreds of times; every step is checked.
  std::mt19937_64 rng(35);
  std::vector<Block*> in_set;
  std::size_t target = 0, shape_changes = 0;
  bool was_tree = false;
  for (int step = 0; step < 60000; ++step) {
    if (step % 100 == 0) target = rng() % (3 * BlockTree::kMaxRing + 1);
    if (in_set.size() < target || (in_set.size() == target && rng() % 2 == 0)) {
      Block* b = make(512 * (1 + rng() % 4), 512 * (1 + rng() % (1u << 20)));
      if (!ref_.emplace(b->size, b->ptr).second) continue;
      tree_.insert(b);
      in_set.push_back(b);
    } else if (!in_set.empty()) {
      const std::size_t k = rng() % in_set.size();
      tree_.erase(in_set[k]);
      ref_.erase(Key(in_set[k]->size, in_set[k]->ptr));
      in_set[k] = in_set.back();
      in_set.pop_back();
    }
    ASSERT_NO_FATAL_FAILURE(expect_matches_reference());
    ASSERT_EQ(tree_.size(), ref_.size());
    // A ring up to kMaxRing blocks, a tree above it; between kRingAgain and kMaxRing either.
    if (ref_.size() > BlockTree::kMaxRing) {
      ASSERT_TRUE(tree_.is_tree());
    }
    if (ref_.size() <= BlockTree::kRingAgain) {
      ASSERT_FALSE(tree_.is_tree());
    }
    shape_changes += tree_.is_tree() != was_tree;
    was_tree = tree_.is_tree();
    const std::size_t want = 512 * (rng() % 6);
    const auto lb = ref_.lower_bound(Key(want, 0));
    const Block* found = tree_.lower_bound(want);
    ASSERT_EQ(found == nullptr, lb == ref_.end());
    if (found != nullptr) {
      ASSERT_EQ(Key(found->size, found->ptr), *lb);
    }
    if (!in_set.empty()) {
      const Block* b = in_set[rng() % in_set.size()];
      ASSERT_EQ(tree_.find(b->size, b->ptr), b);
      ASSERT_TRUE(tree_.alone(b) == (ref_.size() == 1));
    }
  }
  EXPECT_GT(shape_changes, 100u);  // 60,000 steps in 600 targets
}

TEST_F(BlockTreeTest, CheckFindsABrokenRing) {
  std::vector<Block*> blocks;
  for (std::uintptr_t i = 1; i <= 5; ++i) {
    blocks.push_back(make(4096, i << 20));
    tree_.insert(blocks.back());
  }
  std::size_t count = 0;
  ASSERT_EQ(tree_.check(count), nullptr);
  EXPECT_FALSE(tree_.is_tree());
  EXPECT_EQ(count, 5u);
  std::swap(blocks[1]->ptr, blocks[2]->ptr);
  count = 0;
  EXPECT_STREQ(tree_.check(count), "free blocks are out of (size, address) order");
  std::swap(blocks[1]->ptr, blocks[2]->ptr);
  blocks[3]->tree_child[kLeft] = blocks[1];
  count = 0;
  EXPECT_STREQ(tree_.check(count), "a size class's ring links are broken");
  blocks[3]->tree_child[kLeft] = blocks[2];
  count = 0;
  EXPECT_EQ(tree_.check(count), nullptr);
}

TEST_F(BlockTreeTest, CheckFindsABrokenColourAndLink) {
  std::vector<Block*> blocks;
  for (std::uintptr_t i = 1; i <= 2 * BlockTree::kMaxRing; ++i) {
    blocks.push_back(make(4096, i << 20));
    tree_.insert(blocks.back());
  }
  std::size_t count = 0;
  ASSERT_EQ(tree_.check(count), nullptr);
  Block* leaf = tree_.first();
  leaf->tree_red = !leaf->tree_red;
  count = 0;
  EXPECT_NE(tree_.check(count), nullptr);  // black heights or a red pair
  leaf->tree_red = !leaf->tree_red;
  Block* parent = leaf->tree_parent;
  leaf->tree_parent = nullptr;
  count = 0;
  EXPECT_STREQ(tree_.check(count), "a free block's tree parent link is wrong");
  leaf->tree_parent = parent;
  count = 0;
  EXPECT_EQ(tree_.check(count), nullptr);
}

}  // namespace
}  // namespace mem::detail
