// memory_logger.cpp — the ready-made per-module memory log.
#include "vramscope/instrumentation/memory_logger.hpp"

#include <fmt/format.h>

#include <ostream>

#include "vramscope/instrumentation/hooks.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string mib(std::size_t bytes) { return fmt::format("{:.2f} MiB", bytes / kMiB); }
std::string mib_delta(std::int64_t bytes) {
  return fmt::format("{:+.2f} MiB", static_cast<double>(bytes) / kMiB);
}

}  // namespace

MemoryLogger::MemoryLogger(const CachingAllocator& allocator, std::ostream& out,
                           MemoryLoggerOptions options)
    : allocator_(allocator), out_(out), options_(options) {
  add_scope_listener(this);
}

MemoryLogger::~MemoryLogger() {
  remove_scope_listener(this);
  try {
    finish();
  } catch (...) {
    // Writing to the stream failed: nothing sensible to do in a destructor.
  }
}

void MemoryLogger::line(bool pre, const ScopeEvent& event) {
  if (pre && !options_.pre_hooks) return;
  if (options_.max_depth != 0 && event.depth > options_.max_depth) return;
  const Snapshot s = snapshot(allocator_);
  std::lock_guard lock(mutex_);
  if (finished_) return;
  if (!header_printed_) {
    out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12}\n", "hook", "module",
                        options_.module_width, "allocated", "change", "reserved", "nvidia-smi");
    header_printed_ = true;
  }
  const auto allocated = static_cast<std::int64_t>(s.allocated_bytes());
  const std::int64_t change = previous_allocated_ < 0 ? 0 : allocated - previous_allocated_;
  previous_allocated_ = allocated;
  // Indent by depth and show the leaf name: the tree reads like the model's repr.
  const std::size_t dot = event.path.rfind('.');
  const std::string_view leaf = dot == std::string_view::npos ? event.path : event.path.substr(dot + 1);
  const std::size_t indent = 2 * (event.depth > 0 ? event.depth - 1 : 0);
  const std::string module = std::string(indent, ' ') + std::string(leaf.empty() ? "<none>" : leaf);
  out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12}\n",
                      hook_name(pre ? HookPoint::Pre : HookPoint::Post, event.phase), module,
                      options_.module_width, mib(s.allocated_bytes()), mib_delta(change),
                      mib(s.reserved_bytes()), mib(s.device.used_bytes));
  ++lines_;
}

void MemoryLogger::on_scope_enter(const ScopeEvent& event) { line(true, event); }

void MemoryLogger::on_scope_exit(const ScopeEvent& event) noexcept {
  try {
    line(false, event);
  } catch (...) {
    // A failing stream must not turn a scope's destructor into a crash.
  }
}

void MemoryLogger::finish() {
  const Snapshot s = snapshot(allocator_);
  std::lock_guard lock(mutex_);
  if (finished_) return;
  finished_ = true;
  out_ << fmt::format(
      "totals: {} lines; peak allocated {}, peak reserved {}, peak nvidia-smi {} "
      "(CUDA context {}); now allocated {}, reserved {}\n",
      lines_, mib(s.peak_allocated_bytes()), mib(s.peak_reserved_bytes()),
      mib(s.device.peak_used_bytes), mib(s.device.context_bytes), mib(s.allocated_bytes()),
      mib(s.reserved_bytes()));
  if (s.device.info && !s.device.info->assumptions.empty()) {
    out_ << "device: " << s.device.info->name << " — " << s.device.info->assumptions << '\n';
  }
  out_.flush();
}

}  // namespace mem
