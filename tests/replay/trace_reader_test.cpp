// trace_reader_test.cpp — PyTorch snapshots, the history CSV and RMM's log CSV
// read into AllocationTrace, and malformed inputs named by line or element.
#include "vramscope/replay/trace_reader.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>

#include "replay_test_pickles.hpp"
#include "test_support.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"

namespace mem {
namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TraceReader, ReadsPyTorchSnapshot) {
  const AllocationTrace t = read_pytorch_snapshot(read_pickle(test::kSnapshot));
  EXPECT_EQ(t.format, TraceFormat::PyTorchSnapshot);
  ASSERT_EQ(t.events.size(), 5u);
  EXPECT_EQ(t.events[0].action, RecordedAction::SegmentAlloc);
  EXPECT_EQ(t.events[0].size, 2 * MiB);
  EXPECT_EQ(t.events[1].action, RecordedAction::Alloc);
  EXPECT_EQ(t.events[1].address, std::uintptr_t{1} << 30);
  EXPECT_EQ(t.events[1].size, 100u);
  EXPECT_DOUBLE_EQ(t.events[4].time_us, 4.0);
  EXPECT_TRUE(t.has_free_completed);
  EXPECT_TRUE(t.has_final_state);
  EXPECT_TRUE(t.allocator_conf_known);
  EXPECT_FALSE(t.expandable_segments);
  ASSERT_EQ(t.final_segments.size(), 1u);
  EXPECT_TRUE(t.final_segments[0].small_pool);
  ASSERT_EQ(t.final_segments[0].blocks.size(), 2u);
  EXPECT_EQ(t.final_segments[0].blocks[0].state, BlockState::ActiveAllocated);
  EXPECT_EQ(t.final_segments[0].blocks[1].state, BlockState::Inactive);
  EXPECT_EQ(t.action_counts()[static_cast<std::size_t>(RecordedAction::Alloc)], 2u);
}

PickleValue event(std::string_view action, std::int64_t addr, std::int64_t size) {
  PickleValue e = PickleValue::dict();
  e.mutable_dict().emplace_back(PickleValue::string("action"), PickleValue::string(std::string(action)));
  e.mutable_dict().emplace_back(PickleValue::string("addr"), PickleValue::integer(addr));
  e.mutable_dict().emplace_back(PickleValue::string("size"), PickleValue::integer(size));
  return e;
}

PickleValue snapshot_with(std::vector<PickleValue> events) {
  PickleValue root = PickleValue::dict();
  PickleValue traces = PickleValue::sequence(PickleValue::Kind::List);
  PickleValue trace = PickleValue::sequence(PickleValue::Kind::List);
  for (auto& e : events) trace.mutable_list().push_back(std::move(e));
  traces.mutable_list().push_back(trace);
  root.mutable_dict().emplace_back(PickleValue::string("segments"),
                                   PickleValue::sequence(PickleValue::Kind::List));
  root.mutable_dict().emplace_back(PickleValue::string("device_traces"), traces);
  return root;
}

// Issue 20: things PyTorch writes that must load.
TEST(TraceReader, AnOomEntryHasDeviceFreeAndNoAddress) {
  // torch/csrc/cuda/Module.cpp writes an oom entry's address field as "device_free".
  PickleValue oom = PickleValue::dict();
  oom.mutable_dict().emplace_back(PickleValue::string("action"), PickleValue::string("oom"));
  oom.mutable_dict().emplace_back(PickleValue::string("device_free"), PickleValue::integer(123 * 1024));
  oom.mutable_dict().emplace_back(PickleValue::string("size"), PickleValue::integer(64 * MiB));
  const AllocationTrace t =
      read_pytorch_snapshot(snapshot_with({event("segment_alloc", 1 << 30, 2 * MiB), std::move(oom)}));
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[1].action, RecordedAction::Oom);
  EXPECT_EQ(t.events[1].size, 64 * MiB);
  EXPECT_EQ(t.events[1].address, 0u);
}

TEST(TraceReader, AnIntegerBeyond64BitsInAFieldReplayDoesNotReadLoads) {
  // {"line": 2**64 - 1} as pickle protocol 2 writes it: LONG1 of 9 bytes.
  const std::string bytes = std::string("\x80\x02}\x8c\x04line\x8a\x09", 11) + std::string(8, '\xff') +
                            std::string(1, '\0') + "s.";
  const PickleValue v = read_pickle(bytes);
  ASSERT_EQ(v.at("line").kind(), PickleValue::Kind::BigInt);
  EXPECT_NE(error_of([&] { (void)v.at("line").as_int(); }).find("9 bytes does not fit in 64 bits"), std::string::npos);
  // -1 in 9 bytes is still an int; 2**63 - 1 in 8 is too.
  EXPECT_EQ(read_pickle(std::string("\x80\x02\x8a\x09", 4) + std::string(9, '\xff') + ".").as_int(), -1);

  // An alloc entry whose frame's line is 2**64 - 1 (what PyTorch records for an unknown
  // line): the snapshot loads; replay never reads frames.
  PickleValue frame = PickleValue::dict();
  frame.mutable_dict().emplace_back(PickleValue::string("line"), PickleValue::big_integer(std::string(8, '\xff') + '\0'));
  PickleValue frames = PickleValue::sequence(PickleValue::Kind::List);
  frames.mutable_list().push_back(frame);
  PickleValue alloc = event("alloc", 1 << 30, 512);
  alloc.mutable_dict().emplace_back(PickleValue::string("frames"), frames);
  const AllocationTrace t = read_pytorch_snapshot(snapshot_with({std::move(alloc)}));
  ASSERT_EQ(t.events.size(), 1u);
  EXPECT_EQ(t.events[0].size, 512u);
}

TEST(TraceReader, ADeviceWithNothingToReplayNamesTheDevicesThatHaveSomething) {
  // Everything on device 1 (a second GPU): device 0's trace is empty and it has no segment.
  PickleValue root = snapshot_with({});
  PickleValue trace1 = PickleValue::sequence(PickleValue::Kind::List);
  trace1.mutable_list().push_back(event("segment_alloc", 1 << 30, 2 * MiB));
  trace1.mutable_list().push_back(event("alloc", 1 << 30, 512));
  for (auto& [key, value] : root.mutable_dict()) {
    if (key.as_string() == "device_traces") value.mutable_list().push_back(trace1);
  }
  // The default choice is the device with the trace events.
  EXPECT_EQ(read_pytorch_snapshot(root).device, 1);
  EXPECT_EQ(read_pytorch_snapshot(root).events.size(), 2u);
  // Asking for device 0 is an error that names device 1, not a replay of zeros.
  const std::string message = error_of([&] { (void)read_pytorch_snapshot(root, 0, "two-gpus.pickle"); });
  EXPECT_NE(message.find("two-gpus.pickle: device 0 has no segments and no trace events; device 1 (0 segments, "
                         "2 trace events) has them"),
            std::string::npos)
      << message;
}

TEST(TraceReader, ADirectoryIsNotAnEmptyTrace) {
  // A directory opens as a stream on Linux: an error naming it, not an empty or truncated
  // trace (the readers also check the stream after reading, for real read errors).
  const std::string dir = ::testing::TempDir();
  for (const auto& load : std::vector<std::function<void()>>{[&] { (void)load_trace(dir); },
                                                             [&] { (void)read_pickle_file(dir); },
                                                             [&] { (void)read_rmm_log_file(dir); }}) {
    try {
      load();
      ADD_FAILURE() << "a directory was read as a trace";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(dir), std::string::npos) << what;
      EXPECT_TRUE(what.find("read") != std::string::npos) << what;
      EXPECT_EQ(what.find("empty file"), std::string::npos) << what;
      EXPECT_EQ(what.find("truncated"), std::string::npos) << what;
    }
  }
}

TEST(TraceReader, MalformedSnapshotNamesTheElement) {
  PickleValue bad = event("alloc", 4096, 512);
  bad.mutable_dict().pop_back();  // no size
  std::string msg = error_of([&] { read_pytorch_snapshot(snapshot_with({event("alloc", 0, 512), bad}), -1, "s.pickle"); });
  EXPECT_NE(msg.find("s.pickle: device_traces[0][1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'size'"), std::string::npos) << msg;

  msg = error_of([&] { read_pytorch_snapshot(snapshot_with({event("explode", 0, 512)})); });
  EXPECT_NE(msg.find("unknown action 'explode'"), std::string::npos) << msg;

  msg = error_of([&] { read_pytorch_snapshot(snapshot_with({event("alloc", 0, -5)})); });
  EXPECT_NE(msg.find("device_traces[0][0]"), std::string::npos) << msg;

  msg = error_of([&] { read_pytorch_snapshot(PickleValue::integer(3)); });
  EXPECT_NE(msg.find("not a memory snapshot"), std::string::npos) << msg;
}

TEST(TraceReader, ASegmentOnANegativeDeviceIsRefusedNotReplayed) {
  // A hostile snapshot's only segment claims device -1: an error naming it, not a replay of it.
  for (const std::int64_t device : {std::int64_t{-1}, std::int64_t{1} << 40}) {
    PickleValue root = snapshot_with({});
    PickleValue seg = PickleValue::dict();
    seg.mutable_dict().emplace_back(PickleValue::string("device"), PickleValue::integer(device));
    seg.mutable_dict().emplace_back(PickleValue::string("address"), PickleValue::integer(1 << 30));
    seg.mutable_dict().emplace_back(PickleValue::string("total_size"), PickleValue::integer(2 * MiB));
    seg.mutable_dict().emplace_back(PickleValue::string("blocks"), PickleValue::sequence(PickleValue::Kind::List));
    for (auto& [key, value] : root.mutable_dict()) {
      if (key.as_string() == "segments") value.mutable_list().push_back(seg);
    }
    const std::string message = error_of([&] { (void)read_pytorch_snapshot(root, -1, "hostile.pickle"); });
    EXPECT_NE(message.find("hostile.pickle: segments[0]"), std::string::npos) << message;
    EXPECT_NE(message.find("is not a GPU index"), std::string::npos) << message;
  }
}

TEST(TraceReader, ExpandableSegmentsAreFlagged) {
  const AllocationTrace t = read_pytorch_snapshot(snapshot_with({event("segment_map", 0, 2 * MiB)}));
  EXPECT_TRUE(t.expandable_segments);
}

TEST(TraceReader, ReadsOwnHistoryCsv) {
  auto alloc = test::make_allocator();
  History history{*alloc, 1000};
  void* a = alloc->allocate(1000);
  void* b = alloc->allocate(5 * MiB);
  alloc->deallocate(a);
  alloc->deallocate(b);
  std::istringstream in(history_csv(history.entries()));
  const AllocationTrace t = read_history_trace(in, "h.csv");
  EXPECT_EQ(t.format, TraceFormat::HistoryCsv);
  ASSERT_EQ(t.events.size(), history.entries().size());
  EXPECT_EQ(t.events[0].action, RecordedAction::SegmentAlloc);
  EXPECT_EQ(t.events[0].size, 2 * MiB);
  EXPECT_EQ(t.events[1].action, RecordedAction::Alloc);
  EXPECT_EQ(t.events[1].size, 1000u);  // the request, not the 1024 B block
  EXPECT_EQ(t.events[1].address, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_TRUE(t.has_free_completed);
  EXPECT_FALSE(t.has_final_state);
}

TEST(TraceReader, MalformedHistoryCsvNamesTheLine) {
  const std::string header = "seq,time_us,action,address,size,requested_size,stream,module,phase\n";
  auto parse = [](std::string text) {
    std::istringstream in(text);
    return read_history_trace(in, "h.csv");
  };
  EXPECT_EQ(parse(header + "1,0.5,alloc,4096,512,100,0,\"a,b\",forward\n").events.size(), 1u);
  std::string msg = error_of([&] { parse(header + "1,0,alloc,4096,512,100,0,m,forward\n2,0,bogus,1,1,1,0,m,f\n"); });
  EXPECT_NE(msg.find("h.csv: line 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown action 'bogus'"), std::string::npos) << msg;
  msg = error_of([&] { parse(header + "1,0,alloc,0xZZ,512,100,0,m,forward\n"); });
  EXPECT_NE(msg.find("line 2: column address"), std::string::npos) << msg;
  msg = error_of([&] { parse(header + "1,0,alloc,4096\n"); });
  EXPECT_NE(msg.find("line 2: 4 fields"), std::string::npos) << msg;
  msg = error_of([&] { parse("seq,action\n1,alloc\n"); });
  EXPECT_NE(msg.find("missing column 'time_us'"), std::string::npos) << msg;
  msg = error_of([&] { parse(header + "1,0,alloc,1,1,1,0,\"unterminated,f\n"); });
  EXPECT_NE(msg.find("unterminated"), std::string::npos) << msg;
}

TEST(TraceReader, ReadsRmmLog) {
  std::istringstream in(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140573312345856,1634567890.5,allocate,0x7f8a40000000,1024,0x0\n"
      "140573312345856,10:00:01:250000,allocate,0x7f8a40000400,2048,0x7f8a38001020\n"
      "140573312345856,1634567891.0,free,0x7f8a40000000,1024,0x0\n"
      "140573312345856,1634567891.5,deallocate,0x7f8a40000400,2048,0x7f8a38001020\n"
      "140573312345856,1634567892.0,allocate failure,0x0,99999999999,0x0\n");
  const AllocationTrace t = read_rmm_log(in);
  EXPECT_EQ(t.format, TraceFormat::RmmCsv);
  ASSERT_EQ(t.events.size(), 5u);
  EXPECT_EQ(t.events[0].address, 0x7f8a40000000u);
  EXPECT_DOUBLE_EQ(t.events[0].time_us, 1634567890.5e6);
  EXPECT_DOUBLE_EQ(t.events[1].time_us, (10 * 3600 + 1) * 1e6 + 250000);
  EXPECT_EQ(t.events[1].stream, 0x7f8a38001020u);
  EXPECT_EQ(t.events[2].action, RecordedAction::FreeRequested);
  EXPECT_EQ(t.events[3].action, RecordedAction::FreeRequested);
  EXPECT_EQ(t.events[4].action, RecordedAction::Oom);
  EXPECT_FALSE(t.has_free_completed);
}

TEST(TraceReader, MalformedRmmLogNamesTheLine) {
  auto parse = [](std::string text) {
    std::istringstream in(text);
    return read_rmm_log(in, "r.csv");
  };
  const std::string header = "Thread,Time,Action,Pointer,Size,Stream\n";
  std::string msg = error_of([&] { parse(header + "1,1.0,allocate,0x10,12x,0\n"); });
  EXPECT_NE(msg.find("r.csv: line 2: column Size"), std::string::npos) << msg;
  msg = error_of([&] { parse(header + "1,1.0,allocate,0x10,1,0\n1,1.0,grab,0x10,1,0\n"); });
  EXPECT_NE(msg.find("line 3: column Action"), std::string::npos) << msg;
  msg = error_of([&] { parse(header + "1,noon,allocate,0x10,1,0\n"); });
  EXPECT_NE(msg.find("line 2: column Time"), std::string::npos) << msg;
  msg = error_of([&] { parse(""); });
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;
}

TEST(TraceReader, LoadTraceDetectsTheFormat) {
  const auto dir = std::filesystem::temp_directory_path() / "vramscope_trace_reader_test";
  std::filesystem::create_directories(dir);
  const auto pickle = dir / "s.pickle";
  std::ofstream(pickle, std::ios::binary) << test::kSnapshot;
  EXPECT_EQ(load_trace(pickle.string()).format, TraceFormat::PyTorchSnapshot);
  const auto rmm = dir / "r.csv";
  std::ofstream(rmm) << "Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x10,1,0\n";
  EXPECT_EQ(load_trace(rmm.string()).format, TraceFormat::RmmCsv);
  const auto hist = dir / "h.csv";
  std::ofstream(hist) << "seq,time_us,action,address,size,requested_size,stream,module,phase\n";
  EXPECT_EQ(load_trace(hist.string()).format, TraceFormat::HistoryCsv);
  const auto other = dir / "o.txt";
  std::ofstream(other) << "hello\n";
  EXPECT_NE(error_of([&] { load_trace(other.string()); }).find("unrecognised trace format"), std::string::npos);
  EXPECT_NE(error_of([&] { load_trace((dir / "missing").string()); }).find("does not exist"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mem

namespace mem {
namespace {

// A text trace's line costs at most kMaxTextLine: a gigabyte field is an error at the bound,
// never read whole (issue 34: a 1.2 GB field took 3.2 GB of memory).
TEST(TraceReader, ALineLongerThanTheBoundIsAnErrorNotAnAllocation) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / "long-line";
  std::filesystem::create_directories(dir);
  const auto csv = dir / "h.csv";
  {
    std::ofstream out(csv, std::ios::binary);
    out << kHistoryCsvHeader << "\n1,0," << std::string(kMaxTextLine + 10, 'x') << "\n";
  }
  const std::string message = error_of([&] { (void)load_trace(csv.string()); });
  EXPECT_NE(message.find("line 2 is longer than 1.00 MiB"), std::string::npos) << message;
  const std::string direct = error_of([&] { (void)read_history_csv(csv); });
  EXPECT_NE(direct.find("line 2 is longer than 1.00 MiB"), std::string::npos) << direct;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mem
