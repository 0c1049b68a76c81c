// real_traces_test.cpp — conformance with PyTorch on memory snapshots users
// recorded on real GPUs (../shared/real-traces, third-party, read in place).
// With the settings each trace was recorded with (PyTorch's default, or
// expandable_segments:True), replaying it must reproduce every segment_alloc or
// segment_map (size, stream, order), every segment_free or segment_unmap, and
// place every block at its recorded address; the final state must match the
// snapshot's segments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "csv_rows.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/replay/replay.hpp"

namespace mem {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> trace_files() {
  std::vector<std::string> files;
  const fs::path dir{VRAMSCOPE_REAL_TRACES_DIR};
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().extension() == ".pickle" || entry.path().extension() == ".pkl")
      files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  return files;
}

class RealTrace : public ::testing::TestWithParam<std::string> {};

/// Replay options with the settings the trace was recorded with.
ReplayOptions recorded_settings(const AllocationTrace& trace) {
  ReplayOptions opt;
  if (trace.allocator_conf_known) opt.config = AllocatorConfig::parse(trace.allocator_conf);
  return opt;
}

/// The replay did what PyTorch did: every segment call, every block at its address, the
/// final state, nothing diverging.
void expect_reproduced(const ReplayResult& r, const std::string& name) {
  ASSERT_TRUE(r.conformance_checked) << name;
  EXPECT_EQ(r.initial_blocks_misplaced, 0u) << name;
  EXPECT_EQ(r.segment_allocs_reproduced, r.segment_allocs_recorded) << name;
  EXPECT_EQ(r.segment_frees_reproduced, r.segment_frees_recorded) << name;
  EXPECT_EQ(r.allocs_checked, r.allocs) << name;
  EXPECT_EQ(r.blocks_placed, r.allocs_checked) << name;
  EXPECT_EQ(r.final_segments_matched, r.final_segments_recorded) << name;
  EXPECT_EQ(r.unknown_frees, 0u) << name;
  EXPECT_EQ(r.failed_allocs, 0u) << name;
  for (const ReplayDivergence& d : r.divergences) ADD_FAILURE() << name << " event " << d.event_index << ": " << d.what;
}

TEST_P(RealTrace, ReplayMatchesPyTorch) {
  const fs::path path = fs::path{VRAMSCOPE_REAL_TRACES_DIR} / GetParam();
  const AllocationTrace trace = load_trace(path.string());
  const ReplayResult r = replay(trace, recorded_settings(trace));
  if (!r.supported) {
    std::printf("[ conformance ] %s: not yet supported (%s)\n", GetParam().c_str(),
                r.unsupported_reason.c_str());
    GTEST_SKIP() << r.unsupported_reason;
  }
  std::printf("[ conformance ] %s: segment_allocs %zu/%zu, blocks placed %zu/%zu, "
              "segment_frees %zu/%zu, final segments %zu/%zu, starting state %zu segments "
              "%zu live blocks\n",
              GetParam().c_str(), r.segment_allocs_reproduced, r.segment_allocs_recorded,
              r.blocks_placed, r.allocs_checked, r.segment_frees_reproduced,
              r.segment_frees_recorded, r.final_segments_matched, r.final_segments_recorded,
              r.initial_segments, r.initial_blocks);
  expect_reproduced(r, GetParam());
}

TEST_P(RealTrace, EverySettingStartsFromTheRecordedState) {
  // A what-if compares settings, not starting states: each run begins with the recorded
  // segments and live blocks. A setting that cannot act here (garbage_collection_threshold
  // without a memory fraction) then gives exactly the recorded setting's figures, and one
  // that acts (max_split_size_mb) starts from the same reserved and allocated bytes.
  const fs::path path = fs::path{VRAMSCOPE_REAL_TRACES_DIR} / GetParam();
  const AllocationTrace trace = load_trace(path.string());
  const ReplayOptions as_recorded = recorded_settings(trace);
  const ReplayResult recorded = replay(trace, as_recorded);
  if (!recorded.supported) GTEST_SKIP() << recorded.unsupported_reason;
  ReplayOptions idle = as_recorded;
  idle.config.garbage_collection_threshold = 0.6;
  const ReplayResult same = replay(trace, idle);
  EXPECT_EQ(same.initial_reserved, recorded.initial_reserved);
  EXPECT_EQ(same.peak_allocated, recorded.peak_allocated);
  EXPECT_EQ(same.peak_reserved, recorded.peak_reserved);
  EXPECT_EQ(same.peak_device_used, recorded.peak_device_used);
  EXPECT_EQ(same.segment_allocs, recorded.segment_allocs);
  EXPECT_EQ(same.initial_blocks_misplaced, 0u);
  ReplayOptions split = as_recorded;
  split.config.max_split_size = 128 * MiB;
  const ReplayResult other = replay(trace, split);
  EXPECT_EQ(other.initial_reserved, recorded.initial_reserved);
  EXPECT_EQ(other.initial_allocated, recorded.initial_allocated);
  EXPECT_EQ(other.initial_blocks_misplaced, 0u);
}

std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name;
  for (char c : fs::path(info.param).stem().string())
    if (std::isalnum(static_cast<unsigned char>(c))) name.push_back(c);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Snapshots, RealTrace, ::testing::ValuesIn(trace_files()), test_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(RealTrace);

// The expandable-segments snapshot (Constructor-Sun: three GPUs, one with segment_unmap
// events, a refused cuMemCreate and an OOM): every GPU's trace reproduced, and what-if in
// both directions from the same starting state.
TEST(RealTraces, ExpandableSnapshotEveryDeviceAndBothDirections) {
  const fs::path path = fs::path{VRAMSCOPE_REAL_TRACES_DIR} / "Constructor-Sun__memory_snapshot_b5ef.pickle";
  if (!fs::exists(path)) GTEST_SKIP() << "absent: " << path;
  struct Expect {
    int device;
    std::size_t maps, unmaps, allocs, final_segments;
  };
  for (const Expect& want : {Expect{0, 175, 0, 2434, 2}, Expect{1, 40, 6, 199, 8}, Expect{2, 78, 0, 392, 2}}) {
    const AllocationTrace trace = load_trace(path.string(), want.device);
    ASSERT_TRUE(trace.expandable_segments);
    const ReplayResult r = replay(trace, recorded_settings(trace));
    ASSERT_TRUE(r.conformance_checked) << want.device;
    EXPECT_EQ(r.segment_allocs_recorded, want.maps) << want.device;
    EXPECT_EQ(r.segment_allocs_reproduced, want.maps) << want.device;
    EXPECT_EQ(r.segment_frees_recorded, want.unmaps) << want.device;
    EXPECT_EQ(r.segment_frees_reproduced, want.unmaps) << want.device;
    EXPECT_EQ(r.blocks_placed, want.allocs) << want.device;
    EXPECT_EQ(r.allocs_checked, want.allocs) << want.device;
    EXPECT_EQ(r.final_segments_matched, want.final_segments) << want.device;
    EXPECT_EQ(r.final_segments_recorded, want.final_segments) << want.device;
    EXPECT_EQ(r.divergence_count, 0u) << want.device << ": " << (r.divergences.empty() ? "" : r.divergences[0].what);
  }
  // GPU 1 filled an 80 GB card: with expandable segments it fit (one refused page mapping,
  // unmapped and retried); replayed without them on the same card, the first 4.94 GiB
  // request after the release runs out of memory on fragmented segments.
  const AllocationTrace trace = load_trace(path.string(), 1);
  ReplayOptions on = recorded_settings(trace);
  on.device = "sim:a100-80g";
  ReplayOptions off = on;
  off.config = AllocatorConfig{};
  const ReplayResult with = replay(trace, on);
  const ReplayResult without = replay(trace, off);
  EXPECT_FALSE(with.first_oom.has_value());
  ASSERT_TRUE(without.first_oom.has_value());
  EXPECT_EQ(without.first_oom->event_index, 420u);
  EXPECT_EQ(without.initial_reserved, with.initial_reserved);
  EXPECT_GT(without.first_oom->free_bytes, without.first_oom->requested);  // fragmentation, not lack of memory

  // A recording without expandable segments replayed with them: less reserved, no cudaMalloc segment.
  const fs::path plain = fs::path{VRAMSCOPE_REAL_TRACES_DIR} / "Maphsge4__snapshot_ec5b.pickle";
  if (!fs::exists(plain)) return;
  const AllocationTrace maphsge4 = load_trace(plain.string());
  const ReplayResult recorded = replay(maphsge4);
  ReplayOptions expand;
  expand.config = AllocatorConfig::parse("expandable_segments:True");
  const ReplayResult expanded = replay(maphsge4, expand);
  EXPECT_EQ(expanded.initial_reserved, recorded.initial_reserved);
  EXPECT_LT(expanded.peak_reserved, recorded.peak_reserved);
  EXPECT_EQ(expanded.peak_requested, recorded.peak_requested);
}

TEST(RealTraces, FolderIsPresent) {
  if (trace_files().empty())
    GTEST_SKIP() << "no real traces in " << VRAMSCOPE_REAL_TRACES_DIR
                 << " (third-party snapshots are read in place, never copied here)";
  SUCCEED();
}

// Our own recordings (tests/data/h100-parallel-2026-11-26, scripts/parallel_reference.py):
// rank 0 of DDP and FSDP2 at world size 8 on PyTorch's fake process group, with real CUDA
// tensors on one H100 under PyTorch 2.11, three training steps each. FSDP2 allocates on
// its all-gather and reduce-scatter streams; the replay reproduces every block and segment
// on each stream, and its peaks are what torch.cuda reported for the run (the CSV).
TEST(ParallelReference, DdpAndFsdp2RanksReplayExactlyWithTheirPeaks) {
  const fs::path dir = fs::path{VRAMSCOPE_TEST_DATA_DIR} / "h100-parallel-2026-11-26";
  // config -> the largest max allocated and max reserved over its steps (a run that failed
  // in PyTorch has no figures: its snapshot is replayed all the same).
  std::map<std::string, std::pair<std::size_t, std::size_t>> peaks;
  for (const fs::path& file : {dir / "parallel_reference.csv", dir / "variants" / "parallel_variants.csv"}) {
    const auto rows = test::read_csv(file);
    ASSERT_FALSE(rows.empty()) << file;
    for (const auto& row : rows) {
      if (row.at("max_allocated").empty()) continue;
      auto& [allocated, reserved] = peaks[row.at("config")];
      allocated = std::max<std::size_t>(allocated, std::stoull(row.at("max_allocated")));
      reserved = std::max<std::size_t>(reserved, std::stoull(row.at("max_reserved")));
    }
  }
  std::size_t replayed = 0;
  for (const fs::path& folder : {dir, dir / "variants"}) {
    for (const auto& entry : fs::directory_iterator(folder)) {
      if (entry.path().extension() != ".pickle") continue;
      const std::string config = entry.path().stem().string();
      const AllocationTrace trace = load_trace(entry.path().string());
      const ReplayResult r = replay(trace, recorded_settings(trace));
      expect_reproduced(r, config);
      if (peaks.count(config)) {
        EXPECT_EQ(r.peak_allocated, peaks[config].first) << config;
        EXPECT_EQ(r.peak_reserved, peaks[config].second) << config;
      }
      ++replayed;
    }
  }
  EXPECT_EQ(replayed, 6u + 15u);  // the defaults' rank 0, and each variant's
}

}  // namespace
}  // namespace mem
