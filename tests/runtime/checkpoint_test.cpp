// checkpoint_test.cpp — checkpointing changes memory, never results: identical
// losses and gradients for every segment count, identical dropout masks on the
// rerun, BatchNorm statistics updated once, and the reentrant pitfall reported.
#include <gtest/gtest.h>

#include "test_util.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

TEST(Checkpoint, MlpGivesIdenticalLossesAndGradientsForEverySegmentCount) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=6,width=16,batch=4");
  cfg.steps = 3;
  const test::TrainedRun base = test::train_computed(cfg);
  ASSERT_GT(base.losses[0], 0);
  EXPECT_NE(base.losses[0], base.losses[2]);  // training moves
  for (std::size_t k : {2u, 3u, 4u, 5u, 12u}) {
    for (auto mode : {CheckpointMode::NonReentrant, CheckpointMode::Reentrant}) {
      cfg.segments = k;
      cfg.checkpoint_mode = mode;
      cfg.input_requires_grad = mode == CheckpointMode::Reentrant;  // avoid the pitfall here
      const test::TrainedRun r = test::train_computed(cfg);
      EXPECT_EQ(r.losses, base.losses) << "segments " << k << " " << checkpoint_mode_name(mode);
      EXPECT_EQ(r.grads, base.grads) << "segments " << k << " " << checkpoint_mode_name(mode);
      EXPECT_GT(r.last.recompute_ratio, 0.0);
      EXPECT_LE(r.last.recompute_ratio, 1.0);
    }
  }
}

// A checkpointed BatchNorm's recompute updates its running statistics again, as PyTorch's does
// (torch.utils.checkpoint reruns the forward in training mode: num_batches_tracked counts 2 a
// step, and the running mean takes the momentum twice). The loss and the gradients do not
// change: training-mode batch norm normalizes by the batch's own statistics.
TEST(Checkpoint, ResnetBatchNormStatisticsMoveAgainInTheRecomputeAndGradientsMatch) {
  TrainConfig cfg;
  cfg.model = models::find("resnet18");
  cfg.model_options = ModelOptions::parse("batch=2,image=32,classes=10");
  cfg.optimizer.kind = OptimizerKind::SGD;
  cfg.steps = 2;
  const test::TrainedRun base = test::train_computed(cfg);
  cfg.segments = 4;
  const test::TrainedRun ckpt = test::train_computed(cfg);
  EXPECT_EQ(ckpt.losses, base.losses);
  EXPECT_EQ(ckpt.grads, base.grads);
  ASSERT_EQ(ckpt.buffers.size(), base.buffers.size());
  // bn1 (running_mean, running_var, num_batches_tracked first) is in the first segment, which
  // checkpoint_sequential checkpoints: two updates a step. The last BN is in the last
  // segment, which runs plainly: one a step, as without checkpointing.
  EXPECT_EQ(base.buffers[2], std::vector<double>{2.0});
  EXPECT_EQ(ckpt.buffers[2], std::vector<double>{4.0});
  EXPECT_NE(ckpt.buffers[0], base.buffers[0]);
  EXPECT_EQ(ckpt.buffers.back(), std::vector<double>{2.0});  // fc has none: last is a BN counter
  EXPECT_EQ(ckpt.buffers.end()[-3], base.buffers.end()[-3]);
}

TEST(Checkpoint, RerunReplaysDropoutMasks) {
  test::Env env(ExecMode::Compute, 3);
  Sequential net;
  net.append(std::make_unique<Linear>(8, 8));
  net.append(std::make_unique<Dropout>(0.5));
  net.append(std::make_unique<Linear>(8, 8));
  net.append(std::make_unique<Dropout>(0.5));
  net.append(std::make_unique<Linear>(8, 8));
  net.set_path("");
  net.materialize(env.rt, DType::F32);
  const Tensor x = uniform(env.rt, {4, 8}, -1, 1, DType::F32, 1);
  auto grads_for = [&](std::size_t segments) {
    for (Tensor& p : net.parameters()) p.reset_grad();
    env.rt.set_rng_state({3, 0});
    const Tensor y = checkpoint_sequential(net.modules(), segments, x);
    backward(sum(y));
    std::vector<std::vector<double>> g;
    for (const Tensor& p : net.parameters()) g.push_back(to_values(p.grad()));
    return g;
  };
  const auto base = grads_for(1);
  EXPECT_EQ(grads_for(2), base);
  EXPECT_EQ(grads_for(5), base);
}

TEST(Checkpoint, ReentrantWithoutInputGradLosesParameterGradientsAndSaysSo) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=4,width=8,batch=2");
  cfg.segments = 2;
  cfg.checkpoint_mode = CheckpointMode::Reentrant;
  cfg.steps = 1;
  const test::TrainedRun r = test::train_computed(cfg);
  // The first segment (Linear, ReLU, Linear, ReLU) runs under no_grad: 4 tensors lose grads.
  EXPECT_EQ(r.last.params_without_grad, 4u);
  EXPECT_TRUE(r.report.gradients_missing);
  ASSERT_FALSE(r.report.warnings.empty());
  EXPECT_NE(r.report.warnings[0].find("None of the inputs have requires_grad=True"), std::string::npos);
  EXPECT_EQ(r.last.flops.recompute, 0.0);  // nothing to rerun: no backward reaches the segment

  cfg.checkpoint_mode = CheckpointMode::NonReentrant;
  const test::TrainedRun ok = test::train_computed(cfg);
  EXPECT_EQ(ok.last.params_without_grad, 0u);
  EXPECT_FALSE(ok.report.gradients_missing);
}

TEST(Checkpoint, SplitFollowsPyTorch) {
  const SegmentPlan p = plan_segments(10, 3);  // size 3: [0,2] [3,5] checkpointed, 6..9 plain
  ASSERT_EQ(p.checkpointed.size(), 2u);
  EXPECT_EQ(p.checkpointed[0], std::make_pair(std::size_t{0}, std::size_t{2}));
  EXPECT_EQ(p.checkpointed[1], std::make_pair(std::size_t{3}, std::size_t{5}));
  EXPECT_EQ(p.tail_begin, 6u);
  EXPECT_TRUE(plan_segments(10, 1).checkpointed.empty());
  EXPECT_THROW(plan_segments(10, 11), Error);
  EXPECT_THROW(plan_segments(10, 0), Error);
}

/// Two stages a model file flattens into the top-level list ("stage.0", "stage.1", "head.0",
/// "head.1"), as the zoo's resnets keep layer1..4 for checkpoint_sequential.
std::shared_ptr<const ModelSource> staged_model() {
  return models::ModelFile::parse(R"({
    "format": "vramscope-model", "version": 1, "name": "staged",
    "options": {"batch": 4096, "width": 256}, "input": {"shape": ["batch", "width"]}, "loss": {"type": "mse"},
    "layers": [
      {"name": "stage", "type": "Sequential", "expand": true, "layers": [
        {"type": "Linear", "in_features": "width", "out_features": "width"}, {"type": "GELU"}]},
      {"name": "head", "type": "Sequential", "expand": true, "layers": [
        {"type": "Linear", "in_features": "width", "out_features": "width"}, {"type": "GELU"}]}]})",
                                  "staged.json");
}

TEST(CheckpointMarks, AFlattenedContainerIsCheckpointedWholeAsCheckpointOfItWouldBe) {
  // --checkpoint-modules stage: checkpoint(self.stage, x) over its two flattened children,
  // which is checkpoint_sequential's first segment of two here: the same memory and results.
  TrainConfig marked;
  marked.model = staged_model();
  marked.steps = 2;
  marked.checkpoint_modules = std::vector<std::string>{"stage"};
  TrainConfig sequential = marked;
  sequential.checkpoint_modules.reset();
  sequential.segments = 2;
  TrainConfig plain = sequential;
  plain.segments = 1;
  const test::TrainedRun a = test::train_computed(marked), b = test::train_computed(sequential), c = test::train_computed(plain);
  EXPECT_EQ(a.losses, c.losses);
  EXPECT_EQ(a.grads, c.grads);
  EXPECT_EQ(a.report.peak_allocated, b.report.peak_allocated);
  EXPECT_LT(a.report.peak_allocated, c.report.peak_allocated);
  EXPECT_DOUBLE_EQ(a.report.recompute_ratio, b.report.recompute_ratio);
  // A block inside it and the container together are refused, as two nested modules are.
  marked.checkpoint_modules = std::vector<std::string>{"stage", "stage.0"};
  EXPECT_THROW(test::train_computed(marked), Error);
}

TEST(CheckpointMarks, ACheckpointInsideACheckpointedModuleRebuildsThroughTheOuterOne) {
  // checkpoint() inside a checkpointed module (torchvision's memory-efficient DenseNet under
  // apply_activation_checkpointing): the inner inputs are the outer's placeholders, rebuilt by
  // the outer's rerun, and the gradients are the plain run's.
  const auto nested = [](bool outer, bool inner) {
    const std::string mark = outer ? R"("checkpoint": true, )" : "";
    const std::string inner_mark = inner ? R"("checkpoint": true, )" : "";
    return models::ModelFile::parse(R"({
      "format": "vramscope-model", "version": 1, "name": "nested",
      "options": {"batch": 64, "width": 32}, "input": {"shape": ["batch", "width"]}, "loss": {"type": "mse"},
      "layers": [
        {"name": "block", "type": "Sequential", )" + mark + R"("layers": [
          {"name": "fc1", "type": "Linear", "in_features": "width", "out_features": "width"},
          {"type": "Sequential", "inline": true, )" + inner_mark + R"("layers": [
            {"name": "act", "type": "GELU"},
            {"name": "fc2", "type": "Linear", "in_features": "width", "out_features": "width"}]},
          {"name": "act2", "type": "GELU"}]},
        {"name": "head", "type": "Linear", "in_features": "width", "out_features": "width"}]})",
                                    "nested.json");
  };
  TrainConfig cfg;
  cfg.steps = 2;
  cfg.model = nested(false, false);
  const test::TrainedRun plain = test::train_computed(cfg);
  cfg.model = nested(true, true);
  const test::TrainedRun both = test::train_computed(cfg);
  cfg.model = nested(true, false);
  const test::TrainedRun outer = test::train_computed(cfg);
  EXPECT_EQ(both.losses, plain.losses);
  EXPECT_EQ(both.grads, plain.grads);
  EXPECT_EQ(outer.grads, plain.grads);
  EXPECT_FALSE(both.report.gradients_missing);
}

}  // namespace
}  // namespace mem::nn

namespace mem::nn {
namespace {

/// Four residual blocks (Linear, GELU, Dropout) and a head, the blocks marked with `mark`
/// ("" for none), as apply_activation_checkpointing(check_fn=isinstance Block) marks them.
/// Activations of 2 MiB: a block keeps 4.5 MiB without checkpointing (the Linear's input,
/// GELU's input, the dropout mask), 2 MiB with it, well above the second cuBLAS workspace
/// the rerun in backward takes (the autograd thread's own).
std::shared_ptr<const ModelSource> marked_model(const std::string& mark, bool input_requires_grad = false) {
  const std::string block =
      R"({"type": "Residual", "class": "Block", "body": [
           {"name": "fc", "type": "Linear", "in_features": 256, "out_features": 256},
           {"name": "act", "type": "GELU"}, {"name": "drop", "type": "Dropout", "p": 0.25}])" +
      (mark.empty() ? std::string() : R"(, "checkpoint": )" + mark) + "}";
  return models::ModelFile::parse(
      R"({"format": "vramscope-model", "version": 1, "name": "marked", "options": {"batch": 2048},
          "input": {"shape": ["batch", 256])" +
          std::string(input_requires_grad ? R"(, "requires_grad": true)" : "") + R"(},
          "loss": {"type": "mse"},
          "layers": [{"repeat": 4, "layers": [)" + block + R"(]},
                     {"name": "head", "type": "Linear", "in_features": 256, "out_features": 256}]})",
      "marked.json");
}

// Marking the four blocks is checkpoint_sequential with 5 segments (each of the first four
// modules checkpointed, the head not): the same allocations, losses and gradients.
TEST(CheckpointMarks, MarkedBlocksEqualCheckpointSequentialOfTheSameModules) {
  for (const auto& [mark, mode] : {std::pair{std::string("true"), CheckpointMode::NonReentrant},
                                   std::pair{std::string("\"reentrant\""), CheckpointMode::Reentrant}}) {
    SCOPED_TRACE(mark);
    const bool reentrant = mode == CheckpointMode::Reentrant;
    TrainConfig marked;
    marked.model = marked_model(mark, reentrant);  // the file's input requires grad
    marked.steps = 2;
    TrainConfig sequential;
    sequential.model = marked_model("");
    sequential.steps = 2;
    sequential.segments = 5;
    sequential.checkpoint_mode = mode;
    sequential.input_requires_grad = reentrant;
    TrainConfig plain = sequential;
    plain.segments = 1;

    ASSERT_EQ(marked.model->describe().checkpointed_modules, 4u);
    const test::TrainedRun a = test::train_computed(marked), b = test::train_computed(sequential), c = test::train_computed(plain);
    EXPECT_EQ(a.losses, b.losses);
    EXPECT_EQ(a.grads, b.grads);
    EXPECT_EQ(a.losses, c.losses);  // checkpointing changes memory, never results
    EXPECT_EQ(a.grads, c.grads);
    EXPECT_FALSE(a.report.gradients_missing);
    EXPECT_EQ(a.report.peak_allocated, b.report.peak_allocated);
    EXPECT_LT(a.report.peak_allocated, c.report.peak_allocated);
    EXPECT_DOUBLE_EQ(a.report.recompute_ratio, b.report.recompute_ratio);
  }
}

TEST(CheckpointMarks, SegmentsDoNotApplyToAModelThatCheckpointsItself) {
  TrainConfig cfg;
  cfg.model = marked_model("true");
  cfg.segments = 2;
  try {
    test::train_computed(cfg);
    FAIL() << "segments on a marked model ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoints 4 of its modules itself"), std::string::npos) << e.what();
  }
  EXPECT_THROW(marked_model("\"sideways\""), Error);
  EXPECT_EQ(marked_model("false")->describe().checkpointed_modules, 0u);
}

}  // namespace
}  // namespace mem::nn
