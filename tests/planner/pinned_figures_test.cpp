// pinned_figures_test.cpp — the sweep figures of mlp, resnet18 and resnet50 as they were
// when those models were C++ builders (commit 20f2c27), before they became model files.
// Reading the same network from a file must not move a single byte: parameter order,
// op order and what each op saves all show up in these numbers.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "vramscope/planner/sweep.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::planner {
namespace {

struct Pinned {
  const char* model;
  const char* options;
  std::size_t segments;
  nn::Precision precision;
  std::int64_t peak_allocated, peak_reserved, peak_device_used, allocated_end, reserved_end;
};

// Captured from the C++ builders on sim:a100-80g, 2 steps, PyTorch's default allocator settings.
constexpr Pinned kPinned[] = {
#include "pinned_figures.inc"
};

TEST(PinnedFigures, ZooModelsGiveTheFiguresOfTheirCppBuilders) {
  for (const Pinned& p : kPinned) {
    SweepSpec spec;
    spec.model = models::find(p.model);
    spec.model_options = nn::ModelOptions::parse(p.options);
    spec.device = "sim:a100-80g";
    spec.segments = {p.segments};
    spec.precisions = {p.precision};
    spec.alloc_confs = {""};
    spec.steps = 2;
    const SweepResult result = run_sweep(spec);
    ASSERT_EQ(result.rows.size(), 1u);
    const SweepRow& row = result.rows[0];
    SCOPED_TRACE(std::string(p.model) + " " + p.options + " " + row.label());
    ASSERT_TRUE(row.fits());
    EXPECT_EQ(row.figures.peak_allocated, p.peak_allocated);
    EXPECT_EQ(row.figures.peak_reserved, p.peak_reserved);
    // Since these were pinned, the nvidia-smi view also counts the libraries' kernels loaded
    // when they first run (stack.cpp): cuBLAS for every model, cuDNN for the convolutional ones.
    const SimDeviceConfig a100 = sim_preset("a100-80g");
    const std::int64_t modules =
        static_cast<std::int64_t>(a100.cublas_bytes + (std::string(p.model) == "mlp" ? 0 : a100.cudnn_bytes));
    EXPECT_EQ(row.figures.peak_device_used, p.peak_device_used + modules);
    EXPECT_EQ(row.figures.allocated_end, p.allocated_end);
    EXPECT_EQ(row.figures.reserved_end, p.reserved_end);
  }
}

}  // namespace
}  // namespace mem::planner
