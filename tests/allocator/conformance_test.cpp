// conformance_test.cpp — one suite, every device: the Device contract and the
// caching policy's exact layouts must hold on the simulated GPU (both backings)
// and on a real CUDA GPU. Compiled twice: into the allocator tests with the
// simulated devices, and (VRAMSCOPE_CONFORMANCE_CUDA) into the `gpu`-labelled
// binary with cuda:0, where every test skips cleanly without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {
namespace {

class Conformance : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string spec = GetParam();
    if (spec.rfind("cuda", 0) == 0 && cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA GPU (or no CUDA build)";
    }
    device_ = make_device(spec);
  }
  std::shared_ptr<Device> device_;
};

TEST_P(Conformance, SegmentsAreDistinctAlignedAndAccounted) {
  const DeviceMemInfo before = device_->mem_get_info();
  const std::size_t used_before = device_->process_used_bytes();
  void* a = device_->allocate_segment(20 * MiB);
  void* b = device_->allocate_segment(2 * MiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  EXPECT_EQ(pa % 512, 0u);
  EXPECT_EQ(pb % 512, 0u);
  EXPECT_TRUE(pa + 20 * MiB <= pb || pb + 2 * MiB <= pa) << "segments overlap";
  // Other processes may allocate on a real GPU meanwhile: free falls by at least ours.
  EXPECT_LE(device_->mem_get_info().free_bytes + 22 * MiB, before.free_bytes + 2 * MiB);
  EXPECT_GE(device_->process_used_bytes(), used_before);
  device_->free_segment(a, 20 * MiB);
  device_->free_segment(b, 2 * MiB);
  EXPECT_EQ(device_->mem_get_info().total_bytes, before.total_bytes);
}

TEST_P(Conformance, TooLargeASegmentIsNullNotAnException) {
  const std::size_t total = device_->info().total_bytes;
  EXPECT_EQ(device_->allocate_segment(2 * total), nullptr);
  void* p = device_->allocate_segment(2 * MiB);  // and the device is still usable
  ASSERT_NE(p, nullptr);
  device_->free_segment(p, 2 * MiB);
}

TEST_P(Conformance, EventsCompleteOnceTheStreamHasRun) {
  const StreamId s = device_->create_stream();
  const EventId e = device_->create_event();
  device_->record_event(e, s);
  device_->synchronize_event(e);
  EXPECT_TRUE(device_->query_event(e));
  device_->synchronize();
  device_->destroy_event(e);
  EXPECT_TRUE(device_->has_stream(s));
  device_->destroy_stream(s);
  EXPECT_FALSE(device_->has_stream(s));
  EXPECT_TRUE(device_->has_stream(0));  // the default stream always exists
}

TEST_P(Conformance, AllocatorLayoutsMatchThePolicy) {
  CachingAllocator a{device_};
  void* k = a.allocate(KiB);
  EXPECT_EQ(a.stats().reserved_bytes[1].current, static_cast<std::int64_t>(2 * MiB));
  void* p = a.allocate(5 * MiB);
  void* q = a.allocate(5 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[2].current, static_cast<std::int64_t>(20 * MiB));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) - reinterpret_cast<std::uintptr_t>(p), 5 * MiB);
  void* r = a.allocate(25 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(48 * MiB));
  a.validate();
  for (void* x : {k, p, q, r}) a.deallocate(x);
  a.validate();
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(a.stats().num_device_alloc, a.stats().num_device_free);
}

TEST_P(Conformance, RecordStreamDefersReuseUntilTheStreamsWorkIsDone) {
  CachingAllocator a{device_};
  const StreamId side = device_->create_stream();
  void* p = a.allocate(64 * KiB);
  a.record_stream(p, side);
  a.deallocate(p);
  device_->synchronize();  // the side stream's work is done
  void* q = a.allocate(64 * KiB);
  EXPECT_EQ(q, p);  // reclaimed once its event completed
  a.deallocate(q);
  a.validate();
  a.empty_cache();
  device_->destroy_stream(side);
}

TEST_P(Conformance, RandomWorkloadKeepsEveryInvariant) {
  CachingAllocator a{device_};
  std::mt19937_64 rng(42);
  std::vector<void*> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      live.push_back(a.allocate(1 + rng() % (rng() % 2 ? 64 * KiB : 12 * MiB)));
    } else {
      const std::size_t k = rng() % live.size();
      a.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
    if (live.size() > 40) {  // keep a real GPU's footprint small
      a.deallocate(live.front());
      live.erase(live.begin());
    }
    ASSERT_NO_THROW(a.validate()) << "step " << i;
  }
  for (void* x : live) a.deallocate(x);
  a.empty_cache();
  a.validate();
}

TEST_P(Conformance, OutOfMemoryLeavesTheAllocatorConsistent) {
  CachingAllocator a{device_};
  void* p = a.allocate(MiB);
  EXPECT_THROW(a.allocate(2 * device_->info().total_bytes), OutOfMemoryError);
  a.validate();
  EXPECT_EQ(a.stats().num_ooms, 1);
  a.deallocate(p);
  a.empty_cache();
}

#ifdef VRAMSCOPE_CONFORMANCE_CUDA
INSTANTIATE_TEST_SUITE_P(Cuda, Conformance, ::testing::Values("cuda:0"));
#else
INSTANTIATE_TEST_SUITE_P(Sim, Conformance,
                         ::testing::Values("sim:capacity=4GiB,context=100MiB",
                                           "sim:capacity=4GiB,context=100MiB,backing=host",
                                           "sim:a100-80g"));
#endif

}  // namespace
}  // namespace mem
