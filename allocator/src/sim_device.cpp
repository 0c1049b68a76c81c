// sim_device.cpp — the simulated GPU: presets of real cards, the "sim:" spec
// parser, capacity accounting at driver granularity, address-only or host-backed
// segments, a virtual driver clock, fault injection and holdable events.
#include "vramscope/allocator/sim_device.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <string_view>
#include <utility>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {
namespace {

// --- presets -----------------------------------------------------------------
//
// capacity: the total cudaMemGetInfo (and torch.cuda.mem_get_info / the "total capacity"
// in PyTorch's OOM message) reports on Linux. It is below the marketed size and below
// nvidia-smi's "Total" because the driver keeps some memory for itself (ECC, page tables).
// Where a deviceQuery/nvidia-smi byte count was found it is used exactly; otherwise the
// figure is the MiB count behind the GiB value PyTorch users see in OOM messages, and the
// description says "about". Figures move by a few MiB between driver versions.
//
// context: what nvidia-smi shows for a process right after the CUDA runtime initialises
// (CUDA 12 or 13 with lazy module loading, no cuBLAS/cuDNN kernels loaded yet; the runtime
// adds those when they first run, Device::load_module). Measured on the H100; elsewhere an
// assumption: it depends on the driver, the CUDA version and the libraries, so it is
// printed beside every figure and can be overridden with context=.
//
// latency: cudaMalloc of a 2 MiB..1 GiB segment takes tens of microseconds on current
// drivers, cudaFree somewhat more since it synchronizes the device first. We charge a flat
// 25 us / 40 us per call: the point is the count of driver calls the cache saves, not an
// exact timing model.
constexpr double kMallocUs = 25.0;
constexpr double kFreeUs = 40.0;

struct Preset {
  std::string_view name;
  std::size_t capacity;
  std::size_t context;
  int compute_capability;
  // cudaDeviceProp's multiProcessorCount and maxThreadsPerMultiProcessor (NVIDIA's specs):
  // kernels that size their launch by them allocate metadata by them (FSDP's copy-out).
  int multiprocessors;
  int max_threads_per_multiprocessor;
  std::string_view description;
};

constexpr std::size_t mib(std::size_t n) { return n * MiB; }

constexpr Preset kPresets[] = {
    {"rtx2080s", mib(7982), mib(300), 75, 48, 1024,
     "GeForce RTX 2080 SUPER (Turing, 8 GB GDDR6): total about 7982 MiB (PyTorch: \"7.79 GiB "
     "total capacity\"); context 300 MiB assumed"},
    {"rtx2080ti", mib(11019), mib(300), 75, 68, 1024,
     "GeForce RTX 2080 Ti (Turing, 11 GB GDDR6): total about 11019 MiB (PyTorch: \"10.76 GiB "
     "total capacity\"); context 300 MiB assumed"},
    {"titanx-pascal", mib(12196), mib(250), 61, 28, 2048,
     "NVIDIA TITAN X (Pascal, 12 GB GDDR5X): total about 12196 MiB (PyTorch: \"11.91 GiB "
     "total capacity\"); context 250 MiB assumed"},
    {"t4", mib(15104), mib(300), 75, 40, 1024,
     "Tesla T4 (Turing, 16 GB GDDR6): total about 15104 MiB (PyTorch on Colab: \"14.75 GiB "
     "total capacity\"); context 300 MiB assumed"},
    {"v100-16g", mib(16160), mib(320), 70, 80, 2048,
     "Tesla V100-SXM2-16GB (Volta, HBM2): total about 16160 MiB (PyTorch: \"15.78 GiB total "
     "capacity\"); context 320 MiB assumed"},
    {"v100-32g", mib(32510), mib(320), 70, 80, 2048,
     "Tesla V100-SXM2-32GB (Volta, HBM2): total about 32510 MiB (PyTorch: \"31.75 GiB total "
     "capacity\"); context 320 MiB assumed"},
    {"rtx4090", mib(24217), mib(400), 89, 128, 1536,
     "GeForce RTX 4090 (Ada, 24 GB GDDR6X): total about 24217 MiB (PyTorch: \"23.65 GiB total "
     "capacity\"); context 400 MiB assumed"},
    {"a100-40g", 42'298'834'944, mib(420), 80, 108, 2048,
     "A100-SXM4-40GB (Ampere, HBM2): total 42,298,834,944 B = 40339 MiB as deviceQuery "
     "reports it (PyTorch: \"39.39 GiB\"); context 420 MiB assumed"},
    {"a100-80g", mib(81049), mib(420), 80, 108, 2048,
     "A100 80GB (Ampere, HBM2e): total about 81049 MiB as deviceQuery reports it (PyTorch: "
     "\"79.15 GiB total capacity\"; nvidia-smi shows 81920 MiB); context 420 MiB assumed"},
    {"h100-80g", 85'017'493'504, 552'402'944, 90, 132, 2048,
     "H100 80GB HBM3 (Hopper, SXM): total 85,017,493,504 B = 79.18 GiB as cudaMemGetInfo "
     "reports it (nvidia-smi: 81559 MiB); context 526.81 MiB, measured with PyTorch 2.11 and "
     "CUDA 13 right after initialisation (driver 580)"},
    // The rest: Linux figures from deviceQuery outputs and PyTorch OOM messages users posted
    // (sources in each description); the context is PyTorch's maintainers' figure for CUDA
    // >= 11.7 with lazy module loading, "around 400MB" (pytorch/pytorch#109888), unless said.
    {"rtx3060", 12'626'493'440, mib(400), 86, 28, 1536,
     "GeForce RTX 3060 12GB (Ampere, GDDR6): total 12,626,493,440 B = 12042 MiB as deviceQuery "
     "reports it on Linux (CUDA 12.1; PyTorch: \"11.75 GiB total capacity\", "
     "PromtEngineer/localGPT-Vision#14); context 400 MiB assumed"},
    {"rtx3080", 10'472'390'656, mib(400), 86, 68, 1536,
     "GeForce RTX 3080 10GB (Ampere, GDDR6X): total 10,472,390,656 B = 9987 MiB as deviceQuery "
     "reports it on Linux (CUDA 12.0; PyTorch: \"9.78 GiB total capacity\", zai-org/CogVideo#34); "
     "context 400 MiB assumed"},
    {"rtx3090", 25'447'170'048, mib(400), 86, 82, 1536,
     "GeForce RTX 3090 (Ampere, 24 GB GDDR6X): total 25,447,170,048 B = 24268 MiB as deviceQuery "
     "reports it on Linux (CUDA 11.8; PyTorch: \"23.70 GiB total capacity\", GaoLii/DSP#10; newer "
     "drivers report down to 24115 MiB); context 400 MiB assumed"},
    {"rtx5090", 33'668'857'856, mib(400), 120, 170, 1536,
     "GeForce RTX 5090 (Blackwell, 32 GB GDDR7): total 33,668,857,856 B = 32109 MiB as "
     "deviceQuery reports it on Linux (CUDA 13.0; PyTorch: \"31.36 GiB total capacity\"); "
     "context 400 MiB assumed"},
    {"rtx-a6000", 51'160'023'040, mib(400), 86, 84, 1536,
     "RTX A6000 (Ampere, 48 GB GDDR6, ECC off): total 51,160,023,040 B = 48790 MiB as "
     "deviceQuery reports it (CUDA 12.7; PyTorch with driver 525: \"47.54 GiB total capacity\", "
     "vllm-project/vllm#1201); context 400 MiB assumed"},
    {"a10g", mib(22507), mib(400), 86, 80, 1536,
     "NVIDIA A10G (Ampere, 24 GB GDDR6, AWS g5): total about 22507 MiB (PyTorch in 2025: \"21.98 "
     "GiB total capacity\"; 22.19 GiB with 2023 drivers, vllm-project/vllm#372); context 400 MiB "
     "assumed"},
    {"l4", 23'612'293'120, mib(400), 89, 58, 1536,
     "NVIDIA L4 (Ada, 24 GB GDDR6): total 23,612,293,120 B = 22518 MiB as deviceQuery reports it "
     "(CUDA 12.0; nvidia-smi: 23034 MiB; PyTorch: 21.96-21.99 GiB); context 400 MiB assumed"},
    {"l40s", 47'576'711'168, mib(400), 89, 142, 1536,
     "NVIDIA L40S (Ada, 48 GB GDDR6): total 47,576,711,168 B = 45373 MiB as deviceQuery reports "
     "it (CUDA 12.4; PyTorch: 44.31-44.53 GiB, most often 44.39, Wan-Video/Wan2.1#205); context "
     "400 MiB assumed"},
    {"h200", mib(143155), 552'402'944, 90, 132, 2048,
     "H200 141GB HBM3e (Hopper): total about 143155 MiB (PyTorch: \"139.80 GiB total "
     "capacity\", also 139.72-139.81); context 526.81 MiB assumed, as measured on an H100"},
    {"b200", mib(182630), 552'402'944, 100, 148, 2048,
     "B200 180GB HBM3e (Blackwell): total about 182630 MiB (PyTorch: \"178.35 GiB total "
     "capacity\", also 178.36); context 526.81 MiB assumed, as measured on an H100"},
};

// A custom GPU ("sim:capacity=...") without context= gets PyTorch's maintainers' figure for a
// CUDA context with lazy module loading (CUDA >= 11.7): "around 400MB" (pytorch/pytorch#109888).
constexpr std::size_t kDefaultContext = mib(400);

constexpr std::string_view kDefaultPreset = "a100-80g";

constexpr std::size_t kMaxSimCapacity = std::size_t{1} << 50;  // 1 PiB

// Address-only segments live at [2^48, 2^53): never a canonical x86-64 user address under
// 4-level paging, so a stray dereference faults instead of scribbling on host memory, and
// every address stays exact as a double (JSON and the JavaScript of memory_viz).
constexpr std::uintptr_t kSimAddressBase = std::uintptr_t{1} << 48;
constexpr std::uintptr_t kSimAddressLimit = std::uintptr_t{1} << 53;

// Address-only devices alive at once get disjoint windows of that space, as GPUs
// under unified addressing do, so a pointer of one device is never a valid
// address of another. The lowest free window is taken: a lone device always
// starts at 2^48, and the same program prints the same addresses every run.
std::mutex address_windows_mutex;
std::map<std::uintptr_t, std::size_t>& address_windows() {  // base -> span
  static auto* windows = new std::map<std::uintptr_t, std::size_t>();
  return *windows;
}

std::uintptr_t claim_address_window(std::size_t span) {
  std::lock_guard lock(address_windows_mutex);
  auto& windows = address_windows();
  std::uintptr_t base = kSimAddressBase;
  for (const auto& [start, size] : windows) {
    if (start - base >= span) break;
    base = start + size;
  }
  if (base > kSimAddressLimit || kSimAddressLimit - base < span) {
    throw Error("SimDevice: no room for another simulated device's addresses (" +
                std::to_string(windows.size()) +
                " alive); destroy devices you no longer use or lower their capacity");
  }
  windows.emplace(base, span);
  return base;
}

void release_address_window(std::uintptr_t base) noexcept {
  std::lock_guard lock(address_windows_mutex);
  address_windows().erase(base);
}

constexpr std::string_view kSpecKeys =
    "capacity, context, granularity, backing, malloc_us, free_us, sm, cublas, cudnn";

// The libraries' kernels CUDA's lazy loading (>= 11.7) brings onto the device when they
// first run: measured with PyTorch 2.11 and CUDA 13 on an H100 (../shared/gpu-reference):
// nvidia-smi less the reserved segments grew from 526.81 MiB at initialisation to 750.81 MiB
// where only cuBLAS ran (mlp, gpt2, eager llama) and 766.81 MiB where cuDNN ran too (SDPA's
// attention, torchvision's convolutions and batch norms; resnet50 and mobilenet_v2 2-4 MiB
// more). Assumed for the other GPUs; "cublas=" and "cudnn=" override them.
constexpr std::size_t kCublasBytes = std::size_t{224} << 20;
constexpr std::size_t kCudnnBytes = std::size_t{16} << 20;

std::string preset_list() {
  std::string out;
  for (const Preset& p : kPresets) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string format_us(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g us", us);
  return buf;
}

double parse_latency(std::string_view spec, std::string_view key, std::string_view value) {
  double out = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, out);
  if (value.empty() || ec != std::errc{} || ptr != end || !std::isfinite(out) || out < 0) {
    throw Error("sim spec \"" + std::string(spec) + "\": " + std::string(key) + "=\"" +
                std::string(value) +
                "\" is not a latency; expected a non-negative number of microseconds, e.g. " +
                std::string(key) + "=25");
  }
  return out;
}

bool is_power_of_two(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }

void validate_config(const SimDeviceConfig& c) {
  const std::string who = "sim device \"" + c.name + "\": ";
  if (c.capacity == 0) throw Error(who + "capacity is 0; give one, e.g. capacity=8GiB");
  // The segments' addresses need a window of a few times the capacity inside [2^48, 2^53);
  // beyond 1 PiB (thousands of today's largest GPUs) it would wrap and every figure be wrong.
  if (c.capacity > kMaxSimCapacity) {
    throw Error(who + "capacity " + format_bytes(c.capacity) + " (" + std::to_string(c.capacity) +
                " B) is more than a simulated device models (1 PiB, 2^50 B); give a GPU's capacity, e.g. "
                "capacity=80GiB");
  }
  if (c.context_bytes >= c.capacity) {
    throw Error(who + "capacity (" + format_bytes(c.capacity) +
                ") must exceed the CUDA context overhead (" + format_bytes(c.context_bytes) +
                "); lower context= or raise capacity=");
  }
  if (!is_power_of_two(c.granularity) || c.granularity < 512) {
    throw Error(who + "granularity " + std::to_string(c.granularity) +
                " B is not a power of two of at least 512 B; the driver's is 2MiB");
  }
  if (!std::isfinite(c.malloc_latency_us) || c.malloc_latency_us < 0 ||
      !std::isfinite(c.free_latency_us) || c.free_latency_us < 0) {
    throw Error(who + "latencies must be finite and non-negative");
  }
}

// "sm=90" or "sm=9.0": the GPU generation, which decides PyTorch's cuBLAS workspace size.
int parse_compute_capability(std::string_view whole, std::string_view value) {
  std::string digits(value);
  if (const auto dot = digits.find('.'); dot != std::string::npos && dot + 2 == digits.size()) {
    digits.erase(dot, 1);
  }
  int cc = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), cc);
  if (ec != std::errc{} || end != digits.data() + digits.size() || cc < 30 || cc > 199) {
    throw Error("sim spec \"" + std::string(whole) + "\": sm=\"" + std::string(value) +
                "\" is not a compute capability; write it like sm=90 or sm=9.0 (H100), sm=80 (A100)");
  }
  return cc;
}

SimDeviceConfig from_preset(const Preset& p) {
  SimDeviceConfig c;
  c.name = std::string(p.name);
  c.capacity = p.capacity;
  c.context_bytes = p.context;
  c.compute_capability = p.compute_capability;
  c.multiprocessors = p.multiprocessors;
  c.max_threads_per_multiprocessor = p.max_threads_per_multiprocessor;
  c.cublas_bytes = kCublasBytes;
  c.cudnn_bytes = kCudnnBytes;
  c.granularity = 2 * MiB;
  c.backing = SimBacking::None;
  c.malloc_latency_us = kMallocUs;
  c.free_latency_us = kFreeUs;
  c.description = std::string(p.description);
  return c;
}

}  // namespace

// --- presets and specs ------------------------------------------------------

SimDeviceConfig sim_preset(const std::string& name) {
  const std::string key = lower(trim(name));
  for (const Preset& p : kPresets) {
    if (key == p.name) return from_preset(p);
  }
  throw Error("unknown simulated GPU \"" + name + "\"; presets: " + preset_list());
}

std::vector<std::string> sim_preset_names() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

std::string default_sim_preset() { return std::string(kDefaultPreset); }

SimDeviceConfig parse_sim_spec(const std::string& spec) {
  const std::string_view whole = trim(spec);
  if (whole.empty()) {
    throw Error("empty sim spec; expected a preset (" + preset_list() + "), key=value pairs (" +
                std::string(kSpecKeys) +
                "), or a preset followed by overrides, e.g. \"a100-80g,backing=host\"");
  }
  SimDeviceConfig c;
  c.name.clear();
  c.malloc_latency_us = kMallocUs;
  c.free_latency_us = kFreeUs;
  bool have_preset = false;
  std::set<std::string> seen;
  std::string canonical;  // the trimmed tokens: a spec that reproduces this device

  std::size_t pos = 0;
  bool first = true;
  while (true) {
    const std::size_t comma = whole.find(',', pos);
    const std::string_view token =
        trim(whole.substr(pos, comma == std::string_view::npos ? whole.npos : comma - pos));
    if (token.empty()) {
      throw Error("sim spec \"" + std::string(whole) +
                  "\" has an empty item; separate items with single commas");
    }
    const std::size_t eq = token.find('=');
    if (eq == std::string_view::npos) {
      if (!first) {
        throw Error("sim spec \"" + std::string(whole) + "\": \"" + std::string(token) +
                    "\" is not key=value; a preset name may only come first (keys: " +
                    std::string(kSpecKeys) + ")");
      }
      c = sim_preset(std::string(token));
      have_preset = true;
    } else {
      const std::string key = lower(trim(token.substr(0, eq)));
      const std::string_view value = trim(token.substr(eq + 1));
      if (!seen.insert(key).second) {
        throw Error("sim spec \"" + std::string(whole) + "\" sets " + key + " twice");
      }
      if (value.empty()) {
        throw Error("sim spec \"" + std::string(whole) + "\": " + key + " has no value");
      }
      if (key == "capacity") {
        c.capacity = parse_bytes(value);
      } else if (key == "context") {
        c.context_bytes = parse_bytes(value, /*allow_zero=*/true);
      } else if (key == "granularity") {
        c.granularity = parse_bytes(value);
      } else if (key == "backing") {
        const std::string b = lower(value);
        if (b == "none") {
          c.backing = SimBacking::None;
        } else if (b == "host") {
          c.backing = SimBacking::Host;
        } else {
          throw Error("sim spec \"" + std::string(whole) + "\": backing=\"" + std::string(value) +
                      "\" is not valid; use backing=none (addresses only) or backing=host "
                      "(host memory behind every segment)");
        }
      } else if (key == "cublas") {
        c.cublas_bytes = parse_bytes(value, /*allow_zero=*/true);
      } else if (key == "cudnn") {
        c.cudnn_bytes = parse_bytes(value, /*allow_zero=*/true);
      } else if (key == "sm") {
        c.compute_capability = parse_compute_capability(whole, value);
      } else if (key == "malloc_us") {
        c.malloc_latency_us = parse_latency(whole, key, value);
      } else if (key == "free_us") {
        c.free_latency_us = parse_latency(whole, key, value);
      } else {
        throw Error("sim spec \"" + std::string(whole) + "\": unknown key \"" + key +
                    "\"; valid keys: " + std::string(kSpecKeys) +
                    " (or a preset name first: " + preset_list() + ")");
      }
    }
    if (!canonical.empty()) canonical += ',';
    if (eq == std::string_view::npos) {
      canonical += c.name;  // the preset's own spelling
    } else {
      canonical += lower(trim(token.substr(0, eq)));
      canonical += '=';
      canonical += trim(token.substr(eq + 1));
    }
    first = false;
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }

  if (!have_preset) {
    if (c.capacity == 0) {
      throw Error("sim spec \"" + std::string(whole) +
                  "\" names no preset and no capacity; give one, e.g. \"capacity=8GiB\" or "
                  "a preset (" +
                  preset_list() + ")");
    }
    c.description = "custom simulated GPU from \"" + canonical + "\"";
    if (!seen.contains("cublas")) c.cublas_bytes = kCublasBytes;
    if (!seen.contains("cudnn")) c.cudnn_bytes = kCudnnBytes;
    if (!seen.contains("context")) {
      if (c.capacity <= kDefaultContext) {
        throw Error("sim spec \"" + std::string(whole) + "\": capacity " + format_bytes(c.capacity) +
                    " is not above the 400 MiB CUDA context a custom GPU assumes; give "
                    "context= (context=0 for none) or a larger capacity");
      }
      c.context_bytes = kDefaultContext;
      c.description += "; context 400 MiB assumed (CUDA >= 11.7 with lazy loading; set context=)";
    }
  } else if (!seen.empty()) {
    c.description += "; overridden by \"" + canonical + "\"";
  }
  c.name = canonical;
  validate_config(c);
  return c;
}

// --- SimDevice --------------------------------------------------------------

SimDevice::SimDevice(SimDeviceConfig config)
    : config_(std::move(config)) {
  if (config_.name.empty()) config_.name = "custom";
  validate_config(config_);
  // Callers may already spell the name as a device spec ("sim:test"); do not double it.
  info_.name = config_.name.starts_with("sim:") ? config_.name : "sim:" + config_.name;
  info_.total_bytes = config_.capacity;
  info_.context_bytes = config_.context_bytes;
  info_.granularity = config_.granularity;
  info_.simulated = true;
  info_.compute_capability = config_.compute_capability;
  info_.multiprocessors = config_.multiprocessors;
  info_.max_threads_per_multiprocessor = config_.max_threads_per_multiprocessor;
  info_.cublas_bytes = config_.cublas_bytes;
  info_.cudnn_bytes = config_.cudnn_bytes;
  const std::string libraries =
      config_.cublas_bytes + config_.cudnn_bytes == 0
          ? std::string()
          : " (then cuBLAS's kernels " + format_bytes(config_.cublas_bytes) + " and cuDNN's " +
                format_bytes(config_.cudnn_bytes) + " when they first run" +
                (config_.cublas_bytes == kCublasBytes && config_.cudnn_bytes == kCudnnBytes
                     ? ", as PyTorch 2.11 with CUDA 13 loads them on an H100)"
                     : ")");
  info_.assumptions = "simulated " + config_.name + ": " + format_bytes(config_.capacity) +
                      " total, CUDA context " + format_bytes(config_.context_bytes) + " assumed" + libraries + ", " +
                      format_bytes(config_.granularity) + " driver granularity, cudaMalloc " +
                      format_us(config_.malloc_latency_us) + " / cudaFree " +
                      format_us(config_.free_latency_us) + " on a virtual clock, backing " +
                      (config_.backing == SimBacking::Host ? "host" : "none");
  // Room for fragmentation of the offset space: a sequence of segments never
  // spans more than a few times the capacity. Both backings share the bound. At most a third
  // of the address space, so that three devices of the largest capacity (1 PiB: still 2.5
  // times its capacity each) are alive at once: a sweep's device and its unlimited twin.
  const std::size_t pages = pages_of(config_.capacity);
  host_span_ = std::min<std::size_t>(4 * pages * config_.granularity + (std::size_t{1} << 30),
                                     (kSimAddressLimit - kSimAddressBase) / 3 / config_.granularity * config_.granularity);
  // Host-backed devices get distinct addresses from mmap; their offsets need no window.
  address_base_ = config_.backing == SimBacking::None ? claim_address_window(host_span_)
                                                       : kSimAddressBase;
  next_address_ = address_base_;
  if (config_.backing == SimBacking::Host) {
    // One PROT_NONE reservation: no memory, no commit charge, just addresses.
    void* base = ::mmap(nullptr, host_span_, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      throw Error("SimDevice: cannot reserve " + format_bytes(host_span_) +
                  " of host address space for backing=host; use backing=none for dry runs");
    }
    host_base_ = reinterpret_cast<std::uintptr_t>(base);
  }
}

SimDevice::~SimDevice() {
  // Segments a caller leaked are dropped with the whole reservation.
  std::lock_guard lock(mutex_);
  if (host_base_ != 0) ::munmap(reinterpret_cast<void*>(host_base_), host_span_);
  if (config_.backing == SimBacking::None) release_address_window(address_base_);
  for (const auto& [base, span] : reserved_) {  // ranges a caller did not release
    if (config_.backing == SimBacking::None) {
      release_address_window(base);
    } else {
      ::munmap(reinterpret_cast<void*>(base), span);
    }
  }
}

std::size_t SimDevice::pages_of(std::size_t bytes) const {
  return bytes / config_.granularity + (bytes % config_.granularity != 0 ? 1 : 0);
}

void* SimDevice::map_segment_locked(std::size_t bytes) {
  const std::size_t span = pages_of(bytes) * config_.granularity;
  // Lowest free range that fits (first fit by address), else the bump pointer.
  std::uintptr_t address = 0;
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    if (it->second < span) continue;
    address = it->first;
    const std::size_t rest = it->second - span;
    free_ranges_.erase(it);
    if (rest != 0) free_ranges_.emplace(address + span, rest);
    break;
  }
  if (address == 0) {
    if (span > address_base_ + host_span_ - next_address_) return nullptr;
    address = next_address_;
    next_address_ += span;
  }
  if (config_.backing == SimBacking::None) return reinterpret_cast<void*>(address);
  // Same offset inside the host reservation; pages are committed only when touched.
  void* host = reinterpret_cast<void*>(host_base_ + (address - address_base_));
  if (::mprotect(host, span, PROT_READ | PROT_WRITE) != 0) {
    unmap_segment_locked(address, bytes);  // give the offsets back
    return nullptr;
  }
  return host;
}

void SimDevice::unmap_segment_locked(std::uintptr_t address, std::size_t bytes) noexcept {
  const std::size_t span = pages_of(bytes) * config_.granularity;
  if (config_.backing == SimBacking::Host && address >= host_base_ &&
      address < host_base_ + host_span_) {
    // Drop the pages and make the range inaccessible again, as after cudaFree.
    ::mmap(reinterpret_cast<void*>(address), span, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    address = address_base_ + (address - host_base_);
  }
  // Insert and coalesce with both neighbours; a range ending at the bump pointer
  // gives the space back to it so the map stays small.
  std::uintptr_t start = address;
  std::size_t size = span;
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_ranges_.erase(prev);
    }
  }
  if (next != free_ranges_.end() && start + size == next->first) {
    size += next->second;
    free_ranges_.erase(next);
  }
  if (start + size == next_address_) {
    next_address_ = start;
  } else {
    free_ranges_.emplace(start, size);
  }
}

bool SimDevice::take_memory_locked(std::size_t bytes) {
  // A failed cudaMalloc is still a driver call: it costs the same virtual time.
  driver_time_us_ += config_.malloc_latency_us;
  bool inject = false;
  if (fail_countdown_ != 0 && --fail_countdown_ == 0) {
    inject = true;
    if (fail_sticky_) fail_countdown_ = 1;  // and the next one, and the next...
  }
  if (fail_probability_ > 0) {
    // 53 random bits -> [0, 1): the same sequence on every platform for a given seed.
    const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    if (u < fail_probability_) inject = true;
  }
  const std::size_t free_bytes = config_.capacity - config_.context_bytes - used_rounded_;
  if (inject || pages_of(bytes) > free_bytes / config_.granularity) {
    ++failures_;
    return false;
  }
  used_ += bytes;
  used_rounded_ += pages_of(bytes) * config_.granularity;
  ++allocs_;
  return true;
}

void SimDevice::refuse_taken_locked(std::size_t bytes) noexcept {
  used_ -= bytes;
  used_rounded_ -= pages_of(bytes) * config_.granularity;
  --allocs_;
  ++failures_;
}

void SimDevice::give_back_memory_locked(std::size_t bytes) noexcept {
  used_ -= bytes;
  used_rounded_ -= pages_of(bytes) * config_.granularity;
  ++frees_;
  driver_time_us_ += config_.free_latency_us;
}

void* SimDevice::allocate_segment(std::size_t bytes) {
  if (bytes == 0) throw Error("SimDevice::allocate_segment: a segment of 0 bytes was requested");
  std::lock_guard lock(mutex_);
  if (!take_memory_locked(bytes)) return nullptr;
  void* p = map_segment_locked(bytes);
  if (p == nullptr) {
    refuse_taken_locked(bytes);  // no addresses left: refused, as the driver would
    return nullptr;
  }
  live_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
  return p;
}

void SimDevice::free_segment(void* ptr, std::size_t bytes) noexcept {
  if (ptr == nullptr) return;  // cudaFree(nullptr) is a no-op
  std::lock_guard lock(mutex_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  // Freeing what was never allocated (or with another size) is a caller bug; a real
  // driver would return cudaErrorInvalidValue. We cannot throw here, so debug builds stop.
  assert(it != live_.end() && "SimDevice::free_segment: pointer not from allocate_segment");
  if (it == live_.end()) return;
  assert(it->second == bytes && "SimDevice::free_segment: size differs from the allocation");
  (void)bytes;
  const std::size_t size = it->second;  // trust our record over the caller's size
  live_.erase(it);
  unmap_segment_locked(reinterpret_cast<std::uintptr_t>(ptr), size);
  give_back_memory_locked(size);
}

// --- virtual memory (expandable segments) ---------------------------------------

void* SimDevice::reserve_address_range(std::size_t bytes) {
  if (bytes == 0) throw Error("SimDevice::reserve_address_range: a range of 0 bytes was requested");
  const std::size_t span = pages_of(bytes) * config_.granularity;
  std::uintptr_t base = 0;
  if (config_.backing == SimBacking::None) {
    try {
      base = claim_address_window(span);  // a window of its own: never another device's address
    } catch (const Error&) {
      return nullptr;  // no addresses left, as cuMemAddressReserve's out-of-memory
    }
  } else {
    void* p = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    base = reinterpret_cast<std::uintptr_t>(p);
  }
  std::lock_guard lock(mutex_);
  reserved_.emplace(base, span);
  return reinterpret_cast<void*>(base);
}

void SimDevice::release_address_range(void* base, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  const auto key = reinterpret_cast<std::uintptr_t>(base);
  auto it = reserved_.find(key);
  assert(it != reserved_.end() && "SimDevice::release_address_range: not a reserved range");
  if (it == reserved_.end()) return;
  assert(it->second == pages_of(bytes) * config_.granularity && "release_address_range: size differs");
  (void)bytes;
  assert(!mapped_overlaps_locked(key, it->second) && "SimDevice::release_address_range: pages are still mapped");
  if (config_.backing == SimBacking::None) {
    release_address_window(key);
  } else {
    ::munmap(base, it->second);
  }
  reserved_.erase(it);
}

void SimDevice::check_mappable_locked(std::uintptr_t at, std::size_t bytes) const {
  auto range = reserved_.upper_bound(at);
  const bool inside = range != reserved_.begin() && (--range, at >= range->first) &&
                      at - range->first <= range->second && bytes <= range->second - (at - range->first);
  if (!inside || mapped_overlaps_locked(at, bytes)) {
    throw Error("SimDevice::map_memory: [" + format_address(at) + ", +" + format_bytes(bytes) + ") is " +
                (inside ? "already mapped in part" : "outside every reserved range"));
  }
}

bool SimDevice::mapped_overlaps_locked(std::uintptr_t at, std::size_t bytes) const noexcept {
  auto next = mapped_.lower_bound(at);
  return (next != mapped_.end() && next->first - at < bytes) ||
         (next != mapped_.begin() && std::prev(next)->first + std::prev(next)->second > at);
}

void SimDevice::add_mapping_locked(std::uintptr_t at, std::size_t bytes) {
  // Kept as maximal runs: a batch of millions maps terabytes, and a run is one entry. Runs
  // grow in place where they can; only a run on its own takes a new entry (which may throw
  // before anything changed).
  auto next = mapped_.lower_bound(at);
  const bool joins_next = next != mapped_.end() && next->first == at + bytes;
  if (next != mapped_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      prev->second += bytes + (joins_next ? next->second : 0);
      if (joins_next) mapped_.erase(next);
      return;
    }
  }
  if (joins_next) {
    auto node = mapped_.extract(next);
    node.key() = at;
    node.mapped() += bytes;
    mapped_.insert(std::move(node));
    return;
  }
  mapped_.emplace_hint(next, at, bytes);
}

bool SimDevice::remove_mapping_locked(std::uintptr_t at, std::size_t bytes) {
  auto it = mapped_.upper_bound(at);
  if (it == mapped_.begin()) return false;
  --it;
  const std::uintptr_t start = it->first;
  const std::uintptr_t end = start + it->second;
  if (end <= at || end - at < bytes) return false;  // not wholly mapped
  const bool tail = at + bytes < end;
  if (start < at) {
    it->second = at - start;  // the head stays in place
    if (tail) mapped_.emplace_hint(std::next(it), at + bytes, end - (at + bytes));  // a split: one new entry
  } else if (tail) {
    auto node = mapped_.extract(it);  // the tail takes the run's entry
    node.key() = at + bytes;
    node.mapped() = end - (at + bytes);
    mapped_.insert(std::move(node));
  } else {
    mapped_.erase(it);
  }
  return true;
}

void SimDevice::check_page_locked(std::size_t bytes) const {
  if (bytes == 0 || bytes % config_.granularity != 0) {
    throw Error("SimDevice::map_memory: " + std::to_string(bytes) + " B is not a positive multiple of the " +
                format_bytes(config_.granularity) + " granularity");
  }
}

bool SimDevice::map_memory(void* address, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  check_page_locked(bytes);
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  check_mappable_locked(at, bytes);
  if (!take_memory_locked(bytes)) return false;
  if (config_.backing == SimBacking::Host && ::mprotect(address, bytes, PROT_READ | PROT_WRITE) != 0) {
    refuse_taken_locked(bytes);
    return false;
  }
  try {
    add_mapping_locked(at, bytes);
  } catch (...) {
    refuse_taken_locked(bytes);
    throw;
  }
  return true;
}

bool SimDevice::map_pages(void* address, std::size_t count, std::size_t page) {
  {
    std::lock_guard lock(mutex_);
    // Injected failures decide call by call, and host pages are made accessible one call
    // at a time: then every call is made.
    const bool call_by_call = fail_countdown_ != 0 || fail_probability_ > 0 || config_.backing == SimBacking::Host;
    if (!call_by_call) return map_pages_at_once_locked(reinterpret_cast<std::uintptr_t>(address), count, page);
  }
  return Device::map_pages(address, count, page);
}

bool SimDevice::map_pages_at_once_locked(std::uintptr_t at, std::size_t count, std::size_t page) {
  check_page_locked(page);
  if (count == 0) return true;
  if (count > std::numeric_limits<std::size_t>::max() / page) {
    throw Error("SimDevice::map_pages: " + std::to_string(count) + " pages of " + format_bytes(page) +
                " overflow the address space");
  }
  const std::size_t bytes = count * page;
  check_mappable_locked(at, bytes);
  const std::size_t free_pages = (config_.capacity - config_.context_bytes - used_rounded_) / config_.granularity;
  const std::size_t fit = std::min(count, free_pages / pages_of(page));
  // The clock and counters of the calls as they go: `fit` succeed; if that is not all, the
  // next fails and the `fit` are unmapped again.
  if (fit < count) {
    driver_time_us_ += static_cast<double>(fit + 1) * config_.malloc_latency_us +
                       static_cast<double>(fit) * config_.free_latency_us;
    allocs_ += fit;
    frees_ += fit;
    ++failures_;
    return false;
  }
  add_mapping_locked(at, bytes);  // first: it may throw, and then nothing has changed
  driver_time_us_ += static_cast<double>(count) * config_.malloc_latency_us;
  allocs_ += count;
  used_ += bytes;
  used_rounded_ += count * pages_of(page) * config_.granularity;
  return true;
}

void SimDevice::unmap_memory(void* address, std::size_t bytes) noexcept {
  unmap_pages(address, 1, bytes);  // one call's run
}

void SimDevice::unmap_pages(void* address, std::size_t count, std::size_t page) noexcept {
  std::lock_guard lock(mutex_);
  if (count == 0) return;
  assert(page != 0 && page % config_.granularity == 0 && "SimDevice::unmap_memory: not whole granules");
  const std::size_t bytes = count * page;
  const bool mapped = page != 0 && page % config_.granularity == 0 &&
                      remove_mapping_locked(reinterpret_cast<std::uintptr_t>(address), bytes);
  assert(mapped && "SimDevice::unmap_memory: not mapped");
  if (!mapped) return;
  if (config_.backing == SimBacking::Host) {
    // Drop the pages and make the range inaccessible again, as after cuMemUnmap.
    ::mmap(address, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  }
  // As `count` unmap calls: their clock and counters (give_back_memory_locked's, per call).
  used_ -= bytes;
  used_rounded_ -= count * pages_of(page) * config_.granularity;
  frees_ += count;
  driver_time_us_ += static_cast<double>(count) * config_.free_latency_us;
}

std::optional<std::size_t> SimDevice::load_module(std::string_view name, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  if (std::find(modules_.begin(), modules_.end(), name) != modules_.end()) return 0;
  const std::size_t rounded = pages_of(bytes) * config_.granularity;
  if (rounded > config_.capacity - config_.context_bytes - used_rounded_) return std::nullopt;
  config_.context_bytes += rounded;  // from now on part of what the process holds outside segments
  modules_.emplace_back(name);
  return rounded;
}

std::size_t SimDevice::module_bytes() const {
  std::lock_guard lock(mutex_);
  return config_.context_bytes - info_.context_bytes;
}

DeviceMemInfo SimDevice::mem_get_info() const {
  std::lock_guard lock(mutex_);
  return {config_.capacity - config_.context_bytes - used_rounded_, config_.capacity};
}

std::size_t SimDevice::process_used_bytes() const {
  std::lock_guard lock(mutex_);
  return config_.context_bytes + used_rounded_;
}

// --- streams and events -------------------------------------------------------

StreamId SimDevice::create_stream() {
  std::lock_guard lock(mutex_);
  const StreamId id = next_stream_++;
  streams_.insert(id);
  return id;
}

void SimDevice::destroy_stream(StreamId stream) noexcept {
  std::lock_guard lock(mutex_);
  streams_.erase(stream);
}

bool SimDevice::has_stream(StreamId stream) const {
  std::lock_guard lock(mutex_);
  return stream == 0 || streams_.contains(stream);
}

EventId SimDevice::create_event() {
  std::lock_guard lock(mutex_);
  const EventId id = next_event_++;
  events_.emplace(id, true);  // never recorded: cudaEventQuery reports it complete
  return id;
}

void SimDevice::destroy_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  events_.erase(event);
}

void SimDevice::record_event(EventId event, StreamId stream) {
  std::lock_guard lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw Error("SimDevice::record_event: event " + std::to_string(event) +
                " was not created by this device or was destroyed");
  }
  if (stream != 0 && !streams_.contains(stream)) {
    throw Error("SimDevice::record_event: stream " + std::to_string(stream) +
                " was not created by this device or was destroyed (0 is the default stream)");
  }
  it->second = !hold_events_;
}

bool SimDevice::query_event(EventId event) {
  std::lock_guard lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw Error("SimDevice::query_event: event " + std::to_string(event) +
                " was not created by this device or was destroyed");
  }
  return it->second;
}

void SimDevice::synchronize_event(EventId event) {
  std::lock_guard lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw Error("SimDevice::synchronize_event: event " + std::to_string(event) +
                " was not created by this device or was destroyed");
  }
  it->second = true;
}

void SimDevice::synchronize() {
  std::lock_guard lock(mutex_);
  for (auto& [id, complete] : events_) complete = true;
}

double SimDevice::driver_time_us() const {
  std::lock_guard lock(mutex_);
  return driver_time_us_;
}

// --- test controls and counters -----------------------------------------------

void SimDevice::fail_nth_allocation(std::uint64_t n) {
  std::lock_guard lock(mutex_);
  fail_countdown_ = n;
  fail_sticky_ = false;
}

void SimDevice::fail_allocations_from(std::uint64_t n) {
  std::lock_guard lock(mutex_);
  fail_countdown_ = n;
  fail_sticky_ = n != 0;
}

void SimDevice::fail_with_probability(double p, std::uint64_t seed) {
  if (!(p >= 0.0 && p <= 1.0)) {
    throw Error("SimDevice::fail_with_probability: p=" + std::to_string(p) +
                " is not a probability in [0, 1]");
  }
  std::lock_guard lock(mutex_);
  fail_probability_ = p;
  rng_.seed(seed);
}

void SimDevice::hold_events(bool hold) {
  std::lock_guard lock(mutex_);
  hold_events_ = hold;  // events already pending stay pending until released
}

void SimDevice::release_events() {
  std::lock_guard lock(mutex_);
  for (auto& [id, complete] : events_) complete = true;
}

std::size_t SimDevice::used_bytes() const {
  std::lock_guard lock(mutex_);
  return used_;
}

std::uint64_t SimDevice::segment_allocs() const {
  std::lock_guard lock(mutex_);
  return allocs_;
}

std::size_t SimDevice::address_ranges() const {
  std::lock_guard lock(mutex_);
  return reserved_.size();
}

std::uint64_t SimDevice::segment_frees() const {
  std::lock_guard lock(mutex_);
  return frees_;
}

std::uint64_t SimDevice::failed_allocs() const {
  std::lock_guard lock(mutex_);
  return failures_;
}

}  // namespace mem
