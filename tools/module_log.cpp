// module_log.cpp — the per-module memory log of `vramscope trace`.
#include "module_log.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <ostream>

#include "vramscope/instrumentation/hooks.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem::tools {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string mib(std::int64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / kMiB); }
std::string mib_delta(std::int64_t bytes) {
  return fmt::format("{:+.2f} MiB", static_cast<double>(bytes) / kMiB);
}

}  // namespace

ModuleLog::ModuleLog(CachingAllocator& allocator, std::ostream& out,
                     std::unordered_map<std::string, std::string> types, ModuleLogOptions options)
    : allocator_(allocator), out_(out), types_(std::move(types)), options_(options) {
  previous_allocated_ = allocator_.stats().allocated_bytes[0].current;
  peak_since_line_ = previous_allocated_;
  allocator_.add_observer(this);
  add_scope_listener(this);
}

ModuleLog::~ModuleLog() {
  remove_scope_listener(this);
  allocator_.remove_observer(this);
  try {
    flush();
  } catch (...) {
    // A failing stream must not escape a destructor.
  }
}

std::size_t ModuleLog::display_depth(const std::string& path, std::size_t* name_begin) const {
  // Indent under the ancestors that are modules of their own; a path whose parent
  // never runs as a module (resnet's flattened "layer1.0") keeps that prefix.
  std::size_t depth = 0;
  std::size_t begin = 0;
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    if (types_.count(path.substr(0, dot)) != 0) {
      ++depth;
      begin = dot + 1;
    }
  }
  if (name_begin != nullptr) *name_begin = begin;
  return depth + 1;
}

bool ModuleLog::shown(std::string_view path) const {
  return options_.max_depth == 0 || display_depth(std::string(path), nullptr) <= options_.max_depth;
}

ModuleLog::Line ModuleLog::capture(bool pre, const ScopeEvent& event) {
  const Snapshot s = snapshot(allocator_);
  Line line;
  line.pre = pre;
  line.path = std::string(event.path);
  line.phase = event.phase;
  line.allocated = static_cast<std::int64_t>(s.allocated_bytes());
  line.reserved = static_cast<std::int64_t>(s.reserved_bytes());
  line.device_used = static_cast<std::int64_t>(s.device.used_bytes);
  line.peak = std::max(peak_since_line_, line.allocated);
  peak_since_capture_ = line.allocated;
  return line;
}

void ModuleLog::print(const Line& line) {
  if (!header_printed_) {
    out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "hook", "module",
                        options_.module_width, "allocated", "change", "peak between", "reserved",
                        "nvidia-smi");
    header_printed_ = true;
  }
  const std::int64_t change = previous_allocated_ < 0 ? 0 : line.allocated - previous_allocated_;
  previous_allocated_ = line.allocated;
  std::size_t name_begin = 0;
  const std::size_t depth = display_depth(line.path, &name_begin) - 1;
  std::string name = line.path.substr(name_begin);
  if (name.empty()) name = "<step>";
  if (const auto it = types_.find(line.path); it != types_.end()) name += " (" + it->second + ")";
  const std::string module = std::string(2 * depth, ' ') + name;
  out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
                      hook_name(line.pre ? HookPoint::Pre : HookPoint::Post, line.phase), module,
                      options_.module_width, mib(line.allocated), mib_delta(change),
                      mib(line.peak), mib(line.reserved), mib(line.device_used));
  // The next line's peak counts from the moment this one was captured.
  peak_since_line_ = peak_since_capture_;
  if (!line.pre) last_pre_.reset();
  ++lines_;
}

void ModuleLog::flush() {
  if (held_) {
    const Line line = std::move(*held_);
    held_.reset();
    print(line);
  }
}

void ModuleLog::on_scope_enter(const ScopeEvent& event) {
  if (!shown(event.path)) return;
  // The same module reopening in the same phase right after it closed (another of
  // its autograd nodes, its next parameter's update): one hook pair, not several.
  if (held_ && held_->path == event.path && held_->phase == event.phase) {
    held_.reset();
    return;
  }
  flush();
  // A scope nested directly in one of the same module and phase (the step's backward
  // scope around the loss's own) is the same hook: print it once.
  if (last_pre_ && last_pre_->first == event.path && last_pre_->second == event.phase) return;
  if (options_.pre_hooks) print(capture(true, event));
  last_pre_.emplace(std::string(event.path), event.phase);
}

void ModuleLog::on_scope_exit(const ScopeEvent& event) noexcept {
  if (!shown(event.path)) return;
  try {
    flush();
    held_ = capture(false, event);
  } catch (...) {
    // Printing must never turn a scope's destructor into a crash.
  }
}

void ModuleLog::on_event(const TraceEvent& event) noexcept {
  const auto allocated = static_cast<std::int64_t>(event.allocated_bytes);
  peak_since_line_ = std::max(peak_since_line_, allocated);
  peak_since_capture_ = std::max(peak_since_capture_, allocated);
}

}  // namespace mem::tools
