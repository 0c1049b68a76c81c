// bad_input_test.cpp — misuse of the allocator's API. Each case must get a
// clear mem::Error naming the pointer or value (or be a documented no-op), and
// leave the allocator exactly as it was: same statistics, same segments and
// blocks, same device figures, and validate() clean.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "test_device.hpp"

namespace mem {
namespace {

using testing::small_device;

/// Everything observable about an allocator, as one comparable string.
std::string observable_state(const CachingAllocator& a) {
  std::ostringstream out;
  for (const SegmentInfo& seg : a.segments()) {
    out << "segment " << seg.address << ' ' << seg.total_size << ' ' << seg.stream << ' '
        << seg.small_pool << '\n';
    for (const BlockInfo& b : seg.blocks) {
      out << "  block " << b.address << ' ' << b.size << ' ' << b.requested_size << ' '
          << block_state_name(b.state) << '\n';
    }
  }
  const DeviceMemInfo info = a.device().mem_get_info();
  out << "device free " << info.free_bytes << " used " << a.device().process_used_bytes() << '\n';
  return out.str();
}

/// Runs `misuse`, which must throw mem::Error whose message contains every
/// string in `mentions`, and checks that nothing observable changed.
void expect_rejected_unchanged(CachingAllocator& a, const std::function<void()>& misuse,
                               std::initializer_list<std::string> mentions) {
  const DeviceStats stats_before = a.stats();
  const std::string state_before = observable_state(a);
  try {
    misuse();
    ADD_FAILURE() << "misuse was accepted";
  } catch (const Error& e) {
    for (const std::string& m : mentions) {
      EXPECT_NE(std::string(e.what()).find(m), std::string::npos)
          << "message lacks \"" << m << "\": " << e.what();
    }
  }
  DeviceStats stats_after = a.stats();
  stats_after.driver_time_us = stats_before.driver_time_us;
  EXPECT_EQ(stats_after, stats_before);
  EXPECT_EQ(observable_state(a), state_before);
  EXPECT_NO_THROW(a.validate());
}

std::string hex(const void* p) {
  std::ostringstream out;
  out << "0x" << std::hex << reinterpret_cast<std::uintptr_t>(p);
  return out.str();
}

/// An allocator with some live, cached and split blocks in both pools.
struct Populated {
  std::shared_ptr<SimDevice> device = small_device();
  CachingAllocator alloc{device};
  void* small = alloc.allocate(KiB);
  void* large = alloc.allocate(4 * MiB);
  void* freed_small = alloc.allocate(3 * KiB);
  void* freed_large = alloc.allocate(2 * MiB);
  Populated() {
    alloc.deallocate(freed_small);
    alloc.deallocate(freed_large);
  }
  ~Populated() {
    alloc.deallocate(small);
    alloc.deallocate(large);
  }
};

TEST(BadInput, DoubleFreeNamesThePointer) {
  Populated p;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(p.freed_small); },
                            {hex(p.freed_small), "double free"});
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(p.freed_large); },
                            {hex(p.freed_large), "double free"});
}

TEST(BadInput, PointerNeverAllocated) {
  Populated p;
  int on_stack = 0;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(&on_stack); },
                            {hex(&on_stack), "none of this allocator's segments"});
  // nullptr is not misuse: PyTorch's free() returns at once, and so do we.
  const DeviceStats before = p.alloc.stats();
  EXPECT_NO_THROW(p.alloc.deallocate(nullptr));
  EXPECT_EQ(p.alloc.stats(), before);
  // Inside a segment but in cached memory nobody was handed.
  const SegmentInfo seg = p.alloc.segments().front();
  void* cached_tail = reinterpret_cast<void*>(seg.blocks.back().address + 4 * KiB);
  ASSERT_EQ(seg.blocks.back().state, BlockState::Inactive);
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(cached_tail); },
                            {hex(cached_tail), "inside", "free block"});
}

TEST(BadInput, InteriorPointerNamesItsBlock) {
  Populated p;
  void* interior = static_cast<char*>(p.large) + 512;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(interior); },
                            {hex(interior), "512 B inside", "live block at " + hex(p.large)});
  void* last_byte = static_cast<char*>(p.small) + p.alloc.block_size(p.small) - 1;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(last_byte); }, {hex(last_byte)});
}

TEST(BadInput, PointerOfAnotherAllocatorOnTheSameDevice) {
  Populated p;
  CachingAllocator other{p.device};
  void* theirs = other.allocate(KiB);
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(theirs); },
                            {hex(theirs), "another allocator"});
  // ...and the other allocator is untouched by the attempt, too.
  EXPECT_EQ(other.stats().allocation[0].current, 1);
  other.deallocate(theirs);
  other.validate();
}

TEST(BadInput, PointerOfAnotherDevice) {
  Populated p;
  CachingAllocator other{small_device()};
  void* theirs = other.allocate(8 * MiB);
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.deallocate(theirs); }, {hex(theirs)});
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.record_stream(theirs, 0); }, {hex(theirs)});
  other.deallocate(theirs);
}

TEST(BadInput, ZeroSizeIsRejected) {
  Populated p;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.allocate(0); }, {"allocate(0)"});
}

TEST(BadInput, SizesNearTheTopOfSizeTAreRejectedWithoutOverflow) {
  Populated p;
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  for (std::size_t size : {kMax, kMax - 1, kMax - 511, kMax - 512, kMax / 2 + 1,
                           std::size_t{1} << 63, kMaxRequestSize + 1}) {
    expect_rejected_unchanged(p.alloc, [&] { p.alloc.allocate(size); },
                              {std::to_string(size), "1 PiB"});
  }
  // The rounding function itself saturates instead of wrapping to a small size.
  const AllocatorConfig with_divisions = AllocatorConfig::parse("roundup_power2_divisions:4");
  for (const AllocatorConfig& cfg : {AllocatorConfig{}, with_divisions}) {
    EXPECT_EQ(round_size(kMax, cfg), kMax);
    EXPECT_EQ(round_size(kMax - 511, cfg), kMax);
    EXPECT_EQ(round_size(kMaxRequestSize + 1, cfg), kMax);
    EXPECT_GE(round_size(kMaxRequestSize, cfg), kMaxRequestSize);
  }
}

TEST(BadInput, LargestAcceptedSizeIsAnOutOfMemoryNotMisuse) {
  Populated p;
  const DeviceStats before = p.alloc.stats();
  EXPECT_THROW(p.alloc.allocate(kMaxRequestSize), OutOfMemoryError);
  p.alloc.validate();
  EXPECT_EQ(p.alloc.stats().allocated_bytes[0].current, before.allocated_bytes[0].current);
  EXPECT_EQ(p.alloc.stats().num_ooms, before.num_ooms + 1);
}

TEST(BadInput, RecordStreamOnAFreedPointer) {
  Populated p;
  const StreamId side = p.device->create_stream();
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.record_stream(p.freed_large, side); },
                            {"record_stream", hex(p.freed_large), "double free"});
  void* interior = static_cast<char*>(p.large) + MiB;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.record_stream(interior, side); },
                            {"record_stream", hex(interior), "inside"});
}

TEST(BadInput, RecordStreamOnAStreamTheDeviceDoesNotHave) {
  Populated p;
  const StreamId destroyed = p.device->create_stream();
  p.device->destroy_stream(destroyed);
  for (StreamId stream : {destroyed, StreamId{12345}}) {
    expect_rejected_unchanged(p.alloc, [&] { p.alloc.record_stream(p.large, stream); },
                              {"record_stream", "stream " + std::to_string(stream)});
  }
  // The block was not marked as used there: freeing it needs no event and reuses at once.
  p.alloc.deallocate(p.large);
  EXPECT_EQ(p.alloc.stats().allocation[0].current, 1);
  p.large = p.alloc.allocate(4 * MiB);
  p.alloc.validate();
}

TEST(BadInput, AllocateOnAStreamTheDeviceDoesNotHave) {
  Populated p;
  const StreamId destroyed = p.device->create_stream();
  p.device->destroy_stream(destroyed);
  for (StreamId stream : {destroyed, StreamId{12345}}) {
    for (std::size_t size : {std::size_t{512}, 4 * MiB, 64 * MiB}) {
      expect_rejected_unchanged(p.alloc, [&] { p.alloc.allocate(size, stream); },
                                {"allocate(" + std::to_string(size) + " B)",
                                 "stream " + std::to_string(stream), "never created"});
    }
  }
  // A created stream gets its own segment as before.
  const StreamId side = p.device->create_stream();
  void* ptr = p.alloc.allocate(512, side);
  p.alloc.validate();
  p.alloc.deallocate(ptr);
}

TEST(BadInput, StreamDestroyedAfterRecordStreamStillLetsTheBlockBeFreed) {
  // No event can be recorded on a destroyed stream: the free waits for the device
  // instead, and the block is reusable at once rather than stuck forever.
  Populated p;
  const StreamId side = p.device->create_stream();
  const StreamId alive = p.device->create_stream();
  p.alloc.record_stream(p.large, side);
  p.alloc.record_stream(p.large, alive);
  p.device->destroy_stream(side);
  p.device->hold_events(true);
  p.alloc.deallocate(p.large);
  p.alloc.validate();
  EXPECT_EQ(p.alloc.stats().active_bytes[0].current,
            static_cast<std::int64_t>(KiB + 4 * MiB));  // waits for `alive` only
  p.device->release_events();
  void* again = p.alloc.allocate(4 * MiB);
  EXPECT_EQ(again, p.large);
  p.large = again;

  // Used only on a stream destroyed since: nothing to wait for once the device synced.
  const StreamId gone = p.device->create_stream();
  p.alloc.record_stream(p.large, gone);
  p.device->destroy_stream(gone);
  p.alloc.deallocate(p.large);
  p.alloc.validate();
  EXPECT_EQ(p.alloc.stats().active_bytes[0].current, static_cast<std::int64_t>(KiB));
  p.large = p.alloc.allocate(4 * MiB);
  EXPECT_EQ(p.large, again);
  p.device->hold_events(false);
}

TEST(BadInput, BlockSizeOfAnUnknownPointer) {
  Populated p;
  expect_rejected_unchanged(p.alloc, [&] { (void)p.alloc.block_size(p.freed_small); },
                            {"block_size", hex(p.freed_small)});
}

TEST(BadInput, MemoryFractionOutsideZeroToOne) {
  Populated p;
  for (double f : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN(),
                   std::numeric_limits<double>::infinity()}) {
    expect_rejected_unchanged(p.alloc, [&] { p.alloc.set_memory_fraction(f); },
                              {"set_memory_fraction"});
  }
}

TEST(BadInput, ReserveSegmentOfAnUnalignedOrAbsurdSize) {
  Populated p;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1000}, kMaxRequestSize + 512}) {
    expect_rejected_unchanged(p.alloc, [&] { p.alloc.reserve_segment(bytes, 0, false); },
                              {"reserve_segment"});
  }
}

TEST(BadInput, RestoredSegmentWithABadLayout) {
  Populated p;
  using R = CachingAllocator::RestoredBlock;
  const std::vector<std::vector<R>> layouts = {
      {R{0, 1000, 0}},                     // not a multiple of 512
      {R{512, 1024, 0}, R{1024, 512, 0}},  // overlapping
      {R{2 * MiB - 512, 1024, 0}},         // past the end
      {R{0, 1024, 2048}},                  // requested more than the block
      {R{0, 0, 0}},                        // empty
  };
  for (const auto& live : layouts) {
    expect_rejected_unchanged(p.alloc, [&] { p.alloc.restore_segment(2 * MiB, 0, true, live); }, {"restore_segment"});
  }
}

TEST(BadInput, NullDeviceObserverAndRing) {
  EXPECT_THROW(CachingAllocator(nullptr), Error);
  Populated p;
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.add_observer(nullptr); }, {"add_observer"});
  expect_rejected_unchanged(p.alloc, [&] { p.alloc.attach_ring(nullptr); }, {"attach_ring"});
  EXPECT_THROW(EventRing(0, true), Error);
}

TEST(BadInput, MalformedConfigStringsNameTheProblem) {
  struct Case {
    const char* conf;
    const char* mention;
  };
  for (const Case& c : std::initializer_list<Case>{
           {"max_split_size_mb", "max_split_size_mb"},
           {"max_split_size_mb:", "max_split_size_mb"},
           {"max_split_size_mb:-5", "-5"},
           {"max_split_size_mb:abc", "abc"},
           {"max_split_size_mb:99999999999999999999999", "99999999999999999999999"},
           {"roundup_power2_divisions:3", "3"},
           {"roundup_power2_divisions:[256:1", "roundup_power2_divisions"},
           {"garbage_collection_threshold:1.5", "1.5"},
           {"garbage_collection_threshold:nan", "nan"},
           {"expandable_segments:Yes", "Yes"},
           {"backend:cudaMallocAsync", "cudaMallocAsync"},
           {"no_such_key:1", "no_such_key"},
           {"max_split_size_mb:128,max_split_size_mb:256", "max_split_size_mb"},
       }) {
    try {
      (void)AllocatorConfig::parse(c.conf);
      ADD_FAILURE() << "accepted \"" << c.conf << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.mention), std::string::npos)
          << c.conf << " -> " << e.what();
    }
  }
}

TEST(BadInput, UnknownDeviceStringsListTheValidForms) {
  for (const char* spec : {"", "gpu", "sim:", "sim:no-such-card", "cuda:x", "sim:capacity=abc",
                           "sim:a100-80g,capacity", "cuda:-1"}) {
    try {
      (void)make_device(spec);
      ADD_FAILURE() << "accepted \"" << spec << "\"";
    } catch (const Error& e) {
      EXPECT_GT(std::string(e.what()).size(), 20u) << spec;
    }
  }
}

}  // namespace
}  // namespace mem

namespace mem {
namespace {

// Messages quote the user's files; a hostile byte is written as \xNN (issue 36: a NUL cut
// the message, control characters reached the terminal). UTF-8 text stays as it is.
TEST(Printable, EscapesWhatATerminalWouldActOnAndKeepsUtf8) {
  using namespace std::string_literals;
  EXPECT_EQ(printable("plain text, tab\tand newline\n"), "plain text, tab\tand newline\n");
  EXPECT_EQ(printable("a\0b"s), "a\\x00b");
  EXPECT_EQ(printable("\x1b[31mred\x7f"), "\\x1B[31mred\\x7F");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(printable("\xff\xc3"), "\\xFF\\xC3");                   // not UTF-8, truncated
  EXPECT_EQ(printable("\xc0\xaf"), "\\xC0\\xAF");                   // overlong '/'
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xED\\xA0\\x80");          // a surrogate
  const Error e("name 'x\0\x1b]0;owned\x07'"s);
  EXPECT_STREQ(e.what(), "name 'x\\x00\\x1B]0;owned\\x07'");
}

}  // namespace
}  // namespace mem
