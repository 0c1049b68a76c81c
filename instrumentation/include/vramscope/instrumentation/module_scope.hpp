// module_scope.hpp — per-module attribution: which module and phase owns an allocation.
//
//   mem::attach(allocator);                       // once: stamp blocks with the current scope
//   {
//     mem::ModuleScope scope{"layer1.0.conv1", mem::Phase::Forward};
//     void* p = allocator.allocate(bytes);        // block's context -> ("layer1.0.conv1", forward)
//   }
//
// A scope names the *full* dotted module path; scopes nest per thread (the
// innermost one stamps the allocation, a parent's peak includes its children).
// Each distinct (path, phase) pair is interned once into a process-wide
// registry of 32-bit context ids, so the allocator's context source only reads
// one thread-local integer. Id 0 means "no scope".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mem {

class CachingAllocator;

/// What a training step is doing when memory is allocated.
enum class Phase : std::uint8_t { None, Forward, Backward, Recompute, Optimizer };
inline constexpr std::size_t kNumPhases = 5;

/// "none", "forward", "backward", "recompute", "optimizer".
std::string_view phase_name(Phase phase) noexcept;
/// Inverse of phase_name(); throws mem::Error listing the valid names.
Phase parse_phase(std::string_view name);

/// An interned (module path, phase) pair.
using ContextId = std::uint32_t;
inline constexpr ContextId kNoContext = 0;
/// How many (module path, phase) pairs a process may intern (kNoContext included).
inline constexpr std::size_t kMaxContexts = std::size_t{1} << 23;

/// What a context id stands for. References returned by context_info() stay
/// valid for the life of the process (contexts are never removed).
struct ContextInfo {
  std::string path;           ///< full dotted module path; "" for kNoContext
  Phase phase = Phase::None;
};

/// The id of (path, phase), creating it on first use. Thread-safe.
/// Throws mem::Error once the registry is full (kMaxContexts pairs).
ContextId intern_context(std::string_view path, Phase phase);
/// What an id stands for; an unknown id resolves like kNoContext. Lock-free.
const ContextInfo& context_info(ContextId id) noexcept;
/// Number of ids handed out so far, plus one for kNoContext.
std::size_t context_count() noexcept;

/// The innermost scope's context on the calling thread (kNoContext outside any scope).
ContextId current_context() noexcept;
/// Number of scopes open on the calling thread.
std::size_t current_scope_depth() noexcept;

/// RAII: while alive, allocations on this thread are stamped with `path` and `phase`.
/// Scopes must be destroyed in reverse order of construction on the thread that
/// built them (a stack); moving or copying them is therefore not allowed.
class ModuleScope {
 public:
  ModuleScope(std::string_view path, Phase phase);
  /// For hot loops: a context interned beforehand with intern_context().
  explicit ModuleScope(ContextId context);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;
  ModuleScope(ModuleScope&&) = delete;
  ModuleScope& operator=(ModuleScope&&) = delete;

  ContextId context() const noexcept { return context_; }

 private:
  ContextId context_;
  ContextId previous_;
};

/// Installs the context source (current_context) on an allocator, so every new
/// block carries the innermost scope of the allocating thread. Idempotent.
void attach(CachingAllocator& allocator);

/// What a scope listener is told when a scope opens or closes.
struct ScopeEvent {
  ContextId context = kNoContext;
  std::string_view path;
  Phase phase = Phase::None;
  std::size_t depth = 0;  ///< 1 for an outermost scope
};

/// Receives scope openings and closings from every thread (recorders and
/// module hooks implement it). Called on the thread of the scope, outside any
/// allocator lock; it may call into allocators and take snapshots.
class ScopeListener {
 public:
  virtual ~ScopeListener() = default;
  virtual void on_scope_enter(const ScopeEvent& event) = 0;
  virtual void on_scope_exit(const ScopeEvent& event) noexcept = 0;
};

/// Registers a listener (not owned). With none registered, a scope costs a
/// thread-local store and one relaxed atomic load.
void add_scope_listener(ScopeListener* listener);
void remove_scope_listener(ScopeListener* listener) noexcept;

}  // namespace mem
