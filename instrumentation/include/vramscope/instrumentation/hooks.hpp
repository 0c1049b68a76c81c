// hooks.hpp — module hooks: a callback at pre-forward, forward, backward, ...
// with the module path, the phase and a snapshot, driven by mem::ModuleScope.
//
//   mem::ModuleHook hook{allocator, [](const mem::ModuleHookEvent& e) {
//     std::printf("%*s%s %s: %.1f MiB\n", int(2 * e.depth), "", e.hook_name().data(),
//                 e.leaf_name().data(), e.snapshot.allocated_bytes() / 1048576.0);
//   }};
//
// A scope opening is the "pre" hook of its phase (pre-forward, pre-backward,
// ...), its closing the hook proper (forward, backward, ...), like PyTorch's
// register_forward_pre_hook / register_forward_hook / register_full_backward_hook.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {

class CachingAllocator;

/// When a hook fires relative to its scope.
enum class HookPoint : std::uint8_t { Pre, Post };

/// What a module hook receives. References are valid during the call only.
struct ModuleHookEvent {
  HookPoint point = HookPoint::Pre;
  std::string_view path;      ///< full dotted module path
  Phase phase = Phase::None;
  std::size_t depth = 0;      ///< 0 for an outermost scope (for indentation)
  const Snapshot& snapshot;   ///< taken right at the hook

  /// "pre-forward", "forward", "pre-backward", "backward", "pre-recompute",
  /// "recompute", "pre-optimizer", "optimizer"; "enter"/"exit" for Phase::None.
  std::string_view hook_name() const noexcept;
  /// The last component of the path ("conv1" for "layer1.0.conv1").
  std::string_view leaf_name() const noexcept;
};

using ModuleHookFn = std::function<void(const ModuleHookEvent&)>;

/// "pre-forward", "forward", ... for a point and phase (see ModuleHookEvent::hook_name).
std::string_view hook_name(HookPoint point, Phase phase) noexcept;

/// RAII registration of a module hook on one allocator: every scope opening and
/// closing on any thread calls `fn` with a snapshot of `allocator` taken with
/// `options`. An exception thrown by `fn` at a scope opening propagates out of
/// the ModuleScope constructor; one thrown at a closing is dropped (destructors
/// cannot throw) and counted in dropped_exceptions().
class ModuleHook final : public ScopeListener {
 public:
  ModuleHook(const CachingAllocator& allocator, ModuleHookFn fn, SnapshotOptions options = {});
  ~ModuleHook() override;
  ModuleHook(const ModuleHook&) = delete;
  ModuleHook& operator=(const ModuleHook&) = delete;

  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;

  std::size_t dropped_exceptions() const noexcept { return dropped_exceptions_; }

 private:
  void fire(HookPoint point, const ScopeEvent& event);

  const CachingAllocator& allocator_;
  ModuleHookFn fn_;
  SnapshotOptions options_;
  std::atomic<std::size_t> dropped_exceptions_{0};
};

}  // namespace mem
