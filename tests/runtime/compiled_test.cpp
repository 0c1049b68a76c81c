// compiled_test.cpp — torch.compile's step: the partitioner's choice on a graph small enough to
// cut by hand, and the two graphs' buffers on the allocator, to the byte.
// (tests/models/check_compiled.py checks the choice against PyTorch's on real models.)
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.hpp"
#include "vramscope/models/model_file.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

/// y = relu(x @ w).sum() and its backward, as AOTAutograd's joint graph has it:
///   0 primals_1 x [4, 8]   1 primals_2 w [8, 8] (a parameter)   2 tangents_1 []
///   3 mm(x, w)   4 relu(mm)   5 sum(relu): the loss
///   6 expand(tangent)   7 le(relu, 0)   8 where(le, expand, 0)   9 t(x)   10 mm(t, where): w's gradient
JointGraph relu_matmul() {
  JointGraph g;
  auto add = [&](std::string name, JointNode::Op op, Shape shape, DType dtype, std::vector<std::int32_t> inputs,
                 std::uint32_t flags, std::string target = "") {
    JointNode n;
    n.name = std::move(name);
    n.op = op;
    n.target = std::move(target);
    n.shape = shape;
    n.dtype = dtype;
    n.bytes = static_cast<std::int64_t>(shape.numel() * dtype_size(dtype));
    n.inputs = inputs;
    n.args = inputs;
    n.flags = flags;
    n.flops = 1;
    const auto index = static_cast<std::int32_t>(g.nodes.size());
    for (std::int32_t in : inputs) g.nodes[static_cast<std::size_t>(in)].users.push_back(index);
    g.nodes.push_back(std::move(n));
  };
  using N = JointNode;
  const std::uint32_t pointwise = N::Fusible | N::Recomputable;
  add("primals_1", N::Op::Placeholder, {4, 8}, DType::BF16, {}, 0);
  add("primals_2", N::Op::Placeholder, {8, 8}, DType::BF16, {}, N::Static);
  add("tangents_1", N::Op::Placeholder, {}, DType::F32, {}, 0);
  g.nodes[0].input = g.nodes[1].input = N::Input::Primal;
  g.nodes[2].input = N::Input::Tangent;
  g.nodes[0].primal = "input: x";
  g.nodes[1].primal = "param: w";
  add("mm", N::Op::CallFunction, {4, 8}, DType::BF16, {0, 1}, N::ComputeIntensive, "aten.mm.default");
  add("relu", N::Op::CallFunction, {4, 8}, DType::BF16, {3}, pointwise);
  add("sum_1", N::Op::CallFunction, {}, DType::BF16, {4}, pointwise | N::Reduction);
  add("expand", N::Op::CallFunction, {4, 8}, DType::F32, {2}, N::View | N::Recomputable);
  add("le", N::Op::CallFunction, {4, 8}, DType::Bool, {4}, pointwise);
  add("where", N::Op::CallFunction, {4, 8}, DType::BF16, {7, 6}, pointwise);
  add("t", N::Op::CallFunction, {8, 4}, DType::BF16, {0}, N::View | N::Recomputable);
  add("mm_1", N::Op::CallFunction, {8, 8}, DType::BF16, {9, 8}, N::ComputeIntensive, "aten.mm.default");
  JointNode out;
  out.name = "output";
  out.op = N::Op::Output;
  g.nodes.push_back(out);
  g.nodes[5].users.push_back(11);
  g.nodes[10].users.push_back(11);
  g.nodes[1].grad = 10;
  g.outputs = {5, 10};
  g.forward_outputs = 1;
  return g;
}

std::vector<std::string> names(const JointGraph& g, const std::vector<std::int32_t>& nodes) {
  std::vector<std::string> out;
  for (std::int32_t n : nodes) out.push_back(g.nodes[static_cast<std::size_t>(n)].name);
  return out;
}

TEST(CompiledPartition, TheCutNearestTheBackwardSavesTheMaskAndTheTransposedInput) {
  // The flow: x (70 = 64 B x 1.1) feeds t, which w's gradient reads; mm (77) feeds relu (140,
  // doubled: fused into its readers), which feeds le (35 x 2). Both paths carry 70: the cut
  // nearest the sink, networkx's, takes t and le, never mm (banned: not recomputable) nor the
  // loss (banned: the output reads it).
  const JointGraph g = relu_matmul();
  EXPECT_EQ(names(g, choose_saved_values(g, 1.0)), (std::vector<std::string>{"le", "t"}));
  // Budget 0: the inputs only; a budget the default already meets changes nothing.
  EXPECT_EQ(names(g, choose_saved_values(g, 0.0)), (std::vector<std::string>{"primals_1", "primals_2"}));
  EXPECT_EQ(names(g, choose_saved_values(g, 0.5)), (std::vector<std::string>{"le", "t"}));
}

TEST(CompiledPartition, ABudgetOutsideZeroToOneIsRefused) {
  const JointGraph g = relu_matmul();
  EXPECT_THROW(choose_saved_values(g, 1.5), Error);
  EXPECT_THROW(choose_saved_values(g, -0.1), Error);
}

/// A module holding the graph's parameter w.
class Holder : public Module {
 public:
  Holder() : Module("Holder") { add_parameter("w", Shape{8, 8}, 0, 0); }
  Tensor forward(const Tensor& x) override { return x; }
};

TEST(CompiledStep, BuffersLiveFromTheirKernelToTheirLastReader) {
  auto model = std::make_shared<CompiledModel>();
  model->batch = 4;
  model->graph = relu_matmul();
  test::Env env(ExecMode::DryRun);
  Holder root;
  root.materialize(env.rt, DType::BF16);
  CompiledStep step(model, CompileMode{}, root);
  EXPECT_EQ(step.saved_activation_bytes(), 32 + 64);  // le and t (t views x: the batch stays anyway)
  EXPECT_EQ(step.recomputed_nodes(), 0u);
  constexpr std::int64_t kBlock = 512;  // every buffer here is one of the small pool's smallest blocks
  const std::int64_t weights = env.allocated();
  Tensor loss;
  {
    PhaseGuard phase(Phase::Forward);
    loss = step.forward(env.rt);
  }
  const std::int64_t workspace = static_cast<std::int64_t>(env.rt.gemm_workspace_bytes());
  // x, mm, then (relu fused into its readers, mm freed) the loss and the mask.
  EXPECT_EQ(env.peak() - weights, workspace + 3 * kBlock);
  // Kept for the backward: x (t's storage), the mask; the loss.
  EXPECT_EQ(env.allocated() - weights, workspace + 3 * kBlock);
  {
    PhaseGuard phase(Phase::Backward);
    step.backward(env.rt);
  }
  const std::int64_t workspaces = static_cast<std::int64_t>(env.rt.gemm_workspace_bytes());
  EXPECT_EQ(workspaces, 2 * workspace);  // the backward's products run on autograd's thread
  // The tangent and where(le, ...) beside x, the loss and the mask: 5 blocks; then the mask and
  // the tangent go, and the second workspace and w's gradient come beside x, the loss and where.
  EXPECT_EQ(env.peak() - weights, 2 * workspace + 4 * kBlock);
  ASSERT_TRUE(root.parameters().front().grad().defined());
  EXPECT_EQ(root.parameters().front().grad().nbytes(), 128u);
  // Left: x (the batch), the loss, w's gradient.
  EXPECT_EQ(env.allocated() - weights, workspaces + 3 * kBlock);
  step.end_step();
  loss = Tensor{};
  EXPECT_EQ(env.allocated() - weights, workspaces + kBlock);
}

TEST(CompiledStep, APrimalTheModelLacksIsRefused) {
  auto model = std::make_shared<CompiledModel>();
  model->graph = relu_matmul();
  model->graph.nodes[1].primal = "param: v";
  test::Env env(ExecMode::DryRun);
  Holder root;
  root.materialize(env.rt, DType::BF16);
  EXPECT_NE(test::error_of([&] { CompiledStep step(model, CompileMode{}, root); }).find("param: v"), std::string::npos);
}

// A two-layer MLP (Linear, GELU, LayerNorm, Linear; cross entropy) recorded by
// `python3 -m vramscope.export mlp.py:make --input 6,24 --compile` with torch 2.15.
const std::string kMlp = std::string(VRAMSCOPE_TEST_DATA_DIR) + "/compiled-mlp.json";

nlohmann::json mlp_json() {
  std::ifstream in(kMlp);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

TrainConfig mlp_config(std::optional<double> budget, bool cudagraphs = false) {
  TrainConfig cfg;
  cfg.model = models::ModelFile::load(kMlp);
  cfg.precision = Precision::BF16;
  cfg.device = "sim:capacity=8GiB,context=0";
  if (budget) cfg.compile = CompileMode{*budget, cudagraphs};
  return cfg;
}

/// The MLP's compiled step as CUDA graphs (mode="reduce-overhead"), its allocator at hand: the
/// steps run one by one (warmup, recording, replay).
struct CudaGraphsRun {
  explicit CudaGraphsRun(const std::string& device = "sim:capacity=8GiB,context=0")
      : cfg(config(device)), alloc(make_device(device_spec_for(cfg))) {}
  static TrainConfig config(const std::string& device) {
    TrainConfig cfg = mlp_config(1.0, /*cudagraphs=*/true);
    cfg.steps = kCudaGraphSteps;
    cfg.device = device;
    return cfg;
  }
  TrainConfig cfg;
  CachingAllocator alloc;
};

TEST(CompiledModelFile, ItsStepRunsAndItsGradientsReachEveryParameter) {
  const ModelInfo info = models::ModelFile::load(kMlp)->describe();
  ASSERT_TRUE(info.compiled);
  EXPECT_EQ(info.compiled->batch, 6);
  for (double budget : {1.0, 0.5, 0.0}) {
    test::OneStep run(mlp_config(budget));
    ASSERT_NE(run.trainer.compiled(), nullptr);
    EXPECT_EQ(run.stats.params_without_grad, 0u) << budget;
    EXPECT_GT(run.stats.flops.forward, 0) << budget;
  }
  // Budget 0 keeps only the inputs: the backward reruns the forward, and its FLOPs say so.
  test::OneStep none(mlp_config(0.0));
  test::OneStep all(mlp_config(1.0));
  EXPECT_GT(none.trainer.compiled()->recomputed_nodes(), all.trainer.compiled()->recomputed_nodes());
  EXPECT_GT(none.stats.flops.recompute, all.stats.flops.recompute);
  EXPECT_LT(none.trainer.compiled()->saved_activation_bytes(), all.trainer.compiled()->saved_activation_bytes());
}

TEST(CompiledModelFile, ARunThatIsNotTheRecordedOneIsRefused) {
  TrainConfig cfg = mlp_config(1.0);
  cfg.precision = Precision::F32;
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("run it with --dtype bf16"), std::string::npos);
  // Sizes as formulas: any batch runs; a file whose graph held at its own batch only refuses others.
  cfg = mlp_config(1.0);
  cfg.model_options = ModelOptions::parse("batch=8");
  EXPECT_EQ(test::error_of([&] { test::OneStep run(cfg); }), "(no error)");
  nlohmann::json fixed = mlp_json();
  fixed["compiled"]["fixed"] = "torch.compile makes another joint graph at batch 7";
  cfg.model = models::ModelFile::parse(fixed.dump(), "mlp.json");
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("recorded at batch 6"), std::string::npos);
  cfg = mlp_config(1.0);
  cfg.mode = ExecMode::Compute;
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("runs dry"), std::string::npos);
  cfg = mlp_config(1.0);
  cfg.checkpoint_modules = std::vector<std::string>{"0"};
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("partitioner decides"), std::string::npos);
  cfg = mlp_config(1.0);
  cfg.model = models::find("mlp");
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("no compiled step recorded"), std::string::npos);
}

/// Every live block in a segment of private pool `pool`, by its owner's context path.
std::map<std::string, std::int64_t> pool_blocks(const CachingAllocator& alloc, PoolId pool, bool in_pool) {
  std::map<std::string, std::int64_t> out;
  for (const SegmentInfo& seg : alloc.segments()) {
    if ((seg.pool == pool) != in_pool) continue;
    for (const BlockInfo& b : seg.blocks) {
      if (b.state == BlockState::ActiveAllocated) out[context_info(b.context).path] += static_cast<std::int64_t>(b.size);
    }
  }
  return out;
}

TEST(CompiledModelFile, ReduceOverheadRunsBothGraphsInOnePrivatePool) {
  CudaGraphsRun run;
  CachingAllocator& alloc = run.alloc;
  Trainer trainer{run.cfg, alloc};
  // Warmup: the graphs already run in the pool, on its own stream.
  trainer.step();
  const CompiledStep& step = *trainer.compiled();
  const PoolId pool = step.graph_pool();
  ASSERT_NE(pool, 0u);
  // cuBLAS's workspace (8 MiB + 128 KiB on this GPU, a 20 MiB segment) and cublasLt's (1 MiB, with
  // the small buffers in one 2 MiB segment) came and went in the pool.
  EXPECT_EQ(alloc.private_pool_reserved(), 22 * MiB);
  EXPECT_EQ(trainer.runtime().gemm_workspace_bytes(), 0u);
  // What stays live there is the gradients (the next step's zero_grad sets them to None): 5 KiB.
  EXPECT_EQ(alloc.private_pool_allocated(), 5 * KiB);
  // Recording: torch.cuda.graph empties the cache first: a segment the default pools cache goes.
  alloc.deallocate(alloc.allocate(30 * MiB));
  const std::int64_t reserved = alloc.stats().reserved_bytes[0].current;
  trainer.step();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, reserved - static_cast<std::int64_t>(30 * MiB));
  EXPECT_EQ(alloc.private_pool_reserved(), 22 * MiB);
  // Replay: the recording's memory again, nothing new.
  const DeviceStats before_replay = alloc.stats();
  trainer.step();
  EXPECT_EQ(alloc.private_pool_reserved(), 22 * MiB);
  EXPECT_EQ(alloc.stats().num_device_alloc, before_replay.num_device_alloc);
  alloc.validate();
  // The partition is the one without CUDA graphs.
  test::OneStep plain(mlp_config(1.0));
  EXPECT_EQ(step.saved(), plain.trainer.compiled()->saved());
}

TEST(CompiledModelFile, ReduceOverheadKeepsTheSavedValuesAndGradientsInThePool) {
  // Stop inside the third step's backward, before its gradients reach .grad: one step only runs
  // the forward and the backward here, by hand.
  CudaGraphsRun run;
  CachingAllocator& alloc = run.alloc;
  Trainer trainer{run.cfg, alloc};
  trainer.step();
  trainer.step();
  CompiledStep& step = const_cast<CompiledStep&>(*trainer.compiled());
  Runtime& rt = trainer.runtime();
  (void)step.forward(rt);
  // Between the graphs: the pool holds the saved values the backward reads (and the last step's
  // gradients, which the optimizer's zero_grad would have dropped at this step's start).
  const std::map<std::string, std::int64_t> live = pool_blocks(alloc, step.graph_pool(), true);
  ASSERT_EQ(live.count("compiled forward"), 1u);
  EXPECT_GE(live.at("compiled forward"), step.saved_activation_bytes());
  for (const auto& [path, bytes] : live) EXPECT_TRUE(path == "compiled forward" || path.find(".grad") != std::string::npos) << path;
  step.backward(rt);
  // The gradients went to .grad and stay in the pool's blocks, relabelled as the parameters' .grad.
  std::int64_t grads = 0;
  for (const auto& [path, bytes] : pool_blocks(alloc, step.graph_pool(), true)) {
    EXPECT_NE(path.find(".grad"), std::string::npos) << path;
    grads += bytes;
  }
  EXPECT_GT(grads, 0);
  EXPECT_EQ(pool_blocks(alloc, step.graph_pool(), false).count("compiled backward"), 0u);
  step.end_step();
  alloc.validate();
}

TEST(CompiledModelFile, ReduceOverheadOutOfMemoryInsideAGraphLeavesTheAllocatorConsistent) {
  CudaGraphsRun run("sim:capacity=24MiB,context=0");
  CachingAllocator& alloc = run.alloc;
  bool failed = false;
  {
    Trainer trainer{run.cfg, alloc};
    try {
      for (int i = 0; i < 3; ++i) trainer.step();
    } catch (const OutOfMemoryError&) {
      failed = true;
    }
    alloc.validate();
    // The capture ended with the exception: the default pools serve again.
    alloc.deallocate(alloc.allocate(512));
  }
  EXPECT_TRUE(failed) << "cuBLAS's workspace segment (20 MiB) and the pool's small one do not fit beside the rest";
  // The step is gone, and with it the pool's users: empty_cache gives its segments back.
  alloc.empty_cache();
  EXPECT_EQ(alloc.private_pool_reserved(), 0u);
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  alloc.validate();
}

TEST(CompiledModelFile, ReduceOverheadNeedsThreeStepsAndNoAccumulation) {
  TrainConfig cfg = mlp_config(1.0, /*cudagraphs=*/true);
  cfg.steps = 2;
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("run 3 steps or more"), std::string::npos);
  cfg.steps = 4;
  cfg.accumulation = 2;
  EXPECT_NE(test::error_of([&] { test::OneStep run(cfg); }).find("gradient accumulation"), std::string::npos);
}

TEST(CompiledModelFile, AMalformedGraphIsRefusedByItsPath) {
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases{
      {"unknown key", [](nlohmann::json& j) { j["compiled"]["graph"]["extra"] = 1; }, "unknown key 'extra'"},
      {"user out of range", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][9]["users"][0] = 100000; },
       "compiled.graph.nodes[9].users[0]: expected an integer from 0 to"},
      {"user before", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][9]["users"][0] = 2; },
       "a node's users come after it"},
      {"unknown flag", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][9]["flags"][0] = "fast"; },
       "unknown flag 'fast'"},
      {"bytes", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][10]["bytes"] = 7; }, "bytes for a"},
      {"formula", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][10]["bytes"] = "80*batches"; },
       "compiled.graph.nodes[10].bytes: the formula"},
      {"solver", [](nlohmann::json& j) { j["compiled"]["graph"]["partitioner"]["activation_memory_budget_solver"] = "ilp"; },
       "only PyTorch's default, \"dp\""},
      {"output not last", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][5]["op"] = "output"; },
       "the output node must be the graph's last"},
      {"no graph", [](nlohmann::json& j) { j.erase("graph"); j["layers"] = nlohmann::json::array(); },
       "it goes with \"graph\""},
      {"placeholder reads", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][1]["inputs"] = {0}; },
       "a placeholder reads no node"},
      {"user twice",
       [](nlohmann::json& j) {
         auto& users = j["compiled"]["graph"]["nodes"][9]["users"];
         users.push_back(users[0]);
       },
       "a user listed twice"},
      {"grad of no output", [](nlohmann::json& j) { j["compiled"]["graph"]["nodes"][0]["grad"] = 10; },
       "is none of the backward's outputs"},
  };
  for (const Case& c : cases) {
    nlohmann::json doc = mlp_json();
    c.edit(doc);
    const std::string error = test::error_of([&] { models::ModelFile::parse(doc.dump(), "mlp.json")->describe(); });
    EXPECT_NE(error.find(c.message), std::string::npos) << c.what << ": " << error;
  }
}

}  // namespace
}  // namespace mem::nn
