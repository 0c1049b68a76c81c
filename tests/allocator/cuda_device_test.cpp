// cuda_device_test.cpp — CudaDevice on a real GPU (CTest label `gpu`). Every test
// skips cleanly when cuda_device_count() is 0: no CUDA build, no driver or no device.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU (or no CUDA build)";
    device_ = make_device("cuda:0");
  }
  std::shared_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, InfoDescribesARealGpu) {
  const DeviceInfo& info = device_->info();
  EXPECT_FALSE(info.simulated);
  EXPECT_EQ(info.name.rfind("cuda:0 (", 0), 0u) << info.name;
  EXPECT_GT(info.total_bytes, GiB);
  EXPECT_EQ(info.granularity, 2 * MiB);
  EXPECT_NE(info.assumptions.find("cudaMemGetInfo"), std::string::npos) << info.assumptions;
  EXPECT_EQ(device_->mem_get_info().total_bytes, info.total_bytes);
}

TEST_F(CudaDeviceTest, AllocateAndFreeMoveTheDriverFigures) {
  const DeviceMemInfo before = device_->mem_get_info();
  EXPECT_LE(before.free_bytes, before.total_bytes);
  const std::size_t used_before = device_->process_used_bytes();
  EXPECT_GT(used_before, 0u);  // at least the context

  void* p = device_->allocate_segment(256 * MiB);
  ASSERT_NE(p, nullptr);
  const DeviceMemInfo during = device_->mem_get_info();
  // Other processes may allocate meanwhile; ours alone takes at least 256 MiB.
  EXPECT_LE(during.free_bytes + 256 * MiB, before.free_bytes + 64 * MiB);
  EXPECT_GE(device_->process_used_bytes(), used_before + 200 * MiB);
  EXPECT_GT(device_->driver_time_us(), 0.0);

  device_->free_segment(p, 256 * MiB);
  device_->free_segment(nullptr, 0);
  EXPECT_GT(device_->mem_get_info().free_bytes, during.free_bytes);
}

TEST_F(CudaDeviceTest, OutOfMemoryIsNullptrAndNotSticky) {
  const std::size_t too_much = device_->info().total_bytes * 2;
  EXPECT_EQ(device_->allocate_segment(too_much), nullptr);
  void* p = device_->allocate_segment(MiB);  // the failure left no error behind
  ASSERT_NE(p, nullptr);
  device_->free_segment(p, MiB);
  EXPECT_THROW(device_->allocate_segment(0), Error);
}

TEST_F(CudaDeviceTest, StreamsAndEvents) {
  const StreamId s = device_->create_stream();
  EXPECT_NE(s, 0u);
  const EventId e = device_->create_event();
  EXPECT_TRUE(device_->query_event(e));  // never recorded
  device_->record_event(e, s);
  device_->synchronize_event(e);
  EXPECT_TRUE(device_->query_event(e));
  device_->record_event(e, 0);
  device_->synchronize();
  EXPECT_TRUE(device_->query_event(e));
  EXPECT_THROW(device_->record_event(e, s + 1000), Error);
  EXPECT_THROW(device_->query_event(e + 1000), Error);
  device_->destroy_event(e);
  device_->destroy_stream(s);
  EXPECT_THROW(device_->record_event(e, 0), Error);
}

TEST_F(CudaDeviceTest, VirtualMemoryMapsPagesThatCountAsUsed) {
  if (!device_->supports_virtual_memory()) GTEST_SKIP() << "this GPU or driver has no virtual memory management";
  void* base = device_->reserve_address_range(GiB);
  ASSERT_NE(base, nullptr);
  const std::size_t free_before = device_->mem_get_info().free_bytes;
  ASSERT_TRUE(device_->map_memory(static_cast<char*>(base) + 20 * MiB, 20 * MiB));
  EXPECT_LE(device_->mem_get_info().free_bytes, free_before - 20 * MiB);
  device_->unmap_memory(static_cast<char*>(base) + 20 * MiB, 20 * MiB);
  EXPECT_GE(device_->mem_get_info().free_bytes + 2 * MiB, free_before);
  device_->release_address_range(base, GiB);
}

TEST_F(CudaDeviceTest, ExpandableSegmentsGrowInPlaceOnTheGpu) {
  if (!device_->supports_virtual_memory()) GTEST_SKIP() << "this GPU or driver has no virtual memory management";
  CachingAllocator a{device_, AllocatorConfig::parse("expandable_segments:True")};
  void* p = a.allocate(5 * MiB);
  void* q = a.allocate(30 * MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q), reinterpret_cast<std::uintptr_t>(p) + 5 * MiB);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(40 * MiB));
  a.validate();
  a.deallocate(p);
  a.deallocate(q);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  a.validate();
}

TEST_F(CudaDeviceTest, AutoPicksTheGpuAndSaysSo) {
  const auto dev = make_device("auto");
  EXPECT_FALSE(dev->info().simulated);
  EXPECT_NE(dev->info().name.find("auto"), std::string::npos) << dev->info().name;
}

TEST_F(CudaDeviceTest, MissingOrdinalNamesTheGpuCount) {
  const int count = cuda_device_count();
  try {
    make_device("cuda:" + std::to_string(count));
    FAIL() << "expected mem::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(count) + " CUDA GPU(s) found"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace mem
