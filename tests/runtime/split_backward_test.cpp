// split_backward_test.cpp — a pipeline stage's backward in two halves, as the zero-bubble
// schedules run it (torch 2.15 pipelining/_backward.py): the same gradients as one backward,
// each half computing only its own, and what the first half keeps for the second.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "../../runtime/src/parallel/split_backward.hpp"
#include "test_util.hpp"
#include "vramscope/runtime/checkpoint.hpp"

namespace mem::nn {
namespace {

using detail::backward_input;
using detail::backward_weight;

std::vector<double> ramp(std::int64_t n, double scale) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = scale * std::sin(0.7 * static_cast<double>(i) + scale);
  return v;
}

/// A two-projection stage: loss = sum(linear(sigmoid(linear(x, w1)), w2)).
struct Stage {
  explicit Stage(test::Env& env)
      : x(from_values(env.rt, {4, 8}, ramp(32, 0.5))),
        w1(from_values(env.rt, {16, 8}, ramp(128, 0.3))),
        w2(from_values(env.rt, {8, 16}, ramp(128, 0.2))) {
    x.set_requires_grad(true);
    w1.set_requires_grad(true);
    w2.set_requires_grad(true);
  }
  Tensor loss() const { return sum(linear(sigmoid(linear(x, w1)), w2)); }
  Tensor x, w1, w2;
};

void expect_near(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "at " << i;
}

TEST(SplitBackward, TheTwoHalvesGiveOneBackwardsGradients) {
  test::Env env(ExecMode::Compute);
  Stage whole(env);
  backward(whole.loss());
  Stage split(env);
  const Tensor loss = split.loss();
  std::vector<GradientRoot> roots{{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}};
  detail::InputBackward half = backward_input(roots, split.x, {split.w1, split.w2});
  // I: the input's gradient alone (assigned to .grad), no weight's.
  expect_near(to_values(split.x.grad()), to_values(whole.x.grad()));
  expect_near(to_values(half.input_grad), to_values(whole.x.grad()));
  EXPECT_FALSE(split.w1.grad().defined());
  EXPECT_FALSE(split.w2.grad().defined());
  // Each projection is its weight's intermediate: a group each, stashing its output's gradient.
  ASSERT_EQ(half.groups.size(), 2u);
  for (const detail::ParamGroup& group : half.groups) {
    ASSERT_EQ(group.intermediates.size(), 1u);
    ASSERT_EQ(group.params.size(), 1u);
    EXPECT_EQ(group.intermediates.front()->name(), "MmBackward0");
  }
  EXPECT_EQ(half.groups[0].grads[0][0].shape(), (Shape{4, 16}));  // w1's: sigmoid's input's gradient
  EXPECT_EQ(half.groups[1].grads[0][0].shape(), (Shape{4, 8}));   // w2's: the output's gradient
  // W: the weights' gradients, equal to the whole backward's.
  backward_weight(half.groups);
  expect_near(to_values(split.w1.grad()), to_values(whole.w1.grad()));
  expect_near(to_values(split.w2.grad()), to_values(whole.w2.grad()));
}

TEST(SplitBackward, SharedIntermediatesMergeGroupsAndATwiceUsedWeightIsCountedOnce) {
  // A weight and a bias meet at one AddmmBackward0: one group of two weights
  // (get_param_groups merges them). A square weight used by two projections reaches two
  // intermediates: its group holds both, and W clamps each to its stash, so that the gradient
  // flowing from one into the other is not counted twice.
  test::Env env(ExecMode::Compute);
  const auto make = [&] {
    std::vector<Tensor> t{from_values(env.rt, {4, 8}, ramp(32, 0.5)), from_values(env.rt, {8, 8}, ramp(64, 0.3)),
                          from_values(env.rt, {8}, ramp(8, 0.4)), from_values(env.rt, {8, 8}, ramp(64, 0.2))};
    for (Tensor& x : t) x.set_requires_grad(true);
    return t;
  };
  // loss = sum(linear(sigmoid(linear(sigmoid(linear(x, a, bias)), w)), w)): w twice.
  const auto loss_of = [](const std::vector<Tensor>& t) {
    return sum(linear(sigmoid(linear(sigmoid(linear(t[0], t[1], t[2])), t[3])), t[3]));
  };
  const std::vector<Tensor> whole = make();
  backward(loss_of(whole));
  const std::vector<Tensor> split = make();
  const Tensor loss = loss_of(split);
  Tensor x = split[0];
  detail::InputBackward half = backward_input({{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}},
                                              x, {split[1], split[2], split[3]});
  ASSERT_EQ(half.groups.size(), 2u);
  EXPECT_EQ(half.groups[0].params.size(), 2u);         // a and its bias, merged
  EXPECT_EQ(half.groups[0].intermediates.size(), 1u);  // their AddmmBackward0
  EXPECT_EQ(half.groups[1].params.size(), 1u);         // w
  EXPECT_EQ(half.groups[1].intermediates.size(), 2u);  // its two MmBackward0
  backward_weight(half.groups);
  for (std::size_t i = 0; i < whole.size(); ++i) expect_near(to_values(split[i].grad()), to_values(whole[i].grad()));
}

TEST(SplitBackward, WhatTheFirstHalfKeepsGoesWithTheSecond) {
  // Dry run, f32: x [4, 8] (128 B), h [4, 16] (256 B), y [4, 8] (128 B); every block 512 B.
  test::Env env(ExecMode::DryRun);
  env.rt.gemm_workspace(false);  // cuBLAS's workspace, kept for good: taken now
  Stage stage(env);
  const std::int64_t leaves = env.allocated();
  detail::InputBackward half;
  {
    const Tensor loss = stage.loss();
    const std::int64_t forward = env.allocated() - leaves;
    std::vector<GradientRoot> roots{{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}};
    half = backward_input(roots, stage.x, {stage.w1, stage.w2});
    // retain_graph=True: every saved tensor is still there, with x's gradient and the stash of
    // two gradients (h's and y's): three more blocks, the rest of I's temporaries gone.
    EXPECT_EQ(env.allocated() - leaves, forward + 3 * 512);
  }
  // The loss and its root go; the groups hold the graph: sigmoid's saved output (the second
  // projection's saved input too) stays, with x's gradient and the stash.
  EXPECT_EQ(env.allocated() - leaves, 4 * 512);
  backward_weight(half.groups);
  half.groups.clear();
  // After W: x's gradient and the two weights' gradients, nothing of the graph.
  EXPECT_EQ(env.allocated() - leaves, 3 * 512);
}

TEST(SplitBackward, GradRunsOnlyWhatLeadsToItsInputs) {
  // torch.autograd.grad(loss, x): the weights' gradients are not computed at all (the
  // projections' needs_input_grad says so), and nothing is accumulated into them.
  test::Env env(ExecMode::DryRun);
  env.rt.gemm_workspace(false);
  const auto backward_flops = [&](const std::function<void(Stage&, const Tensor&)>& run) {
    Stage stage(env);
    const Tensor loss = stage.loss();
    const double before = env.rt.flops().total();
    run(stage, loss);
    return env.rt.flops().total() - before;
  };
  const double whole = backward_flops([](Stage&, const Tensor& loss) { backward(loss); });
  const double input_only = backward_flops([&](Stage& stage, const Tensor& loss) {
    GradOptions options;
    options.inputs = {grad_accumulator(stage.x)};
    const TensorList got =
        grad({{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}}, options);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].shape(), (Shape{4, 8}));
    EXPECT_FALSE(stage.x.grad().defined());  // captured, not accumulated
    EXPECT_FALSE(stage.w1.grad().defined());
    EXPECT_FALSE(stage.w2.grad().defined());
  });
  // What is not run: the two weights' products, 2 x (16 x 8 x 4) and 2 x (8 x 16 x 4).
  EXPECT_EQ(whole - input_only, 2.0 * 16 * 8 * 4 + 2.0 * 8 * 16 * 4);
}

TEST(SplitBackward, ACheckpointedSegmentIsRecomputedByEachHalf) {
  // torch.utils.checkpoint keys its recompute on the graph task: I and W are two
  // torch.autograd.grad calls, so each reruns the segment it unpacks from.
  test::Env env(ExecMode::Compute);
  Stage whole(env);
  backward(whole.loss());
  Stage split(env);
  const auto segment = [&](const TensorList& in) { return TensorList{sigmoid(linear(in[0], split.w1))}; };
  const Tensor loss = sum(linear(checkpoint(segment, {split.x}).front(), split.w2));
  const double before = env.rt.flops().recompute;
  std::vector<GradientRoot> roots{{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}};
  detail::InputBackward half = backward_input(roots, split.x, {split.w1, split.w2});
  const double first = env.rt.flops().recompute - before;
  EXPECT_GT(first, 0.0);
  backward_weight(half.groups);
  EXPECT_EQ(env.rt.flops().recompute - before, 2 * first);  // W reran the segment too
  expect_near(to_values(split.x.grad()), to_values(whole.x.grad()));
  expect_near(to_values(split.w1.grad()), to_values(whole.w1.grad()));
  expect_near(to_values(split.w2.grad()), to_values(whole.w2.grad()));
}

TEST(SplitBackward, AReentrantCheckpointRefusesGradWithInputs) {
  // CheckpointFunction.backward raises inside torch.autograd.grad with inputs, as a
  // zero-bubble schedule's I is; backward() still runs it.
  test::Env env(ExecMode::DryRun);
  Stage stage(env);
  CheckpointOptions reentrant;
  reentrant.mode = CheckpointMode::Reentrant;
  const auto segment = [&](const TensorList& in) { return TensorList{sigmoid(linear(in[0], stage.w1))}; };
  const Tensor loss = sum(linear(checkpoint(segment, {stage.x}, reentrant).front(), stage.w2));
  const std::string message = test::error_of([&] {
    (void)backward_input({{Edge{loss.grad_fn(), loss.output_nr()}, full(env.rt, loss.shape(), 1.0)}}, stage.x,
                         {stage.w1, stage.w2});
  });
  EXPECT_NE(message.find("use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"), std::string::npos)
      << message;
  EXPECT_NO_THROW(backward(loss));
}

}  // namespace
}  // namespace mem::nn
