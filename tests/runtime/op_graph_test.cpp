// op_graph_test.cpp — operator graphs (op_graph.hpp) run through the allocator: outputs
// allocated and views not, tensors dropped where the recording saw them go, exactly the
// recorded tensors kept for backward, checkpointing a module call by its path, and graphs
// that break an invariant refused with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "test_util.hpp"
#include "vramscope/runtime/checkpoint.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"
#include "vramscope/runtime/op_graph.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {
namespace {

using Kind = OpGraph::Kind;

// Sizes: x [64, 1024] f32 = 256 KiB; w [1024, 1024] = 4 MiB; h = x @ w^T [64, 1024] = 256 KiB.
constexpr std::int64_t kAct = 64 * 1024 * 4;
constexpr std::int64_t kWeight = 1024 * 1024 * 4;

OpGraph::TensorSpec tensor(Kind kind, Shape shape, std::string name = {}, std::int32_t base = -1) {
  OpGraph::TensorSpec t;
  t.kind = kind;
  t.shape = shape;
  t.follows_run_dtype = true;
  t.name = std::move(name);
  t.base = base;
  t.requires_grad = kind == Kind::Param;
  return t;
}

OpGraph::OpSpec op(std::string name, std::vector<std::int32_t> in, std::vector<std::int32_t> out, std::int32_t call,
                   std::string node = {}, std::vector<std::int32_t> saves = {}) {
  OpGraph::OpSpec o;
  o.op = std::move(name);
  o.in = std::move(in);
  o.out = std::move(out);
  o.alias.assign(o.out.size(), -1);
  o.call = call;
  o.node = std::move(node);
  o.saves = std::move(saves);
  return o;
}

/// x -> block { fc: h = x @ w.t(); relu: r = relu(h) } -> r, as the exporter records
/// `nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU())` under the name "block".
/// Tensors: 0 x, 1 w, 2 w.t() (a view), 3 h, 4 r.
OpGraph mlp_block() {
  OpGraph g;
  g.calls = {{"", "Model", -1, CheckpointMark::None, {0}}, {"block", "Sequential", 0, CheckpointMark::None, {0}},
             {"block.0", "Linear", 1, CheckpointMark::None, {0}}, {"block.1", "ReLU", 1, CheckpointMark::None, {3}}};
  g.tensors = {tensor(Kind::Input, {64, 1024}), tensor(Kind::Param, {1024, 1024}, "block.0.weight"),
               tensor(Kind::Activation, {1024, 1024}, {}, 1), tensor(Kind::Activation, {64, 1024}),
               tensor(Kind::Activation, {64, 1024})};
  g.ops.push_back(op("aten.t.default", {1}, {2}, 2, "TBackward0"));
  g.ops.back().alias = {0};
  g.ops.push_back(op("aten.mm.default", {0, 2}, {3}, 2, "MmBackward0", {0, 2}));
  g.ops.back().frees = {2};
  g.ops.push_back(op("aten.relu.default", {3}, {4}, 3, "ReluBackward0", {4}));
  // `x = self.1(x)` rebinds the Sequential's variable: h goes after the ReLU returned.
  g.ops.back().frees_after = {{1, 3}};
  g.inputs = {0};
  g.output = 4;
  g.recorded_with = "test";
  return g;
}

class OpGraphTest : public ::testing::Test {
 protected:
  OpGraphTest() { env_.rt.gemm_workspace(/*lt=*/true); }  // taken once, so only tensors count below
  std::unique_ptr<Module> build(const OpGraph& g) {
    auto root = op_graph_module(std::make_shared<const OpGraph>(g));
    root->set_path("");
    root->materialize(env_.rt, DType::F32);
    return root;
  }
  test::Env env_{ExecMode::DryRun};
};

TEST_F(OpGraphTest, OutputsAllocateViewsDoNotAndModulesAreTheRecordedCalls) {
  auto root = build(mlp_block());
  std::vector<std::string> paths;
  for (Module* m : named_modules(*root)) paths.push_back(m->path() + " (" + m->type_name() + ")");
  EXPECT_EQ(paths, (std::vector<std::string>{"block (Sequential)", "block.0 (Linear)", "block.1 (ReLU)"}));
  const std::int64_t weights = env_.allocated();
  Tensor x = empty(env_.rt, {64, 1024});
  Tensor r = (*root)(x);
  // x, and r; h is kept by nobody but ReluBackward0? No: relu saves its output, mm keeps x
  // and w: h is freed after the block rebinds its variable.
  EXPECT_EQ(env_.allocated() - weights, 2 * kAct);
  EXPECT_EQ(env_.peak() - weights, 3 * kAct);  // x, h and r while the ReLU ran
  EXPECT_EQ(r.grad_fn()->name(), "ReluBackward0");
}

TEST_F(OpGraphTest, NodesKeepExactlyTheRecordedTensors) {
  auto root = build(mlp_block());
  Tensor x = empty(env_.rt, {64, 1024});
  std::vector<std::int64_t> saved;
  {
    SavedTensorsObserver observe([&](const Tensor& t) { saved.push_back(static_cast<std::int64_t>(t.storage()->nbytes())); });
    Tensor r = (*root)(x);
  }
  // MmBackward0 keeps x and the weight (through its transposed view), ReluBackward0 its output.
  EXPECT_EQ(saved, (std::vector<std::int64_t>{kAct, kWeight, kAct}));
}

TEST_F(OpGraphTest, BackwardAllocatesEachInputsGradientAndFreesWhatNodesKept) {
  auto root = build(mlp_block());
  const std::int64_t weights = env_.allocated();
  Tensor x = empty(env_.rt, {64, 1024});
  Tensor r = (*root)(x);
  backward(r, empty(env_.rt, {64, 1024}));
  r = Tensor{};
  // Left: x and the weight's gradient ([1024, 1024], the transpose's view of mm's [K, N] grad).
  EXPECT_EQ(env_.allocated() - weights, kAct + kWeight);
  const Tensor w = root->parameters().at(0);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().shape(), (Shape{1024, 1024}));
}

/// The block with GELU, which keeps its input h (GeluBackward0 saves self).
OpGraph gelu_block() {
  OpGraph g = mlp_block();
  g.calls[3].cls = "GELU";
  g.ops[2] = op("aten.gelu.default", {3}, {4}, 3, "GeluBackward0", {3});
  g.ops[2].frees_after = {{1, 3}};
  return g;
}

TEST_F(OpGraphTest, ACheckpointedCallKeepsOnlyItsInputsAndRecomputesInBackward) {
  auto plain = build(gelu_block());
  const std::int64_t weights = env_.allocated();
  Tensor x = empty(env_.rt, {64, 1024});
  Tensor r = (*plain)(x);
  const std::int64_t kept_plain = env_.allocated() - weights;
  r = Tensor{};

  OpGraph g = gelu_block();
  g.calls[1].checkpoint = CheckpointMark::NonReentrant;
  auto marked = build(g);
  const std::int64_t before = env_.allocated();  // the weights and x
  {
    Tensor r2 = (*marked)(x);
    // Only the block's output is new: its input (x) is the caller's and h, which GELU keeps
    // without the mark, is a placeholder now.
    EXPECT_EQ(env_.allocated() - before, kAct);
    EXPECT_EQ(kept_plain, 3 * kAct);  // x, h (GELU's saved input) and r
    // The recompute reallocates h and r for the ReLU's and the product's nodes: a peak of
    // x, r, the gradient, and the rebuilt h and r.
    backward(r2, empty(env_.rt, {64, 1024}));
  }
  EXPECT_TRUE(marked->parameters().at(0).grad().defined());
}

TEST_F(OpGraphTest, ACheckpointedCallWithKeywordArgumentsOnlyKeepsNoInput) {
  // `self.block(x=x)` under a non-reentrant checkpoint: PyTorch's _NoopSaveInputs saves the
  // positional arguments only; the keyword ones stay with the closure, unsaved (T5's stacks).
  for (const bool positional : {true, false}) {
    OpGraph g = gelu_block();
    g.calls[1].checkpoint = CheckpointMark::NonReentrant;
    if (!positional) g.calls[1].args.clear();
    auto marked = build(g);
    Tensor x = empty(env_.rt, {64, 1024});
    std::vector<std::int64_t> saved;
    Tensor r;
    {
      SavedTensorsObserver observe([&](const Tensor& t) { saved.push_back(static_cast<std::int64_t>(t.storage()->nbytes())); });
      r = (*marked)(x);
    }
    backward(r, empty(env_.rt, {64, 1024}));
    EXPECT_TRUE(marked->parameters().at(0).grad().defined());
    // The forward's saves: checkpoint()'s input x when positional, then nothing but placeholders.
    EXPECT_EQ(std::count(saved.begin(), saved.end(), kAct) > 0, positional) << (positional ? "positional" : "keyword");
  }
}

TEST_F(OpGraphTest, ASelectivePolicyKeepsTheNamedOperatorsOutputsAndTheRecomputeTakesThem) {
  // create_selective_checkpoint_contexts([torch.ops.aten.mm.default]) around the block: the
  // product's output h stays from the forward (its storage, once), GELU's output is recomputed.
  const double mm_flops = 2.0 * 64 * 1024 * 1024, gelu_flops = 64.0 * 1024;
  for (const bool selective : {false, true}) {
    OpGraph g = gelu_block();
    g.calls[1].checkpoint = CheckpointMark::NonReentrant;
    auto marked = build(g);
    if (selective) named_modules(*marked).front()->set_selective_policy(std::make_shared<const SelectivePolicy>(SelectivePolicy::parse("mm")));
    Tensor x = empty(env_.rt, {64, 1024});
    const std::int64_t before = env_.allocated();
    std::vector<std::int64_t> saved;
    Tensor r;
    {
      SavedTensorsObserver observe([&](const Tensor& t) { saved.push_back(static_cast<std::int64_t>(t.storage()->nbytes())); });
      r = (*marked)(x);
    }
    // checkpoint()'s input x, then what the policy keeps (h), seen as the pack hook sees it.
    const std::vector<std::int64_t> expected = selective ? std::vector<std::int64_t>{kAct, kAct} : std::vector<std::int64_t>{kAct};
    EXPECT_EQ(saved, expected);
    EXPECT_EQ(env_.allocated() - before, selective ? 2 * kAct : kAct);  // r, and h when kept
    env_.rt.reset_flops();
    backward(r, empty(env_.rt, {64, 1024}));
    // The rerun takes h instead of running the product: only GELU's FLOPs (the rerun stops once
    // GELU's node has saved h, after its output was made).
    EXPECT_EQ(env_.rt.flops().recompute, selective ? gelu_flops : mm_flops + gelu_flops);
    EXPECT_TRUE(marked->parameters().at(0).grad().defined());
  }
}

TEST_F(OpGraphTest, SelectivePoliciesNameOperatorsAsPyTorchDoes) {
  const SelectivePolicy p = SelectivePolicy::parse("mm, aten.addmm.default,attention");
  EXPECT_TRUE(p.saves("aten.mm.default"));
  EXPECT_TRUE(p.saves("aten.mm.out"));
  EXPECT_FALSE(p.saves("aten.mm_out.default"));
  EXPECT_TRUE(p.saves("aten.addmm.default"));
  EXPECT_FALSE(p.saves("aten.addmm.out"));
  EXPECT_TRUE(p.saves("aten._scaled_dot_product_efficient_attention.default"));
  EXPECT_FALSE(p.saves("aten.bmm.default"));
  EXPECT_EQ(SelectivePolicy::parse("matmuls,mm").save.size(), SelectivePolicy::group("matmuls").size());
  for (const char* bad : {"", "mm,,bmm", "mm,", "aten mm", "aten..mm", ".mm", "a.b.c.d"}) {
    EXPECT_THROW(SelectivePolicy::parse(bad), Error) << bad;
  }
}

TEST_F(OpGraphTest, ASelectivePolicyCanKeepOneCallAndDifferPerModule) {
  // A policy function that counts (sac_ilp's per-operator plans): "@K" keeps the K-th call of
  // that name in a region's forward, counted from 0, and the same call in its rerun.
  const SelectivePolicy p = SelectivePolicy::parse("aten.mm.default@1,addmm@0");
  SelectivePolicy::CallCounts forward;
  std::vector<bool> kept;
  for (const char* op : {"aten.mm.default", "aten.addmm.default", "aten.mm.default", "aten.mm.default", "aten.addmm.out"}) {
    kept.push_back(p.keeps_call(op, forward));
  }
  EXPECT_EQ(kept, (std::vector<bool>{false, true, true, false, false}));
  EXPECT_TRUE(p.saves("aten.mm.default"));
  EXPECT_EQ(p.str(), "aten.mm.default@1,aten.addmm@0");

  // Scopes: the first naming a module (its path or type name, '*' any characters) decides.
  const SelectivePolicy scoped = SelectivePolicy::parse("layers.*.mlp=matmuls; DecoderLayer=mm@2;attention");
  ASSERT_EQ(scoped.scopes.size(), 2u);
  EXPECT_EQ(scoped.for_module("layers.3.mlp", "MLP"), &scoped.scopes[0].save);
  EXPECT_EQ(scoped.for_module("layers.3", "DecoderLayer"), &scoped.scopes[1].save);
  EXPECT_EQ(scoped.for_module("layers.3.attn", "Attention"), &scoped.save);
  EXPECT_EQ(SelectivePolicy::parse(scoped.str()).str(), scoped.str());
  EXPECT_EQ(SelectivePolicy::parse("a=mm").for_module("b", "B"), nullptr);
  for (const char* bad : {"mm@", "mm@x", "mm@1x", "mm@-1", "matmuls@0", "=mm", "a b=mm", "mm;bmm", "a=", "a=mm;;"}) {
    EXPECT_THROW(SelectivePolicy::parse(bad), Error) << bad;
  }

  // In a region: the block runs one product, so "@1" keeps nothing (the rerun recomputes it)
  // and "@0" keeps h; a scope by path or by type name gives the block its policy.
  const double mm_flops = 2.0 * 64 * 1024 * 1024, gelu_flops = 64.0 * 1024;
  for (const auto& [text, keeps] : std::vector<std::pair<std::string, bool>>{
           {"aten.mm.default@1", false}, {"aten.mm.default@0", true}, {"block=mm@0", true}, {"Sequential=mm", true},
           {"block.*=mm", false}}) {
    OpGraph g = gelu_block();
    g.calls[1].checkpoint = CheckpointMark::NonReentrant;
    auto marked = build(g);
    const SelectivePolicy policy = SelectivePolicy::parse(text);
    Module* block = named_modules(*marked).front();
    if (const auto* ops = policy.for_module(block->path(), block->type_name())) {
      block->set_selective_policy(std::make_shared<const SelectivePolicy>(SelectivePolicy{*ops, {}}));
    }
    Tensor x = empty(env_.rt, {64, 1024});
    const std::int64_t before = env_.allocated();
    Tensor r = (*marked)(x);
    EXPECT_EQ(env_.allocated() - before, keeps ? 2 * kAct : kAct) << text;  // r, and h when kept
    env_.rt.reset_flops();
    backward(r, empty(env_.rt, {64, 1024}));
    EXPECT_EQ(env_.rt.flops().recompute, keeps ? gelu_flops : mm_flops + gelu_flops) << text;
  }
}

TEST_F(OpGraphTest, ASelectivePolicyUnderAReentrantCheckpointIsRefused) {
  OpGraph g = gelu_block();
  g.calls[1].checkpoint = CheckpointMark::Reentrant;
  auto marked = build(g);
  named_modules(*marked).front()->set_selective_policy(std::make_shared<const SelectivePolicy>(SelectivePolicy::parse("mm")));
  Tensor x = empty(env_.rt, {64, 1024});
  x.set_requires_grad(true);
  EXPECT_THROW((*marked)(x), Error);
}

TEST_F(OpGraphTest, MarkingByPathUsesTheRecordedCalls) {
  auto root = build(mlp_block());
  mark_checkpointed(*root, {"block.0"}, CheckpointMode::NonReentrant);
  EXPECT_EQ(root->checkpoint_marks(), 1u);
  EXPECT_THROW(mark_checkpointed(*root, {"block.7"}, CheckpointMode::NonReentrant), Error);
}

TEST_F(OpGraphTest, InPlaceOpsWriteTheirInput) {
  OpGraph g = mlp_block();
  g.ops[2] = op("aten.relu_.default", {3}, {3}, 3, "ReluBackward0", {3});
  g.ops[2].alias = {0};
  g.ops[2].inplace = true;
  g.output = 3;
  auto root = build(g);
  const std::int64_t weights = env_.allocated();
  Tensor x = empty(env_.rt, {64, 1024});
  Tensor r = (*root)(x);
  EXPECT_EQ(env_.peak() - weights, 2 * kAct);  // x and h, written in place
  EXPECT_EQ(r.version(), 1u);
}

TEST_F(OpGraphTest, AGraphThatBreaksAnInvariantIsRefusedWithTheReason) {
  const auto refused = [](OpGraph g, const std::string& expected) {
    try {
      (void)op_graph_module(std::make_shared<const OpGraph>(std::move(g)));
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  OpGraph reads_later = mlp_block();
  reads_later.ops[1].in = {0, 4};
  refused(reads_later, "reads a tensor no earlier op made");
  OpGraph twice = mlp_block();
  twice.ops[2].out = {3};
  refused(twice, "is made twice");
  OpGraph saves = mlp_block();
  saves.ops[1].saves = {99};
  refused(saves, "saves a tensor no op made");
  OpGraph parent = mlp_block();
  parent.calls[1].parent = 3;
  refused(parent, "must name an earlier call");
  OpGraph alias = mlp_block();
  alias.ops[0].alias = {5};
  refused(alias, "alias names no input");
  OpGraph output = mlp_block();
  output.output = 17;
  refused(output, "output names no tensor");
  OpGraph deep = mlp_block();
  for (std::int32_t i = 0; i < 300; ++i) {
    deep.calls.push_back({"c", "Deep", static_cast<std::int32_t>(deep.calls.size()) - 1, CheckpointMark::None, {}});
  }
  refused(deep, "module calls nest deeper than 256");
  OpGraph enclose = mlp_block();
  enclose.ops[2].frees_after = {{2, 3}};
  refused(enclose, "does not enclose the op");
}

/// The block recorded under autocast bf16, as `python -m vramscope.export --amp bf16` writes
/// it: the weight stays f32 (the run's dtype), autocast casts it (cached) and the input to
/// bf16, and the product runs in bf16. Tensors: 0 x, 1 w, 2 w16 = w.to(bf16) (autocast's
/// cache), 3 x16, 4 w16.t(), 5 h, 6 r.
OpGraph autocast_block() {
  OpGraph g;
  g.autocast = DType::BF16;
  g.calls = {{"", "Model", -1, CheckpointMark::None, {0}}, {"block", "Sequential", 0, CheckpointMark::None, {0}},
             {"block.0", "Linear", 1, CheckpointMark::None, {0}}, {"block.1", "ReLU", 1, CheckpointMark::None, {5}}};
  const auto half = [](Kind kind, Shape shape, std::int32_t base = -1) {
    OpGraph::TensorSpec t = tensor(kind, std::move(shape), {}, base);
    t.follows_run_dtype = false;
    t.dtype = DType::BF16;
    return t;
  };
  g.tensors = {tensor(Kind::Input, {64, 1024}), tensor(Kind::Param, {1024, 1024}, "block.0.weight"),
               half(Kind::Activation, {1024, 1024}), half(Kind::Activation, {64, 1024}),
               half(Kind::Activation, {1024, 1024}, 2), half(Kind::Activation, {64, 1024}),
               half(Kind::Activation, {64, 1024})};
  g.ops.push_back(op("aten._to_copy.default", {1}, {2}, 2, "ToCopyBackward0"));
  g.ops.back().args = {{"autocast_cache", 1}};
  g.ops.push_back(op("aten._to_copy.default", {0}, {3}, 2, "ToCopyBackward0"));
  g.ops.push_back(op("aten.t.default", {2}, {4}, 2, "TBackward0"));
  g.ops.back().alias = {0};
  g.ops.push_back(op("aten.mm.default", {3, 4}, {5}, 2, "MmBackward0", {3, 4}));
  g.ops.back().frees = {4, 3};
  g.ops.push_back(op("aten.relu.default", {5}, {6}, 3, "ReluBackward0", {6}));
  g.ops.back().frees_after = {{1, 5}};
  g.inputs = {0};
  g.output = 6;
  g.recorded_with = "test";
  return g;
}

TEST_F(OpGraphTest, AnAutocastRecordingRunsUnderItsAutocastAndItsCacheHoldsTheWeightsCast) {
  auto root = build(autocast_block());
  const std::int64_t weights = env_.allocated();
  EXPECT_EQ(root->parameters().at(0).dtype(), DType::F32);  // the weight stays f32 under amp
  Tensor x = empty(env_.rt, {64, 1024});
  {
    AutocastRegion region(env_.rt, DType::BF16);
    Tensor r = (*root)(x);
    // x (f32), its bf16 copy (kept by MmBackward0), r, and the weight's bf16 cast: kept by the
    // node and by autocast's cache until the region ends.
    EXPECT_EQ(env_.allocated() - weights, kAct + kAct / 2 + kAct / 2 + kWeight / 2);
    // A second forward in the same region takes the cached cast: no new weight copy.
    Tensor r2 = (*root)(x);
    EXPECT_EQ(env_.allocated() - weights, kAct + 2 * (kAct / 2 + kAct / 2) + kWeight / 2);
  }
  // Outside autocast, the recording is refused with what to do.
  try {
    (void)(*root)(x);
    ADD_FAILURE() << "ran without autocast";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recorded under autocast (bf16), so it runs with --dtype amp-bf16"),
              std::string::npos) << e.what();
  }
}

TEST_F(OpGraphTest, APlainRecordingIsRefusedUnderAutocast) {
  auto root = build(mlp_block());
  Tensor x = empty(env_.rt, {64, 1024});
  AutocastRegion region(env_.rt, DType::F16);
  try {
    (void)(*root)(x);
    ADD_FAILURE() << "ran under autocast";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("export it again with --amp f16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mem::nn
