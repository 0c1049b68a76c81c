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

std::vector<std::string> split_lines(const std::string& text) {
  std::istringstream lines(text);
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  return rows;
}

// A hand-built step: a forward through net and net.fc, a backward with the
// step's "loss" scope around the loss node's own and two autograd nodes of
// net.fc (the first allocating a transient 2 MiB: the peak between lines), then
// an optimizer update. net never opens in backward or the optimizer, so there
// net.fc keeps its full path (indented under net all the same).
TEST(MemoryLoggerTest, PrintsOneLinePerHookAndModuleCall) {
  auto alloc = test::make_allocator();
  std::ostringstream out;
  {
    MemoryLogger logger{*alloc, out, {.module_type = [](std::string_view path) {
                                        return std::string(path == "net"      ? "Net"
                                                           : path == "net.fc" ? "Linear"
                                                                              : "");
                                      }}};
    void* weight_grad = nullptr;
    {
      ModuleScope net{"net", Phase::Forward};
      ModuleScope fc{"net.fc", Phase::Forward};
      weight_grad = alloc->allocate(4 * MiB);
    }
    {
      ModuleScope step{"loss", Phase::Backward};
      { ModuleScope node{"loss", Phase::Backward}; }
      {
        ModuleScope node{"net.fc", Phase::Backward};
        alloc->deallocate(alloc->allocate(2 * MiB));
      }
      {
        ModuleScope node{"net.fc", Phase::Backward};
        alloc->deallocate(weight_grad);
      }
    }
    { ModuleScope update{"net.fc", Phase::Optimizer}; }
    EXPECT_EQ(logger.lines(), 10u);  // the optimizer's post line is still held
    logger.finish();
    EXPECT_EQ(logger.lines(), 11u);
    { ModuleScope late{"net", Phase::Forward}; }  // after finish(): not logged
  }
  // clang-format off
  const std::vector<std::string> want = {
    "hook           module                                          allocated       change peak between     reserved   nvidia-smi",
    "pre-forward    net (Net)                                        0.00 MiB    +0.00 MiB     0.00 MiB     0.00 MiB   420.00 MiB",
    "pre-forward      fc (Linear)                                    0.00 MiB    +0.00 MiB     0.00 MiB     0.00 MiB   420.00 MiB",
    "forward          fc (Linear)                                    4.00 MiB    +4.00 MiB     4.00 MiB    20.00 MiB   440.00 MiB",
    "forward        net (Net)                                        4.00 MiB    +0.00 MiB     4.00 MiB    20.00 MiB   440.00 MiB",
    "pre-backward   loss                                             4.00 MiB    +0.00 MiB     4.00 MiB    20.00 MiB   440.00 MiB",
    "backward       loss                                             4.00 MiB    +0.00 MiB     4.00 MiB    20.00 MiB   440.00 MiB",
    "pre-backward     net.fc (Linear)                                4.00 MiB    +0.00 MiB     4.00 MiB    20.00 MiB   440.00 MiB",
    "backward         net.fc (Linear)                                0.00 MiB    -4.00 MiB     6.00 MiB    20.00 MiB   440.00 MiB",
    "backward       loss                                             0.00 MiB    +0.00 MiB     0.00 MiB    20.00 MiB   440.00 MiB",
    "pre-optimizer    net.fc (Linear)                                0.00 MiB    +0.00 MiB     0.00 MiB    20.00 MiB   440.00 MiB",
    "optimizer        net.fc (Linear)                                0.00 MiB    +0.00 MiB     0.00 MiB    20.00 MiB   440.00 MiB",
    "totals: 11 lines; peak allocated 6.00 MiB, peak reserved 20.00 MiB, peak nvidia-smi 440.00 MiB "
    "(CUDA context 420.00 MiB); now allocated 0.00 MiB, reserved 20.00 MiB",
  };
  // clang-format on
  std::vector<std::string> rows = split_lines(out.str());
  ASSERT_GE(rows.size(), want.size()) << out.str();
  EXPECT_EQ(rows[want.size()].rfind("device: ", 0), 0u) << out.str();  // the assumptions line
  rows.resize(want.size());
  EXPECT_EQ(rows, want) << out.str();
}

// Without a type callback the tree comes from the scopes seen; a flattened prefix
// that never runs as a scope ("layer1") stays in the name; max_depth and
// pre_hooks filter; device_line = false leaves the assumptions out.
TEST(MemoryLoggerTest, FiltersByTreeDepthAndKeepsFlattenedPrefixes) {
  auto alloc = test::make_allocator();
  std::ostringstream out;
  {
    MemoryLogger logger{*alloc, out, {.pre_hooks = false, .max_depth = 1, .device_line = false}};
    ModuleScope block{"layer1.0", Phase::Forward};
    { ModuleScope conv{"layer1.0.conv1", Phase::Forward}; }
  }
  const std::vector<std::string> rows = split_lines(out.str());
  ASSERT_EQ(rows.size(), 3u) << out.str();
  // conv1 is below max_depth; the block's post line is held until the logger goes.
  EXPECT_EQ(rows[1].rfind("forward        layer1.0 ", 0), 0u) << rows[1];
  EXPECT_EQ(rows[2].rfind("totals: 1 lines;", 0), 0u) << rows[2];

  std::ostringstream out2;
  {
    MemoryLogger logger{*alloc, out2, {.max_depth = 0, .device_line = false}};
    {
      ModuleScope block{"layer1.0", Phase::Forward};
      ModuleScope conv{"layer1.0.conv1", Phase::Forward};
    }
  }
  const std::vector<std::string> rows2 = split_lines(out2.str());
  ASSERT_EQ(rows2.size(), 6u) << out2.str();
  EXPECT_EQ(rows2[1].rfind("pre-forward    layer1.0 ", 0), 0u) << rows2[1];
  EXPECT_EQ(rows2[2].rfind("pre-forward      conv1 ", 0), 0u) << rows2[2];
  EXPECT_EQ(rows2[3].rfind("forward          conv1 ", 0), 0u) << rows2[3];
  EXPECT_EQ(rows2[4].rfind("forward        layer1.0 ", 0), 0u) << rows2[4];
  EXPECT_EQ(rows2[5].rfind("totals: 4 lines;", 0), 0u) << rows2[5];
}

// Hidden scopes that run outside any open shown scope (an optimizer updating each
// parameter under its own module's scope) roll up into their own ancestor's line: their
// memory is not charged to whatever line comes next (issue 22, item 5).
TEST(MemoryLoggerTest, HiddenChildrenRollUpIntoTheirOwnAncestor) {
  auto alloc = test::make_allocator();
  std::ostringstream out;
  std::vector<void*> blocks;
  {
    MemoryLogger logger{*alloc, out, {.pre_hooks = false, .max_depth = 1, .device_line = false}};
    { ModuleScope w{"layer1", Phase::Forward}; }  // layer1 is a module (it ran as a scope)
    for (const char* child : {"layer1.0.conv1", "layer1.0.bn1", "layer1.1.conv1"}) {
      ModuleScope s{child, Phase::Optimizer};
      blocks.push_back(alloc->allocate(2 * MiB));
    }
    {
      ModuleScope fc{"fc", Phase::Optimizer};
      blocks.push_back(alloc->allocate(1 * MiB));
    }
  }
  const std::vector<std::string> rows = split_lines(out.str());
  ASSERT_EQ(rows.size(), 5u) << out.str();
  EXPECT_EQ(rows[2].rfind("optimizer      layer1 ", 0), 0u) << out.str();
  EXPECT_NE(rows[2].find("+6.00 MiB"), std::string::npos) << rows[2];
  EXPECT_EQ(rows[3].rfind("optimizer      fc ", 0), 0u) << out.str();
  EXPECT_NE(rows[3].find("+1.00 MiB"), std::string::npos) << rows[3];  // fc's own, nothing more
  for (void* p : blocks) alloc->deallocate(p);
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
