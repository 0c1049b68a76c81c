// hooks_and_exports.cpp — memory inside module hooks, and the exports, in one
// small program: two training steps of a 4-layer MLP on a simulated A100 (dry
// run), a hook printing allocated memory at every module boundary, then a
// PyTorch memory snapshot, a Perfetto trace, an SVG plot and memory_summary().
//
//   hooks_and_exports [OUTPUT_DIR]
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/instrumentation/instrumentation.hpp"
#include "vramscope/runtime/training.hpp"
#include "vramscope/models/zoo.hpp"

int main(int argc, char** argv) {
  const std::filesystem::path out = argc > 1 ? argv[1] : ".";
  std::filesystem::create_directories(out);

  mem::CachingAllocator alloc{mem::make_device("sim:a100-80g")};
  mem::attach(alloc);                         // stamp every block with its module scope
  mem::History history{alloc, 100'000};       // allocator events, for the snapshot's trace
  mem::Timeline timeline{alloc};              // memory over time, for Perfetto and the plot

  // A hook at every module boundary; statistics-only snapshots are cheap enough for this.
  mem::ModuleHook hook{alloc, [](const mem::ModuleHookEvent& e) {
    if (e.point != mem::HookPoint::Post || e.phase == mem::Phase::None) return;
    std::printf("%-10s %-12s %10.2f MiB allocated, %10.2f MiB reserved\n",
                std::string(e.hook_name()).c_str(), std::string(e.path).c_str(),
                e.snapshot.allocated_bytes() / 1048576.0, e.snapshot.reserved_bytes() / 1048576.0);
  }};

  mem::nn::TrainConfig config;
  config.model = mem::models::find("mlp");
  config.model_options = mem::nn::ModelOptions::parse("depth=4,width=1024,batch=256");
  config.segments = 2;  // checkpoint_sequential with 2 segments
  mem::nn::Trainer trainer{config, alloc};
  for (int step = 0; step < 2; ++step) trainer.step();

  const mem::Snapshot snap =
      mem::snapshot(alloc, {.segments = true, .history = true, .history_source = &history});
  mem::write_memory_snapshot_pickle(snap, out / "snapshot.pickle");  // pytorch.org/memory_viz
  mem::write_perfetto_trace(timeline, out / "trace.json");           // ui.perfetto.dev
  mem::write_memory_plot_svg(timeline, out / "memory.svg");
  std::cout << mem::memory_summary(alloc);
  return 0;
}
