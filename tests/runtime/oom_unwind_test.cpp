// oom_unwind_test.cpp — out of memory at every point of a training step.
//
// For every k, the device fails the k-th segment allocation of the step and
// every one after it (so free-the-cache-and-retry cannot hide it). The
// OutOfMemoryError must reach the caller, every tensor of the step must unwind,
// the allocator must validate, and what stays allocated must be exactly the
// state the user still holds (parameters, gradients, optimizer state): zeroing
// the gradients returns allocated to its value before the step, and a step run
// afterwards ends with exactly the figures of a step that never failed.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/runtime/all.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

struct Case {
  const char* name;
  const char* model;
  const char* options;
  ExecMode mode = ExecMode::DryRun;
  std::size_t segments = 1;
  CheckpointMode checkpoint = CheckpointMode::NonReentrant;
  Precision precision = Precision::F32;
  OptimizerKind optimizer = OptimizerKind::Adam;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

TrainConfig config_of(const Case& c) {
  TrainConfig cfg;
  cfg.model = models::find(c.model);
  cfg.model_options = ModelOptions::parse(c.options);
  cfg.mode = c.mode;
  cfg.segments = c.segments;
  cfg.checkpoint_mode = c.checkpoint;
  cfg.precision = c.precision;
  cfg.optimizer.kind = c.optimizer;
  cfg.input_requires_grad = c.checkpoint == CheckpointMode::Reentrant;
  return cfg;
}

/// A trainer on its own fresh device, with the cache emptied after the
/// parameters are materialized so the step's blocks come from new segments.
struct Rig {
  explicit Rig(const Case& c)
      : device(std::make_shared<SimDevice>(parse_sim_spec(
            c.mode == ExecMode::Compute ? "capacity=16GiB,context=0,backing=host"
                                        : "capacity=16GiB,context=0"))),
        alloc(device),
        trainer(config_of(c), alloc) {
    alloc.empty_cache();
  }
  std::int64_t allocated() const { return alloc.stats().allocated_bytes[0].current; }
  std::shared_ptr<SimDevice> device;
  CachingAllocator alloc;
  Trainer trainer;
};

class OomUnwind : public ::testing::TestWithParam<Case> {};

TEST_P(OomUnwind, EverySegmentAllocationOfAStepCanFailCleanly) {
  const Case& c = GetParam();
  // The reference: how many segments a step allocates, and where a clean step ends.
  std::uint64_t segment_allocs = 0;
  StepStats clean;
  {
    Rig rig(c);
    const std::uint64_t before = rig.device->segment_allocs();
    clean = rig.trainer.step();
    segment_allocs = rig.device->segment_allocs() - before;
  }
  ASSERT_GE(segment_allocs, 3u) << "too small a step to test anything";

  RecordProperty("segment_allocations_failed_in_turn", std::to_string(segment_allocs));
  std::printf("[ %s ] failing each of %llu segment allocations in turn\n", c.name,
              static_cast<unsigned long long>(segment_allocs));
  for (std::uint64_t k = 1; k <= segment_allocs; ++k) {
    SCOPED_TRACE("failing from segment allocation " + std::to_string(k) + " of " +
                 std::to_string(segment_allocs));
    Rig rig(c);
    const std::int64_t before = rig.allocated();
    const std::int64_t requested_before = rig.alloc.stats().requested_bytes[0].current;
    const std::int64_t ooms_before = rig.alloc.stats().num_ooms;
    rig.device->fail_allocations_from(k);
    EXPECT_THROW((void)rig.trainer.step(), OutOfMemoryError);
    rig.device->fail_allocations_from(0);

    ASSERT_NO_THROW(rig.alloc.validate());
    EXPECT_EQ(rig.alloc.stats().num_ooms, ooms_before + 1);
    // What remains is what the user holds: gradients already accumulated and
    // optimizer state created before the failure, nothing of the step itself.
    Optimizer* opt = rig.trainer.optimizer();
    const std::int64_t state = opt != nullptr ? static_cast<std::int64_t>(opt->state_bytes()) : 0;
    if (opt != nullptr) opt->zero_grad(true);
    // cuBLAS workspaces taken before the failure stay, as in PyTorch (see Runtime::gemm_workspace).
    const auto workspaces = static_cast<std::int64_t>(rig.trainer.runtime().gemm_workspace_bytes());
    EXPECT_EQ(rig.alloc.stats().requested_bytes[0].current, requested_before + state + workspaces);
    if (state == 0) {
      EXPECT_EQ(rig.allocated(), before + workspaces);
    }

    // The trainer is still usable: the step, run again, ends holding exactly the
    // tensors a step that never failed holds (a tensor leaked by the failure would
    // show in these counts; allocated bytes may differ by how blocks were split).
    const StepStats recovered = rig.trainer.step();
    EXPECT_EQ(recovered.step, 1u);
    EXPECT_EQ(recovered.stats.requested_bytes[0].current, clean.stats.requested_bytes[0].current);
    EXPECT_EQ(recovered.stats.allocation[0].current, clean.stats.allocation[0].current);
    ASSERT_NO_THROW(rig.alloc.validate());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, OomUnwind,
    ::testing::Values(
        Case{"mlp_sgd", "mlp", "depth=6,width=2048,batch=512", ExecMode::DryRun, 1,
             CheckpointMode::NonReentrant, Precision::F32, OptimizerKind::SGD},
        Case{"mlp_adam_checkpointed", "mlp", "depth=8,width=1536,batch=1024", ExecMode::DryRun, 4},
        Case{"mlp_amp_compute", "mlp", "depth=4,width=512,batch=64", ExecMode::Compute, 2,
             CheckpointMode::NonReentrant, Precision::Amp},
        Case{"mlp_reentrant", "mlp", "depth=6,width=1024,batch=1024", ExecMode::DryRun, 3,
             CheckpointMode::Reentrant},
        Case{"resnet18_amp", "resnet18", "batch=16,image=64,classes=10", ExecMode::DryRun, 2,
             CheckpointMode::NonReentrant, Precision::Amp},
        Case{"gpt2_f16", "gpt2", "batch=2,seq=128", ExecMode::DryRun, 4,
             CheckpointMode::NonReentrant, Precision::F16}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace mem::nn
