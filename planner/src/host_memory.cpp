// host_memory.cpp — the host memory a --compute run needs, checked before it starts.
#include "vramscope/planner/host_memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "vramscope/planner/sweep.hpp"
#include "vramscope/planner/errors.hpp"
#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::planner {

std::size_t available_host_memory() {
  if (const char* given = std::getenv("VRAMSCOPE_HOST_MEMORY")) {
    return as_usage("VRAMSCOPE_HOST_MEMORY", [&] { return parse_bytes(given); });
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  const long pages = ::sysconf(_SC_AVPHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
}

void check_host_memory_for_compute(const nn::TrainConfig& cfg, const DeviceInfo& device) {
  if (cfg.mode != nn::ExecMode::Compute) return;
  nn::TrainConfig dry = cfg;
  dry.mode = nn::ExecMode::DryRun;
  CachingAllocator allocator{unlimited_twin(device), AllocatorConfig::parse(cfg.alloc_conf)};
  try {
    nn::Trainer trainer{dry, allocator};
    for (std::size_t i = 0; i < dry.steps; ++i) (void)trainer.step();
  } catch (const std::exception&) {
    // The run itself will report what stops it; what it reserved so far still counts.
  }
  // Host memory backs what the simulated GPU reserves, which its capacity caps (beyond it
  // the run stops with an out-of-memory row, not with more host memory).
  const auto need = std::min(static_cast<std::size_t>(allocator.stats().reserved_bytes[0].peak),
                             device.total_bytes);
  const std::size_t available = available_host_memory();
  // A tenth kept for the process itself (the model, the autograd graph, the libraries).
  if (available != 0 && need > available - available / 10) {
    throw RunFailed(fmt::format(
        "--compute: this run would hold {} of host memory (its simulated GPU's peak reserved, "
        "backed by host memory) and this machine has {} available; drop --compute (the dry run "
        "gives the same memory figures) or lower --batch",
        format_bytes(need), format_bytes(available)));
  }
}

}  // namespace mem::planner
