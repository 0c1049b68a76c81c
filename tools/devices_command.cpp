// devices_command.cpp — `vramscope devices`: the simulated presets with their
// numbers and assumptions, and any real GPU this build can see.
#include <fmt/format.h>

#include <iostream>

#include "commands.hpp"
#include "table.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::tools {

namespace {

std::string latency(double us) { return us == 0 ? "0" : fmt::format("{:g} us", us); }

void run() {
  Table t{{{"device", Align::Left},
           {"total", Align::Right},
           {"CUDA context", Align::Right},
           {"usable", Align::Right},
           {"granularity", Align::Right},
           {"cudaMalloc", Align::Right},
           {"cudaFree", Align::Right}}};
  const std::string fallback = default_sim_preset();
  std::vector<std::pair<std::string, std::string>> notes;
  for (const std::string& name : sim_preset_names()) {
    const SimDeviceConfig c = sim_preset(name);
    const std::string spec = "sim:" + name;
    t.add_row({name == fallback ? spec + " (default)" : spec, format_bytes(c.capacity),
               format_bytes(c.context_bytes), format_bytes(c.capacity - c.context_bytes),
               format_bytes(c.granularity), latency(c.malloc_latency_us), latency(c.free_latency_us)});
    notes.emplace_back(spec, c.description);
  }
  std::cout << "Simulated GPUs (--device sim:<name>; override any number, e.g. "
               "sim:rtx2080s,context=500MiB, or build one: sim:capacity=8GiB,context=400MiB):\n\n";
  std::cout << t.render("  ") << "\n";
  for (const auto& [spec, description] : notes) {
    std::cout << fmt::format("  {:<18} {}\n", spec, description);
  }
  std::cout << "\n  usable = total - CUDA context: what the caching allocator can reserve.\n"
               "  The context is an assumption (driver, CUDA version and libraries change it); the\n"
               "  cudaMalloc / cudaFree latencies run on a virtual clock and only count driver calls.\n";

  const int gpus = cuda_device_count();
  std::cout << "\nReal GPUs: ";
  if (gpus == 0) {
    std::cout << "none found (no CUDA device, or this build has no CUDA support); `auto` means sim:"
              << fallback << ".\n";
    return;
  }
  std::cout << gpus << " found; `auto` means cuda:0.\n\n";
  Table real{{{"device", Align::Left}, {"total", Align::Right}, {"in use now", Align::Right},
              {"context", Align::Right}}};
  std::vector<std::string> assumptions;
  for (int i = 0; i < gpus; ++i) {
    const auto device = make_device("cuda:" + std::to_string(i));
    const DeviceInfo& info = device->info();
    real.add_row({info.name, format_bytes(info.total_bytes), format_bytes(device->process_used_bytes()),
                  format_bytes(info.context_bytes)});
    assumptions.push_back(info.assumptions);
  }
  std::cout << real.render("  ");
  for (const std::string& a : assumptions) std::cout << "  " << a << "\n";
}

}  // namespace

void add_devices_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "devices", "List the simulated GPU presets with their numbers and assumptions, and any real GPU found.");
  cmd->footer(
      "Examples:\n"
      "  vramscope devices\n"
      "  vramscope sweep --device sim:t4\n"
      "  vramscope sweep --device sim:capacity=6GiB,context=350MiB");
  cmd->callback([] { run(); });
}

}  // namespace mem::tools
