// test_util.hpp — devices and runtimes for the runtime tests.
#pragma once

#include <memory>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/runtime/all.hpp"

namespace mem::nn::test {

/// An allocator on a simulated 80 GiB GPU, host-backed for compute mode.
struct Env {
  explicit Env(ExecMode mode, std::uint64_t seed = 0)
      : device(make_device(mode == ExecMode::Compute ? "sim:capacity=80GiB,context=0,backing=host"
                                                     : "sim:capacity=80GiB,context=0")),
        alloc(device),
        rt(alloc, mode, seed) {}
  std::int64_t allocated() const { return alloc.stats().allocated_bytes[0].current; }
  std::int64_t peak() const { return alloc.stats().allocated_bytes[0].peak; }
  std::shared_ptr<Device> device;
  CachingAllocator alloc;
  Runtime rt;
};

}  // namespace mem::nn::test
