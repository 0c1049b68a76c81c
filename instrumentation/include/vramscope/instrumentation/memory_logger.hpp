// memory_logger.hpp — the per-module memory log people write by hand, ready-made.
//
//   mem::MemoryLogger logger{allocator, std::cout};
//   ... run a training step with ModuleScopes ...
//   logger.finish();   // totals
//
// prints one line per hook and module call, the module tree indented by the
// dotted path, the change in allocated memory since the previous line, the
// peak reached between the two lines, reserved and the nvidia-smi view:
//
//   hook           module                                          allocated       change peak between     reserved   nvidia-smi
//   pre-forward    conv1 (Conv2d)                                  45.00 MiB    +0.00 MiB    45.00 MiB    64.00 MiB   484.00 MiB
//   forward        conv1 (Conv2d)                                 437.00 MiB  +392.00 MiB   444.63 MiB   456.00 MiB   876.00 MiB
//   pre-forward    layer1                                         ...
//   pre-forward      0 (BasicBlock)                               ...
//
// What a training step needs on top of one line per scope:
// - several scopes of one module in one phase in a row (the autograd nodes of a
//   Linear in backward, the optimizer's update of its weight and then its bias)
//   are one module call: one pre line, one post line;
// - a scope opened directly inside one of the same module and phase (a step's
//   backward scope "loss" around the loss's own) is the same call;
// - the indentation follows the module path, not the scope nesting, so the
//   backward pass (which runs inside the step's "loss" scope) reads as a tree.
//
// Module types come from an optional callback, e.g. filled from a model:
//
//   mem::MemoryLogger logger{alloc, std::cout, {.module_type = [&](std::string_view path) {
//     return type_of(path);   // "Conv2d"; "" for a path that is not a module
//   }}};
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

class CachingAllocator;

/// Names the type of the module at a dotted path ("layer1.0.conv1" -> "Conv2d");
/// returns "" for a path that is not a module (a scope such as "loss").
using ModuleTypeFn = std::function<std::string(std::string_view path)>;

/// One line of the log as data (MemoryLoggerOptions::on_row), for CSV and JSON.
struct MemoryLogRow {
  std::string_view hook;        ///< "pre-forward", "forward", "backward", "optimizer", ...
  std::string_view path;        ///< the module's dotted path ("layer1.0.conv1")
  std::string_view type;        ///< its type ("Conv2d"); "" for a scope that is not a module
  std::size_t depth = 0;        ///< the indentation: module ancestors shown
  std::int64_t allocated = 0;   ///< memory_allocated() at the line
  std::int64_t change = 0;      ///< since the previous line
  std::int64_t peak_between = 0;///< max allocated since the previous line
  std::int64_t reserved = 0;
  std::int64_t nvidia_smi = 0;  ///< the device's used bytes as nvidia-smi shows them
};

struct MemoryLoggerOptions {
  bool pre_hooks = true;          ///< also print pre-forward / pre-backward / ... lines
  /// Print modules up to this depth of the module tree (0 = all; 1 = top level).
  std::size_t max_depth = 0;
  std::size_t module_width = 44;  ///< column width of the indented module tree
  /// finish() also prints the device's name and assumptions (simulated devices).
  bool device_line = true;
  /// Optional: module types, printed after the name ("conv1 (Conv2d)"). A path
  /// it names also counts as a module for the indentation of its descendants.
  ModuleTypeFn module_type = {};
  /// Optional: called with every line printed, as data (a CSV or JSON copy of the log).
  std::function<void(const MemoryLogRow&)> on_row = {};
};

/// A scope listener and allocator observer printing the per-module memory log.
///
/// Indentation: one level per dotted ancestor of the path that is a module, i.e.
/// that has been a scope itself (in any phase) or that `module_type` names. When
/// every ancestor runs as a module this is the path depth ("layer1.0.conv1" under
/// "layer1.0" under "layer1"). The name shown is the path below the deepest
/// ancestor whose scope opened since the phase last changed: "conv1" in forward,
/// where the parents open first; "layer1.0.conv1" in the optimizer, where no
/// parent runs; a flattened prefix that never runs stays in the name.
///
/// Lines are printed as the scopes close, except that a post line is held until
/// the next scope event (to merge a module's consecutive scopes): flush() or
/// finish() prints the last one. Meant for one thread running the step; scopes
/// on other threads are logged but interleave.
class MemoryLogger final : public ScopeListener, public AllocatorObserver {
 public:
  /// Registers itself on `allocator` and as a scope listener until destroyed.
  MemoryLogger(CachingAllocator& allocator, std::ostream& out, MemoryLoggerOptions options = {});
  /// Unregisters, then calls finish() if it was not called.
  ~MemoryLogger() override;
  MemoryLogger(const MemoryLogger&) = delete;
  MemoryLogger& operator=(const MemoryLogger&) = delete;

  /// Prints a held line, if any. Idempotent.
  void flush();
  /// flush(), then the totals: lines, the allocator's peak allocated, reserved
  /// and nvidia-smi view (since its last peak reset), the CUDA context, what is
  /// allocated and reserved now, and (options.device_line) the device's
  /// assumptions. Later scopes are not logged. Idempotent.
  void finish();
  /// Lines printed so far (excluding the header and the totals).
  std::size_t lines() const noexcept;

  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;
  void on_event(const TraceEvent& event) noexcept override;

 private:
  struct Line {
    bool pre = false;
    std::string path;
    Phase phase = Phase::None;
    std::size_t depth = 0;  ///< indentation: module ancestors
    std::string name;       ///< what the module column shows, type included
    std::int64_t allocated = 0, reserved = 0, device_used = 0;
    std::int64_t peak = 0;  ///< max allocated since the previous printed line
  };
  Line capture(bool pre, const ScopeEvent& event);
  void print(const Line& line);
  void flush_locked();
  /// module_type's answer for `path`, cached; "" without a callback.
  const std::string& type_of(const std::string& path);
  bool is_module(const std::string& path);
  /// Module ancestors of `path` (0 for a top-level module); where its shown name
  /// begins (after the deepest ancestor entered in the current phase).
  std::size_t tree_depth(const std::string& path, std::size_t* name_begin);
  bool shown(const std::string& path);
  /// For a scope deeper than max_depth that runs outside any open shown scope (an
  /// optimizer update of "layer1.0.conv1", gpt2's "transformer.h.3"): its ancestor at
  /// the deepest shown level, whose line it rolls up into; "" when an open shown
  /// ancestor's own line already covers it.
  std::string rollup_target(const std::string& path);
  /// A post line for `path` in `phase` is held (its own, or its hidden children's).
  bool holds(const std::string& path, Phase phase) const noexcept {
    return held_ && held_->path == path && held_->phase == phase;
  }

  CachingAllocator& allocator_;
  std::ostream& out_;
  MemoryLoggerOptions options_;
  mutable std::mutex mutex_;  // guards everything below but the atomics
  std::unordered_set<std::string> scoped_;               ///< paths seen as scopes
  /// Paths entered since the phase of the scopes last changed: a name is shown
  /// relative to one of these, so a line read on its own still says where it is.
  std::unordered_set<std::string> entered_in_phase_;
  Phase entered_phase_ = Phase::None;
  std::unordered_map<std::string, std::string> types_;  ///< module_type's answers, cached
  std::optional<Line> held_;  ///< a post line waiting to see whether its scope reopens
  bool held_is_rollup_ = false;  ///< held_ stands for hidden children of held_->path
  std::unordered_map<std::string, std::size_t> open_;  ///< scopes open now, by path
  /// The last line printed, if it was a pre line: a nested scope of the same
  /// module and phase is the same call.
  std::optional<std::pair<std::string, Phase>> last_pre_;
  bool header_printed_ = false;
  bool finished_ = false;
  std::size_t lines_ = 0;
  std::int64_t previous_allocated_ = 0;
  // Updated by on_event under the allocator's lock, so no mutex_ there (the
  // scope callbacks take snapshots, i.e. the allocator's lock, under mutex_).
  std::atomic<std::int64_t> peak_since_line_{0};     ///< max allocated since the last printed line
  std::atomic<std::int64_t> peak_since_capture_{0};  ///< max allocated since held_ was captured
};

}  // namespace mem
