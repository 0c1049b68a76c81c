// object_pool_test.cpp — the bookkeeping storage under the allocator's lock,
// white-box: FreeListArena hands out distinct, aligned chunks across slabs and
// reuses released ones first; RecyclingPool keeps a released object's members.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "object_pool.hpp"

namespace mem::detail {
namespace {

constexpr std::size_t kChunk = 128;  // a Block's size

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

TEST(FreeListArena, ChunksAreDistinctAlignedAndDisjointAcrossSlabs) {
  FreeListArena arena;
  std::vector<char*> chunks;
  for (int i = 0; i < 1000; ++i) {  // four slabs of 256
    auto* p = static_cast<char*>(arena.allocate(kChunk));
    ASSERT_TRUE(aligned(p, FreeListArena::kSlabAlignment)) << "chunk " << i;
    std::fill(p, p + kChunk, static_cast<char>(i));  // ASan: the whole chunk is ours
    chunks.push_back(p);
  }
  std::vector<char*> sorted = chunks;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    ASSERT_GE(sorted[i] - sorted[i - 1], static_cast<std::ptrdiff_t>(kChunk)) << "overlapping chunks";
  }
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(chunks[i][kChunk - 1], static_cast<char>(i));
}

TEST(FreeListArena, ReleasedChunksComeBackFirstNewestFirst) {
  FreeListArena arena;
  void* a = arena.allocate(kChunk);
  void* b = arena.allocate(kChunk);
  void* c = arena.allocate(kChunk);
  arena.deallocate(a, kChunk);
  arena.deallocate(c, kChunk);
  EXPECT_EQ(arena.allocate(kChunk), c);
  EXPECT_EQ(arena.allocate(kChunk), a);
  void* fresh = arena.allocate(kChunk);  // the free list is empty: carved from the slab
  EXPECT_TRUE(fresh != a && fresh != b && fresh != c);
}

TEST(FreeListArena, OtherSizesFallThroughToOperatorNew) {
  FreeListArena arena;
  void* node = arena.allocate(kChunk);  // fixes the chunk size
  void* big = arena.allocate(3 * kChunk);
  std::fill_n(static_cast<char*>(big), 3 * kChunk, 'x');
  arena.deallocate(big, 3 * kChunk);  // back to operator delete, not the free list
  EXPECT_NE(arena.allocate(kChunk), big);
  arena.deallocate(node, kChunk);
}

struct alignas(64) Recycled {
  Recycled* next = nullptr;
  std::vector<int> payload;  // kept, capacity and all, while released
};

TEST(RecyclingPool, AReleasedObjectComesBackWithItsMembers) {
  RecyclingPool<Recycled> pool;
  Recycled* r = pool.acquire();
  EXPECT_TRUE(aligned(r, alignof(Recycled)));
  EXPECT_TRUE(r->payload.empty());  // a new object is constructed
  r->payload.assign(100, 7);
  pool.release(r);
  Recycled* again = pool.acquire();
  EXPECT_EQ(again, r);
  EXPECT_EQ(again->payload.size(), 100u);  // not reconstructed: callers set what they use
  std::vector<Recycled*> many;
  for (int i = 0; i < 600; ++i) many.push_back(pool.acquire());
  for (Recycled* m : many) {
    EXPECT_TRUE(aligned(m, alignof(Recycled)));
    EXPECT_NE(m, again);
  }
  for (Recycled* m : many) pool.release(m);
  pool.release(again);  // the pool destroys released objects (ASan: no leak of payload)
}

}  // namespace
}  // namespace mem::detail
