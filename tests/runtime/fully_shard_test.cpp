// fully_shard_test.cpp — one rank of FSDP2: which modules fully_shard wraps, the shards'
// sizes per rank, a model built on the meta device never holding its full parameters, every
// all-gather and reduce-scatter buffer freed within the step, and what it refuses. The
// comparisons with PyTorch itself are in tests/models (the H100 recording) and check_parallel.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <functional>
#include <string>

#include "../../runtime/src/parallel/fully_shard.hpp"
#include "test_util.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

std::vector<std::string> block_paths(const char* model) {
  auto built = models::find(model)->build(ModelOptions{});
  built->body().set_path("");
  std::vector<std::string> out;
  for (const Module* m : repeated_blocks(built->body())) out.push_back(m->path());
  return out;
}

TEST(FullyShard, WrapsTheRepeatedBlocksAsPeopleApplyIt) {
  // A ResNet's Bottlenecks (inside its stages), a decoder's layers, a ViT's encoder blocks.
  const auto resnet = block_paths("resnet50");
  ASSERT_EQ(resnet.size(), 16u);
  EXPECT_EQ(resnet.front(), "layer1.0");
  EXPECT_EQ(resnet.back(), "layer4.2");
  const auto llama = block_paths("llama-3.2-1b");
  ASSERT_EQ(llama.size(), 16u);
  EXPECT_EQ(llama.front(), "model.layers.0");
  EXPECT_EQ(llama.back(), "model.layers.15");
  EXPECT_EQ(block_paths("vit_b_16").size(), 12u);
  // Plain Linear layers have no children: only the root is sharded.
  EXPECT_TRUE(block_paths("mlp").empty());
}

TEST(FullyShard, RanksAreAlikeOnlyWhenEveryDimZeroSplitsEvenly) {
  auto llama = models::find("llama-3.2-1b")->build(ModelOptions{});
  EXPECT_TRUE(fsdp_ranks_alike(llama->body(), 8));
  EXPECT_FALSE(fsdp_ranks_alike(llama->body(), 3));  // 2048 rows over 3 ranks
}

struct RankRun {
  std::int64_t allocated_after_construction = 0, max_during_construction = 0;
  std::int64_t gemm_workspaces = 0;  // cuBLAS's, kept from the first product on
  std::vector<StepStats> steps;
  std::vector<CommunicationBuffer> buffers;
  std::vector<std::size_t> pinned_host;  // after each step
};

RankRun run_rank(const char* model, const char* parallel, const char* options, std::size_t steps = 2,
                 const char* sizes = "batch=2") {
  TrainConfig cfg;
  cfg.model = models::find(model);
  cfg.model_options = ModelOptions::parse(sizes);
  cfg.precision = Precision::BF16;
  cfg.steps = steps;
  cfg.parallel = parse_parallel(parallel, options);
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  RankRun r;
  r.allocated_after_construction = alloc.stats().allocated_bytes[0].current;
  r.max_during_construction = alloc.stats().allocated_bytes[0].peak;
  for (std::size_t i = 0; i < steps; ++i) {
    r.steps.push_back(trainer.step());
    r.pinned_host.push_back(trainer.runtime().pinned_host_bytes());
  }
  r.buffers = trainer.communication_buffers();
  r.gemm_workspaces = static_cast<std::int64_t>(trainer.runtime().gemm_workspace_bytes());
  return r;
}

std::int64_t bytes_of(const std::vector<CommunicationBuffer>& buffers, const std::string& suffix) {
  std::int64_t n = 0;
  for (const auto& b : buffers) n += b.what.ends_with(suffix) ? static_cast<std::int64_t>(b.bytes) : 0;
  return n;
}

TEST(FullyShard, AMetaBuiltModelNeverHoldsItsFullParameters) {
  const RankRun meta = run_rank("gpt2", "fsdp:8", "");
  const RankRun cuda = run_rank("gpt2", "fsdp:8", "init=cuda");
  const std::int64_t full = 124'439'808LL * 2;  // gpt2's bf16 parameters
  const std::int64_t shards = bytes_of(meta.buffers, " shards");
  // Every group's shards: an eighth of the parameters, padded per parameter.
  EXPECT_GE(shards, full / 8);
  EXPECT_LT(shards, full / 8 + 1 * MiB);
  EXPECT_EQ(shards, bytes_of(cuda.buffers, " shards"));
  EXPECT_LT(meta.max_during_construction, full / 4);
  EXPECT_GE(cuda.max_during_construction, full);
  // Sharded alike: what wrapping freed was the full model.
  EXPECT_EQ(meta.allocated_after_construction, cuda.allocated_after_construction);
  // The full model's cached segments move later blocks: a block taken whole from a larger free
  // one (a remainder under 1 MiB is not split off) counts its whole size, as in PyTorch.
  EXPECT_NEAR(static_cast<double>(meta.steps.back().allocated_end),
              static_cast<double>(cuda.steps.back().allocated_end), static_cast<double>(1 * MiB));
}

/// Each parameter's padded shard over `world` ranks in bf16, each rounded by `round`: as its
/// pinned host block holds it (PyTorch's caching host allocator: a power of two), or its block
/// on the GPU (the caching allocator's 512 B).
std::size_t shard_blocks(const Module& m, std::int64_t world, const std::function<std::size_t(std::size_t)>& round) {
  std::size_t n = 0;
  for (const ParamSlot& slot : m.slots()) {
    if (slot.is_buffer) continue;
    const std::int64_t rows = slot.shape.size() == 0 ? 1 : slot.shape[0];
    const std::int64_t numel = slot.shape.size() == 0 ? 1 : slot.shape.numel();
    const auto bytes = static_cast<std::size_t>((rows + world - 1) / world * (numel / rows) * 2);
    n += round(bytes);
  }
  for (const auto& [name, child] : m.children()) n += shard_blocks(*child, world, round);
  return n;
}

// CPUOffloadPolicy: the shards, their gradients and Adam's state on the host; the GPU holds
// each group's copies from the host and what it gathers, and the reduce-scatter outputs only
// until they are copied back. The host's pinned blocks: one per shard, one per gradient, the
// second step's gradients in the first step's cached blocks.
TEST(FullyShard, CpuOffloadKeepsShardsGradientsAndTheOptimizerOnTheHost) {
  const RankRun plain = run_rank("gpt2", "fsdp:8", "");
  const RankRun offload = run_rank("gpt2", "fsdp:8", "offload_policy=cpu");
  const std::int64_t shards = bytes_of(plain.buffers, " shards");
  EXPECT_EQ(bytes_of(offload.buffers, " shards"), shards);  // the same shards, on the host
  const auto built = models::find("gpt2")->build(ModelOptions::parse("batch=2"));
  const auto on_gpu = shard_blocks(built->body(), 8, [](std::size_t b) { return (b + 511) / 512 * 512; });
  EXPECT_EQ(plain.allocated_after_construction - offload.allocated_after_construction,
            static_cast<std::int64_t>(on_gpu));
  // After a step the GPU holds neither the gradients nor Adam's two moments (all bf16 here).
  const std::int64_t kept = plain.steps[1].allocated_end - offload.steps[1].allocated_end;
  EXPECT_GE(kept, 4 * shards);
  EXPECT_LT(kept, 4 * shards + 4 * MiB);
  const std::size_t blocks = shard_blocks(built->body(), 8, [](std::size_t b) { return std::bit_ceil(b); });
  EXPECT_EQ(offload.pinned_host, (std::vector<std::size_t>{2 * blocks, 2 * blocks}));
  EXPECT_TRUE(plain.pinned_host.back() == 0);
  // Each unshard copies its group's shards from the host first; freed once gathered.
  std::int64_t copied = 0;
  for (const auto& b : offload.buffers) {
    if (!b.what.ends_with("all-gather inputs (copied from the host)")) continue;
    copied += static_cast<std::int64_t>(b.bytes);
    EXPECT_EQ(b.freed, b.allocated) << b.what;
  }
  EXPECT_GE(copied, 2 * shards);  // forward and backward, two steps: every group at least twice
  // pin_memory=False: pageable, no pinned block; and it needs the policy.
  EXPECT_EQ(run_rank("gpt2", "fsdp:8", "offload_policy=cpu,pin_memory=false", 1).pinned_host.back(), 0u);
  EXPECT_THROW((void)parse_parallel("fsdp:8", "pin_memory=false"), Error);
  EXPECT_EQ(parallel_label(parse_parallel("fsdp:8", "offload_policy=cpu,pin_memory=false")),
            "fsdp:8 offload_policy=cpu,pin_memory=false");
}

TEST(FullyShard, EveryGatherAndReduceScatterBufferIsFreedWithinItsStep) {
  const RankRun r = run_rank("llama-3.2-1b", "fsdp:8", "", 2);
  std::size_t gathers = 0, unsharded = 0, inputs = 0, outputs = 0;
  for (const auto& b : r.buffers) {
    if (b.what.ends_with("all-gather output")) {
      ++gathers;
      EXPECT_EQ(b.stream, "all-gather copy-in");
      EXPECT_FALSE(b.freed.empty()) << b.what << " " << b.allocated;
    }
    if (b.what.ends_with("unsharded parameters")) {
      ++unsharded;
      EXPECT_FALSE(b.freed.empty()) << b.what << " " << b.allocated;
    }
    if (b.what.ends_with("reduce-scatter input")) {
      ++inputs;
      EXPECT_EQ(b.stream, "default");
      EXPECT_EQ(b.freed, b.allocated) << b.what;  // freed by the next group's post-backward, or the root's
    }
    if (b.what.ends_with("(sharded gradients)")) {
      ++outputs;
      EXPECT_EQ(b.stream, "reduce-scatter");
    }
  }
  // 16 layers and the root per step: gathered in forward and again in backward, except the
  // root, which keeps its parameters from forward to post-backward.
  EXPECT_EQ(gathers, 2u * (2 * 16 + 1));
  EXPECT_EQ(unsharded, gathers);
  EXPECT_EQ(inputs, 2u * 17);
  EXPECT_EQ(outputs, 2u * 17);
  // The second step holds what the first did: the shards, their gradients and Adam's state.
  EXPECT_EQ(r.steps[0].allocated_end, r.steps[1].allocated_end);
}

TEST(FullyShard, KeepingParametersAfterForwardGathersEachOnce) {
  const RankRun r = run_rank("llama-3.2-1b", "fsdp:8", "reshard_after_forward=false", 1);
  std::size_t gathers = 0;
  for (const auto& b : r.buffers) gathers += b.what.ends_with("all-gather output") ? 1 : 0;
  EXPECT_EQ(gathers, 17u);
  const RankRun resharding = run_rank("llama-3.2-1b", "fsdp:8", "", 1);
  EXPECT_GT(r.steps[0].peak_allocated, resharding.steps[0].peak_allocated);
}

// reshard_after_forward=k: each block keeps a 1/k slice of its gathered parameters from
// forward to backward, where it gathers over k ranks into an output as large as before.
TEST(FullyShard, ReshardingToFewerRanksKeepsASliceAfterForward) {
  const RankRun full = run_rank("llama-3.2-1b", "fsdp:8", "", 1);
  const RankRun four = run_rank("llama-3.2-1b", "fsdp:8", "reshard_after_forward=4", 1);
  const RankRun keep = run_rank("llama-3.2-1b", "fsdp:8", "reshard_after_forward=false", 1);
  std::vector<std::size_t> forward, backward;
  for (const auto& b : four.buffers) {
    if (b.what == "model.layers.3 all-gather output") (b.allocated == "step 1 forward" ? forward : backward).push_back(b.bytes);
  }
  ASSERT_EQ(forward.size(), 1u);
  EXPECT_EQ(backward, forward);
  // The slice is a quarter of the gathered parameters, kept from forward to backward, where
  // the copy-out frees it; --buffers lists it.
  std::size_t slices = 0;
  for (const auto& b : four.buffers) {
    if (b.what != "model.layers.3 post-forward shards") continue;
    ++slices;
    EXPECT_EQ(static_cast<std::int64_t>(b.bytes) * 4, bytes_of(four.buffers, "model.layers.3 unsharded parameters") / 2)
        << "gathered in forward and in backward";
    EXPECT_EQ(b.allocated, "step 1 forward");
    EXPECT_EQ(b.freed, "step 1 backward");
  }
  EXPECT_EQ(slices, 1u);
  EXPECT_GT(four.steps[0].forward.peak_allocated, full.steps[0].forward.peak_allocated);
  EXPECT_LT(four.steps[0].forward.peak_allocated, keep.steps[0].forward.peak_allocated);
  EXPECT_EQ(parallel_label(parse_parallel("fsdp:8", "reshard_after_forward=4")), "fsdp:8 reshard_after_forward=4");
  EXPECT_EQ(parse_parallel("fsdp:8", "reshard_after_forward=1").reshard_after_forward, false);
  EXPECT_EQ(parse_parallel("fsdp:8", "reshard_after_forward=8").reshard_after_forward, true);
  EXPECT_EQ(parse_parallel("fsdp:8", "reshard_after_forward=8").reshard_after_forward_to, 0u);
  EXPECT_THROW((void)parse_parallel("fsdp:8", "reshard_after_forward=3"), Error);
}

TEST(FullyShard, OneRankGathersNothing) {
  const RankRun r = run_rank("gpt2", "fsdp:1", "");
  EXPECT_EQ(bytes_of(r.buffers, "all-gather output"), 0);
  EXPECT_GT(bytes_of(r.buffers, "reduce-scatter input"), 0);
}

TEST(FullyShard, TheLastRankHoldsFewerRowsWhereDimZeroDoesNotSplit) {
  // gpt2's vocabulary (50257 rows) over 8: 6283 rows each, the last rank 6276.
  const RankRun first = run_rank("gpt2", "fsdp:8", "", 2);
  const RankRun last = run_rank("gpt2", "fsdp:8", "rank=7", 2);
  EXPECT_EQ(bytes_of(first.buffers, " shards"), bytes_of(last.buffers, " shards"));  // padded alike
  // Adam's two states (in the parameters' dtype, bf16) follow the rows each rank really holds.
  EXPECT_EQ(first.steps.back().allocated_end - last.steps.back().allocated_end,
            static_cast<std::int64_t>(round_size(6283 * 768 * 2, AllocatorConfig{}) * 2 - round_size(6276 * 768 * 2, AllocatorConfig{}) * 2));
}

// DeepSpeed's ZeRO (zero_redundancy.cpp; its buffers against DeepSpeed itself are in
// tests/models): stage 2 against stage 1 on one model, the parts that must hold whatever the
// model.
TEST(ZeroRedundancy, StagesPartitionTheOptimizerAndTheGradients) {
  // Short sequences: the gradients, not the causal-LM loss's f32 logits, make the backward's peak.
  const RankRun one = run_rank("gpt2", "zero1:8", "", 2, "batch=1,seq=128");
  const RankRun two = run_rank("gpt2", "zero2:8", "", 2, "batch=1,seq=128");
  const std::int64_t params = 124'439'808LL;  // gpt2's (the tied head once)
  const std::int64_t padded = (params + 15) / 16 * 16, partition = padded / 8;
  // Construction: the bf16 flat buffer (the model, whole) and the fp32 master partition.
  EXPECT_EQ(bytes_of(one.buffers, "bit16 flat parameters (bit16_groups_flat)"), padded * 2);
  EXPECT_EQ(bytes_of(one.buffers, "fp32 master partition"), partition * 4);
  // Adam's two fp32 moments of the partition, once.
  EXPECT_EQ(bytes_of(two.buffers, "exp_avg") + bytes_of(two.buffers, "exp_avg_sq"), partition * 8);
  // Each backward a 5e8-element bf16 bucket (1 GB), whatever the model's size.
  std::size_t buckets = 0;
  for (const auto& b : two.buffers) {
    if (b.what.starts_with("gradient bucket")) {
      ++buckets;
      EXPECT_EQ(b.bytes, 1'000'000'000u);
      EXPECT_EQ(b.freed, b.allocated);
    }
  }
  EXPECT_EQ(buckets, 2u);
  // Stage 1 holds every bf16 gradient until the backward ends; stage 2 gives each up as it
  // is bucketed: its backward peaks lower, the steps end alike.
  EXPECT_GT(one.steps[1].backward.peak_allocated, two.steps[1].backward.peak_allocated);
  EXPECT_EQ(one.steps[1].allocated_end, two.steps[1].allocated_end);
  EXPECT_EQ(one.steps[0].allocated_end, one.steps[1].allocated_end);
}

// offload_optimizer=cpu (stage_1_and_2.py's cpu_offload, DeepSpeed @edaa7221): the fp32 master,
// its gradient and Adam's moments on the host, the GPU keeping the flat bf16 weights and a
// staging buffer of the largest parameter; each gradient leaves the GPU in the backward.
TEST(ZeroRedundancy, OffloadOptimizerKeepsTheMasterItsGradientAndAdamOnTheHost) {
  const RankRun gpu = run_rank("gpt2", "zero2:8", "", 2, "batch=1,seq=128");
  const RankRun host = run_rank("gpt2", "zero2:8", "offload_optimizer=cpu", 2, "batch=1,seq=128");
  const std::int64_t params = 124'439'808LL, padded = (params + 15) / 16 * 16, partition = padded / 8;
  const std::int64_t largest = 50257LL * 768;  // wte, the largest parameter
  const auto on = [](const RankRun& r, const std::string& what, const char* stream) {
    std::int64_t n = 0;
    for (const auto& b : r.buffers) n += b.what == what && b.stream == stream ? static_cast<std::int64_t>(b.bytes) : 0;
    return n;
  };
  EXPECT_EQ(on(host, "fp32 master partition (host)", "host"), partition * 4);
  EXPECT_EQ(on(host, "fp32 gradient partition (host)", "host"), partition * 4);
  EXPECT_EQ(on(host, "bit16 partition buffer (host)", "host"), partition * 2);
  EXPECT_EQ(on(host, "temp_grad_buffer_for_cpu_offload (host)", "host"), largest * 2);
  EXPECT_EQ(on(host, "exp_avg (host)", "host") + on(host, "exp_avg_sq (host)", "host"), partition * 8);
  EXPECT_EQ(on(host, "temp_grad_buffer_for_gpu_offload", "default"), largest * 2);
  for (const char* gone : {"fp32 master partition", "grads_in_partition", "fp32 gradient partition", "exp_avg",
                           "FusedAdam overflow flag"}) {
    EXPECT_EQ(bytes_of(host.buffers, gone), 0) << gone;
  }
  // The four pinned copies (each a power-of-two block of the caching host allocator); Adam's
  // moments are pageable.
  const auto pow2 = [](std::int64_t bytes) {
    std::int64_t b = 1;
    while (b < bytes) b *= 2;
    return b;
  };
  EXPECT_EQ(static_cast<std::int64_t>(host.pinned_host.back()),
            2 * pow2(partition * 4) + pow2(partition * 2) + pow2(largest * 2));
  EXPECT_EQ(run_rank("gpt2", "zero2:8", "offload_optimizer=cpu,pin_memory=false", 1, "batch=1,seq=128").pinned_host.back(),
            0u);
  // Nothing the step makes stays on the GPU (cuBLAS's workspaces are the first product's);
  // without offloading Adam's two fp32 moments do (each block of its segment's remainder).
  EXPECT_EQ(host.steps.back().allocated_end, host.allocated_after_construction + host.gemm_workspaces);
  const std::int64_t kept = gpu.steps.back().allocated_end - gpu.allocated_after_construction - gpu.gemm_workspaces;
  EXPECT_GE(kept, partition * 8);
  EXPECT_LT(kept, partition * 8 + 2 * (std::int64_t{2} << 20));
}

TEST(ZeroRedundancy, RefusesWhatItDoesNotModel) {
  TrainConfig cfg;
  cfg.model = models::find("gpt2");
  cfg.precision = Precision::BF16;
  cfg.parallel = parse_parallel("zero2:8");
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  for (const char* optimizer : {"none", "adam8bit", "sgd"}) {
    cfg.optimizer = parse_optimizer_config(optimizer);
    cfg.parallel = parse_parallel("zero2:8", std::string(optimizer) == "sgd" ? "offload_optimizer=cpu" : "");
    try {
      Trainer trainer(cfg, alloc);
      ADD_FAILURE() << optimizer << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("zero"), std::string::npos) << e.what();
    }
    EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0) << optimizer;
  }
}

// DeepSpeed's ZeRO stage 3 (zero_stage3.cpp; its buffers against DeepSpeed itself are in
// tests/models): what must hold on a real model whatever its size.
TEST(ZeroStage3, EveryParameterIsGatheredAroundItsModulesAndEveryStateIsPartitioned) {
  const RankRun three = run_rank("gpt2", "zero3:8", "", 2, "batch=1,seq=128");
  const RankRun two = run_rank("gpt2", "zero2:8", "", 2, "batch=1,seq=128");
  // gpt2's 148 parameter tensors (the tied head once), each ceil(n / 8) elements per rank.
  auto model = models::find("gpt2")->build(ModelOptions::parse("batch=1,seq=128"));
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Runtime rt(alloc, ExecMode::DryRun, 0);
  {
    MetaParameters meta;
    model->materialize(rt, DType::BF16);
  }
  std::int64_t partition = 0;
  std::size_t tensors = 0;
  for (const Tensor& t : model->body().parameters()) {
    partition += (t.numel() + 7) / 8;
    ++tensors;
  }
  EXPECT_EQ(tensors, 148u);
  EXPECT_EQ(bytes_of(three.buffers, "bf16 flat partition buffer (lp_param_buffer)"), partition * 2);
  EXPECT_EQ(bytes_of(three.buffers, "gradient partitions (grad_partitions_flat_buffer)"), partition * 2);
  EXPECT_EQ(bytes_of(three.buffers, "fp32 master partition"), partition * 4);
  EXPECT_EQ(bytes_of(three.buffers, "exp_avg") + bytes_of(three.buffers, "exp_avg_sq"), partition * 8);
  EXPECT_EQ(bytes_of(three.buffers, "IPG bucket (reduce_bucket_size)"), 1'000'000'000);
  // The first step records the trace: each parameter gathered before its module runs and
  // released after, so every one of them is gathered once in the forward, and the tied
  // embedding twice: the head's weight is the same Parameter.
  std::size_t gathered = 0;
  for (const CommunicationBuffer& b : three.buffers) {
    if (b.allocated == "step 1 forward" && b.what.starts_with("gathered parameter")) ++gathered;
  }
  EXPECT_EQ(gathered, tensors + 1);
  // Between steps a rank holds exactly ZeRO-3's buffers that live on (the bytes requested;
  // blocks may hold more): the flat partitions, master, moments, gradient partitions, the 1 GB
  // bucket (made once, stage3.py:733, where stage 2 makes it each backward) and the persistent
  // parameters; beside them only cuBLAS's workspaces.
  std::int64_t kept = three.gemm_workspaces;
  for (const CommunicationBuffer& b : three.buffers) {
    if (b.freed.empty()) kept += static_cast<std::int64_t>(b.bytes);
  }
  for (const StepStats& s : three.steps) {
    EXPECT_EQ(s.stats.requested_bytes[0].current, kept);
  }
  EXPECT_GT(three.steps[1].allocated_end, two.steps[1].allocated_end);  // on a model this small
}

// offload_optimizer=cpu under ZeRO-3 (stage3.py's offload_optimizer; its buffers against
// DeepSpeed itself are in tests/models): the master, each sub group's fp32 gradient, Adam's
// moments and the bf16 gradient partitions on the host; between steps the device keeps only
// what lives on the device.
TEST(ZeroStage3, OffloadOptimizerKeepsTheMasterGradientsAndAdamOnTheHost) {
  const RankRun host = run_rank("gpt2", "zero3:8", "offload_optimizer=cpu", 2, "batch=1,seq=128");
  const std::int64_t partition = bytes_of(host.buffers, "bf16 flat partition buffer (lp_param_buffer)") / 2;
  std::int64_t on_host = 0, kept_on_device = host.gemm_workspaces;
  for (const CommunicationBuffer& b : host.buffers) {
    if (b.stream == "host" && b.freed.empty()) on_host += static_cast<std::int64_t>(b.bytes);
    if (b.stream != "host" && b.freed.empty()) kept_on_device += static_cast<std::int64_t>(b.bytes);
  }
  // The fp32 master, its fp32 gradient, the two fp32 moments and the bf16 gradient
  // partitions: 18 bytes per element.
  EXPECT_EQ(on_host, partition * 18);
  for (const StepStats& s : host.steps) EXPECT_EQ(s.stats.requested_bytes[0].current, kept_on_device);
  EXPECT_EQ(bytes_of(host.buffers, "FusedAdam overflow flag"), 0);
  // The gradients are pinned by default (each a power-of-two block of the caching host
  // allocator): the fp32 one of the sub group and the bf16 partitions.
  const auto block = [](std::int64_t bytes) {
    std::int64_t b = 1;
    while (b < bytes) b *= 2;
    return b;
  };
  EXPECT_EQ(static_cast<std::int64_t>(host.pinned_host.back()), block(partition * 4) + block(partition * 2));
  EXPECT_EQ(run_rank("gpt2", "zero3:8", "offload_optimizer=cpu,pin_memory=false", 1, "batch=1,seq=128").pinned_host.back(),
            0u);
}

// offload_param=cpu under ZeRO-3 (ZeRO-Infinity's parameters on the host; the host buffers
// against DeepSpeed itself are in tests/models): no partition stays on the device, the trained
// ones sit in one pinned flat buffer on the host, and every gather first copies the partitions
// it sends: a copy per gathered buffer, of the partition's size, gone by the step's end.
TEST(ZeroStage3, OffloadParamKeepsThePartitionsOnTheHostAndCopiesEachToTheGpuToGather) {
  const RankRun plain = run_rank("gpt2", "zero3:8", "", 2, "batch=1,seq=128");
  const RankRun offload = run_rank("gpt2", "zero3:8", "offload_param=cpu", 2, "batch=1,seq=128");
  const std::int64_t partition = bytes_of(plain.buffers, "bf16 flat partition buffer (lp_param_buffer)");
  EXPECT_EQ(bytes_of(offload.buffers, "bf16 flat partition buffer (lp_param_buffer)"), 0);
  EXPECT_EQ(bytes_of(offload.buffers, "bf16 flat partition buffer (param_groups_fp16_flat_cpu_memory)"), partition);
  std::size_t gathers = 0, copies = 0;
  for (const CommunicationBuffer& b : offload.buffers) {
    if (b.what.starts_with("bf16 parameter partition") || b.what.starts_with("bf16 flat partition")) {
      EXPECT_EQ(b.stream, "host") << b.what;
    }
    gathers += b.what.starts_with("gathered parameter (") && b.what.find("copy out") == std::string::npos;
    gathers += b.what.starts_with("all-gather flat buffer");
    if (b.what == "partition copied to the device (offload_param)") {
      ++copies;
      EXPECT_FALSE(b.freed.empty());
    }
  }
  EXPECT_GE(copies, gathers);  // a coalesced gather copies each of its partitions
  EXPECT_GT(gathers, 0u);
  // Between steps the device keeps the partitions' bytes less.
  EXPECT_EQ(plain.steps[1].stats.requested_bytes[0].current - offload.steps[1].stats.requested_bytes[0].current,
            partition);
  // The flat buffer is always pinned (_create_param_groups_fp16_flat_cpu_memory); the
  // partitions zero.Init makes on the host are pinned unless pin_memory=false.
  EXPECT_GT(offload.pinned_host.back(),
            run_rank("gpt2", "zero3:8", "offload_param=cpu,pin_memory=false", 1, "batch=1,seq=128").pinned_host.back());
  EXPECT_NE(test::error_of([] { parse_parallel("zero2:8", "offload_param=cpu"); }).find("stage 3's"), std::string::npos);
  EXPECT_NE(test::error_of([] { (void)run_rank("gpt2", "zero3:1", "offload_param=cpu", 1, "batch=1,seq=32"); })
                .find("not modelled"),
            std::string::npos);
}

TEST(ZeroStage3, TheCoordinatorsSettingsDecideWhatStaysGathered) {
  const RankRun defaults = run_rank("gpt2", "zero3:8", "", 2, "batch=1,seq=128");
  // Nothing kept for reuse and nothing persistent: from the second step each module's
  // parameters are gathered and freed around it, as in the first.
  const RankRun lean = run_rank("gpt2", "zero3:8",
                                "stage3_max_reuse_distance=0,stage3_param_persistence_threshold=0,"
                                "stage3_prefetch_bucket_size=0",
                                2, "batch=1,seq=128");
  EXPECT_LT(lean.steps[1].forward.peak_allocated, defaults.steps[1].forward.peak_allocated);
  const auto kept_for_backward = [](const RankRun& r) {
    std::size_t n = 0;
    for (const CommunicationBuffer& b : r.buffers) n += b.allocated == "step 2 forward" && b.freed == "step 2 backward";
    return n;
  };
  EXPECT_EQ(kept_for_backward(lean), 0u);
  EXPECT_GT(kept_for_backward(defaults), 0u);
  // Built whole on the GPU, the model passes through construction's peak; under zero.Init
  // only one parameter is whole at a time (a small bucket, so that the model's 249 MB show).
  const RankRun init = run_rank("gpt2", "zero3:8", "reduce_bucket_size=1e6", 1, "batch=1,seq=128");
  const RankRun whole = run_rank("gpt2", "zero3:8", "reduce_bucket_size=1e6,zero3_init_flag=false", 1, "batch=1,seq=128");
  const std::int64_t model_bytes = 248'879'616;  // gpt2's parameters in bf16, the head tied
  EXPECT_GT(whole.max_during_construction, model_bytes);
  EXPECT_LT(init.max_during_construction, model_bytes);
  EXPECT_EQ(whole.allocated_after_construction, init.allocated_after_construction);
}

TEST(ZeroStage3, OneRankGathersNothing) {
  // _no_gather_coalesced: with one rank the partition is the parameter.
  const RankRun one = run_rank("gpt2", "zero3:1", "", 2, "batch=1,seq=32");
  for (const CommunicationBuffer& b : one.buffers) {
    EXPECT_FALSE(b.what.starts_with("gathered") || b.what.starts_with("all-gather")) << b.what;
  }
  EXPECT_GT(bytes_of(one.buffers, "reduce-scatter buffer (N x sum of partitions, interleaved)"), 0);
}

TEST(ZeroStage3, OutOfMemoryInTheConstructionGivesEverythingBack) {
  // The 1 GB bucket does not fit a 1 GiB device after the partitions and the master.
  TrainConfig cfg;
  cfg.model = models::find("gpt2");
  cfg.model_options = ModelOptions::parse("batch=1,seq=32");
  cfg.precision = Precision::BF16;
  cfg.parallel = parse_parallel("zero3:8");
  auto device = make_device("sim:capacity=1GiB,context=0");
  CachingAllocator alloc(device);
  EXPECT_THROW(Trainer(cfg, alloc), OutOfMemoryError);
  EXPECT_GT(alloc.stats().allocated_bytes[0].peak, 150'000'000);  // partitions and master were made first
  EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0);
  alloc.validate();
}

TEST(ZeroStage3, RefusesWhatItDoesNotModelAndChangesNothing) {
  for (const char* what : {"compute", "segments", "none", "adam8bit"}) {
    TrainConfig cfg;
    cfg.model = models::find("mlp");
    cfg.precision = Precision::BF16;
    cfg.parallel = parse_parallel("zero3:8");
    if (std::string(what) == "compute") cfg.mode = ExecMode::Compute;
    if (std::string(what) == "segments") cfg.segments = 2;
    if (std::string(what) == "none" || std::string(what) == "adam8bit") cfg.optimizer = parse_optimizer_config(what);
    auto device = make_device("sim:capacity=4GiB,context=0,backing=host");
    CachingAllocator alloc(device);
    try {
      Trainer trainer(cfg, alloc);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("zero3"), std::string::npos) << e.what();
    }
    EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0) << what;
  }
}

TEST(FullyShard, ComputeModeAndSegmentsAreRefusedWithAReason) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.parallel = parse_parallel("fsdp:8");
  cfg.mode = ExecMode::Compute;
  auto device = make_device("sim:capacity=4GiB,context=0,backing=host");
  CachingAllocator alloc(device);
  try {
    Trainer trainer(cfg, alloc);
    ADD_FAILURE() << "compute mode was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dry run only"), std::string::npos) << e.what();
  }
  EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0);
  cfg.mode = ExecMode::DryRun;
  cfg.segments = 4;
  try {
    Trainer trainer(cfg, alloc);
    ADD_FAILURE() << "segments were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint_sequential"), std::string::npos) << e.what();
  }
  EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0);
}

}  // namespace
}  // namespace mem::nn
