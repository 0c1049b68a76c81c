// batch_search_test.cpp — --batch / --seq lists, --max-batch and the model options.
// Each list row must equal a sweep of that one batch (the lists add no state), and the
// largest batch found must fit while one more sample runs out of memory, both checked by sweeps
// of their own.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>

#include "vramscope/planner/max_batch.hpp"
#include "max_batch_report.hpp"
#include "vramscope/planner/sweep.hpp"
#include "usage_error.hpp"
#include "model_args.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::tools {
namespace {

planner::SweepSpec mlp_spec() {
  planner::SweepSpec spec;
  spec.model = models::find("mlp");
  spec.model_options = nn::ModelOptions::parse("depth=6,width=512");
  spec.device = "sim:capacity=1GiB,context=128MiB";
  spec.segments = {0, 3};
  spec.precisions = {nn::Precision::F32};
  spec.alloc_confs = {""};
  spec.steps = 2;
  return spec;
}

/// The one row of `spec` at one batch and segment count, from a sweep of its own.
planner::SweepRow single(planner::SweepSpec spec, std::int64_t batch, std::size_t segments, std::int64_t seq = 0) {
  spec.batches.clear();
  spec.seqs.clear();
  spec.model_options.batch = batch;
  if (seq > 0) spec.model_options.seq = seq;
  spec.segments = {segments};
  const planner::SweepResult r = planner::run_sweep(spec);
  EXPECT_EQ(r.rows.size(), 1u);
  return r.rows.front();
}

TEST(BatchList, EachRowEqualsASweepOfItsOwnBatch) {
  planner::SweepSpec spec = mlp_spec();
  spec.batches = {256, 1024, 256, 64};  // the repeat is dropped
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 6u);  // 3 batches x 2 segment counts
  const std::int64_t expected_batches[] = {256, 256, 1024, 1024, 64, 64};
  for (std::size_t i = 0; i < result.rows.size(); ++i) {
    const planner::SweepRow& row = result.rows[i];
    SCOPED_TRACE(row.label());
    EXPECT_EQ(row.batch, expected_batches[i]);
    EXPECT_EQ(row.shape, "batch " + std::to_string(row.batch));
    const planner::SweepRow ref = single(spec, row.batch, row.segments);
    EXPECT_EQ(row.figures.peak_allocated, ref.figures.peak_allocated);
    EXPECT_EQ(row.figures.peak_reserved, ref.figures.peak_reserved);
    EXPECT_EQ(row.figures.peak_device_used, ref.figures.peak_device_used);
    EXPECT_EQ(row.fits(), ref.fits());
    // Saving and the star are per batch: each batch has its own baseline and best row.
    EXPECT_EQ(row.saving, ref.saving);
  }
  EXPECT_EQ(result.rows[0].label(), "f32 batch 256 seg 0");
  // A star in every batch's group: each is compared only with its own batch.
  for (std::size_t g = 0; g < 3; ++g) {
    EXPECT_TRUE(result.rows[2 * g].best || result.rows[2 * g + 1].best) << g;
  }
}

TEST(SeqList, Gpt2SweepsSequenceLengthsAndAModelWithoutOneRefusesThem) {
  planner::SweepSpec spec;
  spec.model = models::find("gpt2");
  spec.model_options = nn::ModelOptions::parse("batch=1");
  spec.device = "sim:a100-80g";
  spec.segments = {0};
  spec.precisions = {nn::Precision::Amp};
  spec.alloc_confs = {""};
  spec.steps = 1;
  // Long enough that the activations, not the optimizer step, make the peak.
  spec.seqs = {512, 1024};
  const planner::SweepResult result = planner::run_sweep(spec);
  ASSERT_EQ(result.rows.size(), 2u);
  EXPECT_EQ(result.rows[1].seq, 1024);
  EXPECT_EQ(result.rows[1].shape, "seq 1024");
  EXPECT_EQ(result.rows[1].figures.peak_allocated, single(spec, 1, 0, 1024).figures.peak_allocated);
  EXPECT_LT(result.rows[0].figures.peak_allocated, result.rows[1].figures.peak_allocated);

  planner::SweepSpec mlp = mlp_spec();
  mlp.seqs = {128, 256};
  EXPECT_THROW(planner::validate_sweep(mlp), UsageError);
  // Every batch of the list is checked before anything runs: an overflowing one is refused.
  planner::SweepSpec huge = mlp_spec();
  huge.model_options.width = std::int64_t{1} << 31;
  huge.batches = {1, std::int64_t{1} << 40};
  EXPECT_THROW(planner::validate_sweep(huge), UsageError);
}

TEST(MaxBatch, TheBatchFoundFitsAndOneMoreSampleDoesNot) {
  planner::SweepSpec spec = mlp_spec();
  spec.segments = {0, 3};
  spec.precisions = {nn::Precision::F32, nn::Precision::F16};
  const planner::MaxBatchResult result = planner::find_max_batches(spec);
  ASSERT_EQ(result.rows.size(), 4u);
  for (const planner::MaxBatchRow& row : result.rows) {
    SCOPED_TRACE(row.label());
    ASSERT_GT(row.max_batch, 1);
    planner::SweepSpec at = spec;
    at.precisions = {row.precision};
    const planner::SweepRow fits = single(at, row.max_batch, row.segments);
    const planner::SweepRow over = single(at, row.max_batch + 1, row.segments);
    EXPECT_TRUE(fits.fits());
    EXPECT_TRUE(over.oom.has_value());
    // The figures shown are those of the run at the batch found, and where batch + 1 ran out.
    EXPECT_EQ(row.at_max.peak_allocated, fits.figures.peak_allocated);
    EXPECT_EQ(row.at_max.peak_device_used, fits.figures.peak_device_used);
    ASSERT_TRUE(row.over.has_value());
    EXPECT_EQ(row.over->figures.requested, over.oom->figures.requested);
    EXPECT_EQ(row.over->module, over.oom->module);
    // Doubling then bisection: one probe per doubling and one per halving of the bracket.
    const auto bits = static_cast<std::size_t>(std::bit_width(static_cast<std::uint64_t>(row.max_batch)));
    EXPECT_LE(row.probes, 2 * bits + 1);
  }
  // Checkpointing lets more samples fit, and f16 more than f32.
  EXPECT_GT(result.rows[1].max_batch, result.rows[0].max_batch);
  EXPECT_GT(result.rows[2].max_batch, result.rows[0].max_batch);
  EXPECT_TRUE(result.rows[1].best);
  EXPECT_TRUE(result.rows[3].best);
  EXPECT_EQ(result.probes, result.rows[0].probes + result.rows[1].probes + result.rows[2].probes +
                               result.rows[3].probes);
}

TEST(MaxBatch, EnginesThatHookModulesSearchWithoutSegments) {
  // FSDP2 and ZeRO-3 wrap the modules that checkpoint_sequential's segments would cut across:
  // as in sweep, their one row runs without segments, and its batch fits.
  for (const char* engine : {"fsdp:8", "zero3:8"}) {
    SCOPED_TRACE(engine);
    planner::SweepSpec spec = mlp_spec();
    spec.device = "sim:capacity=4GiB,context=128MiB";
    spec.precisions = {nn::Precision::BF16};
    spec.parallels = {nn::parse_parallel(engine)};
    const planner::MaxBatchResult result = planner::find_max_batches(spec);
    ASSERT_EQ(result.rows.size(), 1u);
    EXPECT_EQ(result.rows[0].segments, 0u);
    EXPECT_GT(result.rows[0].max_batch, 1);
    EXPECT_TRUE(single(spec, result.rows[0].max_batch, 0).fits());
  }
}

TEST(MaxBatch, NothingFitsIsZeroWithTheOutOfMemoryOfBatchOne) {
  planner::SweepSpec spec = mlp_spec();
  spec.model_options.width = 8192;  // 6 x 8192^2 x 4 B = 1.5 GiB of weights on a 1 GiB card
  spec.segments = {0};
  const planner::MaxBatchResult result = planner::find_max_batches(spec);
  ASSERT_EQ(result.rows.size(), 1u);
  EXPECT_EQ(result.rows[0].max_batch, 0);
  EXPECT_EQ(result.rows[0].probes, 1u);
  ASSERT_TRUE(result.rows[0].over.has_value());
  EXPECT_EQ(result.rows[0].over->step, 0u);  // while allocating the parameters
  EXPECT_FALSE(result.rows[0].best);
  EXPECT_NE(max_batch_report(result).find("none [1]"), std::string::npos);
}

TEST(MaxBatch, AConfigurationPyTorchRefusesHasNoBatch) {
  // resnet18 at 5 segments: a checkpointed segment begins with the stem's in-place ReLU.
  planner::SweepSpec spec;
  spec.model = models::find("resnet18");
  spec.model_options = nn::ModelOptions::parse("image=32");
  spec.device = "sim:capacity=1GiB,context=128MiB";
  spec.segments = {0, 8};
  spec.precisions = {nn::Precision::F32};
  spec.alloc_confs = {""};
  spec.steps = 1;
  const planner::MaxBatchResult result = planner::find_max_batches(spec);
  ASSERT_EQ(result.rows.size(), 2u);
  EXPECT_GT(result.rows[0].max_batch, 0);
  EXPECT_EQ(result.rows[1].max_batch, 0);
  EXPECT_TRUE(result.rows[1].error.has_value());
  EXPECT_EQ(result.rows[1].probes, 1u);
}

TEST(MaxBatch, OptionsThatDoNotApplyAreRefused) {
  planner::SweepSpec given = mlp_spec();
  given.model_options.batch = 32;
  EXPECT_THROW(planner::find_max_batches(given), UsageError);
  planner::SweepSpec list = mlp_spec();
  list.batches = {32, 64};
  EXPECT_THROW(planner::find_max_batches(list), UsageError);
  planner::SweepSpec compute = mlp_spec();
  compute.mode = nn::ExecMode::Compute;
  EXPECT_THROW(planner::find_max_batches(compute), UsageError);
}

TEST(MaxBatch, CsvAndJsonCarryEveryRow) {
  planner::SweepSpec spec = mlp_spec();
  const planner::MaxBatchResult result = planner::find_max_batches(spec);
  const std::string csv = max_batch_csv(result);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 3);  // header + 2 rows
  const nlohmann::json j = max_batch_json(result);
  ASSERT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["rows"][0]["max_batch"].get<std::int64_t>(), result.rows[0].max_batch);
  EXPECT_EQ(j["rows"][1]["max_allocated"].get<std::int64_t>(), result.rows[1].at_max.peak_allocated);
}

}  // namespace
}  // namespace mem::tools

namespace mem::tools {
namespace {

TEST(ModelArgs, AnOptionErrorNamesTheFlagTheModelCameFrom) {
  const auto file = models::ModelFile::parse(
      R"({"format": "vramscope-model", "version": 1, "name": "tiny", "options": {"batch": 2},
          "input": {"shape": ["batch", 4]}, "loss": {"type": "mse"},
          "layers": [{"name": "fc", "type": "Linear", "in_features": 4, "out_features": 4}]})",
      "tiny.json");
  const auto message = [](const nn::ModelSource& source) {
    try {
      (void)planner::describe(source, nn::ModelOptions::parse("depth=3"));
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message(*file).rfind("--model-file: tiny has no depth option", 0), 0u) << message(*file);
  EXPECT_EQ(message(*models::find("resnet18")).rfind("--model: resnet18 has no depth option", 0), 0u);
}

}  // namespace
}  // namespace mem::tools

namespace mem::tools {
namespace {

// Pipeline parallel: the batches searched are multiples of the micro-batches, and a batch fits
// when every stage's step does; the answer's stages fit, and the next multiple runs out on one.
TEST(MaxBatch, PipelineStagesAllFitAndTheNextMultipleDoesNot) {
  planner::SweepSpec spec;
  spec.model = models::HfConfig::parse(
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
          "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
          "tie_word_embeddings": false})",
      "ref-llama", "test");
  spec.model_options = nn::ModelOptions::parse("seq=128,attn=sdpa");
  spec.device = "sim:capacity=1GiB,context=128MiB";
  spec.segments = {0};
  spec.precisions = {nn::Precision::BF16};
  spec.alloc_confs = {""};
  spec.parallels = {nn::parse_parallel("pp:2", "microbatches=2")};
  spec.every_stage = true;
  const planner::MaxBatchResult result = planner::find_max_batches(spec);
  ASSERT_EQ(result.rows.size(), 1u);
  const std::int64_t best = result.rows.front().max_batch;
  ASSERT_GT(best, 0);
  EXPECT_EQ(best % 2, 0);
  const auto fits = [&](std::int64_t batch, std::size_t stage) {
    planner::SweepSpec one = spec;
    one.every_stage = false;
    one.model_options.batch = batch;
    one.parallels.front().stage = stage;
    return planner::run_sweep(one).rows.front().fits();
  };
  EXPECT_TRUE(fits(best, 0));
  EXPECT_TRUE(fits(best, 1));
  EXPECT_FALSE(fits(best + 2, 0) && fits(best + 2, 1));
}

TEST(MaxBatch, EachScheduleSearchesTheBatchesItTakes) {
  // One sample per micro-batch when microbatches is not given: 1F1B from P on, interleaved
  // schedules (ZB1P too) in multiples of P, DualPipeV from 2P on, ZBV any.
  const auto grid = [](const char* schedule) {
    const planner::BatchGrid g = planner::batch_grid(nn::parse_parallel("pp:4", schedule));
    return std::pair<std::int64_t, std::int64_t>{g.lowest, g.step};
  };
  EXPECT_EQ(grid("schedule=1f1b"), (std::pair<std::int64_t, std::int64_t>{4, 1}));
  EXPECT_EQ(grid("schedule=interleaved1f1b"), (std::pair<std::int64_t, std::int64_t>{4, 4}));
  EXPECT_EQ(grid("schedule=interleavedzerobubble"), (std::pair<std::int64_t, std::int64_t>{4, 4}));
  EXPECT_EQ(grid("schedule=dualpipev"), (std::pair<std::int64_t, std::int64_t>{8, 1}));
  EXPECT_EQ(grid("schedule=zbvzerobubble"), (std::pair<std::int64_t, std::int64_t>{1, 1}));
  EXPECT_EQ(grid("microbatches=8,schedule=dualpipev"), (std::pair<std::int64_t, std::int64_t>{8, 8}));
}

}  // namespace
}  // namespace mem::tools
