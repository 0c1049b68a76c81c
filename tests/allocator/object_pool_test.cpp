// object_pool_test.cpp — the bookkeeping storage under the allocator's lock,
// white-box: RecyclingPool hands out distinct, aligned objects across slabs,
// reuses released ones first, newest first, and keeps their members.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

#include "object_pool.hpp"

namespace mem::detail {
namespace {

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

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

struct alignas(64) Plain {
  Plain* next = nullptr;
  char bytes[120];
};

TEST(RecyclingPool, ObjectsAreDistinctAlignedAndDisjointAcrossSlabs) {
  RecyclingPool<Plain> pool;
  std::vector<Plain*> objects;
  for (std::size_t i = 0; i < 4 * RecyclingPool<Plain>::kPerSlab - 24; ++i) {  // four slabs
    Plain* p = pool.acquire();
    ASSERT_TRUE(aligned(p, alignof(Plain))) << "object " << i;
    std::fill(std::begin(p->bytes), std::end(p->bytes), static_cast<char>(i));  // ASan: all ours
    objects.push_back(p);
  }
  std::vector<Plain*> sorted = objects;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    ASSERT_GE(reinterpret_cast<char*>(sorted[i]) - reinterpret_cast<char*>(sorted[i - 1]),
              static_cast<std::ptrdiff_t>(sizeof(Plain)))
        << "overlapping objects";
  }
  for (std::size_t i = 0; i < objects.size(); ++i) {
    EXPECT_EQ(objects[i]->bytes[119], static_cast<char>(i));
  }
  for (Plain* p : objects) pool.release(p);
}

TEST(RecyclingPool, ReleasedObjectsComeBackFirstNewestFirst) {
  RecyclingPool<Plain> pool;
  Plain* a = pool.acquire();
  Plain* b = pool.acquire();
  Plain* c = pool.acquire();
  pool.release(a);
  pool.release(c);
  EXPECT_EQ(pool.acquire(), c);
  EXPECT_EQ(pool.acquire(), a);
  Plain* fresh = pool.acquire();  // the free list is empty: carved from the slab
  EXPECT_TRUE(fresh != a && fresh != b && fresh != c);
  for (Plain* p : {a, b, c, fresh}) pool.release(p);
}

}  // namespace
}  // namespace mem::detail
