// module_tracker.cpp — per-module attribution: block lifetimes from allocator
// events, scope frames for nested peaks.
#include "vramscope/instrumentation/module_tracker.hpp"

#include <algorithm>

#include "vramscope/allocator/clock.hpp"
#include "vramscope/allocator/caching_allocator.hpp"

namespace mem {

std::size_t ModuleReport::peak_bytes() const noexcept {
  return *std::max_element(peak_increase.begin(), peak_increase.end());
}

ModuleTracker::ModuleTracker(CachingAllocator& allocator, ModuleTrackerOptions options)
    : allocator_(&allocator), options_(options), start_ticks_(detail::ticks()) {
  const DeviceStats stats = allocator.stats();
  allocated_now_ = static_cast<std::size_t>(std::max<std::int64_t>(0, stats.allocated_bytes[0].current));
  attach(allocator);
  add_scope_listener(this);
  allocator.add_observer(this);
}

ModuleTracker::~ModuleTracker() {
  allocator_->remove_observer(this);
  remove_scope_listener(this);
}

std::size_t ModuleTracker::module_index(const std::string& path, std::size_t depth) {
  if (auto it = module_by_path_.find(path); it != module_by_path_.end()) return it->second;
  const std::size_t index = modules_.size();
  ModuleState state;
  state.report.path = path;
  state.report.depth = depth;
  modules_.push_back(std::move(state));
  module_by_path_.emplace(path, index);
  return index;
}

std::vector<ModuleTracker::Frame>& ModuleTracker::frames_of_this_thread() {
  return frames_[std::this_thread::get_id()];
}

void ModuleTracker::on_event(const TraceEvent& event) noexcept {
  try {
    std::lock_guard lock(mutex_);
    allocated_now_ = event.allocated_bytes;
    switch (event.action) {
      case TraceAction::Alloc: {
        BlockLifetime life;
        life.address = event.address;
        life.size = event.size;
        life.requested_size = event.requested_size;
        life.stream = event.stream;
        life.alloc_context = event.context;
        life.alloc_sequence = event.sequence;
        life.alloc_time_us = detail::ticks_to_us(start_ticks_, detail::ticks());
        live_[event.address] = life;
        if (event.context != kNoContext) {
          const ContextInfo& owner = context_info(event.context);
          ModuleState& m = modules_[module_index(owner.path, 0)];
          const std::size_t p = ModuleReport::at(owner.phase);
          m.report.allocated[p] += event.size;
          m.report.allocations[p] += 1;
          m.report.live_bytes += event.size;
          m.report.live_blocks += 1;
          if (owner.phase == Phase::Forward) {
            m.forward_live_bytes += event.size;
            m.forward_live_blocks += 1;
          }
        }
        auto it = frames_.find(std::this_thread::get_id());
        if (it != frames_.end() && !it->second.empty()) {
          Frame& top = it->second.back();
          top.max_allocated = std::max(top.max_allocated, event.allocated_bytes);
        }
        break;
      }
      case TraceAction::FreeRequested: {
        auto it = live_.find(event.address);
        if (it == live_.end()) break;  // allocated before the tracker started
        BlockLifetime life = it->second;
        live_.erase(it);
        life.alive = false;
        life.free_context = current_context();  // observers run on the freeing thread
        life.free_sequence = event.sequence;
        life.free_time_us = detail::ticks_to_us(start_ticks_, detail::ticks());
        if (life.alloc_context != kNoContext) {
          const ContextInfo& owner = context_info(life.alloc_context);
          ModuleState& m = modules_[module_index(owner.path, 0)];
          const std::size_t p = ModuleReport::at(context_info(life.free_context).phase);
          m.report.freed[p] += life.size;
          m.report.frees[p] += 1;
          m.report.live_bytes -= life.size;
          m.report.live_blocks -= 1;
          if (owner.phase == Phase::Forward) {
            m.forward_live_bytes -= life.size;
            m.forward_live_blocks -= 1;
          }
        }
        finished_.push_back(life);
        while (finished_.size() > options_.max_lifetimes) finished_.pop_front();
        break;
      }
      default:
        break;  // segment events and completions change no module's bytes
    }
  } catch (...) {
    // Out of memory while recording: the allocation itself must not fail for it.
  }
}

void ModuleTracker::on_scope_enter(const ScopeEvent& event) {
  std::lock_guard lock(mutex_);
  const std::size_t index = module_index(std::string(event.path), event.depth);
  ModuleReport& report = modules_[index].report;
  if (report.depth == 0) report.depth = event.depth;
  report.calls[ModuleReport::at(event.phase)] += 1;
  frames_of_this_thread().push_back(Frame{event.context, index, allocated_now_, allocated_now_});
}

void ModuleTracker::on_scope_exit(const ScopeEvent& event) noexcept {
  std::lock_guard lock(mutex_);
  auto it = frames_.find(std::this_thread::get_id());
  if (it == frames_.end() || it->second.empty()) return;  // opened before the tracker
  std::vector<Frame>& stack = it->second;
  const Frame frame = stack.back();
  if (frame.context != event.context) return;  // opened before the tracker
  stack.pop_back();
  ModuleState& m = modules_[frame.module];
  const std::size_t p = ModuleReport::at(event.phase);
  m.report.peak_increase[p] =
      std::max(m.report.peak_increase[p], frame.max_allocated - frame.entry_allocated);
  m.report.peak_allocated[p] = std::max(m.report.peak_allocated[p], frame.max_allocated);
  if (!stack.empty()) {
    // The parent was open the whole time: its peak includes the child's.
    stack.back().max_allocated = std::max(stack.back().max_allocated, frame.max_allocated);
  }
  if (event.phase == Phase::Forward) {
    m.report.kept_for_backward_bytes = m.forward_live_bytes;
    m.report.kept_for_backward_blocks = m.forward_live_blocks;
  }
}

std::vector<ModuleReport> ModuleTracker::report() const {
  std::lock_guard lock(mutex_);
  std::vector<ModuleReport> out;
  out.reserve(modules_.size());
  for (const ModuleState& m : modules_) out.push_back(m.report);
  return out;
}

std::optional<ModuleReport> ModuleTracker::find(std::string_view path) const {
  std::lock_guard lock(mutex_);
  auto it = module_by_path_.find(std::string(path));
  if (it == module_by_path_.end()) return std::nullopt;
  return modules_[it->second].report;
}

std::vector<BlockLifetime> ModuleTracker::lifetimes() const {
  std::lock_guard lock(mutex_);
  std::vector<BlockLifetime> out(finished_.begin(), finished_.end());
  for (const auto& [address, life] : live_) out.push_back(life);
  std::sort(out.begin(), out.end(), [](const BlockLifetime& a, const BlockLifetime& b) {
    return a.alloc_sequence < b.alloc_sequence;
  });
  return out;
}

void ModuleTracker::reset() {
  std::lock_guard lock(mutex_);
  modules_.clear();
  module_by_path_.clear();
  finished_.clear();
  live_.clear();
  for (auto& [thread, stack] : frames_) stack.clear();
  start_ticks_ = detail::ticks();
}

}  // namespace mem
