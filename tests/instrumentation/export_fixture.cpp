// export_fixture.cpp — runs two simulated training steps of a six-layer network
// (two layers checkpointed, an Adam-like optimizer, one provoked OOM) under every
// recorder, and writes each export into the directory given as argv[1] for the
// python readers in this folder. Also usable by hand to look at the outputs.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/instrumentation.hpp"

namespace {

using namespace std::chrono_literals;

void compute(std::chrono::microseconds t) { std::this_thread::sleep_for(t); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output-directory>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  try {
    auto device = std::make_shared<mem::SimDevice>(mem::sim_preset("a100-80g"));
    mem::CachingAllocator alloc{device};
    mem::attach(alloc);
    mem::History history{alloc, 100000};
    mem::Timeline timeline{alloc};
    mem::ModuleTracker tracker{alloc};

    constexpr int kLayers = 6;
    const std::size_t param = 48 * mem::MiB;
    const std::size_t act = 384 * mem::MiB;
    auto checkpointed = [](int i) { return i == 2 || i == 3; };

    std::vector<void*> params, adam;
    for (int i = 0; i < kLayers; ++i) params.push_back(alloc.allocate(param));
    // A small-pool block that stays; not a multiple of 512 B, so its request and
    // its block size differ (the pickle check tells the two apart).
    void* small = alloc.allocate(600 * mem::KiB + 3);

    for (int step = 0; step < 2; ++step) {
      std::vector<void*> acts(kLayers, nullptr), grads;
      void* input = alloc.allocate(act);
      {
        mem::ModuleScope model{"model", mem::Phase::Forward};
        for (int i = 0; i < kLayers; ++i) {
          mem::ModuleScope layer{"model.layer" + std::to_string(i), mem::Phase::Forward};
          void* workspace = alloc.allocate(act / 2);
          compute(300us);
          acts[i] = alloc.allocate(act);
          alloc.deallocate(workspace);
          if (checkpointed(i)) {  // checkpoint: keep only the segment boundary
            alloc.deallocate(acts[i]);
            acts[i] = nullptr;
          }
        }
      }
      {
        mem::ModuleScope model{"model", mem::Phase::Backward};
        for (int i = kLayers - 1; i >= 0; --i) {
          const std::string path = "model.layer" + std::to_string(i);
          if (checkpointed(i)) {
            mem::ModuleScope recompute{path, mem::Phase::Recompute};
            acts[i] = alloc.allocate(act);
            compute(300us);
          }
          mem::ModuleScope layer{path, mem::Phase::Backward};
          void* grad_input = alloc.allocate(act);
          grads.push_back(alloc.allocate(param));
          compute(500us);
          alloc.deallocate(acts[i]);
          alloc.deallocate(grad_input);
        }
      }
      alloc.deallocate(input);
      {
        mem::ModuleScope opt{"optimizer", mem::Phase::Optimizer};
        if (adam.empty()) {
          for (int i = 0; i < 2 * kLayers; ++i) adam.push_back(alloc.allocate(param));
        }
        compute(400us);
        for (void* g : grads) alloc.deallocate(g);
      }
    }
    // One failed request, so the exports carry an oom entry.
    try {
      mem::ModuleScope scope{"model.too_big", mem::Phase::Forward};
      alloc.allocate(200 * mem::GiB);
    } catch (const mem::OutOfMemoryError&) {
    }

    const mem::Snapshot s = mem::snapshot(alloc, {.segments = true, .history_source = &history});
    mem::Snapshot full = s;
    full.history = history.entries();
    full.has_history = true;
    mem::write_memory_snapshot_pickle(full, dir / "snapshot.pickle");
    mem::write_snapshot_json(full, dir / "snapshot.json");
    mem::write_history_csv(full.history, dir / "history.csv");
    timeline.stop();
    mem::write_perfetto_trace(timeline, dir / "trace.json");
    mem::write_memory_plot_svg(timeline, dir / "memory.svg");
    std::ofstream(dir / "summary.txt") << mem::memory_summary(full);

    std::size_t blocks = 0;
    for (const auto& seg : full.segments) blocks += seg.blocks.size();
    std::ofstream expected(dir / "expected.json");
    expected << "{\"allocated_bytes\": " << full.allocated_bytes()
             << ", \"reserved_bytes\": " << full.reserved_bytes()
             << ", \"segments\": " << full.segments.size() << ", \"blocks\": " << blocks
             << ", \"history_entries\": " << full.history.size()
             << ", \"modules\": " << tracker.report().size() << "}\n";

    for (void* p : adam) alloc.deallocate(p);
    for (void* p : params) alloc.deallocate(p);
    alloc.deallocate(small);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "export fixture failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
