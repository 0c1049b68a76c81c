// real_traces_test.cpp — conformance with PyTorch on memory snapshots users
// recorded on real GPUs (../shared/real-traces, third-party, read in place).
// With PyTorch's default settings, replaying each trace must reproduce every
// segment_alloc (size, stream, order) and place every block at its recorded
// offset in its segment; the final state must match the snapshot's segments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "vramscope/instrumentation/replay.hpp"

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

TEST_P(RealTrace, ReplayMatchesPyTorch) {
  const fs::path path = fs::path{VRAMSCOPE_REAL_TRACES_DIR} / GetParam();
  const AllocationTrace trace = load_trace(path.string());
  const ReplayResult r = replay(trace);
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
  ASSERT_TRUE(r.conformance_checked);
  EXPECT_EQ(r.initial_blocks_misplaced, 0u);
  EXPECT_EQ(r.segment_allocs_reproduced, r.segment_allocs_recorded);
  EXPECT_EQ(r.segment_frees_reproduced, r.segment_frees_recorded);
  EXPECT_EQ(r.allocs_checked, r.allocs);
  EXPECT_EQ(r.blocks_placed, r.allocs_checked);
  EXPECT_EQ(r.final_segments_matched, r.final_segments_recorded);
  EXPECT_EQ(r.unknown_frees, 0u);
  EXPECT_EQ(r.failed_allocs, 0u);
  for (const ReplayDivergence& d : r.divergences)
    ADD_FAILURE() << GetParam() << " event " << d.event_index << ": " << d.what;
}

std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name;
  for (char c : fs::path(info.param).stem().string())
    if (std::isalnum(static_cast<unsigned char>(c))) name.push_back(c);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Snapshots, RealTrace, ::testing::ValuesIn(trace_files()), test_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(RealTrace);

TEST(RealTraces, FolderIsPresent) {
  if (trace_files().empty())
    GTEST_SKIP() << "no real traces in " << VRAMSCOPE_REAL_TRACES_DIR
                 << " (third-party snapshots are read in place, never copied here)";
  SUCCEED();
}

}  // namespace
}  // namespace mem
