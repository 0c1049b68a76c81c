// test_util.hpp — devices and runtimes for the runtime tests.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/runtime/all.hpp"

namespace mem::nn::test {

/// What `f` throws, or "(no error)": for asserting on an error's words.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

/// One training step of `cfg` on its own allocator (its config's device), kept for the
/// trainer's figures after it.
struct OneStep {
  explicit OneStep(const TrainConfig& cfg)
      : device(make_device(device_spec_for(cfg))), alloc(device, {}), trainer(cfg, alloc), stats(trainer.step()) {}
  std::shared_ptr<Device> device;
  CachingAllocator alloc;
  Trainer trainer;
  StepStats stats;
};

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

/// A training run in compute mode on a host-backed simulated GPU: each step's loss, then every
/// parameter's gradient (empty where it got none) and value, every buffer, the last step's
/// figures and the report. Runs compared by these give the same numbers or not.
struct TrainedRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> grads;
  std::vector<std::vector<double>> params;
  std::vector<std::vector<double>> buffers;
  StepStats last;
  TrainReport report;
};

inline TrainedRun train_computed(TrainConfig cfg) {
  cfg.mode = ExecMode::Compute;
  auto device = make_device("sim:capacity=16GiB,context=0,backing=host");
  CachingAllocator alloc(device);
  Trainer trainer(cfg, alloc);
  TrainedRun r;
  for (std::size_t i = 0; i < cfg.steps; ++i) {
    r.last = trainer.step();
    r.losses.push_back(r.last.loss);
  }
  for (const Tensor& p : trainer.model().parameters()) {
    r.grads.push_back(p.grad().defined() ? to_values(p.grad()) : std::vector<double>{});
    r.params.push_back(to_values(p));
  }
  std::function<void(const Module&)> collect = [&](const Module& m) {
    for (const auto& slot : m.slots()) {
      if (slot.is_buffer) r.buffers.push_back(to_values(slot.tensor));
    }
    for (const auto& [name, child] : m.children()) collect(*child);
  };
  collect(trainer.model().body());
  r.report = trainer.report();
  return r;
}

}  // namespace mem::nn::test
