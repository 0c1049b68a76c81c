// c_api.cpp — the C API (vramscope/c_api.h) over the C++ API: one process allocator per
// device index, exceptions turned into a status and a per-thread message, and PyTorch's
// pluggable-allocator entry points.
#include "vramscope/c_api.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/instrumentation/snapshot.hpp"
#include "vramscope/instrumentation/summary.hpp"

namespace {

// sizeof(vramscope_stats) in version 1 of the API: every caller passes at least this.
constexpr std::size_t kStatsV1Size = 1032;
static_assert(sizeof(vramscope_stats) == kStatsV1Size, "version 1: later versions only append");

// PyTorch's own ceiling on device indices (c10::Device holds an int8_t index).
constexpr int kMaxDevices = 128;

// The calling thread's last failure. A fixed buffer: recording an error never allocates
// (it may be reporting that memory ran out), and it has no destructor that could run
// before another thread-local's.
struct LastError {
  char message[1024] = "";
  vramscope_status code = VRAMSCOPE_OK;
};
thread_local LastError last_error;

vramscope_status fail(vramscope_status code, const char* function, const char* what) noexcept {
  std::snprintf(last_error.message, sizeof last_error.message, "%s%s%s", function,
                *function != '\0' ? ": " : "", what);
  last_error.code = code;
  return code;
}

// A file could not be written (reported as VRAMSCOPE_ERROR_IO, not as misuse).
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The exception being handled, as a status and this thread's message. Out of line, so
// the functions below keep only a zero-cost try block on their fast paths.
[[gnu::noinline, gnu::cold]] vramscope_status fail_current(const char* function) noexcept {
  try {
    throw;
  } catch (const mem::OutOfMemoryError& e) {
    return fail(VRAMSCOPE_ERROR_OUT_OF_MEMORY, "", e.what());  // the message says it all
  } catch (const IoError& e) {
    return fail(VRAMSCOPE_ERROR_IO, function, e.what());
  } catch (const mem::Error& e) {
    return fail(VRAMSCOPE_ERROR_INVALID, function, e.what());
  } catch (const std::bad_alloc&) {
    return fail(VRAMSCOPE_ERROR_INTERNAL, function, "host memory exhausted");
  } catch (const std::exception& e) {
    return fail(VRAMSCOPE_ERROR_INTERNAL, function, e.what());
  } catch (...) {
    return fail(VRAMSCOPE_ERROR_INTERNAL, function, "unknown exception");
  }
}

// Runs `body` and maps what it throws onto a status; the library's exceptions never
// cross the C boundary.
template <class Body>
vramscope_status guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    return VRAMSCOPE_OK;
  } catch (...) {
    return fail_current(function);
  }
}

// One device's process allocator, its optional history, and the native streams
// (cudaStream_t handles from PyTorch) it has adopted. Created once, never destroyed:
// blocks held by static objects may be freed after main() returns.
struct DeviceSlot {
  std::unique_ptr<mem::CachingAllocator> allocator;
  std::mutex mutex;  // guards history (snapshots hold it while they are taken)
  std::unique_ptr<mem::History> history;
  std::mutex streams_mutex;  // guards native_streams: allocations never wait for a snapshot
  std::unordered_map<std::uintptr_t, mem::StreamId> native_streams;

  mem::StreamId adopt(void* handle) {
    const auto key = reinterpret_cast<std::uintptr_t>(handle);
    if (key == 0) return 0;
    std::lock_guard lock(streams_mutex);
    auto [it, inserted] = native_streams.try_emplace(key, 0);
    if (inserted) {
      try {
        it->second = allocator->device().adopt_native_stream(key);
      } catch (...) {
        native_streams.erase(it);
        throw;
      }
    }
    return it->second;
  }
};

// The slots, published once each with a release store, so the fast path reads one atomic
// pointer; and the only slot while there is exactly one, which frees use without asking
// which allocator owns the pointer. Trivially destructible: still readable while static
// objects free their blocks after main() returns.
constinit std::array<std::atomic<DeviceSlot*>, kMaxDevices> slots{};
constinit std::atomic<DeviceSlot*> sole_slot{nullptr};

// Settings, and the lock slots are created under.
struct Registry {
  std::mutex mutex;
  bool settings_read = false;
  std::string device_spec;
  std::string alloc_conf;
  int slot_count = 0;

  void read_env_locked() {
    if (settings_read) return;
    const char* spec = std::getenv("VRAMSCOPE_DEVICE");
    const char* conf = std::getenv("VRAMSCOPE_ALLOC_CONF");
    device_spec = spec ? spec : "auto";
    alloc_conf = conf ? conf : "";
    settings_read = true;
  }
};

Registry& registry() {
  static Registry* instance = new Registry;  // leaked on purpose, as the slots
  return *instance;
}

// The spec with "auto" resolved, so "auto" and "cuda" compare equal on a GPU machine.
std::string resolved_spec(const std::string& spec) {
  if (spec == "auto") return mem::cuda_device_count() > 0 ? "cuda" : "sim";
  return spec;
}

bool is_cuda_spec(const std::string& spec) {
  const std::string resolved = resolved_spec(spec);
  return resolved == "cuda" || resolved.starts_with("cuda:");
}

// The device behind index `device` under `spec`: GPU cuda:N for a CUDA spec, an
// independent simulated GPU of the spec otherwise.
std::shared_ptr<mem::Device> make_indexed_device(const std::string& spec, int device) {
  if (spec.starts_with("cuda:")) {
    if (spec != "cuda:" + std::to_string(device)) {
      throw mem::Error("device index " + std::to_string(device) + " is not the configured device " +
                       spec + "; pass its index, or configure \"cuda\" to use every GPU");
    }
    return mem::make_device(spec);
  }
  if (is_cuda_spec(spec)) return mem::make_device("cuda:" + std::to_string(device));
  return mem::make_device(spec);
}

void check_index(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw mem::Error("device index " + std::to_string(device) + " is out of range [0, " +
                     std::to_string(kMaxDevices) + ")");
  }
}

[[gnu::noinline]] DeviceSlot& create_slot(int device) {
  check_index(device);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (DeviceSlot* slot = slots[device].load(std::memory_order_acquire)) return *slot;
  r.read_env_locked();
  auto slot = std::make_unique<DeviceSlot>();
  slot->allocator = std::make_unique<mem::CachingAllocator>(
      make_indexed_device(r.device_spec, device), mem::AllocatorConfig::parse(r.alloc_conf));
  mem::attach(*slot->allocator);  // blocks carry the scope of vramscope_scope_push
  DeviceSlot* published = slot.release();
  // The sole-slot shortcut ends before a second allocator can hand out a pointer: a thread
  // that sees the new slot must not free through the old shortcut.
  if (++r.slot_count == 1) {
    sole_slot.store(published, std::memory_order_release);
  } else {
    sole_slot.store(nullptr, std::memory_order_seq_cst);
  }
  slots[device].store(published, std::memory_order_seq_cst);
  return *published;
}

// The device's slot if it was made already, else null (a device number out of range too).
inline DeviceSlot* made_slot(int device) noexcept {
  if (static_cast<unsigned>(device) >= static_cast<unsigned>(kMaxDevices)) [[unlikely]] return nullptr;
  return slots[device].load(std::memory_order_acquire);
}

inline DeviceSlot& slot_for(int device) {
  if (DeviceSlot* slot = made_slot(device)) [[likely]] return *slot;
  return create_slot(device);
}

// The slot whose allocator handed out `ptr`, or null.
DeviceSlot* owner_of(const void* ptr) noexcept {
  for (auto& entry : slots) {
    DeviceSlot* slot = entry.load(std::memory_order_acquire);
    if (slot != nullptr && slot->allocator->owns(ptr)) return slot;
  }
  return nullptr;
}

// The slot whose allocator holds `ptr` as an allocated block; mem::Error otherwise.
DeviceSlot& owner_or_throw(const void* ptr) {
  DeviceSlot* slot = owner_of(ptr);
  if (slot == nullptr) {
    throw mem::Error("pointer " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                     " is not an allocated block of vramscope (never handed out, or already "
                     "freed); nothing changed");
  }
  return *slot;
}

// Frees on the owner of `ptr` when there are several allocators, or none.
[[gnu::noinline]] void free_searching(void* ptr) { owner_or_throw(ptr).allocator->deallocate(ptr); }

// Frees on the owning allocator. With one device there is nothing to search: its
// deallocate checks the pointer itself.
inline void free_anywhere(void* ptr) {
  if (DeviceSlot* slot = sole_slot.load(std::memory_order_acquire)) [[likely]] {
    slot->allocator->deallocate(ptr);
    return;
  }
  free_searching(ptr);
}

// The C++ allocate() takes any stream id on trust; the C API refuses a stream never
// created (or destroyed), as record_stream refuses it.
[[gnu::noinline]] void check_stream(mem::CachingAllocator& allocator, vramscope_stream stream,
                                    int device) {
  if (!allocator.device().has_stream(stream)) {
    throw mem::Error("stream " + std::to_string(stream) + " was not created on device " +
                     std::to_string(device) + " or was destroyed (0 is the default stream)");
  }
}

void copy_stat(const mem::Stat& from, vramscope_stat& to) noexcept {
  to = {from.current, from.peak, from.allocated, from.freed};
}

void copy_stats(const mem::DeviceStats& s, vramscope_stats& out) noexcept {
#define VRAMSCOPE_COPY_ARRAY(name) \
  for (std::size_t i = 0; i < mem::kNumStatTypes; ++i) copy_stat(s.name[i], out.name[i]);
  VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_COPY_ARRAY)
#undef VRAMSCOPE_COPY_ARRAY
#define VRAMSCOPE_COPY_COUNTER(name) out.name = s.name;
  VRAMSCOPE_STAT_COUNTERS(VRAMSCOPE_COPY_COUNTER)
#undef VRAMSCOPE_COPY_COUNTER
  copy_stat(s.oversize_allocations, out.oversize_allocations);
  copy_stat(s.oversize_segments, out.oversize_segments);
  out.max_split_size = s.max_split_size;
  copy_stat(s.device_used_bytes, out.device_used_bytes);
  out.device_total_bytes = s.device_total_bytes;
  out.context_bytes = s.context_bytes;
  out.driver_time_us = s.driver_time_us;
}

mem::Snapshot full_snapshot(DeviceSlot& slot) {
  std::lock_guard lock(slot.mutex);
  return mem::snapshot(*slot.allocator, {.segments = true,
                                         .history = slot.history != nullptr,
                                         .history_source = slot.history.get()});
}

// Writes `device`'s full snapshot with `write(snapshot, path)`; a failed write is an I/O
// error, not misuse.
template <class Write>
void write_snapshot(int device, const char* path, Write&& write) {
  if (path == nullptr || *path == '\0') throw mem::Error("the output path is empty");
  const mem::Snapshot snap = full_snapshot(slot_for(device));
  try {
    write(snap, std::string(path));
  } catch (const mem::Error& e) {
    throw IoError(e.what());
  }
}

// The open scopes of this thread, innermost last. Closed innermost first at thread exit,
// as ModuleScope requires.
struct ScopeStack {
  std::vector<std::unique_ptr<mem::ModuleScope>> scopes;
  ~ScopeStack() {
    while (!scopes.empty()) scopes.pop_back();
  }
};
thread_local ScopeStack scope_stack;

}  // namespace

extern "C" {

int vramscope_api_version(void) { return VRAMSCOPE_C_API_VERSION; }

vramscope_status vramscope_init(const char* device_spec, const char* alloc_conf) {
  return guarded("vramscope_init", [&] {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    r.read_env_locked();
    const std::string spec = device_spec ? device_spec : r.device_spec;
    const std::string conf = alloc_conf ? alloc_conf : r.alloc_conf;
    if (spec.empty()) throw mem::Error("the device spec is empty; try \"auto\" or \"sim:a100-80g\"");
    // Both checked before anything changes: a malformed setting is refused here, not at the
    // first allocation.
    const mem::AllocatorConfig parsed = mem::AllocatorConfig::parse(conf);
    if (!is_cuda_spec(spec)) (void)mem::make_device(spec);
    if (r.slot_count > 0 && (resolved_spec(spec) != resolved_spec(r.device_spec) ||
                             mem::AllocatorConfig::parse(r.alloc_conf) != parsed)) {
      throw mem::Error("allocators already exist with device \"" + r.device_spec +
                       "\" and settings \"" + r.alloc_conf +
                       "\"; call vramscope_init before the first allocation");
    }
    if (r.slot_count > 0) return;  // the same settings in other words: keep the first
    r.device_spec = spec;
    r.alloc_conf = conf;
  });
}

namespace {

// vramscope_malloc's other cases: the device's first allocation, or a stream other than 0.
[[gnu::noinline]] void* malloc_slow(size_t size, int device, vramscope_stream stream) {
  mem::CachingAllocator& allocator = *slot_for(device).allocator;
  if (stream != 0) check_stream(allocator, stream, device);
  return allocator.allocate(size, stream);
}

}  // namespace

void* vramscope_malloc(size_t size, int device, vramscope_stream stream) {
  try {
    // The common case holds nothing across its one call, so it saves no registers (with
    // the slow cases inline it saved four on every call).
    if (stream == 0) [[likely]] {
      if (DeviceSlot* slot = made_slot(device)) [[likely]] return slot->allocator->allocate(size, 0);
    }
    return malloc_slow(size, device, stream);
  } catch (...) {
    fail_current("vramscope_malloc");
    return nullptr;
  }
}

vramscope_status vramscope_free(void* ptr) {
  if (ptr == nullptr) return VRAMSCOPE_OK;  // as free(NULL) and cudaFree(NULL)
  return guarded("vramscope_free", [&] { free_anywhere(ptr); });
}

vramscope_status vramscope_record_stream(void* ptr, vramscope_stream stream) {
  return guarded("vramscope_record_stream",
                 [&] { owner_or_throw(ptr).allocator->record_stream(ptr, stream); });
}

vramscope_status vramscope_stream_create(int device, vramscope_stream* out) {
  return guarded("vramscope_stream_create", [&] {
    if (out == nullptr) throw mem::Error("the output pointer is NULL");
    *out = slot_for(device).allocator->device().create_stream();
  });
}

vramscope_status vramscope_stream_destroy(int device, vramscope_stream stream) {
  return guarded("vramscope_stream_destroy", [&] {
    mem::Device& d = slot_for(device).allocator->device();
    if (stream == 0 || !d.has_stream(stream)) {
      throw mem::Error("stream " + std::to_string(stream) + " was not created on device " +
                       std::to_string(device) + " (0, the default stream, is never destroyed)");
    }
    d.destroy_stream(stream);
  });
}

vramscope_status vramscope_empty_cache(int device) {
  return guarded("vramscope_empty_cache", [&] { slot_for(device).allocator->empty_cache(); });
}

vramscope_status vramscope_set_memory_fraction(int device, double fraction) {
  return guarded("vramscope_set_memory_fraction",
                 [&] { slot_for(device).allocator->set_memory_fraction(fraction); });
}

vramscope_status vramscope_get_stats(int device, vramscope_stats* out, size_t out_size) {
  return guarded("vramscope_get_stats", [&] {
    if (out == nullptr) throw mem::Error("the output pointer is NULL");
    if (out_size < kStatsV1Size) {
      throw mem::Error("out_size " + std::to_string(out_size) +
                       " is smaller than version 1's vramscope_stats (" +
                       std::to_string(kStatsV1Size) + " bytes)");
    }
    vramscope_stats stats{};
    copy_stats(slot_for(device).allocator->stats(), stats);
    // An older caller's struct is a prefix of ours; a newer caller's fields that we lack are 0.
    std::memset(out, 0, out_size);
    std::memcpy(out, &stats, std::min(out_size, sizeof stats));
  });
}

vramscope_status vramscope_reset_peak_stats(int device) {
  return guarded("vramscope_reset_peak_stats",
                 [&] { slot_for(device).allocator->reset_peak_stats(); });
}

vramscope_status vramscope_reset_accumulated_stats(int device) {
  return guarded("vramscope_reset_accumulated_stats",
                 [&] { slot_for(device).allocator->reset_accumulated_stats(); });
}

vramscope_status vramscope_record_history(int device, size_t max_entries) {
  return guarded("vramscope_record_history", [&] {
    DeviceSlot& slot = slot_for(device);
    std::lock_guard lock(slot.mutex);
    // The new ring is made (it may fail) before the old one goes: a failure changes nothing.
    std::unique_ptr<mem::History> next;
    if (max_entries > 0) next = std::make_unique<mem::History>(max_entries);
    slot.history.reset();  // detaches
    if (next) {
      next->attach_to(*slot.allocator);
      slot.history = std::move(next);
    }
  });
}

vramscope_status vramscope_snapshot_pickle(int device, const char* path) {
  return guarded("vramscope_snapshot_pickle", [&] {
    write_snapshot(device, path, [&](const mem::Snapshot& snap, const std::string& out) {
      mem::write_memory_snapshot_pickle(snap, out, device);
    });
  });
}

vramscope_status vramscope_snapshot_json(int device, const char* path) {
  return guarded("vramscope_snapshot_json", [&] {
    write_snapshot(device, path, [](const mem::Snapshot& snap, const std::string& out) {
      mem::write_snapshot_json(snap, out);
    });
  });
}

size_t vramscope_memory_summary(int device, char* buf, size_t capacity) {
  size_t length = 0;
  const vramscope_status status = guarded("vramscope_memory_summary", [&] {
    if (buf == nullptr && capacity > 0) throw mem::Error("buf is NULL but capacity is not 0");
    const std::string text =
        mem::memory_summary(full_snapshot(slot_for(device)), {.device_index = device});
    length = text.size();
    if (capacity > 0) {
      const size_t n = std::min(text.size(), capacity - 1);
      std::memcpy(buf, text.data(), n);
      buf[n] = '\0';
    }
  });
  return status == VRAMSCOPE_OK ? length : 0;
}

vramscope_status vramscope_scope_push(const char* path, const char* phase) {
  return guarded("vramscope_scope_push", [&] {
    if (path == nullptr) throw mem::Error("the module path is NULL");
    const mem::Phase p = mem::parse_phase(phase ? phase : "none");
    const mem::ContextId context = mem::intern_context(path, p);
    scope_stack.scopes.reserve(scope_stack.scopes.size() + 1);  // no throw after the scope opens
    scope_stack.scopes.push_back(std::make_unique<mem::ModuleScope>(context));
  });
}

vramscope_status vramscope_scope_pop(void) {
  return guarded("vramscope_scope_pop", [&] {
    if (scope_stack.scopes.empty()) {
      throw mem::Error("no module scope is open on this thread (pushes and pops must pair up)");
    }
    scope_stack.scopes.pop_back();
  });
}

size_t vramscope_scope_depth(void) { return scope_stack.scopes.size(); }

const char* vramscope_last_error(void) { return last_error.message; }

vramscope_status vramscope_last_error_code(void) { return last_error.code; }

void* vramscope_torch_malloc(ptrdiff_t size, int device, void* stream) {
  // PyTorch asks for 0 bytes (empty tensors); its own allocator answers with null.
  if (size <= 0) return nullptr;
  DeviceSlot& slot = slot_for(device);
  // Exceptions go on into PyTorch (as RMM's plugin does): it reports our message, and
  // mem::OutOfMemoryError is a std::bad_alloc.
  return slot.allocator->allocate(static_cast<size_t>(size), slot.adopt(stream));
}

void vramscope_torch_record_stream(void* ptr, void* stream) {
  if (ptr == nullptr) return;
  guarded("vramscope_torch_record_stream", [&] {
    DeviceSlot& slot = owner_or_throw(ptr);
    slot.allocator->record_stream(ptr, slot.adopt(stream));
  });
}

void vramscope_torch_free(void* ptr, ptrdiff_t /*size*/, int device, void* /*stream*/) {
  if (ptr == nullptr) return;
  // Called from tensor deleters, which must not throw: a failure is kept for
  // vramscope_last_error.
  guarded("vramscope_torch_free", [&] {
    DeviceSlot& slot = slot_for(device);
    slot.allocator->deallocate(ptr);
  });
}

}  // extern "C"
