// sweep_test.cpp — the sweep engine against the runtime's own report: every
// figure the command prints must be what nn::train() measures on a fresh
// allocator of its own (an independent path through device, allocator and
// trainer), and OOM rows, savings and the best mark must follow from them.
#include <gtest/gtest.h>

#include <algorithm>

#include "sweep.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/runtime/training.hpp"

namespace mem::tools {
namespace {

SweepSpec small_spec() {
  SweepSpec spec;
  spec.model = "mlp";
  spec.model_options = nn::ModelOptions::parse("depth=6,width=512,batch=512");
  spec.device = "sim:capacity=2GiB,context=128MiB";
  spec.segments = {0, 2, 3, 4};
  spec.precisions = {nn::Precision::F32, nn::Precision::F16};
  spec.alloc_confs = {""};
  spec.steps = 2;
  return spec;
}

nn::TrainReport reference(const SweepSpec& spec, const SweepRow& row) {
  nn::TrainConfig cfg;
  cfg.model = spec.model;
  cfg.model_options = spec.model_options;
  cfg.device = spec.device;
  cfg.steps = spec.steps;
  cfg.segments = std::max<std::size_t>(row.segments, 1);
  cfg.precision = row.precision;
  cfg.alloc_conf = row.alloc_conf;
  return nn::train(cfg);
}

TEST(Sweep, FiguresEqualTheRuntimesOwnReport) {
  const SweepSpec spec = small_spec();
  const SweepResult result = run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 8u);
  EXPECT_TRUE(result.baselines.empty());
  for (const SweepRow& row : result.rows) {
    SCOPED_TRACE(row.label());
    ASSERT_TRUE(row.fits());
    const nn::TrainReport ref = reference(spec, row);
    EXPECT_EQ(row.figures.peak_allocated, ref.peak_allocated);
    EXPECT_EQ(row.figures.peak_reserved, ref.peak_reserved);
    EXPECT_EQ(row.figures.peak_device_used, ref.peak_device_used);
    EXPECT_EQ(row.figures.allocated_end, ref.steps.back().allocated_end);
    EXPECT_EQ(row.figures.reserved_end, ref.steps.back().reserved_end);
    EXPECT_DOUBLE_EQ(row.figures.recompute_ratio, ref.recompute_ratio);
    EXPECT_EQ(row.figures.steps_done, 2u);
    EXPECT_GE(row.figures.unallocated_at_peak, 0);
    EXPECT_LE(row.figures.peak_allocated + row.figures.unallocated_at_peak, row.figures.peak_reserved);
    // nvidia-smi: the context plus the reserved segments (2 MiB granularity).
    EXPECT_GE(row.figures.peak_device_used, row.figures.peak_reserved + static_cast<std::int64_t>(128 * MiB));
  }
}

TEST(Sweep, SavingIsAgainstTheSameDtypeWithoutCheckpointing) {
  const SweepResult result = run_sweep(small_spec());
  for (const SweepRow& row : result.rows) {
    const auto base = std::find_if(result.rows.begin(), result.rows.end(), [&](const SweepRow& r) {
      return r.precision == row.precision && r.segments == 0;
    });
    ASSERT_NE(base, result.rows.end());
    ASSERT_TRUE(row.saving.has_value());
    EXPECT_EQ(*row.saving, base->figures.peak_allocated - row.figures.peak_allocated);
    EXPECT_DOUBLE_EQ(row.saving_fraction, static_cast<double>(*row.saving) /
                                              static_cast<double>(base->figures.peak_allocated));
  }
}

TEST(Sweep, BestIsTheLowestNvidiaSmiPeakOfEachDtype) {
  const SweepResult result = run_sweep(small_spec());
  for (const nn::Precision p : {nn::Precision::F32, nn::Precision::F16}) {
    std::int64_t lowest = INT64_MAX;
    for (const SweepRow& r : result.rows) {
      if (r.precision == p) lowest = std::min(lowest, r.figures.peak_device_used);
    }
    int marked = 0;
    for (const SweepRow& r : result.rows) {
      if (r.precision != p || !r.best) continue;
      ++marked;
      EXPECT_EQ(r.figures.peak_device_used, lowest);
    }
    EXPECT_EQ(marked, 1);
  }
}

TEST(Sweep, OutOfMemoryIsARowAndTheSweepGoesOn) {
  SweepSpec spec = small_spec();
  spec.model_options = nn::ModelOptions::parse("depth=16,width=1024,batch=4096");
  spec.device = "sim:capacity=600MiB,context=100MiB";
  spec.segments = {0, 4};
  spec.precisions = {nn::Precision::F32};
  const SweepResult result = run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 2u);
  const SweepRow& oom = result.rows[0];
  ASSERT_FALSE(oom.fits());
  const auto& f = oom.oom->figures;
  EXPECT_EQ(f.device_total, 600 * MiB);
  EXPECT_GT(f.requested, f.device_free);
  EXPECT_GE(f.reserved, f.allocated);
  EXPECT_FALSE(oom.best);
  EXPECT_FALSE(oom.saving.has_value());
  EXPECT_NE(oom.oom->phase, Phase::None);
  // What it needs, measured without the limit, is what the runtime measures on a big device.
  ASSERT_TRUE(oom.unlimited.has_value());
  SweepSpec big = spec;
  big.device = "sim:capacity=64GiB,context=100MiB";
  const nn::TrainReport ref = reference(big, oom);
  EXPECT_EQ(oom.unlimited->peak_allocated, ref.peak_allocated);
  EXPECT_GT(oom.unlimited->peak_device_used, static_cast<std::int64_t>(600 * MiB));

  const SweepRow& fits = result.rows[1];
  EXPECT_TRUE(fits.fits());
  EXPECT_TRUE(fits.best);
  ASSERT_TRUE(fits.saving.has_value());
  EXPECT_EQ(*fits.saving, oom.unlimited->peak_allocated - fits.figures.peak_allocated);
}

TEST(Sweep, BaselineRunWhenZeroSegmentsIsNotAsked) {
  SweepSpec spec = small_spec();
  spec.segments = {2, 3};
  spec.precisions = {nn::Precision::F32};
  const SweepResult result = run_sweep(spec);
  ASSERT_EQ(result.baselines.size(), 1u);
  const std::int64_t base = result.baselines[0].figures.peak_allocated;
  for (const SweepRow& row : result.rows) {
    ASSERT_TRUE(row.saving.has_value());
    EXPECT_EQ(*row.saving, base - row.figures.peak_allocated);
  }
}

TEST(Sweep, ValidationNamesWhatIsValid) {
  SweepSpec spec = small_spec();
  spec.segments = {13};  // mlp depth 6 has 12 sequential modules
  try {
    validate_sweep(spec);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("12"), std::string::npos) << e.what();
  }
  spec.segments = {12};
  EXPECT_NO_THROW(validate_sweep(spec));
  spec.model = "nosuchnet";
  EXPECT_THROW(validate_sweep(spec), UsageError);
  spec = small_spec();
  spec.device = "sim:capacity=lots";
  EXPECT_THROW(validate_sweep(spec), UsageError);
  spec = small_spec();
  spec.alloc_confs = {"max_split_size_mb:-1"};
  EXPECT_THROW(validate_sweep(spec), UsageError);
}

}  // namespace
}  // namespace mem::tools
