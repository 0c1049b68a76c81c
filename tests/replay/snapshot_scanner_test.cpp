// snapshot_scanner_test.cpp — the fast path for snapshot pickles reads exactly what the
// generic reader reads (events, stacks, final segments, settings) on the real traces and
// on our own exports, and gives way to the generic reader (with its error messages) on
// anything else.
#include "snapshot_scanner.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}
fs::path temp_dir() { return fs::path{::testing::TempDir()}; }

void expect_same(const AllocationTrace& fast, const AllocationTrace& generic, const std::string& what) {
  ASSERT_EQ(fast.events.size(), generic.events.size()) << what;
  for (std::size_t i = 0; i < fast.events.size(); ++i) {
    const RecordedEvent& a = fast.events[i];
    const RecordedEvent& b = generic.events[i];
    ASSERT_TRUE(a.action == b.action && a.address == b.address && a.size == b.size && a.stream == b.stream &&
                a.time_us == b.time_us && a.stack == b.stack)
        << what << ": event " << i;
  }
  EXPECT_EQ(fast.stacks, generic.stacks) << what;
  ASSERT_EQ(fast.final_segments.size(), generic.final_segments.size()) << what;
  for (std::size_t i = 0; i < fast.final_segments.size(); ++i) {
    const RecordedSegment& a = fast.final_segments[i];
    const RecordedSegment& b = generic.final_segments[i];
    EXPECT_TRUE(a.address == b.address && a.total_size == b.total_size && a.stream == b.stream &&
                a.small_pool == b.small_pool && a.expandable == b.expandable && a.blocks.size() == b.blocks.size())
        << what << ": segment " << i;
    for (std::size_t k = 0; k < std::min(a.blocks.size(), b.blocks.size()); ++k) {
      const RecordedBlock& x = a.blocks[k];
      const RecordedBlock& y = b.blocks[k];
      EXPECT_TRUE(x.address == y.address && x.size == y.size && x.requested_size == y.requested_size &&
                  x.state == y.state)
          << what << ": segment " << i << " block " << k;
    }
  }
  EXPECT_EQ(fast.device, generic.device) << what;
  EXPECT_EQ(fast.allocator_conf, generic.allocator_conf) << what;
  EXPECT_EQ(fast.allocator_conf_known, generic.allocator_conf_known) << what;
  EXPECT_EQ(fast.expandable_segments, generic.expandable_segments) << what;
  EXPECT_EQ(fast.has_free_completed, generic.has_free_completed) << what;
}

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(SnapshotScanner, ReadsEveryRealTraceAsTheGenericReaderDoes) {
  const fs::path dir{VRAMSCOPE_REAL_TRACES_DIR};
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) GTEST_SKIP() << "no real traces in " << dir;
  std::size_t scanned = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".pickle") continue;
    const std::string path = entry.path().string();
    const std::string data = bytes_of(entry.path());
    const auto scan = detail::scan_snapshot(data);
    const PickleValue root = read_pickle(data);
    if (!root.is_dict()) {  // the older list of segments: the generic reader's
      EXPECT_FALSE(scan.has_value()) << path;
      continue;
    }
    ASSERT_TRUE(scan.has_value()) << path << ": the fast path gave up on a snapshot PyTorch wrote";
    ++scanned;
    const std::size_t gpus = scan->device_ranges.size();
    for (std::size_t d = 0; d < std::max<std::size_t>(gpus, 1); ++d) {
      if (gpus > 0 && scan->device_ranges[d].second == 0) continue;
      expect_same(read_pytorch_snapshot_file(path, static_cast<int>(d)),
                  read_pytorch_snapshot(root, static_cast<int>(d), path), path + " device " + std::to_string(d));
    }
    expect_same(read_pytorch_snapshot_file(path), read_pytorch_snapshot(root, -1, path), path + " busiest");
  }
  EXPECT_GE(scanned, 6u);
}

TEST(SnapshotScanner, ReadsOurOwnExportsAsTheGenericReaderDoes) {
  for (const char* conf : {"", "expandable_segments:True"}) {
    auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
    CachingAllocator alloc{device, AllocatorConfig::parse(conf)};
    History history{alloc, 10000};
    std::vector<void*> live;
    for (int i = 0; i < 300; ++i) {
      live.push_back(alloc.allocate(static_cast<std::size_t>(1 + (i * 7919) % (3 * MiB))));
      if (i % 3 == 2) {
        alloc.deallocate(live[live.size() / 2]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(live.size() / 2));
      }
    }
    alloc.empty_cache();
    const Snapshot snap = snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
    const std::string data = memory_snapshot_pickle(snap);
    ASSERT_TRUE(detail::scan_snapshot(data).has_value()) << conf;
    const fs::path file = temp_dir() / "scanner_own.pickle";
    std::ofstream(file, std::ios::binary) << data;
    const AllocationTrace fast = read_pytorch_snapshot_file(file.string());
    EXPECT_GT(fast.events.size(), 400u);
    expect_same(fast, read_pytorch_snapshot(read_pickle(data), -1, file.string()), conf);
    for (void* p : live) alloc.deallocate(p);
  }
}

// Protocol 4 bytes as Python's pickle writes them, by hand: {"segments": [], "device_traces": [[E]]}
// with E the given trace entry's items.
std::string snapshot_bytes(const std::string& entry_items) {
  std::string s = "\x80\x04}(";
  s += "\x8c\x08segments]";
  s += "\x8c\x0d" "device_traces](](}(" + entry_items + "ueeu.";
  return s;
}
std::string short_str(const std::string& text) { return std::string("\x8c") + static_cast<char>(text.size()) + text; }
/// BININT: a 4-byte little-endian int (a literal would stop at its first zero byte).
std::string binint(std::uint32_t v) {
  std::string s = "J";
  for (int k = 0; k < 4; ++k) s += static_cast<char>((v >> (8 * k)) & 0xff);
  return s;
}

TEST(SnapshotScanner, AHandWrittenSnapshotIsReadByTheFastPath) {
  const std::string data = snapshot_bytes(short_str("action") + short_str("alloc") + short_str("addr") + binint(0x1000) +
                                          short_str("size") + binint(512) + short_str("stream") + binint(0));
  const auto scan = detail::scan_snapshot(data);
  ASSERT_TRUE(scan.has_value());
  ASSERT_EQ(scan->events.size(), 1u);
  EXPECT_EQ(scan->events[0].action, RecordedAction::Alloc);
  EXPECT_EQ(scan->events[0].address, 0x1000u);
  EXPECT_EQ(scan->events[0].size, 512u);
  ASSERT_EQ(scan->device_ranges.size(), 1u);
  EXPECT_EQ(scan->device_ranges[0].second, 1u);
}

TEST(SnapshotScanner, WhatItDoesNotReadGoesToTheGenericReaderAndItsMessages) {
  // A trace entry without a size: the fast path gives way; the generic reader names it.
  const std::string no_size = snapshot_bytes(short_str("action") + short_str("alloc") + short_str("addr") + "K\x01");
  EXPECT_FALSE(detail::scan_snapshot(no_size).has_value());
  const fs::path file = temp_dir() / "scanner_bad.pickle";
  std::ofstream(file, std::ios::binary) << no_size;
  const std::string msg = error_of([&] { (void)read_pytorch_snapshot_file(file.string()); });
  EXPECT_NE(msg.find("device_traces[0][0]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("size"), std::string::npos) << msg;
  // An unknown action, an opcode the fast path does not know (a set), truncation.
  EXPECT_FALSE(detail::scan_snapshot(snapshot_bytes(short_str("action") + short_str("allocate") + short_str("addr") +
                                                    "K\x01" + short_str("size") + "K\x01"))
                   .has_value());
  EXPECT_FALSE(detail::scan_snapshot("\x80\x04\x8f.").has_value());
  // A memo key of 2^31 - 1 in a 9-byte file: given way at once, nothing grown.
  static const char far_memo[] = "\x80\x04N\x72\xff\xff\xff\x7f.";
  EXPECT_FALSE(detail::scan_snapshot(std::string(far_memo, sizeof far_memo - 1)).has_value());
  const std::string good = snapshot_bytes(short_str("action") + short_str("alloc") + short_str("addr") + "K\x01" +
                                          short_str("size") + "K\x01");
  ASSERT_TRUE(detail::scan_snapshot(good).has_value());
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_FALSE(detail::scan_snapshot(good.substr(0, cut)).has_value()) << cut;
  }
  // A trace entry shared twice through the memo is not what PyTorch writes: the generic reader's.
  std::string shared = "\x80\x04}(\x8c\x08segments]\x8c\x0d" "device_traces](](}\x94(" + short_str("action") +
                       short_str("alloc") + short_str("addr") + "K\x01" + short_str("size") + "K\x01uh\x00" "eeu.";
  EXPECT_FALSE(detail::scan_snapshot(shared).has_value());
}

// {"segments": [S], "device_traces": []} with S a large segment at 0x100000 of 2 MiB whose
// blocks are the given dicts' items.
std::string segment_bytes(const std::vector<std::string>& blocks) {
  std::string s = "\x80\x04}(" + short_str("segments") + "](}(" + short_str("address") + binint(0x100000) +
                  short_str("total_size") + binint(2 << 20) + short_str("stream") + binint(0) +
                  short_str("segment_type") + short_str("large") + short_str("blocks") + "](";
  for (const std::string& b : blocks) s += "}(" + b + "u";
  return s + "eue" + short_str("device_traces") + "]u.";
}

// A run that holds much is a snapshot of hundreds of thousands of blocks: the scanner reads
// them into structs, as read_segment reads them from the generic reader's values.
TEST(SnapshotScanner, ReadsSegmentsBlocksAsTheGenericReaderDoes) {
  const std::string size1m = short_str("size") + binint(1 << 20);
  const std::vector<std::string> blocks = {
      // no address: blocks tile the segment in order (older snapshots)
      size1m + short_str("state") + short_str("active_allocated") + short_str("requested_size") + binint(1000000),
      size1m + short_str("state") + short_str("inactive") + short_str("frames") + "](}(" + short_str("name") +
          short_str("f") + "ue",
  };
  const std::string tiled = segment_bytes(blocks);
  const auto scan = detail::scan_snapshot(tiled);
  ASSERT_TRUE(scan.has_value());
  ASSERT_EQ(scan->blocks.size(), 1u);
  EXPECT_EQ(scan->blocks.begin()->second.size(), 2u);
  const fs::path file = temp_dir() / "scanner_blocks.pickle";
  std::ofstream(file, std::ios::binary | std::ios::trunc) << tiled;
  const AllocationTrace fast = read_pytorch_snapshot_file(file.string());
  expect_same(fast, read_pytorch_snapshot(read_pickle(tiled), -1, file.string()), "tiled");
  ASSERT_EQ(fast.final_segments.size(), 1u);
  ASSERT_EQ(fast.final_segments[0].blocks.size(), 2u);
  EXPECT_EQ(fast.final_segments[0].blocks[1].address, 0x100000u + (1u << 20));
  EXPECT_EQ(fast.final_segments[0].blocks[0].requested_size, 1000000u);
  EXPECT_EQ(fast.final_segments[0].blocks[1].state, BlockState::Inactive);

  // With addresses, out of order: sorted by address, as the generic reader sorts them.
  const std::string placed = segment_bytes({size1m + short_str("address") + binint(0x100000 + (1 << 20)) +
                                                short_str("state") + short_str("active_pending_free"),
                                            size1m + short_str("address") + binint(0x100000) + short_str("state") +
                                                short_str("inactive")});
  ASSERT_TRUE(detail::scan_snapshot(placed).has_value());
  std::ofstream(file, std::ios::binary | std::ios::trunc) << placed;
  expect_same(read_pytorch_snapshot_file(file.string()), read_pytorch_snapshot(read_pickle(placed), -1, file.string()),
              "placed");

  // What it does not read is the generic reader's, with its messages: an unknown state, a
  // negative size, a block without a state, a blocks list shared through the memo.
  for (const std::string& bad : {size1m + short_str("state") + short_str("reserved"),
                                 short_str("size") + "J\xff\xff\xff\xff" + short_str("state") + short_str("inactive"),
                                 size1m}) {
    const std::string data = segment_bytes({bad});
    EXPECT_FALSE(detail::scan_snapshot(data).has_value());
    std::ofstream(file, std::ios::binary | std::ios::trunc) << data;
    const std::string msg = error_of([&] { (void)read_pytorch_snapshot_file(file.string()); });
    EXPECT_NE(msg.find("segments[0]: blocks[0]: "), std::string::npos) << msg;
  }
  std::string shared = tiled;
  shared.replace(shared.find(short_str("blocks") + "]"), short_str("blocks").size() + 1,
                 short_str("blocks") + "]\x94");  // memoized as key 0
  shared.replace(shared.find(short_str("device_traces")), short_str("device_traces").size() + 1,
                 short_str("again") + "h" + std::string(1, '\0') + short_str("device_traces") + "]");
  ASSERT_NO_THROW((void)read_pickle(shared));
  EXPECT_FALSE(detail::scan_snapshot(shared).has_value());
}

// Review findings: the root's device_traces is its last such key; MEMOIZE's key is
// len(memo), the keys stored, not the highest key plus one.
TEST(SnapshotScanner, ReadsTheRootsLastDeviceTracesAndMemoizesAsPython) {
  const std::string entry = short_str("action") + short_str("alloc") + short_str("addr") + binint(0x1000) +
                            short_str("size") + binint(512);
  const std::string dup = std::string("\x80\x04}(") + short_str("segments") + "]" + short_str("device_traces") +
                          "](](}(" + entry + "uee" + short_str("device_traces") + ")u.";
  const auto scan_dup = detail::scan_snapshot(dup);
  EXPECT_TRUE(!scan_dup.has_value() || scan_dup->events.empty());
  EXPECT_TRUE(read_pytorch_snapshot(read_pickle(dup)).events.empty());

  const std::string memo = std::string("\x80\x04}(") + short_str("x") + short_str("alloc") + "q" + '\x01' +
                           short_str("y") + short_str("free_requested") + "\x94" + short_str("segments") + "]" +
                           short_str("device_traces") + "](](}(" + short_str("action") + "h" + '\x01' +
                           short_str("addr") + binint(0x1000) + short_str("size") + binint(512) + "ueeu.";
  const AllocationTrace generic = read_pytorch_snapshot(read_pickle(memo));
  ASSERT_EQ(generic.events.size(), 1u);
  EXPECT_EQ(generic.events[0].action, RecordedAction::FreeRequested);  // key 1, rewritten by MEMOIZE
  const auto scan_memo = detail::scan_snapshot(memo);
  ASSERT_TRUE(scan_memo.has_value());
  ASSERT_EQ(scan_memo->events.size(), 1u);
  EXPECT_EQ(scan_memo->events[0].action, RecordedAction::FreeRequested);
}

TEST(SnapshotScanner, AListThatHoldsItselfIsLeftToTheGenericReader) {
  // [segments: L] with L appended into itself: a cycle, which the generic reader refuses.
  static const char bytes[] = "\x80\x04}(\x8c\x08segments]\x94h\x00" "au.";
  const std::string cyclic(bytes, sizeof bytes - 1);  // the literal holds a zero byte
  EXPECT_FALSE(detail::scan_snapshot(cyclic).has_value());
}

// Hostile bytes: a snapshot with random bytes changed or cut. The fast path either gives
// way or ends as the generic reader ends: the same trace or the same error; neither crashes.
TEST(SnapshotScanner, DamagedSnapshotsAreReadAsTheGenericReaderReadsThem) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  CachingAllocator alloc{device};
  History history{alloc, 1000};
  std::vector<void*> live;
  for (int i = 0; i < 40; ++i) live.push_back(alloc.allocate(static_cast<std::size_t>(512 + i * 100000)));
  for (std::size_t i = 0; i < live.size(); i += 2) alloc.deallocate(live[i]);
  const std::string good = memory_snapshot_pickle(snapshot(alloc, {.segments = true, .history = true, .history_source = &history}));
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  std::size_t agreed = 0;
  for (int round = 0; round < 400; ++round) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::string bad = good;
    for (int k = 0; k < 1 + static_cast<int>(x % 3); ++k) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      bad[x % bad.size()] = static_cast<char>(x >> 40);
    }
    if (round % 4 == 0) bad.resize(x % bad.size());
    if (!detail::scan_snapshot(bad).has_value()) continue;  // the generic reader's, as before
    // Read through the fast path (the file) and the generic one (the bytes): the same
    // trace, or the same error.
    const fs::path file = temp_dir() / "scanner_damaged.pickle";
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bad;
    AllocationTrace fast, generic;
    std::string fast_error, generic_error;
    try {
      fast = read_pytorch_snapshot_file(file.string());
    } catch (const std::exception& e) {
      fast_error = e.what();
    }
    try {
      generic = read_pytorch_snapshot(read_pickle(bad), -1, file.string());
    } catch (const std::exception& e) {
      generic_error = e.what();
    }
    EXPECT_EQ(fast_error, generic_error) << "round " << round;
    if (fast_error.empty() && generic_error.empty()) {
      expect_same(fast, generic, "round " + std::to_string(round));
      ++agreed;
    }
  }
  EXPECT_GT(agreed, 10u);
  for (std::size_t i = 1; i < live.size(); i += 2) alloc.deallocate(live[i]);
}

}  // namespace
}  // namespace mem
