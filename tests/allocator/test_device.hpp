// test_device.hpp — a fresh simulated device and allocator per test.
#pragma once

#include <memory>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::testing {

/// A small simulated GPU: 1 GiB, no context, 2 MiB granularity, no backing.
inline std::shared_ptr<SimDevice> small_device(std::size_t capacity = GiB,
                                               std::size_t context = 0) {
  SimDeviceConfig cfg;
  cfg.name = "sim:test";
  cfg.capacity = capacity;
  cfg.context_bytes = context;
  return std::make_shared<SimDevice>(cfg);
}

}  // namespace mem::testing
