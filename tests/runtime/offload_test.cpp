// offload_test.cpp — activation offloading (torch.autograd.graph.save_on_cpu(pin_memory=True)):
// what autograd saves leaves the device for pinned host blocks of PyTorch's caching host
// allocator (powers of two, reused once freed), comes back in backward, and changes no number.
#include <gtest/gtest.h>

#include "test_util.hpp"
#include "vramscope/models/zoo.hpp"

namespace mem::nn {
namespace {

std::size_t power_of_two_ceil(std::size_t n) {
  std::size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

TEST(Offload, LossesAndGradientsAreThoseWithoutIt) {
  for (const char* model : {"mlp", "forum-cnn"}) {
    TrainConfig cfg;
    cfg.model = models::find(model);
    cfg.model_options = ModelOptions::parse(std::string(model) == "mlp" ? "depth=4,width=16,batch=4" : "batch=2");
    cfg.steps = 2;
    const test::TrainedRun plain = test::train_computed(cfg);
    cfg.offload_activations = true;
    const test::TrainedRun offloaded = test::train_computed(cfg);
    EXPECT_EQ(offloaded.losses, plain.losses) << model;
    EXPECT_EQ(offloaded.grads, plain.grads) << model;
    cfg.segments = 2;  // under checkpointing too: the checkpoint's hooks come first
    const test::TrainedRun both = test::train_computed(cfg);
    EXPECT_EQ(both.grads, plain.grads) << model;
  }
}

TEST(Offload, EverySaveTakesAPowerOfTwoPinnedBlockReusedByTheNextStep) {
  TrainConfig cfg;
  cfg.model = models::find("mlp");
  cfg.model_options = ModelOptions::parse("depth=3,width=1000,batch=100");
  auto device = make_device("sim:capacity=4GiB,context=0");
  CachingAllocator alloc(device);
  cfg.offload_activations = true;
  Trainer trainer(cfg, alloc);
  // pack_to_cpu copies each saved tensor's elements (a parameter's too), once per save.
  std::size_t expected = 0;
  {
    SavedTensorsObserver observe([&](const Tensor& t) { expected += power_of_two_ceil(t.nbytes()); });
    trainer.step();
  }
  ASSERT_GT(expected, 0u);
  EXPECT_EQ(trainer.runtime().pinned_host_bytes(), expected);
  trainer.step();  // the same sizes again: the cached blocks serve it
  EXPECT_EQ(trainer.runtime().pinned_host_bytes(), expected);

  // On the device: the saved activations are gone between forward and backward.
  TrainConfig plain_cfg = cfg;
  plain_cfg.offload_activations = false;
  CachingAllocator plain_alloc(make_device("sim:capacity=4GiB,context=0"));
  Trainer plain(plain_cfg, plain_alloc);
  plain.step();
  plain.step();
  const StepStats with = trainer.step(), without = plain.step();  // both third steps
  EXPECT_LT(with.forward.allocated_end, without.forward.allocated_end);
  EXPECT_EQ(plain.runtime().pinned_host_bytes(), 0u);
}

}  // namespace
}  // namespace mem::nn
