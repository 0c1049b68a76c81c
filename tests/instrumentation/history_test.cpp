// history_test.cpp — the history ring: bound, order, module stamps, CSV round trip.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "test_support.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/replay/pickle_reader.hpp"
#include "vramscope/replay/trace_reader.hpp"

namespace mem {
namespace {

TEST(History, WithoutTimestampsKeepsTheSameEntriesInSequenceOrder) {
  auto alloc = test::make_allocator();
  History timed{*alloc, 100};
  History untimed{*alloc, 100, {.timestamps = false}};
  for (int i = 0; i < 3; ++i) alloc->deallocate(alloc->allocate(4 * KiB));
  const auto a = timed.entries();
  const auto b = untimed.entries();
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(b.size(), 10u);  // segment_alloc + 3 x (alloc, free_requested, free_completed)
  for (std::size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i].sequence, a[i].sequence);
    EXPECT_EQ(b[i].action, a[i].action);
    EXPECT_EQ(b[i].address, a[i].address);
    EXPECT_EQ(b[i].time_us, 0.0);
  }
  EXPECT_GT(a.back().time_us, 0.0);
}

// A gradient is allocated by its consumer's backward and becomes a parameter's .grad later:
// relabel names the new owner on the block (snapshots) and on its alloc entry (the trace).
TEST(History, RelabelNamesTheNewOwnerOfALiveBlockAndIsNoEntryOfItsOwn) {
  auto alloc = test::make_allocator();
  attach(*alloc);  // blocks take the calling thread's module scope
  History history{*alloc, 100};
  const ContextId made_by = intern_context("fc", Phase::Backward);
  const ContextId owner = intern_context("fc.weight.grad", Phase::Backward);
  void* other = nullptr;
  void* p = nullptr;
  {
    ModuleScope scope(made_by);
    other = alloc->allocate(4 * KiB);
    p = alloc->allocate(8 * KiB);
  }
  const DeviceStats before = alloc->stats();
  EXPECT_TRUE(alloc->relabel(p, owner));
  // Nothing but the owner changed: the same statistics.
  const DeviceStats after = alloc->stats();
  EXPECT_EQ(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
  EXPECT_EQ(after.allocation[0].current, before.allocation[0].current);
  // Not a live block's address (inside one, freed, foreign): false, nothing changes.
  EXPECT_FALSE(alloc->relabel(static_cast<char*>(p) + 512, owner));
  EXPECT_FALSE(alloc->relabel(nullptr, owner));
  alloc->deallocate(other);
  EXPECT_FALSE(alloc->relabel(other, owner));

  const auto entries = history.entries();
  ASSERT_EQ(entries.size(), 5u);  // segment_alloc, alloc, alloc, free_requested (completed), ...
  for (const HistoryEntry& e : entries) EXPECT_NE(e.action, TraceAction::Relabel);
  std::size_t labelled = 0;
  for (const HistoryEntry& e : entries) {
    if (e.action != TraceAction::Alloc) continue;
    EXPECT_EQ(e.context, reinterpret_cast<std::uintptr_t>(p) == e.address ? owner : made_by);
    labelled += e.context == owner ? 1 : 0;
  }
  EXPECT_EQ(labelled, 1u);
  // The block itself, as snapshots list it, carries the new owner.
  bool found = false;
  for (const SegmentInfo& seg : alloc->segments()) {
    for (const BlockInfo& b : seg.blocks) {
      if (b.address == reinterpret_cast<std::uintptr_t>(p)) {
        found = true;
        EXPECT_EQ(b.context, owner);
      }
    }
  }
  EXPECT_TRUE(found);
  alloc->deallocate(p);
}

TEST(History, DropsTheOldestEntriesAtItsBound) {
  auto alloc = test::make_allocator();
  History all{*alloc, 1000};
  History ring{*alloc, 8};
  for (int i = 0; i < 5; ++i) alloc->deallocate(alloc->allocate(4 * KiB));
  // segment_alloc once, then alloc, free_requested, free_completed per pair.
  EXPECT_EQ(ring.recorded(), 16u);
  EXPECT_EQ(ring.size(), 8u);
  EXPECT_EQ(ring.dropped(), 8u);
  const auto kept = ring.entries();
  const auto every = all.entries();
  ASSERT_EQ(kept.size(), 8u);
  ASSERT_EQ(every.size(), 16u);
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const HistoryEntry& want = every[every.size() - kept.size() + i];
    EXPECT_EQ(kept[i].sequence, want.sequence);
    EXPECT_EQ(kept[i].action, want.action);
    EXPECT_EQ(kept[i].address, want.address);
    if (i > 0) {
      EXPECT_EQ(kept[i].sequence, kept[i - 1].sequence + 1);
      EXPECT_GE(kept[i].time_us, kept[i - 1].time_us);
    }
  }
  EXPECT_EQ(every.front().action, TraceAction::SegmentAlloc);
  EXPECT_EQ(kept.back().action, TraceAction::FreeCompleted);
  ring.clear();
  EXPECT_EQ(ring.size(), 0u);
  EXPECT_TRUE(ring.entries().empty());
}

TEST(History, RecordsModuleStreamSizesAndTotals) {
  auto alloc = test::make_allocator();
  attach(*alloc);
  History history{*alloc, 64};
  void* p = nullptr;
  {
    ModuleScope scope{"decoder.block3.mlp", Phase::Backward};
    p = alloc->allocate(3 * MiB + 100, 0);
  }
  alloc->deallocate(p);
  const auto entries = history.entries();
  ASSERT_EQ(entries.size(), 4u);
  const HistoryEntry& a = entries[1];
  EXPECT_EQ(a.action, TraceAction::Alloc);
  EXPECT_EQ(a.address, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(a.requested_size, 3 * MiB + 100);
  EXPECT_EQ(a.size, 3 * MiB + 512);
  EXPECT_FALSE(a.small_pool);
  EXPECT_EQ(a.module(), "decoder.block3.mlp");
  EXPECT_EQ(a.phase(), Phase::Backward);
  EXPECT_EQ(a.allocated_bytes, 3 * MiB + 512);
  EXPECT_EQ(a.reserved_bytes, 20 * MiB);
  EXPECT_GT(a.device_used_bytes, 20 * MiB);
  // The free carries the block's context, not the freeing thread's.
  EXPECT_EQ(entries[2].action, TraceAction::FreeRequested);
  EXPECT_EQ(entries[2].module(), "decoder.block3.mlp");
  EXPECT_EQ(entries[3].allocated_bytes, 0u);
}

TEST(History, DetachStopsRecording) {
  auto alloc = test::make_allocator();
  History history{*alloc, 16};
  alloc->deallocate(alloc->allocate(KiB));
  const auto before = history.recorded();
  history.detach();
  alloc->deallocate(alloc->allocate(KiB));
  EXPECT_EQ(history.recorded(), before);
}

TEST(History, ABoundOfZeroIsRejectedAndAttachesNothing) {
  auto alloc = test::make_allocator();
  void* p = alloc->allocate(MiB);
  const DeviceStats before = alloc->stats();
  try {
    History bad{*alloc, 0};
    FAIL() << "a bound of zero was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_entries must be at least 1"), std::string::npos);
  }
  EXPECT_THROW(History(0), Error);
  EXPECT_EQ(alloc->stats(), before);
  alloc->validate();
  // Nothing dangling was left registered: events after the failed construction are fine.
  alloc->deallocate(p);
  alloc->deallocate(alloc->allocate(KiB));
  // record_history's 0 is the documented "stop recording", not an error.
  record_history(*alloc, 0);
  EXPECT_EQ(recorded_history(*alloc), nullptr);
}

TEST(History, CsvRoundTrips) {
  auto alloc = test::make_allocator();
  attach(*alloc);
  History history{*alloc, 64};
  {
    ModuleScope scope{"weird,name \"quoted\"", Phase::Forward};
    alloc->deallocate(alloc->allocate(5 * MiB));
  }
  const auto entries = history.entries();
  const auto path = std::filesystem::temp_directory_path() / "vramscope_history_roundtrip.csv";
  write_history_csv(entries, path);
  const auto back = read_history_csv(path);
  ASSERT_EQ(back.size(), entries.size());
  for (std::size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].sequence, entries[i].sequence);
    EXPECT_EQ(back[i].action, entries[i].action);
    EXPECT_EQ(back[i].address, entries[i].address);
    EXPECT_EQ(back[i].size, entries[i].size);
    EXPECT_EQ(back[i].requested_size, entries[i].requested_size);
    EXPECT_EQ(back[i].context, entries[i].context);
    EXPECT_EQ(back[i].small_pool, entries[i].small_pool);
    EXPECT_EQ(back[i].reserved_bytes, entries[i].reserved_bytes);
    EXPECT_NEAR(back[i].time_us, entries[i].time_us, 0.001);
  }
  const std::string csv = history_csv(entries);
  EXPECT_EQ(csv.substr(0, csv.find('\n')), kHistoryCsvHeader);
  // Another header (an older schema, another tool's CSV), an empty file, an unknown action:
  // errors that name the file and the line.
  const auto error_reading = [&](const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
    try {
      (void)read_history_csv(path);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error_reading("seq,time_us,action\n1,0,alloc\n").find("line 1: not a vramscope history CSV"),
            std::string::npos);
  EXPECT_NE(error_reading("").find("empty"), std::string::npos);
  std::string bad = csv;
  bad.replace(bad.find(",alloc,"), 7, ",allocate,");  // line 2 is the segment_alloc before it
  EXPECT_NE(error_reading(bad).find("line 3: column action: unknown action 'allocate'"), std::string::npos)
      << error_reading(bad);
  std::filesystem::remove(path);
}

TEST(Exports, UnwritablePathGivesAClearError) {
  auto alloc = test::make_allocator();
  const Snapshot s = snapshot(*alloc, {.segments = true});
  try {
    write_snapshot_json(s, "/nonexistent-dir-for-vramscope/snap.json");
    FAIL() << "expected mem::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("/nonexistent-dir-for-vramscope"), std::string::npos) << what;
    EXPECT_NE(what.find("does not exist"), std::string::npos) << what;
  }
  EXPECT_THROW(write_history_csv({}, ""), Error);
  EXPECT_THROW(read_history_csv("/nonexistent-dir-for-vramscope/h.csv"), Error);
  EXPECT_THROW(memory_snapshot_pickle(snapshot(*alloc)), Error);  // nothing to export
}

TEST(Exports, PickleUsesProtocolTwoAndStops) {
  auto alloc = test::make_allocator();
  void* p = alloc->allocate(MiB);
  const std::string bytes = memory_snapshot_pickle(snapshot(*alloc, {.segments = true}));
  ASSERT_GE(bytes.size(), 3u);
  EXPECT_EQ(bytes[0], '\x80');
  EXPECT_EQ(bytes[1], '\x02');
  EXPECT_EQ(bytes.back(), '.');
  alloc->deallocate(p);
}

// PyTorch's device_traces carry the caller's size (orig_size) for alloc and
// free entries; the segment's block keeps the rounded size next to the request.
TEST(Exports, PickleTraceEntriesCarryTheRequestedSize) {
  auto alloc = test::make_allocator();
  History history{*alloc, 100};
  const StreamId side = alloc->device().create_stream();
  void* kept = alloc->allocate(4);
  alloc->deallocate(alloc->allocate(4));  // free_completed folded into free_requested
  void* deferred = alloc->allocate(4);
  alloc->record_stream(deferred, side);
  alloc->deallocate(deferred);
  alloc->empty_cache();  // the deferred free_completed, emitted on its own
  const PickleValue root = read_pickle(memory_snapshot_pickle(
      snapshot(*alloc, {.segments = true, .history = true, .history_source = &history})));

  const PickleList& trace = root.at("device_traces").as_list().at(0).as_list();
  const std::vector<std::pair<std::string, std::size_t>> want = {
      {"segment_alloc", 2 * MiB}, {"alloc", 4}, {"alloc", 4},          {"free_requested", 4},
      {"free_completed", 4},      {"alloc", 4}, {"free_requested", 4}, {"free_completed", 4}};
  ASSERT_EQ(trace.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(trace[i].at("action").as_string(), want[i].first) << i;
    EXPECT_EQ(trace[i].at("size").as_size(), want[i].second) << i;
  }
  EXPECT_EQ(trace[1].at("addr").as_size(), reinterpret_cast<std::uintptr_t>(kept));

  const PickleList& segments = root.at("segments").as_list();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].at("total_size").as_size(), 2 * MiB);
  const PickleValue& block = segments[0].at("blocks").as_list().at(0);
  EXPECT_EQ(block.at("address").as_size(), reinterpret_cast<std::uintptr_t>(kept));
  EXPECT_EQ(block.at("state").as_string(), "active_allocated");
  EXPECT_EQ(block.at("size").as_size(), 512u);
  EXPECT_EQ(block.at("requested_size").as_size(), 4u);
  alloc->deallocate(kept);
}

}  // namespace
}  // namespace mem
