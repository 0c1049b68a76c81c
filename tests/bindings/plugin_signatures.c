/* plugin_signatures.c — the plugin's entry points as PyTorch sees them: compiled as C99
 * with -Werror, so a declaration that drifts from the types PyTorch calls through is a
 * build error; then loaded by path with dlopen/dlsym, as
 * torch.cuda.memory.CUDAPluggableAllocator(path, "vramscope_torch_malloc",
 * "vramscope_torch_free") does, and called on a simulated device.
 *
 * PyTorch's types (torch/csrc/cuda/CUDAPluggableAllocator.h):
 *   std::function<void*(size_t, int, cudaStream_t)> alloc_fn
 *   std::function<void(void*, size_t, int, cudaStream_t)> free_fn
 * and cudaStream_t is a pointer (struct CUstream_st*). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#include "vramscope/c_api.h"

typedef struct CUstream_st* cudaStream_t; /* as cuda_runtime_api.h declares it */
typedef void* (*torch_alloc_fn)(ssize_t size, int device, cudaStream_t stream);
typedef void (*torch_free_fn)(void* ptr, ssize_t size, int device, cudaStream_t stream);

/* The declarations in c_api.h must have exactly these types (void* stands for cudaStream_t). */
static void* (*const declared_alloc)(ptrdiff_t, int, void*) = vramscope_torch_malloc;
static void (*const declared_free)(void*, ptrdiff_t, int, void*) = vramscope_torch_free;

static int failures = 0;
#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                \
    }                                                            \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s path/to/libvramscope.so\n", argv[0]);
    return 2;
  }
  (void)declared_alloc;
  (void)declared_free;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  torch_alloc_fn alloc_fn;
  torch_free_fn free_fn;
  *(void**)&alloc_fn = dlsym(lib, "vramscope_torch_malloc");
  *(void**)&free_fn = dlsym(lib, "vramscope_torch_free");
  CHECK(alloc_fn != NULL);
  CHECK(free_fn != NULL);
  /* The same library as the one linked: dlopen by path finds the loaded copy. */
  CHECK(alloc_fn == (torch_alloc_fn)declared_alloc);
  if (failures) return 1;

  CHECK(vramscope_init("sim:a100-80g", "") == VRAMSCOPE_OK);
  cudaStream_t stream = (cudaStream_t)(uintptr_t)0x5000;
  void* p = alloc_fn(5 << 20, 0, stream);
  CHECK(p != NULL);
  vramscope_stats s;
  CHECK(vramscope_get_stats(0, &s, sizeof s) == VRAMSCOPE_OK);
  CHECK(s.allocated_bytes[0].current == 5 << 20);
  CHECK(s.reserved_bytes[0].current == 20 << 20);
  free_fn(p, 5 << 20, 0, stream);
  CHECK(vramscope_get_stats(0, &s, sizeof s) == VRAMSCOPE_OK);
  CHECK(s.allocated_bytes[0].current == 0);
  CHECK(alloc_fn(0, 0, stream) == NULL);
  if (failures == 0) printf("plugin entry points: ok\n");
  return failures ? 1 : 0;
}
