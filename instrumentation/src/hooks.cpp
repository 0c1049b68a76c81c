// hooks.cpp — module hooks: scope openings and closings turned into callbacks
// with a snapshot.
#include "vramscope/instrumentation/hooks.hpp"

#include <array>

#include "vramscope/allocator/errors.hpp"

namespace mem {

std::string_view hook_name(HookPoint point, Phase phase) noexcept {
  static constexpr std::array<std::string_view, kNumPhases> kPre = {
      "enter", "pre-forward", "pre-backward", "pre-recompute", "pre-optimizer"};
  static constexpr std::array<std::string_view, kNumPhases> kPost = {
      "exit", "forward", "backward", "recompute", "optimizer"};
  const auto index = static_cast<std::size_t>(phase);
  if (index >= kNumPhases) return "unknown";
  return point == HookPoint::Pre ? kPre[index] : kPost[index];
}

std::string_view ModuleHookEvent::hook_name() const noexcept {
  return mem::hook_name(point, phase);
}

std::string_view ModuleHookEvent::leaf_name() const noexcept {
  const auto dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

ModuleHook::ModuleHook(const CachingAllocator& allocator, ModuleHookFn fn, SnapshotOptions options)
    : allocator_(allocator), fn_(std::move(fn)), options_(options) {
  if (!fn_) throw Error("mem::ModuleHook: the callback is empty");
  add_scope_listener(this);
}

ModuleHook::~ModuleHook() { remove_scope_listener(this); }

void ModuleHook::fire(HookPoint point, const ScopeEvent& event) {
  const Snapshot snap = snapshot(allocator_, options_);
  const ModuleHookEvent hook_event{point, event.path, event.phase,
                                   event.depth > 0 ? event.depth - 1 : 0, snap};
  fn_(hook_event);
}

void ModuleHook::on_scope_enter(const ScopeEvent& event) { fire(HookPoint::Pre, event); }

void ModuleHook::on_scope_exit(const ScopeEvent& event) noexcept {
  try {
    fire(HookPoint::Post, event);
  } catch (...) {
    dropped_exceptions_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace mem
