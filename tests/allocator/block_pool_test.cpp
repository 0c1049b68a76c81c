// block_pool_test.cpp — the pool's size-class index, white-box: 200,000 random
// inserts, erases, re-keys and queries on three streams, with best_fit, largest, before
// and the walk order checked against one std::map in PyTorch's (stream, size,
// address) order, and the index's own check() after every step.
#include <gtest/gtest.h>

#include <bit>
#include <iterator>
#include <memory>
#include <random>
#include <map>
#include <tuple>
#include <vector>

#include "block_pool.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::detail {
namespace {

using Key = std::tuple<StreamId, std::size_t, std::uintptr_t>;  // PyTorch's order

Key key_of(const Block* b) { return {b->stream, b->size, b->ptr}; }

// What PyTorch's lower_bound on (stream, size, 0) returns, if it is that stream's.
const Block* reference_best_fit(const std::map<Key, Block*>& ref, StreamId stream,
                                std::size_t size) {
  const auto it = ref.lower_bound(Key{stream, size, 0});
  if (it == ref.end() || std::get<0>(it->first) != stream) return nullptr;
  return it->second;
}

TEST(SizeClass, IsMonotoneAndExactUpTo64KiB) {
  std::vector<std::size_t> sizes;
  for (std::size_t s = 512; s <= 64 * KiB; s += 512) sizes.push_back(s);
  for (unsigned bit = 16; bit < 63; ++bit) {
    const std::size_t p = std::size_t{1} << bit;
    for (std::size_t d : {p / 2, p / 4, p / 32, p / 64, std::size_t{512}, std::size_t{0}}) {
      sizes.push_back(p - d);
      sizes.push_back(p + d);
    }
  }
  sizes.push_back(~std::size_t{0});
  std::sort(sizes.begin(), sizes.end());
  for (std::size_t i = 1; i < sizes.size(); ++i) {
    EXPECT_LE(size_class(sizes[i - 1]), size_class(sizes[i])) << sizes[i - 1] << " " << sizes[i];
  }
  for (std::size_t s = 1024; s <= 64 * KiB; s += 512) {
    EXPECT_EQ(size_class(s), size_class(s - 512) + 1) << s;  // one class per size
  }
  EXPECT_LT(size_class(~std::size_t{0}), kNumSizeClasses);
  // A class's top is a round size: a segment that lends a small block keeps its class.
  EXPECT_EQ(size_class(2 * MiB), size_class(2 * MiB - 1 * KiB));
  EXPECT_EQ(size_class(20 * MiB), size_class(20 * MiB - 256 * KiB));  // classes of 512 KiB there
  EXPECT_NE(size_class(2 * MiB), size_class(2 * MiB + 512));
}

class BlockPoolTest : public ::testing::Test {
 protected:
  Block* make(StreamId stream, std::size_t size, std::uintptr_t ptr) {
    storage_.push_back(std::make_unique<Block>());
    Block* b = storage_.back().get();
    b->stream = stream;
    b->size = size;
    b->ptr = ptr;
    b->pool = &pool_;
    return b;
  }
  void expect_consistent() {
    ASSERT_EQ(pool_.check(), "");
    ASSERT_EQ(pool_.size(), ref_.size());
    // The walk visits every block in PyTorch's set order.
    std::vector<Key> walked;
    pool_.for_each([&](const Block* b) { walked.push_back(key_of(b)); });
    ASSERT_EQ(walked.size(), ref_.size());
    auto it = ref_.begin();
    for (const Key& k : walked) ASSERT_EQ(k, (it++)->first);
  }

  BlockPool pool_{false};
  std::map<Key, Block*> ref_;
  std::vector<std::unique_ptr<Block>> storage_;
};

TEST_F(BlockPoolTest, MatchesOneOrderedSetUnderRandomOperations) {
  std::mt19937_64 rng(2026);
  const StreamId streams[] = {0, 7, 3};
  std::vector<Block*> in_pool;
  std::uintptr_t next_ptr = 1 << 20;
  auto random_size = [&]() -> std::size_t {
    switch (rng() % 5) {
      case 0: return 512 * (1 + rng() % 128);                  // the exact classes
      case 1: return 512 * (1 + rng() % 4096);                 // up to 2 MiB
      case 2: return 2 * MiB - 512 * (rng() % 4);              // at a class top
      case 3: return 512 * (1 + rng() % (1u << 22));           // up to 2 GiB
      default: return (std::size_t{1} << (40 + rng() % 20)) + 512 * (rng() % 3);  // huge
    }
  };
  auto insert = [&] {
    Block* b = make(streams[rng() % 3], random_size(), next_ptr);
    next_ptr += 4096;
    pool_.insert(b);
    ASSERT_TRUE(ref_.emplace(key_of(b), b).second);
    in_pool.push_back(b);
  };
  for (int i = 0; i < 3000; ++i) insert();
  for (int step = 0; step < 200000; ++step) {
    const unsigned op = rng() % 10;
    if (op < 3 || in_pool.empty()) {
      insert();
    } else if (op < 6) {  // erase a random block
      const std::size_t k = rng() % in_pool.size();
      Block* b = in_pool[k];
      pool_.erase(b, b->stream);
      ref_.erase(key_of(b));
      in_pool[k] = in_pool.back();
      in_pool.pop_back();
      ASSERT_FALSE(pool_.contains(b));
    } else if (op < 9) {  // re-key: shrink from the front (a split) or grow (a merge)
      Block* b = in_pool[rng() % in_pool.size()];
      std::size_t size = b->size;
      std::uintptr_t ptr = b->ptr;
      if (rng() % 2 == 0 && size > 512) {
        const std::size_t cut = 512 * (1 + rng() % (size / 512 - 1));
        size -= cut;
        ptr += cut;
      } else {
        size += 512 * (1 + rng() % (rng() % 2 ? 8 : 1u << 20));
        if (rng() % 2) ptr -= 512;  // a merge with the block before
      }
      if (ref_.count(Key{b->stream, size, ptr})) continue;  // keys stay unique, as addresses are
      ref_.erase(key_of(b));
      pool_.rekey(b, b->stream, ptr, size);
      ASSERT_TRUE(ref_.emplace(key_of(b), b).second);
      ASSERT_TRUE(pool_.contains(b));
    } else {  // queries
      const StreamId s = streams[rng() % 3];
      const std::size_t want = random_size();
      ASSERT_EQ(pool_.best_fit(s, want), reference_best_fit(ref_, s, want))
          << "stream " << s << " size " << want;
      if (step % 7 == 0) {
        // largest() and before() walk the stream backwards, as the reference does.
        std::vector<Key> backwards;
        for (const Block* b = pool_.largest(s); b != nullptr; b = pool_.before(b)) {
          backwards.push_back(key_of(b));
        }
        std::vector<Key> expected;
        for (auto it = ref_.rbegin(); it != ref_.rend(); ++it) {
          if (std::get<0>(it->first) == s) expected.push_back(it->first);
        }
        ASSERT_EQ(backwards, expected);
      }
    }
    if (step % 97 == 0) expect_consistent();
  }
  expect_consistent();
  // Emptied in random order, the index ends empty and consistent.
  std::shuffle(in_pool.begin(), in_pool.end(), rng);
  for (Block* b : in_pool) {
    pool_.erase(b, b->stream);
    ref_.erase(key_of(b));
  }
  expect_consistent();
  EXPECT_EQ(pool_.best_fit(0, 512), nullptr);
  EXPECT_EQ(pool_.largest(7), nullptr);
}

TEST_F(BlockPoolTest, AStreamNeverSeenHasNoBlocks) {
  EXPECT_EQ(pool_.best_fit(42, 512), nullptr);
  EXPECT_EQ(pool_.largest(42), nullptr);
  pool_.insert(make(1, 4096, 1 << 20));
  EXPECT_EQ(pool_.best_fit(42, 512), nullptr);
  EXPECT_EQ(pool_.best_fit(1, 4097), nullptr);
  ASSERT_NE(pool_.best_fit(1, 4096), nullptr);
  EXPECT_EQ(pool_.best_fit(1, 512)->size, 4096u);
}

TEST_F(BlockPoolTest, StreamsThatComeAndGoKeepTheIndexConsistent) {
  // A program may create thousands of streams; an emptied stream's table is
  // dropped when the next new stream arrives, and its blocks are found again
  // if it comes back.
  for (StreamId s = 1; s <= 2000; ++s) {
    Block* b = make(s, 512 * s, s << 20);
    pool_.insert(b);
    ASSERT_EQ(pool_.best_fit(s, 512), b);
    if (s % 100 != 0) pool_.erase(b, s);  // every hundredth stream keeps a block
  }
  ASSERT_EQ(pool_.check(), "");
  EXPECT_EQ(pool_.size(), 20u);
  for (StreamId s = 100; s <= 2000; s += 100) {
    ASSERT_NE(pool_.best_fit(s, 512), nullptr) << s;
    EXPECT_EQ(pool_.largest(s)->size, 512 * s);
  }
  EXPECT_EQ(pool_.best_fit(1, 512), nullptr);
  pool_.insert(make(1, 4096, 1));
  EXPECT_EQ(pool_.best_fit(1, 512)->size, 4096u);
  EXPECT_EQ(pool_.check(), "");
}

TEST_F(BlockPoolTest, CheckNamesAKeyChangedBehindItsBack) {
  Block* low = make(0, 8192, 1 << 20);
  Block* high = make(0, 8192, 2 << 20);
  pool_.insert(low);
  pool_.insert(high);
  ASSERT_EQ(pool_.check(), "");
  high->size = 16384;
  EXPECT_EQ(pool_.check(), "a block sits in the wrong size class");
  high->size = 8192;
  high->ptr = 1 << 19;  // now below `low`, but still after it in the tree
  EXPECT_EQ(pool_.check(), "free blocks are out of (size, address) order");
  high->ptr = 2 << 20;
  EXPECT_EQ(pool_.check(), "");
}

}  // namespace
}  // namespace mem::detail
