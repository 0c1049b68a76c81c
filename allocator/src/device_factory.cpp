// device_factory.cpp — make_device(): from a spec string ("auto", "sim:a100-80g",
// "cuda:1", ...) to a Device, saying which one "auto" picked and why.
#include <cctype>
#include <charconv>
#include <string>
#include <string_view>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/sim_device.hpp"
#ifdef VRAMSCOPE_HAVE_CUDA
#include "vramscope/allocator/cuda_device.hpp"
#endif

namespace mem {
namespace {

std::string preset_list() {
  std::string out;
  for (const std::string& name : sim_preset_names()) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

std::string valid_forms() {
  return "valid devices: auto (a CUDA GPU if present, else sim:" + default_sim_preset() +
         "), sim (sim:" + default_sim_preset() + "), sim:<preset> (" + preset_list() +
         "), sim:capacity=8GiB,context=400MiB (keys: capacity, context, granularity, backing, "
         "malloc_us, free_us), sim:<preset>,backing=host, cuda (cuda:0), cuda:N";
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::shared_ptr<Device> make_cuda(std::string_view spec, int ordinal, const std::string& note) {
#ifdef VRAMSCOPE_HAVE_CUDA
  const int count = cuda_device_count();
  if (ordinal >= count) {
    throw Error("device \"" + std::string(spec) + "\": " +
                (count == 0 ? std::string("no CUDA GPU found (no device or no driver)")
                            : std::to_string(count) + " CUDA GPU(s) found, cuda:0..cuda:" +
                                  std::to_string(count - 1) + " exist") +
                "; use sim:<preset> for a simulated GPU (" + preset_list() + ")");
  }
  return std::make_shared<CudaDevice>(ordinal, note);
#else
  (void)ordinal;
  (void)note;
  throw Error("device \"" + std::string(spec) +
              "\": this build of vramscope has no CUDA support (configured without the CUDA "
              "toolkit or with VRAMSCOPE_CUDA=OFF); use sim:<preset> for a simulated GPU (" +
              preset_list() + ")");
#endif
}

}  // namespace

int cuda_device_count() noexcept {
#ifdef VRAMSCOPE_HAVE_CUDA
  return CudaDevice::device_count();
#else
  return 0;
#endif
}

std::shared_ptr<Device> make_device(const std::string& spec) {
  const std::string_view s = trim(spec);
  if (s == "auto") {
    if (cuda_device_count() > 0) return make_cuda(s, 0, "(auto: CUDA GPU found)");
    SimDeviceConfig config = sim_preset(default_sim_preset());
    // The reason goes into the name so every report that prints the device says it.
    config.name += " (auto: no CUDA GPU found)";
    return std::make_shared<SimDevice>(std::move(config));
  }
  if (s == "sim") return std::make_shared<SimDevice>(sim_preset(default_sim_preset()));
  if (s.starts_with("sim:"))
    return std::make_shared<SimDevice>(parse_sim_spec(std::string(s.substr(4))));
  if (s == "cuda") return make_cuda(s, 0, {});
  if (s.starts_with("cuda:")) {
    const std::string_view digits = s.substr(5);
    int ordinal = -1;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ordinal);
    if (digits.empty() || ec != std::errc{} || ptr != digits.data() + digits.size() ||
        ordinal < 0) {
      throw Error("device \"" + spec + "\": \"" + std::string(digits) + "\" is not a GPU number; " +
                  valid_forms());
    }
    return make_cuda(s, ordinal, {});
  }
  throw Error("unknown device \"" + spec + "\"; " + valid_forms());
}

}  // namespace mem
