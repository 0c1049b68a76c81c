// module_tracker.hpp — per-module attribution and block lifetimes.
//
//   mem::ModuleTracker tracker{allocator};        // attaches; records until destroyed
//   { mem::ModuleScope s{"layer1", mem::Phase::Forward}; ... }
//   { mem::ModuleScope s{"layer1", mem::Phase::Backward}; ... }
//   const mem::ModuleReport* r = tracker.find("layer1");
//   r->forward_allocated_bytes(); r->kept_for_backward_bytes; r->backward_freed_bytes();
//
// Definitions (sizes are block sizes, i.e. rounded as allocated_bytes counts them):
// - a block belongs to the innermost scope open on the allocating thread (its
//   context); its *free phase* is the phase of the innermost scope open on the
//   thread that frees it (Phase::None outside any scope);
// - allocated[p] / allocations[p]: bytes and blocks the module itself allocated
//   in phase p (children's blocks are theirs);
// - freed[p] / frees[p]: bytes and blocks the module allocated (in any phase)
//   and that were freed during phase p; so freed[Backward] is what backward
//   releases of this module's memory;
// - kept_for_backward_bytes: of the blocks the module allocated in forward,
//   the bytes still alive when its last forward scope closed;
// - peak_increase[p]: the largest rise of the allocator's allocated bytes above
//   their value at scope entry, over the module's scopes of phase p. Children
//   run inside their parent's scope, so a parent's peak includes its children's;
//   peak_allocated[p] is the absolute allocated bytes at that moment.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

class CachingAllocator;

/// One block's life: when and where it was allocated and freed.
struct BlockLifetime {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  StreamId stream = 0;
  ContextId alloc_context = kNoContext;  ///< owner module and phase
  ContextId free_context = kNoContext;   ///< innermost scope of the freeing thread
  std::uint64_t alloc_sequence = 0;      ///< allocator event numbers
  std::uint64_t free_sequence = 0;       ///< 0 while alive
  double alloc_time_us = 0;              ///< since the tracker started
  double free_time_us = -1;              ///< -1 while alive
  bool alive = true;

  const ContextInfo& owner() const noexcept { return context_info(alloc_context); }
  const ContextInfo& freed_in() const noexcept { return context_info(free_context); }
};

/// What one module did with memory; arrays are indexed by Phase.
struct ModuleReport {
  using PerPhase = std::array<std::size_t, kNumPhases>;

  std::string path;
  std::size_t depth = 0;             ///< scope depth at the module's first scope (1 = outermost)
  PerPhase calls{};                  ///< scopes opened
  PerPhase allocated{};              ///< bytes allocated by the module itself
  PerPhase allocations{};            ///< blocks allocated by the module itself
  PerPhase freed{};                  ///< bytes of its blocks freed during each phase
  PerPhase frees{};
  PerPhase peak_increase{};          ///< includes children
  PerPhase peak_allocated{};
  std::size_t kept_for_backward_bytes = 0;
  std::size_t kept_for_backward_blocks = 0;
  std::size_t live_bytes = 0;        ///< its blocks alive now
  std::size_t live_blocks = 0;

  static constexpr std::size_t at(Phase p) noexcept { return static_cast<std::size_t>(p); }
  std::size_t forward_allocated_bytes() const noexcept { return allocated[at(Phase::Forward)]; }
  std::size_t backward_allocated_bytes() const noexcept { return allocated[at(Phase::Backward)]; }
  std::size_t backward_freed_bytes() const noexcept { return freed[at(Phase::Backward)]; }
  std::size_t forward_peak_bytes() const noexcept { return peak_increase[at(Phase::Forward)]; }
  /// The largest peak_increase over all phases.
  std::size_t peak_bytes() const noexcept;
};

struct ModuleTrackerOptions {
  /// Keep at most this many finished lifetimes (oldest dropped); live blocks are always kept.
  std::size_t max_lifetimes = std::size_t{1} << 20;
};

/// Observer + scope listener that attributes every block to its module.
/// Attaches in the constructor (also calls mem::attach) and detaches in the destructor.
/// Thread-safe; meant for one allocator.
class ModuleTracker final : public AllocatorObserver, public ScopeListener {
 public:
  explicit ModuleTracker(CachingAllocator& allocator, ModuleTrackerOptions options = {});
  ~ModuleTracker() override;
  ModuleTracker(const ModuleTracker&) = delete;
  ModuleTracker& operator=(const ModuleTracker&) = delete;

  /// Every module seen, in the order its first scope opened (a pre-order walk of the tree).
  std::vector<ModuleReport> report() const;
  /// One module's report; empty when no scope of that path was seen.
  std::optional<ModuleReport> find(std::string_view path) const;
  /// Lifetimes, oldest allocation first: finished ones (up to max_lifetimes) and live ones.
  std::vector<BlockLifetime> lifetimes() const;
  /// Forgets everything recorded (blocks alive now are no longer tracked).
  void reset();

  void on_event(const TraceEvent& event) noexcept override;
  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;

 private:
  struct Frame {
    ContextId context;
    std::size_t module;        // index into modules_
    std::size_t entry_allocated;
    std::size_t max_allocated;
  };
  struct ModuleState {
    ModuleReport report;
    std::size_t forward_live_bytes = 0;   // its forward blocks alive now
    std::size_t forward_live_blocks = 0;
  };
  std::size_t module_index(const std::string& path, std::size_t depth);
  std::vector<Frame>& frames_of_this_thread();

  CachingAllocator* allocator_;
  ModuleTrackerOptions options_;
  mutable std::mutex mutex_;
  std::uint64_t start_ticks_;
  std::size_t allocated_now_ = 0;  // allocator's allocated bytes after the last event
  std::vector<ModuleState> modules_;
  std::unordered_map<std::string, std::size_t> module_by_path_;
  std::unordered_map<std::thread::id, std::vector<Frame>> frames_;
  std::deque<BlockLifetime> finished_;                     // oldest first, bounded
  std::unordered_map<std::uintptr_t, BlockLifetime> live_;  // by block address
};

}  // namespace mem
