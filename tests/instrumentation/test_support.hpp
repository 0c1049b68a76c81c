// test_support.hpp — a fresh allocator on a simulated A100 for each test.
#pragma once

#include <memory>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::test {

inline std::unique_ptr<CachingAllocator> make_allocator(AllocatorConfig config = {}) {
  auto device = std::make_shared<SimDevice>(sim_preset("a100-80g"));
  return std::make_unique<CachingAllocator>(device, config);
}

}  // namespace mem::test
