// hooks_test.cpp — module hooks, the MemoryLogger and memory_summary's layout.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "test_support.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/hooks.hpp"
#include "vramscope/instrumentation/memory_logger.hpp"
#include "vramscope/instrumentation/summary.hpp"
#include "vramscope/instrumentation/timeline.hpp"

namespace mem {
namespace {

TEST(ModuleHookTest, FiresPreAndPostWithSnapshots) {
  auto alloc = test::make_allocator();
  std::vector<std::string> log;
  {
    ModuleHook hook{*alloc, [&](const ModuleHookEvent& e) {
                      log.push_back(std::string(e.hook_name()) + " " + std::string(e.path) + " " +
                                    std::to_string(e.depth) + " " +
                                    std::to_string(e.snapshot.allocated_bytes() / MiB));
                    }};
    void* p = nullptr;
    {
      ModuleScope net{"net", Phase::Forward};
      {
        ModuleScope fc{"net.fc", Phase::Forward};
        p = alloc->allocate(4 * MiB);
      }
    }
    {
      ModuleScope fc{"net.fc", Phase::Backward};
      alloc->deallocate(p);
    }
  }
  {
    ModuleScope after{"net", Phase::Forward};  // hook gone: nothing logged
  }
  const std::vector<std::string> want = {
      "pre-forward net 0 0", "pre-forward net.fc 1 0", "forward net.fc 1 4",
      "forward net 0 4",     "pre-backward net.fc 0 4", "backward net.fc 0 0"};
  EXPECT_EQ(log, want);
}

TEST(ModuleHookTest, ExceptionsInPostHooksAreCountedNotThrown) {
  auto alloc = test::make_allocator();
  ModuleHook hook{*alloc, [](const ModuleHookEvent& e) {
                    if (e.point == HookPoint::Post) throw std::runtime_error("boom");
                  }};
  { ModuleScope s{"m", Phase::Forward}; }
  EXPECT_EQ(hook.dropped_exceptions(), 1u);
}

TEST(MemoryLoggerTest, PrintsTheIndentedTreeWithChanges) {
  auto alloc = test::make_allocator();
  std::ostringstream out;
  void* p = nullptr;
  {
    MemoryLogger logger{*alloc, out};
    {
      ModuleScope net{"net", Phase::Forward};
      ModuleScope conv{"net.conv1", Phase::Forward};
      p = alloc->allocate(4 * MiB);
    }
    EXPECT_EQ(logger.lines(), 4u);
  }
  alloc->deallocate(p);
  const std::string text = out.str();
  std::istringstream lines(text);
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  ASSERT_GE(rows.size(), 6u) << text;
  EXPECT_EQ(rows[0].rfind("hook", 0), 0u);
  EXPECT_EQ(rows[1].rfind("pre-forward    net ", 0), 0u) << rows[1];
  EXPECT_EQ(rows[2].rfind("pre-forward      conv1 ", 0), 0u) << rows[2];
  EXPECT_EQ(rows[3].rfind("forward          conv1 ", 0), 0u) << rows[3];
  EXPECT_NE(rows[3].find("+4.00 MiB"), std::string::npos) << rows[3];
  EXPECT_NE(rows[4].find("+0.00 MiB"), std::string::npos) << rows[4];
  EXPECT_EQ(rows[5].rfind("totals: 4 lines; peak allocated 4.00 MiB", 0), 0u) << rows[5];
}

TEST(MemorySummaryTest, FollowsPyTorchsLayout) {
  auto alloc = test::make_allocator();
  void* p = alloc->allocate(5 * MiB);
  const std::string text = memory_summary(*alloc);
  EXPECT_NE(text.find("|                  PyTorch CUDA memory summary, device ID 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("|            CUDA OOMs: 0            |        cudaMalloc retries: 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"),
            std::string::npos);
  // PyTorch picks KiB for 5 MiB (the unit steps up only from 768 of the next).
  EXPECT_NE(text.find("| Allocated memory      |   5120 KiB |   5120 KiB |   5120 KiB |      0 B   |"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("|       from large pool |   5120 KiB |"), std::string::npos);
  EXPECT_NE(text.find("| GPU reserved memory   |  20480 KiB |"), std::string::npos) << text;
  EXPECT_NE(text.find("| Allocations           |       1    |"), std::string::npos) << text;
  for (const char* row : {"Active memory", "Requested memory", "Non-releasable memory",
                          "Active allocs", "GPU reserved segments", "Non-releasable allocs",
                          "Oversize allocations", "Oversize GPU segments", "nvidia-smi view",
                          "CUDA context", "Reserved unallocated", "Largest free block"}) {
    EXPECT_NE(text.find(row), std::string::npos) << row;
  }
  const std::string brief = memory_summary(snapshot(*alloc), {.abbreviated = true});
  EXPECT_EQ(brief.find("from large pool"), std::string::npos);
  alloc->deallocate(p);
}

TEST(TimelineTest, RecordsSamplesSlicesAndRendersThem) {
  auto alloc = test::make_allocator();
  Timeline timeline{*alloc};
  {
    ModuleScope fwd{"net", Phase::Forward};
    alloc->deallocate(alloc->allocate(64 * MiB));
  }
  { ModuleScope opt{"optimizer", Phase::Optimizer}; }
  timeline.stop();
  const auto samples = timeline.samples();
  ASSERT_GE(samples.size(), 4u);  // start, segment_alloc, alloc, free_completed
  EXPECT_EQ(samples.front().allocated_bytes, 0u);
  std::size_t peak = 0;
  for (const auto& s : samples) peak = std::max(peak, s.allocated_bytes);
  EXPECT_EQ(peak, 64 * MiB);
  const auto slices = timeline.slices();
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(context_info(slices[0].context).path, "net");
  EXPECT_GE(slices[0].end_us, slices[0].begin_us);
  const std::string svg = memory_plot_svg(timeline);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  for (const char* id : {"id=\"allocated\"", "id=\"reserved\"", "id=\"nvidia-smi\"", "id=\"peak\"",
                         "peak allocated 64.00 MiB", ">forward<", ">optimizer<"}) {
    EXPECT_NE(svg.find(id), std::string::npos) << id;
  }
  const std::string trace = perfetto_trace_json(timeline);
  EXPECT_NE(trace.find("\"traceEvents\""), std::string::npos);
}

}  // namespace
}  // namespace mem
