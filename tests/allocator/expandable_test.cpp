// expandable_test.cpp — expandable_segments:True with exact byte counts: pages mapped as
// segments grow (2 MiB small, 20 MiB large), contiguous growth, best fit by expandable
// size, unmapping whole free pages, the events, statistics and out of memory, as
// PyTorch's ExpandableSegment policy (c10/cuda/CUDACachingAllocator.cpp) dictates.
#include <gtest/gtest.h>

#include <vector>

#include "test_device.hpp"
#include "vramscope/allocator/observer.hpp"

namespace mem {
namespace {

using testing::small_device;

AllocatorConfig expandable(const std::string& more = {}) {
  return AllocatorConfig::parse("expandable_segments:True" + (more.empty() ? "" : "," + more));
}

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

struct Recorder final : AllocatorObserver {
  void on_event(const TraceEvent& e) noexcept override {
    if (e.action == TraceAction::SegmentMap || e.action == TraceAction::SegmentUnmap) events.push_back(e);
  }
  std::vector<TraceEvent> events;
};

TEST(Expandable, SmallRequestMapsOneTwoMiBPage) {
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  Recorder rec;
  a.add_observer(&rec);
  void* p = a.allocate(KiB);
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.reserved_bytes[1].current, static_cast<std::int64_t>(2 * MiB));  // the small pool
  EXPECT_EQ(s.segment[0].current, 0);  // no cudaMalloc segment
  EXPECT_EQ(s.num_device_alloc, 1);
  EXPECT_EQ(s.device_used_bytes.current, static_cast<std::int64_t>(2 * MiB));
  ASSERT_EQ(rec.events.size(), 1u);
  EXPECT_EQ(rec.events[0].action, TraceAction::SegmentMap);
  EXPECT_EQ(rec.events[0].address, addr(p));
  EXPECT_EQ(rec.events[0].size, 2 * MiB);
  const std::vector<SegmentInfo> segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_TRUE(segs[0].expandable);
  EXPECT_EQ(segs[0].total_size, 2 * MiB);
  ASSERT_EQ(segs[0].blocks.size(), 2u);
  EXPECT_EQ(segs[0].blocks[0].size, KiB);
  EXPECT_EQ(segs[0].blocks[1].size, 2 * MiB - KiB);
  EXPECT_EQ(dev->address_ranges(), 1u);
  a.remove_observer(&rec);
  a.deallocate(p);
  a.validate();
}

TEST(Expandable, LargeSegmentGrowsInPlaceWhereCudaMallocWouldAddASegment) {
  CachingAllocator a{small_device(), expandable()};
  void* p = a.allocate(5 * MiB);   // maps one 20 MiB page: [5 live][15 free]
  void* q = a.allocate(30 * MiB);  // the free 15 MiB plus one more page: no new segment
  EXPECT_EQ(addr(q), addr(p) + 5 * MiB);
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(40 * MiB));
  EXPECT_EQ(s.num_device_alloc, 2);
  const std::vector<SegmentInfo> segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);  // one contiguous mapped range
  ASSERT_EQ(segs[0].blocks.size(), 3u);
  EXPECT_EQ(segs[0].blocks[2].size, 5 * MiB);
  EXPECT_EQ(segs[0].blocks[2].state, BlockState::Inactive);
  EXPECT_EQ(s.inactive_split[0].current, 0);  // PyTorch leaves expandable blocks out
  a.validate();

  // The default policy needs a second segment for the same two requests.
  CachingAllocator plain{small_device()};
  void* x = plain.allocate(5 * MiB);
  void* y = plain.allocate(30 * MiB);
  EXPECT_EQ(plain.stats().reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB + 30 * MiB));
  plain.deallocate(x);
  plain.deallocate(y);
  a.deallocate(p);
  a.deallocate(q);
}

TEST(Expandable, EmptyCacheUnmapsOnlyWholeFreePages) {
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  Recorder rec;
  a.add_observer(&rec);
  void* p = a.allocate(5 * MiB);
  void* q = a.allocate(30 * MiB);  // [5 p][30 q][5 free] over two 20 MiB pages
  a.deallocate(p);
  a.empty_cache();  // free [0, 5) and [35, 40): no whole page
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(40 * MiB));
  a.deallocate(q);  // all 40 MiB free, one block
  a.empty_cache();
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.num_device_free, 1);
  EXPECT_EQ(dev->used_bytes(), 0u);
  EXPECT_EQ(dev->address_ranges(), 0u);  // the whole segment unmapped: its addresses go back
  ASSERT_EQ(rec.events.size(), 3u);
  EXPECT_EQ(rec.events[2].action, TraceAction::SegmentUnmap);
  EXPECT_EQ(rec.events[2].address, addr(p));
  EXPECT_EQ(rec.events[2].size, 40 * MiB);
  a.remove_observer(&rec);
  a.validate();
}

TEST(Expandable, UnmapKeepsPartPagesMappedAsFreeBlocks) {
  CachingAllocator a{small_device(), expandable()};
  void* p = a.allocate(5 * MiB);
  void* q = a.allocate(30 * MiB);
  void* r = a.allocate(5 * MiB);   // the last 5 MiB: [5 p][30 q][5 r]
  a.deallocate(q);                 // free [5, 35): pages are [0,20) and [20,40)
  a.empty_cache();                 // no whole page inside [5, 35)
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(40 * MiB));
  a.deallocate(p);                 // free [0, 35): the page [0, 20) is whole
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB));
  const std::vector<SegmentInfo> segs = a.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].address, addr(p) + 20 * MiB);  // [15 free][5 r] in the second page
  ASSERT_EQ(segs[0].blocks.size(), 2u);
  EXPECT_EQ(segs[0].blocks[0].size, 15 * MiB);
  EXPECT_EQ(addr(r), addr(p) + 35 * MiB);
  a.validate();
  // Growing again maps the first page back in front of the free block.
  void* big = a.allocate(30 * MiB);
  EXPECT_EQ(addr(big), addr(p));  // the lowest unmapped space that fits: [0,20) + the free 15 MiB
  a.validate();
  a.deallocate(big);
  a.deallocate(r);
}

TEST(Expandable, BestFitPassesOverABlockThatCanGrow) {
  CachingAllocator a{small_device(), expandable()};
  void* x = a.allocate(3 * MiB);   // [0, 3)
  void* y = a.allocate(2 * MiB);   // [3, 5)
  void* z = a.allocate(13 * MiB);  // [5, 18); [18, 20) stays free before the unmapped space
  a.deallocate(x);                 // free 3 MiB at 0, inside the mapped range
  // Plain best fit would take the 2 MiB block at 18 MiB; its expandable size counts the
  // unmapped space after it, so the 3 MiB block is taken (PyTorch's get_free_block).
  void* w = a.allocate(2 * MiB - 512 * KiB);
  EXPECT_EQ(addr(w), addr(x));
  a.validate();
  for (void* p : {y, z, w}) a.deallocate(p);
}

TEST(Expandable, SmallPoolPagesFillBeforeTheNextIsMapped) {
  CachingAllocator a{small_device(), expandable()};
  void* p = a.allocate(MiB);
  void* q = a.allocate(MiB);  // the rest of the first page
  void* r = a.allocate(MiB);  // maps the next page, right after it
  EXPECT_EQ(addr(q), addr(p) + MiB);
  EXPECT_EQ(addr(r), addr(p) + 2 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(a.stats().num_device_alloc, 2);
  for (void* b : {p, q, r}) a.deallocate(b);
  a.validate();
}

TEST(Expandable, StreamsAndPoolsHaveSegmentsOfTheirOwn) {
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  const StreamId s1 = dev->create_stream();
  void* p = a.allocate(MiB);
  void* q = a.allocate(5 * MiB);
  void* r = a.allocate(5 * MiB, s1);
  EXPECT_EQ(dev->address_ranges(), 3u);
  EXPECT_EQ(a.segments().size(), 3u);
  for (void* b : {p, q, r}) a.deallocate(b);
  a.empty_cache();
  EXPECT_EQ(dev->address_ranges(), 0u);
  a.validate();
}

TEST(Expandable, OutOfMemoryLeavesTheAllocatorConsistent) {
  auto dev = small_device(64 * MiB);
  CachingAllocator a{dev, expandable()};
  void* p = a.allocate(50 * MiB);  // three 20 MiB pages
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(60 * MiB));
  try {
    (void)a.allocate(30 * MiB);  // 10 MiB free + one more page would pass 64 MiB
    FAIL() << "no out-of-memory error";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.figures().requested, 30 * MiB);
    EXPECT_EQ(e.figures().reserved, 60 * MiB);
  }
  a.validate();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(60 * MiB));
  void* q = a.allocate(10 * MiB);  // the free tail still serves
  EXPECT_EQ(addr(q), addr(p) + 50 * MiB);
  a.deallocate(p);
  a.deallocate(q);
  a.empty_cache();
  EXPECT_EQ(dev->used_bytes(), 0u);
  a.validate();
}

TEST(Expandable, AFailedMultiPageMapReleasesThePagesItMapped) {
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  dev->fail_nth_allocation(2);  // the second page of three
  // The first try maps one page and fails; the cache holds nothing to free; the retry maps all three.
  void* p = a.allocate(50 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(60 * MiB));
  EXPECT_EQ(a.stats().num_alloc_retries, 1);
  EXPECT_EQ(dev->used_bytes(), 60 * MiB);
  a.validate();
  a.deallocate(p);
}

TEST(Expandable, MemoryFractionCountsTheSegmentSizeOfTheRequest) {
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  a.set_memory_fraction(40.0 / 1024);  // 40 MiB of 1 GiB
  void* p = a.allocate(15 * MiB);      // one 20 MiB page; 20 + 15 MiB asked next fits
  void* q = a.allocate(15 * MiB);      // maps a second page: 40 MiB reserved
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(40 * MiB));
  // A 5 MiB request fits the free 10 MiB, so no check applies; a 12 MiB one needs a page.
  void* r = a.allocate(5 * MiB);
  EXPECT_THROW((void)a.allocate(12 * MiB), OutOfMemoryError);
  for (void* b : {p, q, r}) a.deallocate(b);
  a.validate();
}

TEST(Expandable, PlainAndExpandableSegmentsCoexist) {
  // A restored cudaMalloc segment (a recording made without expandable segments) and a
  // restored mapped range of an expandable segment side by side.
  auto dev = small_device();
  CachingAllocator a{dev, expandable()};
  const std::vector<void*> plain = a.restore_segment(20 * MiB, 0, false, {{0, 4 * MiB, 0}});
  const std::uintptr_t base = a.expandable_segment_base(0, false);
  const std::vector<void*> mapped = a.restore_expandable(40 * MiB, 40 * MiB, 0, false, {{MiB, 2 * MiB, 0}});
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(addr(mapped[0]), base + 41 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(60 * MiB));
  EXPECT_EQ(a.stats().segment[0].current, 1);
  a.validate();
  const std::vector<SegmentInfo> segs = a.segments();
  ASSERT_EQ(segs.size(), 2u);
  // A range that is not whole pages, or is mapped already, is refused and changes nothing.
  EXPECT_THROW((void)a.restore_expandable(MiB, 20 * MiB, 0, false, {}), Error);
  EXPECT_THROW((void)a.restore_expandable(40 * MiB, 20 * MiB, 0, false, {}), Error);
  a.validate();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(60 * MiB));
  a.deallocate(plain[0]);
  a.deallocate(mapped[0]);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(dev->address_ranges(), 0u);
}

// Review finding: with max_split_size set, the release-and-retry path gave back an oversize
// free block that was only part of a segment (a restored recording's gap between live
// blocks): a cudaFree inside a segment, and a corrupt segment list. Only whole segments go.
TEST(Expandable, ReleaseAndRetryGivesBackOnlyWholeSegments) {
  auto dev = small_device(1100 * MiB);
  CachingAllocator a{dev, AllocatorConfig::parse("max_split_size_mb:128")};
  const std::vector<void*> live = a.restore_segment(GiB, 0, false, {{0, 512 * MiB, 0}});  // [512 live][512 free]
  EXPECT_THROW((void)a.allocate(100 * MiB), OutOfMemoryError);  // 1 GiB + 100 MiB > 1100 MiB
  a.validate();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(GiB));
  EXPECT_EQ(dev->used_bytes(), GiB);
  a.deallocate(live[0]);
  a.validate();
}

/// A device without virtual memory management (an old driver).
class NoVmDevice final : public Device {
 public:
  NoVmDevice() : inner_(small_device()) {}
  const DeviceInfo& info() const override { return inner_->info(); }
  void* allocate_segment(std::size_t b) override { return inner_->allocate_segment(b); }
  void free_segment(void* p, std::size_t b) noexcept override { inner_->free_segment(p, b); }
  DeviceMemInfo mem_get_info() const override { return inner_->mem_get_info(); }
  std::size_t process_used_bytes() const override { return inner_->process_used_bytes(); }
  StreamId create_stream() override { return inner_->create_stream(); }
  void destroy_stream(StreamId s) noexcept override { inner_->destroy_stream(s); }
  bool has_stream(StreamId s) const override { return inner_->has_stream(s); }
  EventId create_event() override { return inner_->create_event(); }
  void destroy_event(EventId e) noexcept override { inner_->destroy_event(e); }
  void record_event(EventId e, StreamId s) override { inner_->record_event(e, s); }
  bool query_event(EventId e) override { return inner_->query_event(e); }
  void synchronize_event(EventId e) override { inner_->synchronize_event(e); }
  void synchronize() override { inner_->synchronize(); }
  double driver_time_us() const override { return inner_->driver_time_us(); }

 private:
  std::shared_ptr<SimDevice> inner_;
};

TEST(Expandable, ADeviceWithoutVirtualMemoryIsRefusedByName) {
  try {
    CachingAllocator a{std::make_shared<NoVmDevice>(), expandable()};
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("virtual memory"), std::string::npos) << e.what();
  }
  CachingAllocator plain{std::make_shared<NoVmDevice>()};
  EXPECT_THROW((void)plain.expandable_segment_base(0, false), Error);
}

}  // namespace
}  // namespace mem
