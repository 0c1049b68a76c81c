// memory_logger.cpp — the ready-made per-module memory log: one line per hook
// and module call, the module tree, changes and peaks between lines, totals.
#include "vramscope/instrumentation/memory_logger.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <ostream>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/instrumentation/hooks.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string mib(std::int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / kMiB);
}
std::string mib_delta(std::int64_t bytes) {
  return fmt::format("{:+.2f} MiB", static_cast<double>(bytes) / kMiB);
}

void atomic_max(std::atomic<std::int64_t>& target, std::int64_t value) noexcept {
  std::int64_t seen = target.load(std::memory_order_relaxed);
  while (seen < value && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

MemoryLogger::MemoryLogger(CachingAllocator& allocator, std::ostream& out, MemoryLoggerOptions options)
    : allocator_(allocator), out_(out), options_(std::move(options)) {
  previous_allocated_ = static_cast<std::int64_t>(snapshot(allocator_).allocated_bytes());
  peak_since_line_ = previous_allocated_;
  peak_since_capture_ = previous_allocated_;
  allocator_.add_observer(this);
  add_scope_listener(this);
}

MemoryLogger::~MemoryLogger() {
  remove_scope_listener(this);
  allocator_.remove_observer(this);
  try {
    finish();
  } catch (...) {
    // Writing to the stream failed: nothing sensible to do in a destructor.
  }
}

std::size_t MemoryLogger::lines() const noexcept {
  std::lock_guard lock(mutex_);
  return lines_;
}

const std::string& MemoryLogger::type_of(const std::string& path) {
  static const std::string none;
  if (!options_.module_type) return none;
  auto it = types_.find(path);
  if (it == types_.end()) it = types_.emplace(path, options_.module_type(path)).first;
  return it->second;
}

bool MemoryLogger::is_module(const std::string& path) {
  return scoped_.count(path) != 0 || !type_of(path).empty();
}

std::size_t MemoryLogger::tree_depth(const std::string& path, std::size_t* name_begin) {
  std::size_t depth = 0;
  std::size_t begin = 0;
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    const std::string ancestor = path.substr(0, dot);
    if (is_module(ancestor)) ++depth;
    if (entered_in_phase_.count(ancestor) != 0) begin = dot + 1;
  }
  if (name_begin != nullptr) *name_begin = begin;
  return depth;
}

bool MemoryLogger::shown(const std::string& path) {
  return options_.max_depth == 0 || tree_depth(path, nullptr) < options_.max_depth;
}

std::string MemoryLogger::rollup_target(const std::string& path) {
  std::string target;  // the deepest shown module ancestor
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    const std::string ancestor = path.substr(0, dot);
    if (!shown(ancestor)) break;  // deeper ancestors are hidden too
    if (auto it = open_.find(ancestor); it != open_.end() && it->second > 0) return {};
    if (is_module(ancestor)) target = ancestor;
  }
  return target;
}

MemoryLogger::Line MemoryLogger::capture(bool pre, const ScopeEvent& event) {
  const Snapshot s = snapshot(allocator_);
  Line line;
  line.pre = pre;
  line.path = std::string(event.path);
  line.phase = event.phase;
  std::size_t name_begin = 0;
  line.depth = tree_depth(line.path, &name_begin);
  line.name = line.path.substr(name_begin);
  if (line.name.empty()) line.name = "<step>";
  if (const std::string& type = type_of(line.path); !type.empty()) line.name += " (" + type + ")";
  line.allocated = static_cast<std::int64_t>(s.allocated_bytes());
  line.reserved = static_cast<std::int64_t>(s.reserved_bytes());
  line.device_used = static_cast<std::int64_t>(s.device.used_bytes);
  line.peak = std::max(peak_since_line_.load(std::memory_order_relaxed), line.allocated);
  peak_since_capture_.store(line.allocated, std::memory_order_relaxed);
  return line;
}

void MemoryLogger::print(const Line& line) {
  if (!header_printed_) {
    out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "hook", "module",
                        options_.module_width, "allocated", "change", "peak between", "reserved",
                        "nvidia-smi");
    header_printed_ = true;
  }
  const std::int64_t change = line.allocated - previous_allocated_;
  previous_allocated_ = line.allocated;
  const std::string module = std::string(2 * line.depth, ' ') + line.name;
  const std::string_view hook = hook_name(line.pre ? HookPoint::Pre : HookPoint::Post, line.phase);
  if (options_.on_row) {
    options_.on_row(MemoryLogRow{.hook = hook, .path = line.path, .type = type_of(line.path),
                                 .depth = line.depth, .allocated = line.allocated, .change = change,
                                 .peak_between = line.peak, .reserved = line.reserved,
                                 .nvidia_smi = line.device_used});
  }
  out_ << fmt::format("{:<14} {:<{}} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
                      hook, module,
                      options_.module_width, mib(line.allocated), mib_delta(change), mib(line.peak),
                      mib(line.reserved), mib(line.device_used));
  // The next line's peak counts from the moment this one was captured.
  peak_since_line_.store(peak_since_capture_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  if (!line.pre) last_pre_.reset();
  ++lines_;
}

void MemoryLogger::flush_locked() {
  if (!held_) return;
  const Line line = std::move(*held_);
  held_.reset();
  held_is_rollup_ = false;
  print(line);
}

void MemoryLogger::flush() {
  std::lock_guard lock(mutex_);
  flush_locked();
  out_.flush();
}

void MemoryLogger::on_scope_enter(const ScopeEvent& event) {
  std::lock_guard lock(mutex_);
  if (finished_) return;
  const std::string path(event.path);
  scoped_.insert(path);
  if (event.phase != entered_phase_) {
    entered_in_phase_.clear();
    entered_phase_ = event.phase;
  }
  entered_in_phase_.insert(path);
  ++open_[path];
  if (!shown(path)) return;
  // The same module reopening in the same phase right after it closed (another of
  // its autograd nodes, its next parameter's update): one call, one line pair.
  if (holds(path, event.phase)) {
    held_.reset();  // its line will cover what the held one did (rolled-up children too)
    held_is_rollup_ = false;
    return;
  }
  flush_locked();
  // A scope nested directly in one of the same module and phase (the step's
  // backward scope around the loss's own) is the same hook: print it once.
  if (last_pre_ && last_pre_->first == path && last_pre_->second == event.phase) return;
  if (options_.pre_hooks) print(capture(true, event));
  last_pre_.emplace(path, event.phase);
}

void MemoryLogger::on_scope_exit(const ScopeEvent& event) noexcept {
  try {
    std::lock_guard lock(mutex_);
    const std::string path(event.path);
    if (auto it = open_.find(path); it != open_.end() && it->second > 0 && --it->second == 0) {
      open_.erase(it);
    }
    if (finished_) return;
    if (!shown(path)) {
      // Hidden below max_depth: its memory belongs to its own ancestor's line, not to
      // whatever line is printed next. Consecutive children of one ancestor and phase
      // make one line, captured after the last of them.
      const std::string target = rollup_target(path);
      if (target.empty()) return;
      // One line for the ancestor's own scope and its hidden children in a row (a block's
      // backward runs its children's nodes and its own in turn).
      if (!holds(target, event.phase)) flush_locked();
      ScopeEvent as_ancestor = event;
      as_ancestor.path = target;
      held_ = capture(false, as_ancestor);
      held_is_rollup_ = true;
      return;
    }
    // A rolled-up line of this very scope's children is taken over by its own line.
    if (!(holds(path, event.phase) && held_is_rollup_)) flush_locked();
    held_ = capture(false, event);
    held_is_rollup_ = false;
  } catch (...) {
    // A failing stream must not turn a scope's destructor into a crash.
  }
}

void MemoryLogger::on_event(const TraceEvent& event) noexcept {
  const auto allocated = static_cast<std::int64_t>(event.allocated_bytes);
  atomic_max(peak_since_line_, allocated);
  atomic_max(peak_since_capture_, allocated);
}

void MemoryLogger::finish() {
  std::lock_guard lock(mutex_);
  if (finished_) return;
  flush_locked();
  finished_ = true;
  const Snapshot s = snapshot(allocator_);
  out_ << fmt::format(
      "totals: {} lines; peak allocated {}, peak reserved {}, peak nvidia-smi {} "
      "(CUDA context {}); now allocated {}, reserved {}\n",
      lines_, mib(static_cast<std::int64_t>(s.peak_allocated_bytes())),
      mib(static_cast<std::int64_t>(s.peak_reserved_bytes())),
      mib(static_cast<std::int64_t>(s.device.peak_used_bytes)),
      mib(static_cast<std::int64_t>(s.device.context_bytes)),
      mib(static_cast<std::int64_t>(s.allocated_bytes())),
      mib(static_cast<std::int64_t>(s.reserved_bytes())));
  if (options_.device_line && s.device.info && !s.device.info->assumptions.empty()) {
    out_ << "device: " << s.device.info->name << " — " << s.device.info->assumptions << '\n';
  }
  out_.flush();
}

}  // namespace mem
