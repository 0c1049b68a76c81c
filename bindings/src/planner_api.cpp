// planner_api.cpp — the planner C API (planner_api.h) over the command library.
#include "vramscope/planner_api.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "command_json.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/errors.hpp"

namespace {

char* copy_out(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

}  // namespace

extern "C" {

int vramscope_planner_api_version(void) { return VRAMSCOPE_PLANNER_API_VERSION; }

int vramscope_planner_run(int argc, const char* const* argv, char** out) {
  return vramscope_planner_run_progress(argc, argv, nullptr, nullptr, out);
}

int vramscope_planner_run_progress(int argc, const char* const* argv, vramscope_planner_progress progress, void* user,
                                   char** out) {
  if (out == nullptr) return 2;
  *out = nullptr;
  // Nothing may leave a C function: every failure, out of memory included, is a status.
  try {
    if (argc < 0 || argc > 4096 || (argc > 0 && argv == nullptr)) {
      *out = copy_out("vramscope_planner_run: argc must be 0 to 4096 and argv hold argc strings");
      return 2;
    }
    std::vector<std::string> args;
    for (int i = 0; i < argc; ++i) {
      if (argv[i] == nullptr) {
        *out = copy_out("vramscope_planner_run: argv[" + std::to_string(i) + "] is NULL");
        return 2;
      }
      args.emplace_back(argv[i]);
    }
    // A run holds process-wide state (the simulated devices' address windows, the models'
    // caches): one at a time.
    static std::mutex running;
    std::lock_guard lock(running);
    try {
      std::function<void(std::size_t, std::size_t, const std::string&)> told;
      if (progress != nullptr) {
        told = [&](std::size_t done, std::size_t total, const std::string& item) {
          progress(done, total, item.c_str(), user);
        };
      }
      *out = copy_out(mem::tools::command_json(args, told).dump());
      return 0;
    } catch (const mem::tools::UsageError& e) {
      *out = copy_out(mem::tools::one_line(e.what()));
      return 2;
    } catch (const std::exception& e) {
      *out = copy_out(mem::tools::one_line(e.what()));
      return 1;
    }
  } catch (...) {
    *out = copy_out("vramscope_planner_run: out of memory");  // NULL if even that cannot be had
    return 1;
  }
}

void vramscope_planner_free(char* text) { std::free(text); }

}  // extern "C"
