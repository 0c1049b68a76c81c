// data_parallel_test.cpp — one rank of DistributedDataParallel: the options by their names
// (and every malformed one refused), bucket assignment as reducer.cpp closes buckets, the
// buckets' bytes and rebuild, what each option adds or saves, exact to the block, and
// training results identical to one GPU's (DDP moves memory, never numbers).
#include <gtest/gtest.h>

#include <string>

#include "../../runtime/src/parallel/data_parallel.hpp"
#include "test_util.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

using test::error_of;

TEST(DataParallel, OptionsAreTheEnginesOwnNamesAndBadOnesAreRefused) {
  const ParallelConfig none = parse_parallel("none");
  EXPECT_FALSE(none.enabled());
  EXPECT_EQ(parallel_label(none), "none");
  const ParallelConfig ddp = parse_parallel("ddp:8");
  EXPECT_EQ(ddp.engine, ParallelEngine::Ddp);
  EXPECT_EQ(ddp.world_size, 8u);
  EXPECT_FALSE(ddp.bucket_cap_mb.has_value());
  EXPECT_EQ(parallel_label(ddp), "ddp:8");
  const ParallelConfig tuned =
      parse_parallel("ddp:64", "bucket_cap_mb=50, gradient_as_bucket_view=true,broadcast_buffers=False,static_graph=1");
  EXPECT_EQ(*tuned.bucket_cap_mb, 50.0);
  EXPECT_TRUE(tuned.gradient_as_bucket_view);
  EXPECT_FALSE(tuned.broadcast_buffers);
  EXPECT_TRUE(tuned.static_graph);
  EXPECT_EQ(parallel_label(tuned), "ddp:64 bucket_cap_mb=50,gradient_as_bucket_view=true,broadcast_buffers=false,"
                                   "static_graph=true");
  EXPECT_EQ(parse_parallel("ddp:64", "bucket_cap_mb=50,gradient_as_bucket_view=true,broadcast_buffers=false,"
                                     "static_graph=true"),
            tuned);

  const ParallelConfig fsdp = parse_parallel("fsdp:16", "reshard_after_forward=false,param_dtype=bf16,"
                                                       "reduce_dtype=f32,init=cuda,rank=15");
  EXPECT_EQ(fsdp.engine, ParallelEngine::Fsdp);
  EXPECT_EQ(fsdp.world_size, 16u);
  EXPECT_EQ(fsdp.reshard_after_forward, false);
  EXPECT_EQ(fsdp.param_dtype, DType::BF16);
  EXPECT_EQ(fsdp.reduce_dtype, DType::F32);
  EXPECT_FALSE(fsdp.meta_init);
  EXPECT_EQ(fsdp.rank, 15u);
  EXPECT_EQ(parallel_label(fsdp),
            "fsdp:16 reshard_after_forward=false,param_dtype=bf16,reduce_dtype=f32,init=cuda,rank=15");
  EXPECT_EQ(parallel_label(parse_parallel("fsdp:8")), "fsdp:8");
  const ParallelConfig zero = parse_parallel("zero2:64", "reduce_bucket_size=2e8,overlap_comm=true,rank=63");
  EXPECT_EQ(zero.engine, ParallelEngine::Zero2);
  EXPECT_EQ(zero.reduce_bucket_size, 2e8);
  EXPECT_EQ(zero.overlap_comm, true);
  EXPECT_EQ(zero.rank, 63u);
  EXPECT_EQ(parallel_label(zero), "zero2:64 reduce_bucket_size=200000000,overlap_comm=true,rank=63");
  EXPECT_EQ(parallel_label(parse_parallel("zero1:8", "offload_optimizer=cpu,pin_memory=false")),
            "zero1:8 offload_optimizer=cpu,pin_memory=false");
  EXPECT_EQ(parallel_label(parse_parallel("zero3:8", "offload_param=cpu,offload_optimizer=cpu")),
            "zero3:8 offload_optimizer=cpu,offload_param=cpu");
  EXPECT_EQ(parallel_label(parse_parallel("zero1:8")), "zero1:8");
  const ParallelConfig zero3 = parse_parallel(
      "zero3:64", "stage3_prefetch_bucket_size=0,stage3_param_persistence_threshold=1e4,stage3_max_live_parameters=3e8,"
                  "stage3_max_reuse_distance=0,sub_group_size=1e8,zero3_init_flag=false,overlap_comm=false");
  EXPECT_EQ(zero3.engine, ParallelEngine::Zero3);
  EXPECT_EQ(zero3.prefetch_bucket_size, 0);
  EXPECT_EQ(zero3.param_persistence_threshold, 1e4);
  EXPECT_EQ(zero3.max_live_parameters, 3e8);
  EXPECT_EQ(zero3.max_reuse_distance, 0);
  EXPECT_EQ(zero3.sub_group_size, 1e8);
  EXPECT_FALSE(zero3.zero3_init);
  EXPECT_EQ(parallel_label(zero3),
            "zero3:64 overlap_comm=false,stage3_prefetch_bucket_size=0,stage3_param_persistence_threshold=10000,"
            "stage3_max_live_parameters=300000000,stage3_max_reuse_distance=0,sub_group_size=100000000,"
            "zero3_init_flag=false");
  EXPECT_EQ(parallel_label(parse_parallel("zero3:8")), "zero3:8");

  const struct {
    const char *spec, *options, *says;
  } bad[] = {
      {"fsdp1:8", "", "fsdp1 is not modelled yet"},
      {"zero3:8", "stage3_prefetch_bucket_size=-1", "from 0 to 1e19"},
      {"zero3:8", "sub_group_size=0", "from 1 to 1e19"},
      {"zero3:8", "zero3_init_flag=maybe", "expected true or false"},
      {"zero2:8", "stage3_max_reuse_distance=0", "'stage3_max_reuse_distance' is not an option of zero2"},
      {"zero3:8", "bucket_cap_mb=5", "'bucket_cap_mb' is not an option of zero3"},
      {"zero4:8", "", "unknown engine 'zero4'"},
      {"zero2:0", "", "whole number from 1"},
      {"zero2:8", "bucket_cap_mb=5", "'bucket_cap_mb' is not an option of zero2"},
      {"zero1:8", "reduce_bucket_size=0", "from 1 to 1e12"},
      {"zero1:8", "reduce_bucket_size=5e20", "from 1 to 1e12"},
      {"zero1:8", "reduce_bucket_size=lots", "from 1 to 1e12"},
      {"zero2:8", "overlap_comm=maybe", "expected true or false"},
      {"zero2:8", "rank=8", "below 8"},
      {"zero2:8", "offload_optimizer=nvme", "expected cpu"},
      {"zero2:8", "pin_memory=false", "give offload_policy=cpu (fsdp), offload_optimizer=cpu (zero1, zero2, zero3)"},
      {"zero3:8", "offload_param=gpu", "offload_param=gpu: expected cpu"},
      {"zero2:8", "offload_param=cpu", "offload_param is ZeRO stage 3's"},
      {"fsdp:8", "offload_optimizer=cpu", "'offload_optimizer' is not an option of fsdp"},
      {"fsdp:0", "", "whole number from 1"},
      {"fsdp:8", "bucket_cap_mb=50", "'bucket_cap_mb' is not an option of fsdp"},
      {"fsdp:8", "reshard_after_forward=yes", "expected true or false"},
      {"fsdp:8", "reshard_after_forward=3", "a factor of 8"},
      {"fsdp:8", "reshard_after_forward=0", "a factor of 8"},
      {"fsdp:8", "param_dtype=int8", "expected bf16, f16 or f32"},
      {"fsdp:8", "reduce_dtype=", "expected bf16, f16 or f32"},
      {"fsdp:8", "init=cpu", "expected meta"},
      {"fsdp:8", "rank=8", "below 8"},
      {"fsdp:8", "rank=-1", "below 8"},
      {"fsdp:8", "rank=1,rank=2", "given twice"},
      {"ddp", "", "whole number from 1"},
      {"ddp:", "", "whole number from 1"},
      {"ddp:0", "", "whole number from 1"},
      {"ddp:-2", "", "whole number from 1"},
      {"ddp:8x", "", "whole number from 1"},
      {"ddp:99999999999999999999", "", "whole number from 1"},
      {"ddp:2000000", "", "whole number from 1"},
      {"none", "bucket_cap_mb=50", "are options of an engine"},
      {"ddp:8", "bucket_cap=50", "'bucket_cap' is not an option of ddp"},
      {"ddp:8", "reshard_after_forward=false", "not an option of ddp"},
      {"ddp:8", "bucket_cap_mb", "is not key=value"},
      {"ddp:8", "bucket_cap_mb=50,,static_graph=true", "is not key=value"},
      {"ddp:8", "bucket_cap_mb=0", "more than 0"},
      {"ddp:8", "bucket_cap_mb=-1", "more than 0"},
      {"ddp:8", "bucket_cap_mb=nan", "more than 0"},
      {"ddp:8", "bucket_cap_mb=1e300", "more than 0"},
      {"ddp:8", "bucket_cap_mb=25MiB", "more than 0"},
      {"ddp:8", "static_graph=yes", "expected true or false"},
      {"ddp:8", "bucket_cap_mb=50,", "is not key=value"},
      {"ddp:8", ",bucket_cap_mb=50", "is not key=value"},
      {"ddp:8", "bucket_cap_mb=50,bucket_cap_mb=25", "given twice"},
      {"ddp:8", "bucket_cap_mb=0x1p4", "more than 0"},
  };
  for (const auto& b : bad) {
    const std::string message = error_of([&] { (void)parse_parallel(b.spec, b.options); });
    EXPECT_NE(message.find(b.says), std::string::npos) << b.spec << " " << b.options << ": " << message;
  }
}

// reducer.cpp compute_bucket_assignment_by_size: add, then close once the limit is reached;
// each dtype its own bucket and its own limits; sorted by smallest index unless an order was
// given.
TEST(DataParallel, BucketsCloseAsTheReducerClosesThem) {
  test::Env env(ExecMode::DryRun);
  const auto t = [&](std::int64_t bytes, DType dtype = DType::F32) {
    return empty(env.rt, Shape{bytes / static_cast<std::int64_t>(dtype_size(dtype))}, dtype);
  };
  const std::vector<Tensor> tensors{t(600 * KiB), t(600 * KiB), t(100 * KiB, DType::BF16), t(24 * MiB),
                                    t(2 * MiB),   t(30 * MiB),  t(2 * KiB, DType::BF16)};
  const std::vector<std::size_t> order{6, 5, 4, 3, 2, 1, 0};  // the gradient-ready order
  using Buckets = std::vector<std::vector<std::size_t>>;
  // 1 MiB first: 30 MiB closes at once (f32); then 25 MiB: 2 + 24 reach it; 600 + 600 stay open.
  // The bf16 tensors (6, then 2) stay under their own 1 MiB; the open buckets come last.
  EXPECT_EQ(detail::assign_buckets(tensors, order, {1 * MiB, 25 * MiB}, false), (Buckets{{5}, {4, 3}, {1, 0}, {6, 2}}));
  // One limit of everything: one bucket per dtype, sorted by their smallest index.
  std::vector<std::size_t> forward{0, 1, 2, 3, 4, 5, 6};
  EXPECT_EQ(detail::assign_buckets(tensors, forward, {SIZE_MAX}, true), (Buckets{{0, 1, 3, 4, 5}, {2, 6}}));
}

struct RankRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> grads;
  std::vector<StepStats> steps;
  std::vector<std::size_t> buckets_after_construction, buckets;
  std::int64_t allocated_after_construction = 0;
};

RankRun run(TrainConfig cfg, ExecMode mode = ExecMode::DryRun) {
  cfg.mode = mode;
  auto device = make_device(mode == ExecMode::Compute ? "sim:capacity=16GiB,context=0,backing=host"
                                                      : "sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  RankRun r;
  r.buckets_after_construction = trainer.ddp_bucket_bytes();
  r.allocated_after_construction = alloc.stats().allocated_bytes[0].current;
  for (std::size_t i = 0; i < cfg.steps; ++i) {
    r.steps.push_back(trainer.step());
    r.losses.push_back(r.steps.back().loss);
  }
  if (mode == ExecMode::Compute) {
    for (const Tensor& p : trainer.model().parameters()) r.grads.push_back(to_values(p.grad()));
  }
  r.buckets = trainer.ddp_bucket_bytes();
  return r;
}

TrainConfig mlp(const std::string& parallel, const std::string& options = "") {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=4,width=512,batch=64");
  cfg.steps = 3;
  cfg.parallel = parse_parallel(parallel, options);
  return cfg;
}

TEST(DataParallel, EveryGradientInOneBucketThenTheRebuiltOnesExactly) {
  // mlp depth 4, width 512: four [512, 512] weights (1 MiB each) and biases (2 KiB).
  const RankRun plain = run(mlp("none"));
  const RankRun ddp = run(mlp("ddp:8"));
  const std::size_t weight = 512 * 512 * 4, bias = 512 * 4;
  const std::size_t all = 4 * (weight + bias);
  EXPECT_EQ(ddp.buckets_after_construction, std::vector<std::size_t>{all});
  // Gradients become ready from the last layer: its bias, then its weight; the first bucket
  // closes past 1 MiB (bias + weight), the next at 25 MiB takes the rest.
  EXPECT_EQ(ddp.buckets, (std::vector<std::size_t>{bias + weight, 3 * (bias + weight)}));
  // Wrapping leaves the parameters and the bucket; each step holds one bucket's worth more
  // than one GPU (gradient_as_bucket_view=False: the gradients and their bucket copies).
  EXPECT_EQ(ddp.allocated_after_construction, static_cast<std::int64_t>(2 * all));
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ddp.steps[i].allocated_end - plain.steps[i].allocated_end, static_cast<std::int64_t>(all)) << i;
    EXPECT_EQ(ddp.steps[i].peak_allocated - plain.steps[i].peak_allocated, static_cast<std::int64_t>(all)) << i;
  }
}

TEST(DataParallel, GradientAsBucketViewSavesTheGradientsCopy) {
  const RankRun copy = run(mlp("ddp:8"));
  const RankRun view = run(mlp("ddp:8", "gradient_as_bucket_view=true"));
  const std::int64_t all = 4 * (512 * 512 * 4 + 512 * 4);
  // Each gradient becomes a view of its bucket: after the step only the buckets hold them.
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(copy.steps[i].allocated_end - view.steps[i].allocated_end, all) << i;
}

TEST(DataParallel, BucketCapSetsBothLimits) {
  // bucket_cap_mb given: no 1 MiB first bucket; 1.5 MiB closes after every weight and bias pair.
  const RankRun r = run(mlp("ddp:8", "bucket_cap_mb=1.5"));
  const std::size_t pair = 512 * 512 * 4 + 512 * 4;
  EXPECT_EQ(r.buckets, (std::vector<std::size_t>{2 * pair, 2 * pair}));
}

TEST(DataParallel, StaticGraphRebuildsAtTheThirdForward) {
  TrainConfig cfg = mlp("ddp:8", "static_graph=true");
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  const std::size_t all = 4 * (512 * 512 * 4 + 512 * 4);
  trainer.step();
  trainer.step();
  EXPECT_EQ(trainer.ddp_bucket_bytes(), std::vector<std::size_t>{all});  // iteration 1 records nothing
  trainer.step();
  EXPECT_EQ(trainer.ddp_bucket_bytes().size(), 2u);
}

TEST(DataParallel, StaticGraphsFirstBackwardCopiesEveryGradientAtItsEnd) {
  // static_graph's first backward: the hooks return early and delay_all_reduce copies the
  // gradients into the bucket at the end, so with gradient_as_bucket_view the gradients are
  // only given up for views then: step 1's backward peak holds them all beside the bucket.
  const RankRun eager = run(mlp("ddp:8", "gradient_as_bucket_view=true"));
  const RankRun delayed = run(mlp("ddp:8", "gradient_as_bucket_view=true,static_graph=true"));
  const std::int64_t pair = 512 * 512 * 4 + 512 * 4;
  EXPECT_GE(delayed.steps[0].backward.peak_allocated - eager.steps[0].backward.peak_allocated, 2 * pair);
  EXPECT_EQ(delayed.steps[0].allocated_end, eager.steps[0].allocated_end + 512);  // + the int32 used map
}

TEST(DataParallel, WithoutInitSyncNothingIsCheckedOrBroadcast) {
  TrainConfig cfg = mlp("ddp:8", "init_sync=false");
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  const auto buffers = trainer.communication_buffers();
  ASSERT_EQ(buffers.size(), 1u);  // the bucket alone
  EXPECT_EQ(buffers[0].what, "gradient bucket 0 (every gradient of its dtype, until the rebuild)");
  const std::int64_t all = 4 * (512 * 512 * 4 + 512 * 4);
  EXPECT_EQ(alloc.stats().allocated_bytes[0].peak, 2 * all);  // parameters, then the bucket
}

TEST(DataParallel, BroadcastKeepsTwoBucketsInFlightOneTensorBucketsIncluded) {
  // comm.cpp: every bucket takes one of the two slots, a one-tensor bucket too (broadcast in
  // place, no copy). Frozen weights of 300, 100 + 200, 300 and 100 + 200 MiB make buckets
  // [300] [100, 200] [300] [100, 200]: the two copies are never alive together.
  test::Env env(ExecMode::DryRun);
  Sequential net;
  for (std::int64_t out : {15360, 5120, 10240, 15360, 5120, 10240}) {
    auto layer = std::make_unique<Linear>(5120, out, /*bias=*/false);
    layer->freeze();
    net.append(std::move(layer));
  }
  net.append(std::make_unique<Linear>(8, 8, /*bias=*/false));  // something to train
  net.set_path("");
  net.materialize(env.rt, DType::F32);
  const std::int64_t params = env.allocated();
  detail::DataParallel ddp(parse_parallel("ddp:8"), net, env.rt);
  const std::int64_t copy = (5120 * 5120 + 5120 * 10240) * 4;  // 300 MiB
  EXPECT_EQ(env.peak() - params, copy);
  std::size_t copies = 0;
  for (const auto& b : ddp.buffers()) copies += b.what == "parameters and buffers broadcast copy" ? 1 : 0;
  EXPECT_EQ(copies, 2u);
}

TEST(DataParallel, FindUnusedParametersKeepsTheFirstBucketsAndClonesTheOutput) {
  const RankRun fixed = run(mlp("ddp:8", "find_unused_parameters=true"));
  const std::size_t pair = 512 * 512 * 4 + 512 * 4;
  // [1 MiB, 25 MiB] in parameter order from construction (the first weight alone reaches
  // 1 MiB), reversed, never rebuilt; the int32 map of used parameters stays for the run.
  const std::size_t weight = 512 * 512 * 4, bias = 512 * 4;
  EXPECT_EQ(fixed.buckets_after_construction, (std::vector<std::size_t>{3 * pair + bias, weight}));
  EXPECT_EQ(fixed.buckets, fixed.buckets_after_construction);
  EXPECT_EQ(fixed.allocated_after_construction, static_cast<std::int64_t>(2 * 4 * pair + 512));
  // _DDPSink clones the output every forward: one [64, 512] f32 block more in the forward.
  const RankRun plain = run(mlp("ddp:8"));
  EXPECT_EQ(fixed.steps[0].forward.allocations, plain.steps[0].forward.allocations + 1);
}

TEST(DataParallel, BuffersAreBroadcastEveryForward) {
  // resnet18's batch norms: every forward flattens their f32 statistics and their int64
  // counters into one copy each, freed before the forward goes on.
  TrainConfig cfg;
  cfg.model = models::find("resnet18");
  cfg.model_options = ModelOptions::parse("batch=2,image=32,classes=10");
  cfg.steps = 1;
  cfg.parallel = parse_parallel("ddp:8");
  const RankRun with = run(cfg);
  cfg.parallel = parse_parallel("ddp:8", "broadcast_buffers=false");
  const RankRun without = run(cfg);
  EXPECT_GT(with.steps[0].forward.allocations, without.steps[0].forward.allocations);
  EXPECT_EQ(with.steps[0].allocated_end, without.steps[0].allocated_end);
  // Each forward: one copy of every f32 statistic (running mean and var of 20 batch norms:
  // 2 x 4,800 channels) and one of the 20 int64 counters, freed before the forward goes on.
  auto device = make_device("sim:capacity=80GiB,context=0");
  CachingAllocator alloc(device);
  cfg.parallel = parse_parallel("ddp:8");
  Trainer trainer(cfg, alloc);
  trainer.step();
  std::vector<std::pair<std::size_t, std::string>> copies;
  for (const auto& b : trainer.communication_buffers()) {
    if (b.what == "buffers broadcast copy") copies.emplace_back(b.bytes, b.allocated + " / " + b.freed);
  }
  const std::size_t channels = 2 * (64 + 64 + 64 + 64 + 64 + 128 + 128 + 128 + 128 + 128 + 256 + 256 + 256 + 256 + 256 +
                                    512 + 512 + 512 + 512 + 512);
  EXPECT_EQ(copies, (std::vector<std::pair<std::size_t, std::string>>{
                        {channels * 4, "step 1 forward / step 1 forward"}, {20 * 8, "step 1 forward / step 1 forward"}}));
}

TEST(DataParallel, TrainingResultsAreOneGpusExactly) {
  // Every rank computes the same gradients; their average is what one GPU computes, so
  // losses and gradients equal one GPU's, also with gradients as bucket views.
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=4,width=16,batch=4");
  cfg.steps = 3;
  const RankRun base = run(cfg, ExecMode::Compute);
  ASSERT_NE(base.losses[0], base.losses[2]);
  for (const char* options : {"", "gradient_as_bucket_view=true", "static_graph=true"}) {
    cfg.parallel = parse_parallel("ddp:4", options);
    const RankRun r = run(cfg, ExecMode::Compute);
    EXPECT_EQ(r.losses, base.losses) << options;
    EXPECT_EQ(r.grads, base.grads) << options;
  }
}

TEST(DataParallel, AModelWithNothingToTrainIsRefusedAsPyTorchRefusesIt) {
  test::Env env(ExecMode::DryRun);
  Sequential net;
  net.append(std::make_unique<Linear>(8, 8));
  net.freeze();
  net.set_path("");
  net.materialize(env.rt, DType::F32);
  const std::string message = error_of([&] { detail::DataParallel ddp(parse_parallel("ddp:2"), net, env.rt); });
  EXPECT_NE(message.find("doesn't have any parameter that requires a gradient"), std::string::npos) << message;
  EXPECT_EQ(env.allocated(), 512 + 512);  // the weight and the bias: nothing of DDP's left behind
}


// NCCL's communicator memory (nccl_memory.cpp): per ring channel a 10 MiB receive buffer and a
// 2 MiB send header; 16 channels on NVSwitch, 2 on PCIe; NVLS on Hopper NVSwitch nodes, 32 MiB
// a head, a head per GPU of the node. It shows in nvidia-smi's view from the first collective.
TEST(DataParallel, NcclHoldsItsBuffersOutsideTheAllocatorFromTheFirstCollective) {
  ParallelConfig ddp = parse_parallel("ddp:8");
  EXPECT_EQ(nccl_memory(ddp, "sim:h100-80g", 90).bytes, 16 * 12 * MiB + 8 * 32 * MiB);
  EXPECT_EQ(nccl_memory(ddp, "sim:a100-80g", 80).bytes, 16 * 12 * MiB);  // no NVLS before Hopper
  EXPECT_EQ(nccl_memory(ddp, "sim:rtx4090", 89).bytes, 2 * 12 * MiB);    // PCIe
  EXPECT_EQ(nccl_memory(parse_parallel("ddp:2"), "sim:h100-80g", 90).bytes, 16 * 12 * MiB + 2 * 32 * MiB);
  EXPECT_EQ(nccl_memory(parse_parallel("ddp:1"), "sim:h100-80g", 90).bytes, 0u);
  // Eight nodes of 8: per GPU, the ring's 16 channels each bring the node a 10 MiB network
  // receive and send side in place of a 12 MiB P2P pair (16/8 x 8 MiB), and the double binary
  // tree 3.5 network peers per node, both ways (16 x 3.5 x 10 MiB / 8): 16 + 70 MiB.
  const NcclMemory eight_nodes = nccl_memory(parse_parallel("fsdp:64"), "sim:h100-80g", 90);
  EXPECT_EQ(eight_nodes.bytes, 16 * 12 * MiB + 8 * 32 * MiB + 16 * MiB + 70 * MiB);
  EXPECT_NE(eight_nodes.assumptions.find("across 8 nodes of 8"), std::string::npos) << eight_nodes.assumptions;
  EXPECT_NE(eight_nodes.assumptions.find("NVLS-tree"), std::string::npos) << eight_nodes.assumptions;
  // Two nodes: the tree links each node to 2 others on average (16 x 2 x 10 MiB / 8 = 40 MiB).
  EXPECT_EQ(nccl_memory(parse_parallel("zero3:16"), "sim:h100-80g", 90).bytes,
            16 * 12 * MiB + 8 * 32 * MiB + 16 * MiB + 40 * MiB);
  // PCIe nodes without GPUDirect RDMA: the network buffers live in host memory, and a ring
  // channel's P2P pair leaves the GPU (2 channels / 8 x 12 MiB = 3 MiB less).
  EXPECT_EQ(nccl_memory(parse_parallel("ddp:16"), "sim:rtx4090", 89).bytes, 2 * 12 * MiB - 3 * MiB);
  ddp.topology = Topology::None;
  EXPECT_EQ(nccl_memory(ddp, "sim:h100-80g", 90).bytes, 0u);
  ddp.topology = Topology::Pcie;
  EXPECT_EQ(nccl_memory(ddp, "sim:h100-80g", 90).bytes, 2 * 12 * MiB);
  EXPECT_THROW((void)parse_topology("infiniband"), Error);

  // The same DDP rank with and without NCCL's buffers and the other ranks' stray contexts:
  // allocated and reserved alike, nvidia-smi's view higher by exactly them.
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  const auto used_after_construction = [&](Topology topology, bool stray) {
    cfg.parallel = parse_parallel("ddp:8");
    cfg.parallel.topology = topology;
    cfg.parallel.stray_contexts = stray;
    auto device = make_device("sim:h100-80g");
    CachingAllocator alloc(device);
    Trainer trainer(cfg, alloc);
    return std::pair(alloc.stats().reserved_bytes[0].current, alloc.stats().device_used_bytes.current);
  };
  const auto [reserved, without] = used_after_construction(Topology::None, false);
  const auto [reserved_nccl, with_nccl] = used_after_construction(Topology::Auto, false);
  const auto [reserved_stray, with_stray] = used_after_construction(Topology::Auto, true);
  EXPECT_EQ(reserved, reserved_nccl);
  EXPECT_EQ(reserved, reserved_stray);
  EXPECT_EQ(with_nccl - without, static_cast<std::int64_t>(448 * MiB));
  // (The device holds them at its 2 MiB granularity.)
  const std::size_t contexts = 7 * make_device("sim:h100-80g")->info().context_bytes;
  EXPECT_EQ(with_stray - with_nccl, static_cast<std::int64_t>((contexts + 2 * MiB - 1) / (2 * MiB) * (2 * MiB)));
}

}  // namespace
}  // namespace mem::nn
