/* c_api.h — vramscope's C API: the caching allocator and its instrumentation from C,
 * and from any language that can call C (Python's ctypes, Rust, Julia, ...).
 *
 *   #include <vramscope/c_api.h>
 *
 *   if (vramscope_init("sim:a100-80g", "max_split_size_mb:128") != VRAMSCOPE_OK)
 *     fprintf(stderr, "%s\n", vramscope_last_error());
 *   void* p = vramscope_malloc(5 << 20, 0, 0);  // device 0, default stream
 *   vramscope_stats s;
 *   vramscope_get_stats(0, &s, sizeof s);       // s.reserved_bytes[0].current == 20 MiB
 *   vramscope_free(p);
 *
 * One process allocator per device index, created on first use from the settings of
 * vramscope_init() (or VRAMSCOPE_DEVICE and VRAMSCOPE_ALLOC_CONF when it was not called).
 * With a CUDA device spec ("cuda", "auto" on a machine with a GPU) device index N is the
 * GPU cuda:N; with a simulated spec every index is its own simulated GPU of that spec.
 *
 * Errors: functions return a vramscope_status (or NULL / 0 where they return a value) and
 * keep the message of the calling thread's last failure for vramscope_last_error(). A
 * failed call changes nothing. Success does not clear the last error (as errno).
 * Every function is thread-safe.
 *
 * Versioning: VRAMSCOPE_C_API_VERSION grows when functions or struct fields are added;
 * existing ones never change. Structs are extended only at their end, and callers pass
 * sizeof the struct they were compiled with, so an old caller keeps working with a newer
 * library.
 */
#ifndef VRAMSCOPE_C_API_H
#define VRAMSCOPE_C_API_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define VRAMSCOPE_C_EXPORT __declspec(dllexport)
#else
#define VRAMSCOPE_C_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define VRAMSCOPE_C_API_VERSION 1

/** What a call returned. */
typedef enum vramscope_status {
  VRAMSCOPE_OK = 0,
  VRAMSCOPE_ERROR_INVALID = 1,       /**< misuse: bad pointer, size, name or setting */
  VRAMSCOPE_ERROR_OUT_OF_MEMORY = 2, /**< the device could not supply it, even after the cache was freed */
  VRAMSCOPE_ERROR_IO = 3,            /**< a file could not be written */
  VRAMSCOPE_ERROR_INTERNAL = 4       /**< anything else (a bug: please report it) */
} vramscope_status;

/** A stream of a device: 0 is the default stream; others come from vramscope_stream_create. */
typedef uint64_t vramscope_stream;

/** One counter as PyTorch keeps it: current value, peak since the last reset, totals. */
typedef struct vramscope_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} vramscope_stat;

/** torch.cuda.memory_stats() as a flat struct. Arrays are indexed by pool:
 *  [0] "all", [1] "small_pool", [2] "large_pool". */
typedef struct vramscope_stats {
  vramscope_stat allocation[3];
  vramscope_stat segment[3];
  vramscope_stat active[3];
  vramscope_stat inactive_split[3];
  vramscope_stat allocated_bytes[3];
  vramscope_stat reserved_bytes[3];
  vramscope_stat active_bytes[3];
  vramscope_stat inactive_split_bytes[3];
  vramscope_stat requested_bytes[3];
  int64_t num_alloc_retries;
  int64_t num_ooms;
  int64_t num_sync_all_streams;
  int64_t num_device_alloc;
  int64_t num_device_free;
  vramscope_stat oversize_allocations;
  vramscope_stat oversize_segments;
  int64_t max_split_size;
  /* The device view, beside PyTorch's figures. */
  vramscope_stat device_used_bytes; /**< what nvidia-smi shows for this process */
  int64_t device_total_bytes;
  int64_t context_bytes;            /**< the CUDA context, included in device_used_bytes */
  double driver_time_us;            /**< time spent in cudaMalloc / cudaFree */
} vramscope_stats;

/** VRAMSCOPE_C_API_VERSION of the library actually loaded. */
VRAMSCOPE_C_EXPORT int vramscope_api_version(void);

/** Chooses the device ("auto", "sim:a100-80g", "cuda", ... as `vramscope devices` lists)
 *  and the allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax; "" for the defaults) of
 *  every process allocator created from now on. NULL keeps a setting's current value
 *  (at first, VRAMSCOPE_DEVICE and VRAMSCOPE_ALLOC_CONF). Both are checked now. Once an
 *  allocator exists, settings other than the current ones are VRAMSCOPE_ERROR_INVALID. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_init(const char* device_spec, const char* alloc_conf);

/** A block of at least `size` bytes on `device` for use on `stream`; NULL on failure
 *  (vramscope_last_error_code() tells out of memory from misuse, such as size 0). */
VRAMSCOPE_C_EXPORT void* vramscope_malloc(size_t size, int device, vramscope_stream stream);
/** Returns a block; NULL is a no-op. A pointer not handed out, or freed twice, is an error. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_free(void* ptr);
/** The block is also used on `stream` (of the block's device): reuse waits for it. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_record_stream(void* ptr, vramscope_stream stream);
/** A new stream of `device`, written to *out. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_stream_create(int device, vramscope_stream* out);
VRAMSCOPE_C_EXPORT vramscope_status vramscope_stream_destroy(int device, vramscope_stream stream);

/** Returns every unsplit cached segment of `device` to it (torch.cuda.empty_cache). */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_empty_cache(int device);
/** Caps the allocator at fraction * capacity (torch.cuda.set_per_process_memory_fraction). */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_set_memory_fraction(int device, double fraction);

/** Copies the statistics into *out; `out_size` is sizeof(vramscope_stats) as the caller
 *  was compiled with (at least version 1's size). Fields the library lacks are set to 0. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_get_stats(int device, vramscope_stats* out, size_t out_size);
VRAMSCOPE_C_EXPORT vramscope_status vramscope_reset_peak_stats(int device);
VRAMSCOPE_C_EXPORT vramscope_status vramscope_reset_accumulated_stats(int device);

/** Starts (max_entries > 0) or stops (0) recording `device`'s allocator events for the
 *  snapshots' trace, as torch.cuda.memory._record_memory_history does. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_record_history(int device, size_t max_entries);
/** Writes the device's segments, blocks (with their module and phase) and recorded
 *  history in PyTorch's memory-snapshot pickle (pytorch.org/memory_viz), or as JSON.
 *  The file is written whole or not at all. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_snapshot_pickle(int device, const char* path);
VRAMSCOPE_C_EXPORT vramscope_status vramscope_snapshot_json(int device, const char* path);
/** torch.cuda.memory_summary()'s text, NUL-terminated, into buf (truncated to capacity - 1).
 *  Returns the text's full length, so a call with capacity 0 sizes the buffer; 0 on error. */
VRAMSCOPE_C_EXPORT size_t vramscope_memory_summary(int device, char* buf, size_t capacity);

/** Opens a module scope on the calling thread: blocks allocated until the matching pop
 *  carry `path` (the full dotted module name, e.g. "layer1.0.conv1") and `phase`
 *  ("forward", "backward", "recompute", "optimizer" or "none"). Scopes nest. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_scope_push(const char* path, const char* phase);
/** Closes the calling thread's innermost scope; an error when none is open. */
VRAMSCOPE_C_EXPORT vramscope_status vramscope_scope_pop(void);
/** Scopes open on the calling thread. */
VRAMSCOPE_C_EXPORT size_t vramscope_scope_depth(void);

/** The calling thread's last failure: its message ("" if none) and its status. */
VRAMSCOPE_C_EXPORT const char* vramscope_last_error(void);
VRAMSCOPE_C_EXPORT vramscope_status vramscope_last_error_code(void);

/* --- PyTorch's pluggable allocator ------------------------------------------------
 * torch.cuda.memory.CUDAPluggableAllocator(path_of_this_library,
 *     "vramscope_torch_malloc", "vramscope_torch_free")
 * `stream` is the cudaStream_t PyTorch allocates on. Out of memory throws a C++
 * std::bad_alloc carrying vramscope's message through PyTorch (a NULL return would
 * hand PyTorch a tensor without storage); size 0 returns NULL as PyTorch's own
 * allocator does. */
VRAMSCOPE_C_EXPORT void* vramscope_torch_malloc(ptrdiff_t size, int device, void* stream);
VRAMSCOPE_C_EXPORT void vramscope_torch_free(void* ptr, ptrdiff_t size, int device, void* stream);
/** For C++ code that builds the allocator with torch's createCustomAllocator: pass it to
 *  set_record_stream_fn, so tensor.record_stream() (NCCL, DDP, FSDP side streams) defers
 *  reuse. Python's CUDAPluggableAllocator cannot set it: there, record_stream, empty_cache
 *  and set_per_process_memory_fraction do nothing in PyTorch (use the vramscope package's
 *  empty_cache and set_per_process_memory_fraction). */
VRAMSCOPE_C_EXPORT void vramscope_torch_record_stream(void* ptr, void* stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* VRAMSCOPE_C_API_H */
