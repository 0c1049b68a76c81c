// module_scope.cpp — the context registry, the per-thread scope stack and the
// scope listeners behind mem::ModuleScope.
#include "vramscope/instrumentation/module_scope.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

constexpr std::array<std::string_view, kNumPhases> kPhaseNames = {
    "none", "forward", "backward", "recompute", "optimizer"};

// Contexts live in fixed-size chunks that never move, so readers index them
// without a lock: an id below the published count points at a finished entry.
constexpr std::size_t kChunkBits = 12;
constexpr std::size_t kChunkSize = std::size_t{1} << kChunkBits;
// 2^23 contexts: every (module, phase) pair of the largest model a file may describe
// (1,000,000 modules, models/model_file.hpp) in every phase, with room to spare.
constexpr std::size_t kMaxChunks = kMaxContexts >> kChunkBits;

class ContextRegistry {
 public:
  ContextRegistry() {
    chunks_[0].store(new ContextInfo[kChunkSize], std::memory_order_relaxed);
    count_.store(1, std::memory_order_release);  // id 0 = {"", None}
  }
  // Process lifetime: the chunks are deliberately leaked so that references
  // handed out by context_info() stay valid during static destruction.

  ContextId intern(std::string_view path, Phase phase) {
    std::string key;
    key.reserve(path.size() + 1);
    key.push_back(static_cast<char>(phase));
    key.append(path);
    std::lock_guard lock(mutex_);
    if (auto it = ids_.find(key); it != ids_.end()) return it->second;
    const std::size_t id = count_.load(std::memory_order_relaxed);
    const std::size_t chunk = id >> kChunkBits;
    if (chunk >= kMaxChunks) {
      throw Error("mem::intern_context: more than " + std::to_string(kMaxChunks * kChunkSize - 1) +
                  " distinct (module path, phase) pairs; module paths should name modules, "
                  "not individual calls");
    }
    ContextInfo* block = chunks_[chunk].load(std::memory_order_relaxed);
    if (block == nullptr) {
      block = new ContextInfo[kChunkSize];
      chunks_[chunk].store(block, std::memory_order_release);
    }
    block[id & (kChunkSize - 1)] = ContextInfo{std::string(path), phase};
    ids_.emplace(std::move(key), static_cast<ContextId>(id));
    count_.store(id + 1, std::memory_order_release);
    return static_cast<ContextId>(id);
  }

  const ContextInfo& lookup(ContextId id) const noexcept {
    if (id >= count_.load(std::memory_order_acquire)) id = kNoContext;
    return chunks_[id >> kChunkBits].load(std::memory_order_acquire)[id & (kChunkSize - 1)];
  }

  std::size_t count() const noexcept { return count_.load(std::memory_order_acquire); }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, ContextId> ids_;
  std::array<std::atomic<ContextInfo*>, kMaxChunks> chunks_{};
  std::atomic<std::size_t> count_{0};
};

ContextRegistry& registry() {
  static auto* instance = new ContextRegistry();  // leaked on purpose, see above
  return *instance;
}

thread_local ContextId tls_context = kNoContext;
thread_local std::size_t tls_depth = 0;

// Listeners: copy-on-write list so that dispatch takes no lock while calling out.
using ListenerList = std::vector<ScopeListener*>;
std::mutex listeners_mutex;
std::shared_ptr<const ListenerList> listeners;       // guarded by listeners_mutex
std::atomic<bool> have_listeners{false};

std::shared_ptr<const ListenerList> current_listeners() {
  std::lock_guard lock(listeners_mutex);
  return listeners;
}

ScopeEvent make_event(ContextId id) {
  const ContextInfo& info = registry().lookup(id);
  return ScopeEvent{id, info.path, info.phase, tls_depth};
}

void notify_enter(ContextId id) {
  if (!have_listeners.load(std::memory_order_relaxed)) return;
  const auto list = current_listeners();
  if (!list) return;
  const ScopeEvent event = make_event(id);
  for (ScopeListener* listener : *list) listener->on_scope_enter(event);
}

void notify_exit(ContextId id) noexcept {
  if (!have_listeners.load(std::memory_order_relaxed)) return;
  std::shared_ptr<const ListenerList> list;
  try {
    list = current_listeners();
  } catch (...) {
    return;
  }
  if (!list) return;
  const ScopeEvent event = make_event(id);
  for (ScopeListener* listener : *list) listener->on_scope_exit(event);
}

}  // namespace

std::string_view phase_name(Phase phase) noexcept {
  const auto index = static_cast<std::size_t>(phase);
  return index < kPhaseNames.size() ? kPhaseNames[index] : std::string_view{"unknown"};
}

Phase parse_phase(std::string_view name) {
  for (std::size_t i = 0; i < kPhaseNames.size(); ++i) {
    if (kPhaseNames[i] == name) return static_cast<Phase>(i);
  }
  throw Error("unknown phase '" + std::string(name) +
              "'; expected one of none, forward, backward, recompute, optimizer");
}

ContextId intern_context(std::string_view path, Phase phase) {
  if (path.empty() && phase == Phase::None) return kNoContext;
  return registry().intern(path, phase);
}

const ContextInfo& context_info(ContextId id) noexcept { return registry().lookup(id); }
std::size_t context_count() noexcept { return registry().count(); }

ContextId current_context() noexcept { return tls_context; }
std::size_t current_scope_depth() noexcept { return tls_depth; }

ModuleScope::ModuleScope(std::string_view path, Phase phase)
    : ModuleScope(intern_context(path, phase)) {}

ModuleScope::ModuleScope(ContextId context) : context_(context), previous_(tls_context) {
  tls_context = context_;
  ++tls_depth;
  try {
    notify_enter(context_);
  } catch (...) {
    --tls_depth;
    tls_context = previous_;
    throw;
  }
}

ModuleScope::~ModuleScope() {
  notify_exit(context_);
  --tls_depth;
  tls_context = previous_;
}

void attach(CachingAllocator& allocator) { allocator.set_context_source(&current_context); }

void add_scope_listener(ScopeListener* listener) {
  if (listener == nullptr) throw Error("mem::add_scope_listener: listener is null");
  std::lock_guard lock(listeners_mutex);
  auto next = listeners ? std::make_shared<ListenerList>(*listeners)
                        : std::make_shared<ListenerList>();
  if (std::find(next->begin(), next->end(), listener) == next->end()) next->push_back(listener);
  listeners = std::move(next);
  have_listeners.store(true, std::memory_order_relaxed);
}

void remove_scope_listener(ScopeListener* listener) noexcept {
  std::lock_guard lock(listeners_mutex);
  if (!listeners) return;
  try {
    auto next = std::make_shared<ListenerList>(*listeners);
    next->erase(std::remove(next->begin(), next->end(), listener), next->end());
    have_listeners.store(!next->empty(), std::memory_order_relaxed);
    listeners = std::move(next);
  } catch (...) {
    // Out of memory while copying a handful of pointers: leave the list as is.
  }
}

}  // namespace mem
