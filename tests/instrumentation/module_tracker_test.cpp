// module_tracker_test.cpp — per-module attribution of a hand-built training
// step with exact expected bytes, nested peaks and blocks outliving their scope.
#include <gtest/gtest.h>

#include "test_support.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/module_tracker.hpp"

namespace mem {
namespace {

constexpr std::size_t F = ModuleReport::at(Phase::Forward);
constexpr std::size_t B = ModuleReport::at(Phase::Backward);
constexpr std::size_t O = ModuleReport::at(Phase::Optimizer);

// All sizes are whole MiB above 1 MiB: block size == request, so the expected
// figures below are exact. Comments carry allocated_bytes after each step.
class ModuleTrackerStep : public ::testing::Test {
 protected:
  void SetUp() override {
    alloc_ = test::make_allocator();
    tracker_ = std::make_unique<ModuleTracker>(*alloc_);
    auto a = [&](std::size_t mib) { return alloc_->allocate(mib * MiB); };
    auto f = [&](void* p) { alloc_->deallocate(p); };

    weights_ = a(8);  // outside any scope: 8
    void *x, *t, *b, *c, *d, *o, *g, *h, *s;
    {
      ModuleScope model{"model", Phase::Forward};      // entry 8
      {
        ModuleScope l1{"model.layer1", Phase::Forward}; // entry 8
        x = a(4);                                      // 12, kept for backward
        t = a(2);                                      // 14 (peak of layer1)
        f(t);                                          // 12
      }
      {
        ModuleScope l2{"model.layer2", Phase::Forward}; // entry 12
        b = a(6);                                      // 18, kept
        {
          ModuleScope act{"model.layer2.act", Phase::Forward};  // entry 18
          c = a(3);                                    // 21, outlives its scope
        }
        d = a(5);                                      // 26 (peak of forward)
        f(d);                                          // 21
      }
      o = a(2);                                        // 23, model's own output
    }
    {
      ModuleScope model{"model", Phase::Backward};     // entry 23
      {
        ModuleScope l2{"model.layer2", Phase::Backward};  // entry 23
        g = a(6);                                      // 29 (peak of backward)
        f(c);                                          // 26: act's block freed in backward
        f(b);                                          // 20
      }
      {
        ModuleScope l1{"model.layer1", Phase::Backward};  // entry 20
        h = a(4);                                      // 24
        f(x);                                          // 20
        f(h);                                          // 16
      }
      f(o);                                            // 14
    }
    {
      ModuleScope opt{"optimizer", Phase::Optimizer};  // entry 14
      f(g);                                            // 8
      s = a(2);                                        // 10
      f(s);                                            // 8
    }
  }
  void TearDown() override {
    tracker_.reset();
    alloc_->deallocate(weights_);
  }

  ModuleReport get(std::string_view path) {
    auto r = tracker_->find(path);
    EXPECT_TRUE(r.has_value()) << path;
    return r.value_or(ModuleReport{});
  }

  std::unique_ptr<CachingAllocator> alloc_;
  std::unique_ptr<ModuleTracker> tracker_;
  void* weights_ = nullptr;
};

TEST_F(ModuleTrackerStep, ReportListsModulesInFirstSeenOrderWithDepth) {
  const auto report = tracker_->report();
  ASSERT_EQ(report.size(), 5u);
  const char* paths[] = {"model", "model.layer1", "model.layer2", "model.layer2.act", "optimizer"};
  const std::size_t depths[] = {1, 2, 2, 3, 1};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(report[i].path, paths[i]);
    EXPECT_EQ(report[i].depth, depths[i]);
  }
  EXPECT_FALSE(tracker_->find("model.layer3").has_value());
}

TEST_F(ModuleTrackerStep, Layer1) {
  const ModuleReport r = get("model.layer1");
  EXPECT_EQ(r.calls[F], 1u);
  EXPECT_EQ(r.calls[B], 1u);
  EXPECT_EQ(r.forward_allocated_bytes(), 6 * MiB);
  EXPECT_EQ(r.allocations[F], 2u);
  EXPECT_EQ(r.freed[F], 2 * MiB);  // the temporary
  EXPECT_EQ(r.frees[F], 1u);
  EXPECT_EQ(r.kept_for_backward_bytes, 4 * MiB);
  EXPECT_EQ(r.kept_for_backward_blocks, 1u);
  EXPECT_EQ(r.backward_allocated_bytes(), 4 * MiB);
  EXPECT_EQ(r.backward_freed_bytes(), 8 * MiB);  // its activation and its gradient
  EXPECT_EQ(r.frees[B], 2u);
  EXPECT_EQ(r.peak_increase[F], 6 * MiB);
  EXPECT_EQ(r.peak_allocated[F], 14 * MiB);
  EXPECT_EQ(r.peak_increase[B], 4 * MiB);
  EXPECT_EQ(r.live_bytes, 0u);
}

TEST_F(ModuleTrackerStep, Layer2) {
  const ModuleReport r = get("model.layer2");
  EXPECT_EQ(r.forward_allocated_bytes(), 11 * MiB);
  EXPECT_EQ(r.allocations[F], 2u);
  EXPECT_EQ(r.freed[F], 5 * MiB);
  EXPECT_EQ(r.kept_for_backward_bytes, 6 * MiB);
  EXPECT_EQ(r.backward_allocated_bytes(), 6 * MiB);
  EXPECT_EQ(r.backward_freed_bytes(), 6 * MiB);
  EXPECT_EQ(r.freed[O], 6 * MiB);  // its gradient, released by the optimizer
  // Includes the child "act" (3 MiB) and the 5 MiB temporary: 26 - 12.
  EXPECT_EQ(r.forward_peak_bytes(), 14 * MiB);
  EXPECT_EQ(r.peak_allocated[F], 26 * MiB);
  EXPECT_EQ(r.peak_increase[B], 6 * MiB);
  EXPECT_EQ(r.peak_bytes(), 14 * MiB);
}

TEST_F(ModuleTrackerStep, ChildBlockOutlivesItsScope) {
  const ModuleReport r = get("model.layer2.act");
  EXPECT_EQ(r.depth, 3u);
  EXPECT_EQ(r.forward_allocated_bytes(), 3 * MiB);
  EXPECT_EQ(r.kept_for_backward_bytes, 3 * MiB);
  EXPECT_EQ(r.freed[F], 0u);
  EXPECT_EQ(r.backward_freed_bytes(), 3 * MiB);  // freed inside model.layer2's backward
  EXPECT_EQ(r.peak_increase[F], 3 * MiB);
  EXPECT_EQ(r.calls[B], 0u);

  int seen = 0;
  for (const BlockLifetime& life : tracker_->lifetimes()) {
    if (life.owner().path != "model.layer2.act") continue;
    ++seen;
    EXPECT_FALSE(life.alive);
    EXPECT_EQ(life.size, 3 * MiB);
    EXPECT_EQ(life.owner().phase, Phase::Forward);
    EXPECT_EQ(life.freed_in().path, "model.layer2");
    EXPECT_EQ(life.freed_in().phase, Phase::Backward);
    EXPECT_GT(life.free_sequence, life.alloc_sequence);
    EXPECT_GE(life.free_time_us, life.alloc_time_us);
  }
  EXPECT_EQ(seen, 1);
}

TEST_F(ModuleTrackerStep, ParentPeakIncludesChildren) {
  const ModuleReport r = get("model");
  EXPECT_EQ(r.forward_allocated_bytes(), 2 * MiB);  // only its own output
  EXPECT_EQ(r.kept_for_backward_bytes, 2 * MiB);
  EXPECT_EQ(r.backward_freed_bytes(), 2 * MiB);
  EXPECT_EQ(r.forward_peak_bytes(), 18 * MiB);     // 26 - 8, reached inside layer2
  EXPECT_EQ(r.peak_allocated[F], 26 * MiB);
  EXPECT_EQ(r.peak_increase[B], 6 * MiB);          // 29 - 23, inside layer2's backward
  EXPECT_EQ(r.peak_allocated[B], 29 * MiB);
}

TEST_F(ModuleTrackerStep, PeakNeverGoesBelowEntry) {
  const ModuleReport r = get("optimizer");
  EXPECT_EQ(r.allocated[O], 2 * MiB);
  EXPECT_EQ(r.freed[O], 2 * MiB);
  EXPECT_EQ(r.peak_increase[O], 0u);  // frees 6 MiB before allocating 2
  EXPECT_EQ(r.peak_allocated[O], 14 * MiB);
}

TEST_F(ModuleTrackerStep, LifetimesCoverEveryBlockInAllocationOrder) {
  const auto lifetimes = tracker_->lifetimes();
  ASSERT_EQ(lifetimes.size(), 10u);  // the weights + 9 scoped blocks
  for (std::size_t i = 1; i < lifetimes.size(); ++i) {
    EXPECT_LT(lifetimes[i - 1].alloc_sequence, lifetimes[i].alloc_sequence);
  }
  EXPECT_TRUE(lifetimes.front().alive);  // the weights
  EXPECT_EQ(lifetimes.front().alloc_context, kNoContext);
  std::size_t alive = 0;
  for (const auto& life : lifetimes) alive += life.alive ? 1 : 0;
  EXPECT_EQ(alive, 1u);
}

TEST(ModuleTrackerTest, ResetForgetsEverything) {
  auto alloc = test::make_allocator();
  ModuleTracker tracker{*alloc};
  {
    ModuleScope s{"m", Phase::Forward};
    alloc->deallocate(alloc->allocate(2 * MiB));
  }
  EXPECT_EQ(tracker.report().size(), 1u);
  tracker.reset();
  EXPECT_TRUE(tracker.report().empty());
  EXPECT_TRUE(tracker.lifetimes().empty());
}

}  // namespace
}  // namespace mem
