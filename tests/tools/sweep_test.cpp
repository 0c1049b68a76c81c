// sweep_test.cpp — the sweep engine against the runtime's own report: every
// figure the command prints must be what nn::train() measures on a fresh
// allocator of its own (an independent path through device, allocator and
// trainer), and OOM rows, savings and the best mark must follow from them.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "vramscope/planner/accepted_segments.hpp"
#include "vramscope/planner/sweep.hpp"
#include "sweep_export.hpp"
#include "sweep_report.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/runtime/training.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::tools {
namespace {

planner::SweepSpec small_spec() {
  planner::SweepSpec spec;
  spec.model = models::find("mlp");
  spec.model_options = nn::ModelOptions::parse("depth=6,width=512,batch=512");
  spec.device = "sim:capacity=2GiB,context=128MiB";
  spec.segments = {0, 2, 3, 4};
  spec.precisions = {nn::Precision::F32, nn::Precision::F16};
  spec.alloc_confs = {""};
  spec.steps = 2;
  return spec;
}

nn::TrainReport reference(const planner::SweepSpec& spec, const planner::SweepRow& row) {
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
  const planner::SweepSpec spec = small_spec();
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 8u);
  EXPECT_TRUE(result.baselines.empty());
  for (const planner::SweepRow& row : result.rows) {
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
  const planner::SweepResult result = planner::run_sweep(small_spec());
  for (const planner::SweepRow& row : result.rows) {
    const auto base = std::find_if(result.rows.begin(), result.rows.end(), [&](const planner::SweepRow& r) {
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
  const planner::SweepResult result = planner::run_sweep(small_spec());
  for (const nn::Precision p : {nn::Precision::F32, nn::Precision::F16}) {
    std::int64_t lowest = INT64_MAX;
    for (const planner::SweepRow& r : result.rows) {
      if (r.precision == p) lowest = std::min(lowest, r.figures.peak_device_used);
    }
    int marked = 0;
    for (const planner::SweepRow& r : result.rows) {
      if (r.precision != p || !r.best) continue;
      ++marked;
      EXPECT_EQ(r.figures.peak_device_used, lowest);
    }
    EXPECT_EQ(marked, 1);
  }
}

TEST(Sweep, OutOfMemoryIsARowAndTheSweepGoesOn) {
  planner::SweepSpec spec = small_spec();
  spec.model_options = nn::ModelOptions::parse("depth=16,width=1024,batch=4096");
  spec.device = "sim:capacity=824MiB,context=100MiB";
  spec.segments = {0, 4};
  spec.precisions = {nn::Precision::F32};
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 2u);
  const planner::SweepRow& oom = result.rows[0];
  ASSERT_FALSE(oom.fits());
  const auto& f = oom.oom->figures;
  EXPECT_EQ(f.device_total, 824 * MiB);
  EXPECT_GT(f.requested, f.device_free);
  EXPECT_GE(f.reserved, f.allocated);
  EXPECT_FALSE(oom.best);
  EXPECT_FALSE(oom.saving.has_value());
  EXPECT_NE(oom.oom->phase, Phase::None);
  // What it needs, measured without the limit, is what the runtime measures on a big device.
  ASSERT_TRUE(oom.unlimited.has_value());
  planner::SweepSpec big = spec;
  big.device = "sim:capacity=64GiB,context=100MiB";
  const nn::TrainReport ref = reference(big, oom);
  EXPECT_EQ(oom.unlimited->peak_allocated, ref.peak_allocated);
  EXPECT_GT(oom.unlimited->peak_device_used, static_cast<std::int64_t>(824 * MiB));

  const planner::SweepRow& fits = result.rows[1];
  EXPECT_TRUE(fits.fits());
  EXPECT_TRUE(fits.best);
  ASSERT_TRUE(fits.saving.has_value());
  EXPECT_EQ(*fits.saving, oom.unlimited->peak_allocated - fits.figures.peak_allocated);
}

TEST(Sweep, BaselineRunWhenZeroSegmentsIsNotAsked) {
  planner::SweepSpec spec = small_spec();
  spec.segments = {2, 3};
  spec.precisions = {nn::Precision::F32};
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.baselines.size(), 1u);
  const std::int64_t base = result.baselines[0].figures.peak_allocated;
  for (const planner::SweepRow& row : result.rows) {
    ASSERT_TRUE(row.saving.has_value());
    EXPECT_EQ(*row.saving, base - row.figures.peak_allocated);
  }
}

TEST(Sweep, AConfigurationPyTorchRefusesIsAnErrorRowNeverBest) {
  // PyTorch 2.11 refuses checkpoint_sequential(resnet50, 8): segment 2 begins with the stem's
  // ReLU(inplace=True), which modifies the input that segment's checkpoint saved.
  planner::SweepSpec spec;
  spec.model = models::find("resnet50");
  spec.model_options = nn::ModelOptions::parse("batch=2,image=32,classes=10");
  spec.device = "sim:h100-80g";
  spec.segments = {0, 2, 4, 8};
  spec.precisions = {nn::Precision::F32, nn::Precision::F16};
  spec.alloc_confs = {""};
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 8u);
  for (const planner::SweepRow& row : result.rows) {
    SCOPED_TRACE(row.label());
    EXPECT_FALSE(row.oom.has_value());
    if (row.segments != 8) {
      EXPECT_TRUE(row.fits());
      EXPECT_FALSE(row.error.has_value());
      continue;
    }
    ASSERT_TRUE(row.error.has_value());
    EXPECT_FALSE(row.fits());
    EXPECT_FALSE(row.best);
    EXPECT_FALSE(row.saving.has_value());
    EXPECT_FALSE(row.unlimited.has_value());
    EXPECT_EQ(row.error->step, 1u);
    EXPECT_EQ(row.error->phase, Phase::Backward);
    EXPECT_EQ(row.error->module, "maxpool");
    const std::string type = row.precision == nn::Precision::F32 ? "FloatTensor" : "HalfTensor";
    EXPECT_NE(row.error->message.find("modified by an inplace operation: [torch.cuda." + type +
                                      " [2, 64, 16, 16]], which is output 0 of ReluBackward0, is at version 1; "
                                      "expected version 0 instead."),
              std::string::npos)
        << row.error->message;
  }
  // One best per dtype, always among the rows that ran.
  for (const nn::Precision p : spec.precisions) {
    const auto best = std::count_if(result.rows.begin(), result.rows.end(),
                                    [&](const planner::SweepRow& r) { return r.precision == p && r.best; });
    EXPECT_EQ(best, 1);
  }

  const std::string text = sweep_report(result);
  EXPECT_NE(text.find("error [1]"), std::string::npos) << text;
  EXPECT_NE(text.find("[1] f32 seg 8: fails as on PyTorch, in step 1, backward of module maxpool: one of the"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("[2] f16 seg 8"), std::string::npos) << text;

  // The counts that would run, found by a dry run of each: 8 and up begin a segment with the ReLU.
  ASSERT_TRUE(result.accepted_segments.has_value());
  EXPECT_EQ(*result.accepted_segments, (std::vector<std::size_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_NE(text.find("Segment counts PyTorch accepts for resnet50: 0 (none), 2-7."), std::string::npos) << text;

  const std::string csv = sweep_csv(result);
  EXPECT_NE(csv.find(",error,error_step,error_phase,error_module"), std::string::npos) << csv;
  EXPECT_NE(csv.find(",false,false,0,"), std::string::npos) << csv;  // fits, best, steps of a refused row
  EXPECT_NE(csv.find(",\"one of the variables needed for gradient computation"), std::string::npos) << csv;
  const nlohmann::json j = sweep_json(result);
  const nlohmann::json& refused = j["rows"][3];
  EXPECT_EQ(refused["segments"], 8);
  EXPECT_EQ(refused["fits"], false);
  EXPECT_EQ(refused["best"], false);
  EXPECT_EQ(refused["error_step"], 1);
  EXPECT_EQ(refused["error_phase"], "backward");
  EXPECT_EQ(refused["error_module"], "maxpool");
  EXPECT_NE(refused["error"].get<std::string>().find("ReluBackward0"), std::string::npos);
  EXPECT_EQ(j["accepted_segments"], nlohmann::json({1, 2, 3, 4, 5, 6, 7}));
  EXPECT_TRUE(j["rows"][2]["error"].is_null());
  EXPECT_EQ(j["rows"][2]["fits"], true);
}

TEST(Sweep, AcceptedSegmentCountsOnlyWhenARowWasRefused) {
  // The mlp depth 6 with inplace ReLU that PyTorch ran on an H100: 4 and 7 refused.
  planner::SweepSpec spec = small_spec();
  spec.model = models::find("mlp");
  spec.model_options = nn::ModelOptions::parse("depth=6,width=64,batch=4,inplace=1");
  spec.segments = {0, 4};
  spec.precisions = {nn::Precision::F32};
  const planner::SweepResult refused = planner::run_sweep(spec);
  ASSERT_TRUE(refused.accepted_segments.has_value());
  EXPECT_EQ(*refused.accepted_segments, (std::vector<std::size_t>{1, 2, 3, 5, 6}));
  EXPECT_EQ(planner::describe_segment_counts(*refused.accepted_segments), "0 (none), 2-3, 5-6");
  spec.segments = {0, 5};
  const planner::SweepResult fine = planner::run_sweep(spec);
  EXPECT_FALSE(fine.accepted_segments.has_value());
  EXPECT_TRUE(sweep_json(fine)["accepted_segments"].is_null());
  EXPECT_EQ(sweep_report(fine).find("Segment counts PyTorch accepts"), std::string::npos);
}

TEST(Sweep, SegmentCountsReadAsTheSweepsOption) {
  EXPECT_EQ(planner::describe_segment_counts(std::vector<std::size_t>{}), "none");
  EXPECT_EQ(planner::describe_segment_counts(std::vector<std::size_t>{1}), "0 (none)");
  EXPECT_EQ(planner::describe_segment_counts(std::vector<std::size_t>{2}), "2");
  EXPECT_EQ(planner::describe_segment_counts(std::vector<std::size_t>{1, 2, 3, 4, 5}), "0 (none), 2-5");
  EXPECT_EQ(planner::describe_segment_counts(std::vector<std::size_t>{3, 5, 6, 9}), "3, 5-6, 9");
  // Past the bound the search is not made, and the hint says why (bounded work).
  EXPECT_NE(planner::describe_segment_counts(std::nullopt).find("not searched beyond 512"), std::string::npos);
}

TEST(Sweep, ValidationNamesWhatIsValid) {
  planner::SweepSpec spec = small_spec();
  spec.segments = {13};  // mlp depth 6 has 12 sequential modules
  try {
    planner::validate_sweep(spec);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("12"), std::string::npos) << e.what();
  }
  spec.segments = {12};
  EXPECT_NO_THROW(planner::validate_sweep(spec));
  EXPECT_THROW(models::find("nosuchnet"), Error);
  spec.model = nullptr;
  EXPECT_THROW(planner::validate_sweep(spec), UsageError);
  spec = small_spec();
  spec.device = "sim:capacity=lots";
  EXPECT_THROW(planner::validate_sweep(spec), UsageError);
  spec = small_spec();
  spec.alloc_confs = {"max_split_size_mb:-1"};
  EXPECT_THROW(planner::validate_sweep(spec), UsageError);
}

// The same checkpointing said two ways, a model file's own "checkpoint" marks and
// --checkpoint-modules naming the same modules, saves the same bytes against the same
// model without checkpointing (issue 49: the file's marks showed a saving of 0 B).
TEST(Sweep, AFilesOwnCheckpointMarksSaveWhatCheckpointModulesSave) {
  const std::string path = std::string(VRAMSCOPE_TEST_DATA_DIR) + "/plan-chain.json";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string marked = text.str();
  const std::string b1 = "\"name\": \"b1\",";
  ASSERT_NE(marked.find(b1), std::string::npos);
  marked.replace(marked.find(b1), b1.size(), b1 + " \"checkpoint\": true,");

  planner::SweepSpec named;
  named.model = models::ModelFile::load(path);
  named.device = "sim:h100-80g";
  named.segments = {0};
  named.precisions = {nn::Precision::F32};
  named.alloc_confs = {""};
  named.checkpoint_modules = std::vector<std::string>{"b1"};
  planner::SweepSpec own = named;
  own.model = models::ModelFile::parse(marked, "marked.json");
  own.checkpoint_modules.reset();

  const planner::SweepResult a = planner::run_sweep(named);
  const planner::SweepResult b = planner::run_sweep(own);
  ASSERT_EQ(a.rows.size(), 1u);
  ASSERT_EQ(b.rows.size(), 1u);
  EXPECT_EQ(b.rows[0].figures.peak_allocated, a.rows[0].figures.peak_allocated);
  ASSERT_TRUE(a.rows[0].saving && b.rows[0].saving);
  EXPECT_GT(*a.rows[0].saving, 0);
  EXPECT_EQ(*b.rows[0].saving, *a.rows[0].saving);
  // Measured against one run of the model without marks, as for --checkpoint-modules.
  ASSERT_EQ(b.baselines.size(), 1u);
  EXPECT_EQ(b.baselines[0].figures.peak_allocated, a.baselines[0].figures.peak_allocated);
}

}  // namespace
}  // namespace mem::tools
