// policy_test.cpp — exact byte counts that PyTorch's caching policy dictates:
// rounding, pools, segment sizes, best fit, splitting, coalescing, oversize.
#include <gtest/gtest.h>

#include "test_device.hpp"

namespace mem {
namespace {

using testing::small_device;
constexpr std::size_t kAll = 0, kSmall = 1, kLarge = 2;

std::int64_t reserved(const CachingAllocator& a, std::size_t t = kAll) {
  return a.stats().reserved_bytes[t].current;
}
std::int64_t allocated(const CachingAllocator& a, std::size_t t = kAll) {
  return a.stats().allocated_bytes[t].current;
}

TEST(Rounding, SizesRoundUpTo512Bytes) {
  AllocatorConfig cfg;
  EXPECT_EQ(round_size(1, cfg), 512u);
  EXPECT_EQ(round_size(512, cfg), 512u);
  EXPECT_EQ(round_size(513, cfg), 1024u);
  EXPECT_EQ(round_size(1000, cfg), 1024u);
  EXPECT_EQ(round_size(1258291, cfg), 1258496u);  // 2458 * 512
}

TEST(Rounding, PowerOfTwoDivisionsMatchPyTorch) {
  const auto cfg = AllocatorConfig::parse("roundup_power2_divisions:4");
  // 1 MiB .. 2 MiB in 4 steps of 256 KiB: 1,258,291 -> 1,310,720 (= 1.25 MiB).
  EXPECT_EQ(round_size(1258291, cfg), 1310720u);
  EXPECT_EQ(round_size(1048576, cfg), 1048576u);  // powers of two stay
  EXPECT_EQ(round_size(3 * MiB + 1, cfg), 3 * MiB + 512 * KiB);
  // Below 512 B * divisions the plain rounding applies.
  EXPECT_EQ(round_size(1500, cfg), 1536u);
}

TEST(Rounding, DivisionListAppliesPerInterval) {
  const auto cfg = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:8]");
  // Below 256 MiB the first entry (1 = off) applies: plain 512 B rounding.
  EXPECT_EQ(round_size(100 * MiB + 1, cfg), 100 * MiB + 512);
  // [512 MiB, 1 GiB) in 2 divisions: 600 MiB -> 768 MiB.
  EXPECT_EQ(round_size(600 * MiB, cfg), 768 * MiB);
  // >: 8 divisions from 1 GiB up: 1.1 GiB -> 1.125 GiB.
  EXPECT_EQ(round_size(GiB + 100 * MiB, cfg), GiB + 128 * MiB);
}

TEST(SegmentSizes, FollowThePoolRules) {
  EXPECT_EQ(segment_size_for(512), 2 * MiB);
  EXPECT_EQ(segment_size_for(MiB), 2 * MiB);             // 1 MiB is still small
  EXPECT_EQ(segment_size_for(MiB + 512), 20 * MiB);      // large, under 10 MiB
  EXPECT_EQ(segment_size_for(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(segment_size_for(10 * MiB), 10 * MiB);       // own segment, 2 MiB multiple
  EXPECT_EQ(segment_size_for(25 * MiB), 26 * MiB);
}

TEST(Policy, OneKiBReservesOneSmallSegment) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(KiB);
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.reserved_bytes[kAll].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.reserved_bytes[kSmall].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.reserved_bytes[kLarge].current, 0);
  EXPECT_EQ(s.allocated_bytes[kAll].current, 1024);
  EXPECT_EQ(s.requested_bytes[kAll].current, 1024);
  EXPECT_EQ(s.segment[kSmall].current, 1);
  EXPECT_EQ(s.inactive_split[kSmall].current, 1);  // the 2 MiB - 1 KiB remainder
  EXPECT_EQ(s.inactive_split_bytes[kSmall].current, static_cast<std::int64_t>(2 * MiB - KiB));
  EXPECT_EQ(s.num_device_alloc, 1);
  a.deallocate(p);
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(2 * MiB));  // cached, not returned
  EXPECT_EQ(allocated(a), 0);
  EXPECT_EQ(a.stats().inactive_split[kSmall].current, 0);  // coalesced back whole
  a.validate();
}

TEST(Policy, FiveMiBReservesTwentyAndTheSecondReusesTheRemainder) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(5 * MiB);
  EXPECT_EQ(reserved(a, kLarge), static_cast<std::int64_t>(20 * MiB));
  void* q = a.allocate(5 * MiB);
  EXPECT_EQ(reserved(a, kLarge), static_cast<std::int64_t>(20 * MiB));
  EXPECT_EQ(a.stats().segment[kAll].current, 1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) - reinterpret_cast<std::uintptr_t>(p), 5 * MiB);
  EXPECT_EQ(allocated(a), static_cast<std::int64_t>(10 * MiB));
  a.validate();
  a.deallocate(p);
  a.deallocate(q);
  a.validate();
}

TEST(Policy, TwentyFiveMiBReservesTwentySixMiB) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(25 * MiB);
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(26 * MiB));
  // The 1 MiB remainder is not split off (a large split needs more than 1 MiB).
  EXPECT_EQ(allocated(a), static_cast<std::int64_t>(26 * MiB));
  EXPECT_EQ(a.stats().requested_bytes[kAll].current, static_cast<std::int64_t>(25 * MiB));
  a.deallocate(p);
  a.validate();
}

TEST(Policy, LargeBlocksSplitOnlyWhenMoreThanOneMiBRemains) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(19 * MiB + 512 * KiB);  // 20 MiB segment, 512 KiB would remain
  EXPECT_EQ(allocated(a), static_cast<std::int64_t>(20 * MiB));
  a.deallocate(p);
  void* q = a.allocate(18 * MiB);  // 2 MiB would remain: split
  EXPECT_EQ(allocated(a), static_cast<std::int64_t>(18 * MiB));
  EXPECT_EQ(a.stats().inactive_split_bytes[kLarge].current, static_cast<std::int64_t>(2 * MiB));
  a.deallocate(q);
  a.validate();
}

TEST(Policy, SmallBlocksSplitDownTo512Bytes) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(MiB);  // 1 MiB: small pool, 2 MiB segment
  void* q = a.allocate(MiB - 512);
  void* r = a.allocate(512);  // exactly fills the segment
  EXPECT_EQ(a.stats().segment[kAll].current, 1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r) - reinterpret_cast<std::uintptr_t>(p),
            2 * MiB - 512);
  EXPECT_EQ(a.stats().inactive_split[kSmall].current, 0);
  a.deallocate(p);
  a.deallocate(q);
  a.deallocate(r);
  a.validate();
}

TEST(Policy, BestFitPicksTheSmallestThenLowestAddress) {
  CachingAllocator a{small_device()};
  // Carve one small segment into free holes of 4 KiB, 2 KiB and 2 KiB.
  void* h1 = a.allocate(4 * KiB);
  void* k1 = a.allocate(512);
  void* h2 = a.allocate(2 * KiB);
  void* k2 = a.allocate(512);
  void* h3 = a.allocate(2 * KiB);
  void* k3 = a.allocate(512);
  a.deallocate(h1);
  a.deallocate(h3);
  a.deallocate(h2);
  // 2 KiB fits the two 2 KiB holes best; the lower address wins.
  EXPECT_EQ(a.allocate(2 * KiB), h2);
  EXPECT_EQ(a.allocate(2 * KiB), h3);
  // 3 KiB takes the 4 KiB hole and splits it.
  EXPECT_EQ(a.allocate(3 * KiB), h1);
  a.validate();
  (void)k1, (void)k2, (void)k3;
}

TEST(Policy, FreeingNeighboursCoalesces) {
  CachingAllocator a{small_device()};
  void* x = a.allocate(64 * KiB);
  void* y = a.allocate(64 * KiB);
  void* z = a.allocate(64 * KiB);
  a.deallocate(x);
  a.deallocate(z);
  // x is an inactive split block; z merged with the tail remainder.
  EXPECT_EQ(a.stats().inactive_split[kSmall].current, 2);
  a.deallocate(y);  // merges x, y and the tail into one 2 MiB block
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.inactive_split[kSmall].current, 0);
  EXPECT_EQ(s.inactive_split_bytes[kSmall].current, 0);
  const auto segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  ASSERT_EQ(segs[0].blocks.size(), 1u);
  EXPECT_EQ(segs[0].blocks[0].size, 2 * MiB);
  a.validate();
}

TEST(Policy, OversizeBlocksAreNeverSplit) {
  CachingAllocator a{small_device(), AllocatorConfig::parse("max_split_size_mb:32")};
  void* big = a.allocate(40 * MiB);
  a.deallocate(big);
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(40 * MiB));
  // A small-for-the-pool request must not take the oversize block.
  void* mid = a.allocate(12 * MiB);
  EXPECT_NE(mid, big);
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(52 * MiB));
  // An oversize request reuses it whole when less than 20 MiB is wasted.
  void* again = a.allocate(35 * MiB);
  EXPECT_EQ(again, big);
  EXPECT_EQ(a.block_size(again), 40 * MiB);
  EXPECT_EQ(a.stats().oversize_allocations.current, 1);
  EXPECT_EQ(a.stats().oversize_segments.current, 1);
  a.deallocate(again);
  // ... but not when 20 MiB or more would be wasted.
  void* small_oversize = a.allocate(33 * MiB - 20 * MiB + 8 * MiB);  // 21 MiB: not oversize
  EXPECT_NE(small_oversize, big);
  a.deallocate(small_oversize);
  a.deallocate(mid);
  a.validate();
}

TEST(Policy, OversizeRequestDoesNotTakeAMuchLargerBlock) {
  CachingAllocator a{small_device(), AllocatorConfig::parse("max_split_size_mb:32")};
  void* huge = a.allocate(80 * MiB);
  a.deallocate(huge);
  void* p = a.allocate(50 * MiB);  // 80 >= 50 + 20: a new 50 MiB segment
  EXPECT_NE(p, huge);
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(130 * MiB));
  a.deallocate(p);
  a.validate();
}

TEST(Policy, EmptyCacheReturnsOnlyWholeFreeSegments) {
  CachingAllocator a{small_device()};
  void* keep = a.allocate(KiB);      // pins its small segment
  void* drop = a.allocate(5 * MiB);  // its 20 MiB segment becomes whole on free
  a.deallocate(drop);
  a.empty_cache();
  EXPECT_EQ(reserved(a), static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(a.stats().num_device_free, 1);
  a.deallocate(keep);
  a.empty_cache();
  EXPECT_EQ(reserved(a), 0);
  a.validate();
}

TEST(Policy, DeviceViewRoundsSegmentsToGranularityPlusContext) {
  auto dev = small_device(GiB, 300 * MiB);
  CachingAllocator a{dev};
  EXPECT_EQ(a.stats().device_used_bytes.current, static_cast<std::int64_t>(300 * MiB));
  void* p = a.allocate(KiB);
  EXPECT_EQ(a.stats().device_used_bytes.current, static_cast<std::int64_t>(302 * MiB));
  EXPECT_EQ(dev->process_used_bytes(), 302 * MiB);
  // A reserved segment of an odd size still costs whole 2 MiB pages on the device.
  a.reserve_segment(3 * MiB, 0, false);
  EXPECT_EQ(a.stats().reserved_bytes[kAll].current, static_cast<std::int64_t>(5 * MiB));
  EXPECT_EQ(a.stats().device_used_bytes.current, static_cast<std::int64_t>(306 * MiB));
  a.deallocate(p);
  a.validate();
}

TEST(Policy, RestoredSegmentHoldsTheLayoutGivenWhateverTheSettings) {
  // max_split_size_mb:20 would never split this 64 MiB segment for a small request; restored,
  // it holds three live blocks at their recorded offsets anyway, the gaps free and split.
  CachingAllocator a{small_device(GiB, 0), AllocatorConfig::parse("max_split_size_mb:20")};
  using R = CachingAllocator::RestoredBlock;
  const std::vector<void*> ptrs = a.restore_segment(
      64 * MiB, 0, false, {R{2 * MiB, 4 * MiB, 4 * MiB - 100}, R{6 * MiB, MiB, 0}, R{40 * MiB, 24 * MiB, 0}});
  a.validate();
  ASSERT_EQ(ptrs.size(), 3u);
  const auto segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  const std::uintptr_t base = segs[0].address;
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ptrs[0]), base + 2 * MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ptrs[2]), base + 40 * MiB);
  std::vector<std::pair<std::size_t, BlockState>> layout;
  for (const BlockInfo& b : segs[0].blocks) layout.emplace_back(b.size, b.state);
  EXPECT_EQ(layout, (std::vector<std::pair<std::size_t, BlockState>>{
                        {2 * MiB, BlockState::Inactive}, {4 * MiB, BlockState::ActiveAllocated},
                        {MiB, BlockState::ActiveAllocated}, {33 * MiB, BlockState::Inactive},
                        {24 * MiB, BlockState::ActiveAllocated}}));
  const DeviceStats st = a.stats();
  EXPECT_EQ(st.allocated_bytes[kAll].current, static_cast<std::int64_t>(29 * MiB));
  EXPECT_EQ(st.requested_bytes[kAll].current, static_cast<std::int64_t>(29 * MiB - 100));
  EXPECT_EQ(st.inactive_split[kAll].current, 2);
  EXPECT_EQ(st.inactive_split_bytes[kAll].current, static_cast<std::int64_t>(35 * MiB));
  EXPECT_EQ(a.largest_free_block(), 33 * MiB);
  // The blocks are ordinary blocks from here on: freed, they coalesce back into one segment.
  for (void* p : ptrs) a.deallocate(p);
  a.validate();
  ASSERT_EQ(a.segments()[0].blocks.size(), 1u);
  a.empty_cache();
  EXPECT_EQ(reserved(a), 0);
}

TEST(Policy, SegmentsListBlocksWithStatesAndRequestedSizes) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(1000);
  const auto segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_TRUE(segs[0].small_pool);
  EXPECT_EQ(segs[0].total_size, 2 * MiB);
  EXPECT_EQ(segs[0].allocated_size, 1024u);
  EXPECT_EQ(segs[0].requested_size, 1000u);
  ASSERT_EQ(segs[0].blocks.size(), 2u);
  EXPECT_EQ(segs[0].blocks[0].state, BlockState::ActiveAllocated);
  EXPECT_EQ(segs[0].blocks[0].requested_size, 1000u);
  EXPECT_EQ(segs[0].blocks[1].state, BlockState::Inactive);
  EXPECT_EQ(segs[0].blocks[1].size, 2 * MiB - 1024);
  a.deallocate(p);
}

TEST(Stats, PeaksAndAccumulatedCountsReset) {
  CachingAllocator a{small_device()};
  void* p = a.allocate(4 * MiB);
  void* q = a.allocate(4 * MiB);
  a.deallocate(p);
  DeviceStats s = a.stats();
  EXPECT_EQ(s.allocated_bytes[kAll].peak, static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(s.allocated_bytes[kAll].allocated, static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(s.allocated_bytes[kAll].freed, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(s.allocation[kLarge].allocated, 2);
  a.reset_peak_stats();
  EXPECT_EQ(a.stats().allocated_bytes[kAll].peak, static_cast<std::int64_t>(4 * MiB));
  a.reset_accumulated_stats();
  s = a.stats();
  EXPECT_EQ(s.allocated_bytes[kAll].allocated, 0);
  EXPECT_EQ(s.allocated_bytes[kAll].freed, 0);
  EXPECT_EQ(s.num_device_alloc, 0);
  EXPECT_EQ(s.allocated_bytes[kAll].current, static_cast<std::int64_t>(4 * MiB));
  a.deallocate(q);
  a.validate();
}

}  // namespace
}  // namespace mem
