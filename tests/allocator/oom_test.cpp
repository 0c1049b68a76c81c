// oom_test.cpp — free-cache-and-retry, the out-of-memory error and its figures,
// the memory fraction and the garbage collector.
#include <gtest/gtest.h>

#include <string>

#include "test_device.hpp"

namespace mem {
namespace {

using testing::small_device;

TEST(OutOfMemory, RetryAfterFreeingTheCacheSucceeds) {
  CachingAllocator a{small_device(100 * MiB)};
  void* p = a.allocate(60 * MiB);
  a.deallocate(p);  // 60 MiB cached
  void* q = a.allocate(70 * MiB);  // does not fit beside the cache: free it and retry
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(70 * MiB));
  a.deallocate(q);
  a.validate();
}

TEST(OutOfMemory, ErrorCarriesTheFiguresAndTheAllocatorStaysConsistent) {
  CachingAllocator a{small_device(100 * MiB, 10 * MiB)};
  void* p = a.allocate(50 * MiB);
  void* k = a.allocate(5 * MiB);  // a 20 MiB segment, 15 MiB of it free
  try {
    a.allocate(40 * MiB);
    FAIL() << "expected an OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const auto& f = e.figures();
    EXPECT_EQ(f.requested, 40 * MiB);
    EXPECT_EQ(f.device_total, 100 * MiB);
    EXPECT_EQ(f.device_free, 20 * MiB);  // 100 - 10 context - 70 segments
    EXPECT_EQ(f.allocated, 55 * MiB);
    EXPECT_EQ(f.reserved, 70 * MiB);
    EXPECT_EQ(f.process_used, 80 * MiB);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Tried to allocate 40.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("total capacity of 100.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("of which 20.00 MiB is free"), std::string::npos) << msg;
    EXPECT_NE(msg.find("55.00 MiB is allocated"), std::string::npos) << msg;
    EXPECT_NE(msg.find("15.00 MiB is reserved"), std::string::npos) << msg;
    EXPECT_NE(msg.find("max_split_size_mb"), std::string::npos) << msg;
  }
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 1);
  a.validate();
  // Still usable afterwards.
  void* q = a.allocate(10 * MiB);
  a.deallocate(q);
  a.deallocate(k);
  a.deallocate(p);
  a.validate();
}

TEST(OutOfMemory, IsABadAlloc) {
  CachingAllocator a{small_device(64 * MiB)};
  EXPECT_THROW(a.allocate(128 * MiB), std::bad_alloc);
}

TEST(OutOfMemory, ReleasesOneOversizeBlockBeforeFlushingTheCache) {
  // With max_split_size set, a miss first releases the smallest cached oversize
  // block that covers max_split_size, before flushing everything.
  CachingAllocator a{small_device(140 * MiB), AllocatorConfig::parse("max_split_size_mb:40")};
  void* x = a.allocate(60 * MiB);
  void* y = a.allocate(50 * MiB);
  void* keep = a.allocate(KiB);
  a.deallocate(x);
  a.deallocate(y);
  // 30 MiB may not take an oversize block, and only 28 MiB of the device is free.
  void* z = a.allocate(30 * MiB);
  DeviceStats s = a.stats();
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_device_free, 1);  // the 50 MiB block went, the 60 MiB one stayed
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(92 * MiB));
  a.deallocate(z);
  a.deallocate(keep);
  a.validate();
}

TEST(OutOfMemory, ReleasesOversizeBlocksLargestFirstUntilEnough) {
  CachingAllocator a{small_device(200 * MiB), AllocatorConfig::parse("max_split_size_mb:40")};
  void* x = a.allocate(60 * MiB);
  void* y = a.allocate(50 * MiB);
  void* keep = a.allocate(KiB);
  a.deallocate(x);
  a.deallocate(y);
  // No cached block covers 100 MiB: release oversize blocks, largest first,
  // until 100 MiB were released (60, then 50).
  void* z = a.allocate(100 * MiB);
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.num_device_free, 2);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(102 * MiB));
  a.deallocate(z);
  a.deallocate(keep);
  a.validate();
}

TEST(MemoryFraction, CapsReservedMemory) {
  CachingAllocator a{small_device(GiB)};
  a.set_memory_fraction(0.25);
  void* p = a.allocate(200 * MiB);
  try {
    a.allocate(100 * MiB);
    FAIL() << "the fraction should cap at 256 MiB";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.figures().allowed, 256 * MiB);
    EXPECT_NE(std::string(e.what()).find("allows 256.00 MiB"), std::string::npos) << e.what();
  }
  EXPECT_THROW(a.set_memory_fraction(1.5), Error);
  EXPECT_THROW(a.set_memory_fraction(-0.1), Error);
  a.deallocate(p);
  a.validate();
}

TEST(GarbageCollection, ReclaimsOldCachedSegmentsAboveTheThreshold) {
  CachingAllocator a{small_device(GiB), AllocatorConfig::parse("garbage_collection_threshold:0.5")};
  a.set_memory_fraction(1.0);  // the collector only runs with a fraction set
  void* p = a.allocate(300 * MiB);
  void* q = a.allocate(300 * MiB);
  a.deallocate(p);
  a.deallocate(q);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(600 * MiB));
  // A miss with 600 MiB reserved > 512 MiB threshold frees old cached segments first.
  void* r = a.allocate(400 * MiB);
  const DeviceStats s = a.stats();
  EXPECT_GE(s.num_device_free, 1);
  EXPECT_LE(s.reserved_bytes[0].current, static_cast<std::int64_t>(700 * MiB));
  EXPECT_EQ(s.num_alloc_retries, 0);
  a.deallocate(r);
  a.validate();
}

}  // namespace
}  // namespace mem
