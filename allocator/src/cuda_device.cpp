// cuda_device.cpp — CudaDevice on the CUDA runtime, and NVML bound at run time.
//
// The only file in vramscope that includes CUDA headers. It is compiled as plain C++
// and linked against the static cudart, so a binary built here starts on machines with
// no CUDA libraries: cudart then finds no driver and cudaGetDeviceCount returns an error,
// which device_count() turns into 0. NVML is dlopen()ed for the same reason: linking
// libnvidia-ml would make the program fail to load wherever the driver is absent.
#include "vramscope/allocator/cuda_device.hpp"

#include <cuda.h>  // driver API types only: the calls are looked up through cudart at run time
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {
namespace {

// --- NVML, declared here rather than from nvml.h (not shipped with every toolkit) -------
// Only the stable C ABI of the four calls we need; names follow nvml.h.
using nvml_return_t = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
using nvml_device_t = struct nvml_device_opaque*;
constexpr nvml_return_t kNvmlSuccess = 0;
constexpr nvml_return_t kNvmlInsufficientSize = 7;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;

struct NvmlProcessInfo {  // nvmlProcessInfo_v2_t, filled by the _v2 and _v3 process queries
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

struct Nvml {
  using init_fn = nvml_return_t (*)();
  using handle_by_pci_fn = nvml_return_t (*)(const char*, nvml_device_t*);
  using processes_fn = nvml_return_t (*)(nvml_device_t, unsigned int*, NvmlProcessInfo*);

  bool ok = false;
  handle_by_pci_fn handle_by_pci = nullptr;
  processes_fn processes = nullptr;

  // Loaded once per process and never unloaded: NVML is reference counted by the driver
  // and shutting it down during static destruction races with other users.
  static const Nvml& get() {
    static const Nvml nvml = [] {
      Nvml n;
      void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) return n;
      auto init = reinterpret_cast<init_fn>(::dlsym(lib, "nvmlInit_v2"));
      n.handle_by_pci =
          reinterpret_cast<handle_by_pci_fn>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
      n.processes =
          reinterpret_cast<processes_fn>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
      if (n.processes == nullptr) {
        n.processes =
            reinterpret_cast<processes_fn>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v2"));
      }
      n.ok = init != nullptr && n.handle_by_pci != nullptr && n.processes != nullptr &&
             init() == kNvmlSuccess;
      return n;
    }();
    return nvml;
  }
};

// Bytes NVML attributes to this process on `device`; false when NVML cannot say (no
// library, or our pid is not in its list, as inside a container with its own pid namespace).
bool nvml_process_used(nvml_device_t device, std::size_t& out) {
  const Nvml& nvml = Nvml::get();
  if (!nvml.ok || device == nullptr) return false;
  std::vector<NvmlProcessInfo> infos(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    unsigned int count = static_cast<unsigned int>(infos.size());
    const nvml_return_t rc = nvml.processes(device, &count, infos.data());
    if (rc == kNvmlInsufficientSize) {
      infos.resize(static_cast<std::size_t>(count) + 16);  // processes may start meanwhile
      continue;
    }
    if (rc != kNvmlSuccess) return false;
    const auto pid = static_cast<unsigned int>(::getpid());
    for (unsigned int i = 0; i < count; ++i) {
      if (infos[i].pid == pid && infos[i].used_gpu_memory != kNvmlValueNotAvailable) {
        out = static_cast<std::size_t>(infos[i].used_gpu_memory);
        return true;
      }
    }
    return false;
  }
  return false;
}

// --- CUDA helpers -------------------------------------------------------------------

std::string where(int ordinal) { return " on cuda:" + std::to_string(ordinal); }

[[noreturn]] void throw_cuda(const char* call, cudaError_t err, int ordinal) {
  (void)cudaGetLastError();  // clear it so the next unrelated call does not see it
  throw Error(std::string("CUDA error in ") + call + where(ordinal) + ": " + cudaGetErrorName(err) +
              " (" + cudaGetErrorString(err) + ")");
}

// Makes `ordinal` current for the scope and restores the caller's device, as PyTorch's
// CUDAGuard does: the allocator may be called from threads working on another GPU.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) noexcept {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ == ordinal) return;
    switched_ = cudaSetDevice(ordinal) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (switched_ && previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

std::int64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              since)
      .count();
}

}  // namespace

namespace detail {
/// The driver's virtual-memory calls, found through cudart (cudaGetDriverEntryPointByVersion)
/// rather than by linking libcuda, which would stop the binary from starting without a driver.
struct DriverVm {
  decltype(&::cuMemAddressReserve) address_reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuDeviceGetAttribute) get_attribute = nullptr;

  bool complete() const {
    return address_reserve && address_free && create && map && set_access && unmap && release && get_attribute;
  }
  static const DriverVm& get() {
    static const DriverVm vm = [] {
      DriverVm d;
      const auto find = [](const char* name, auto& fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
            found == cudaDriverEntryPointSuccess) {
          fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
        }
        (void)cudaGetLastError();
      };
      find("cuMemAddressReserve", d.address_reserve);
      find("cuMemAddressFree", d.address_free);
      find("cuMemCreate", d.create);
      find("cuMemMap", d.map);
      find("cuMemSetAccess", d.set_access);
      find("cuMemUnmap", d.unmap);
      find("cuMemRelease", d.release);
      find("cuDeviceGetAttribute", d.get_attribute);
      return d;
    }();
    return vm;
  }
};

struct CudaDeviceState {
  std::mutex mutex;  // guards the maps and counters below; CUDA calls themselves are thread-safe
  bool virtual_memory = false;  // the driver's calls were found and the GPU supports them
  std::unordered_map<std::uintptr_t, CUmemGenericAllocationHandle> mappings;  // address -> handle
  std::unordered_map<StreamId, cudaStream_t> streams;
  std::unordered_set<StreamId> adopted;  // streams owned elsewhere: never destroyed here
  std::unordered_map<EventId, cudaEvent_t> events;
  StreamId next_stream = 1;
  EventId next_event = 1;
  nvml_device_t nvml_device = nullptr;  // null: process figure falls back to total - free
};
}  // namespace detail
using detail::DriverVm;

int CudaDevice::device_count() noexcept {
  // The GPU set is fixed for the life of a process, and the first call initialises the
  // runtime (slow; without a driver it just fails), so ask once.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

CudaDevice::CudaDevice(int ordinal, const std::string& note)
    : ordinal_(ordinal), state_(std::make_unique<detail::CudaDeviceState>()) {
  const int count = device_count();
  if (ordinal < 0 || ordinal >= count) {
    throw Error("cuda:" + std::to_string(ordinal) + " does not exist: " + std::to_string(count) +
                " CUDA GPU(s) found; use cuda:0..cuda:N-1, or sim:<preset> for a simulated GPU");
  }
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, ordinal); err != cudaSuccess) {
    throw_cuda("cudaGetDeviceProperties", err, ordinal);
  }
  DeviceGuard guard(ordinal);
  // cudaFree(nullptr) creates the primary context now, so the context appears in the
  // figures below and not in the first allocation's cost.
  if (cudaError_t err = cudaFree(nullptr); err != cudaSuccess)
    throw_cuda("cudaFree(0)", err, ordinal);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) {
    throw_cuda("cudaMemGetInfo", err, ordinal);
  }

  // NVML addresses GPUs by PCI bus id, which survives CUDA_VISIBLE_DEVICES renumbering.
  char bus_id[32] = {};
  std::size_t context = 0;
  std::string process_source =
      "total - free of the whole GPU (NVML unavailable; includes "
      "other processes)";
  const Nvml& nvml = Nvml::get();
  if (nvml.ok && cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, ordinal) == cudaSuccess) {
    nvml_device_t handle = nullptr;
    if (nvml.handle_by_pci(bus_id, &handle) == kNvmlSuccess) {
      state_->nvml_device = handle;
      if (nvml_process_used(handle, context)) {
        process_source = "NVML per-process figure";
      } else {
        process_source =
            "total - free of the whole GPU (this pid not in NVML's list, e.g. a "
            "container pid namespace; includes other processes)";
      }
    }
  }
  (void)cudaGetLastError();

  const DriverVm& vm = DriverVm::get();
  int vmm = 0;
  state_->virtual_memory =
      vm.complete() &&
      vm.get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ordinal) == CUDA_SUCCESS &&
      vmm != 0;

  info_.name = "cuda:" + std::to_string(ordinal) + " (" + prop.name + ")";
  if (!note.empty()) info_.name += " " + note;
  info_.total_bytes = total_bytes;
  info_.context_bytes = context;
  info_.granularity = 2 * MiB;
  info_.simulated = false;
  info_.compute_capability = prop.major * 10 + prop.minor;
  info_.multiprocessors = prop.multiProcessorCount;
  info_.max_threads_per_multiprocessor = prop.maxThreadsPerMultiProcessor;
  info_.assumptions = info_.name + ": " + format_bytes(total_bytes) +
                      " total (cudaMemGetInfo), CUDA context " +
                      (context != 0 ? format_bytes(context) + " measured by NVML at start"
                                    : std::string("not measured (no NVML figure)")) +
                      ", 2.00 MiB driver granularity assumed, process memory from " +
                      process_source + ", driver time measured";
}

CudaDevice::~CudaDevice() {
  DeviceGuard guard(ordinal_);
  for (auto& [id, event] : state_->events) (void)cudaEventDestroy(event);
  for (auto& [id, stream] : state_->streams) {
    if (!state_->adopted.contains(id)) (void)cudaStreamDestroy(stream);
  }
  (void)cudaGetLastError();
}

void* CudaDevice::allocate_segment(std::size_t bytes) {
  if (bytes == 0) throw Error("CudaDevice::allocate_segment: a segment of 0 bytes was requested");
  DeviceGuard guard(ordinal_);
  void* ptr = nullptr;
  const auto start = std::chrono::steady_clock::now();
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  driver_time_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is an answer, not a sticky error
    return nullptr;
  }
  if (err != cudaSuccess) throw_cuda("cudaMalloc", err, ordinal_);
  return ptr;
}

void CudaDevice::free_segment(void* ptr, std::size_t /*bytes*/) noexcept {
  if (ptr == nullptr) return;
  DeviceGuard guard(ordinal_);
  const auto start = std::chrono::steady_clock::now();
  // Errors cannot be reported from a noexcept free; at process exit cudart may already be
  // unloading (cudaErrorCudartUnloading), which is harmless.
  (void)cudaFree(ptr);
  driver_time_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  (void)cudaGetLastError();
}

// --- virtual memory (expandable segments), as PyTorch's ExpandableSegment uses it ---------

bool CudaDevice::supports_virtual_memory() const { return state_->virtual_memory; }

void* CudaDevice::reserve_address_range(std::size_t bytes) {
  if (!state_->virtual_memory) return nullptr;
  DeviceGuard guard(ordinal_);
  CUdeviceptr base = 0;
  if (DriverVm::get().address_reserve(&base, bytes, 0, 0, 0) != CUDA_SUCCESS) return nullptr;
  return reinterpret_cast<void*>(base);
}

void CudaDevice::release_address_range(void* base, std::size_t bytes) noexcept {
  if (!state_->virtual_memory || base == nullptr) return;
  DeviceGuard guard(ordinal_);
  (void)DriverVm::get().address_free(reinterpret_cast<CUdeviceptr>(base), bytes);
}

bool CudaDevice::map_memory(void* address, std::size_t bytes) {
  if (!state_->virtual_memory) return false;
  const DriverVm& vm = DriverVm::get();
  DeviceGuard guard(ordinal_);
  const auto start = std::chrono::steady_clock::now();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal_;
  CUmemGenericAllocationHandle handle{};
  const CUresult created = vm.create(&handle, bytes, &prop, 0);
  if (created != CUDA_SUCCESS) {
    driver_time_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    if (created == CUDA_ERROR_OUT_OF_MEMORY) return false;  // an answer, as cudaMalloc's
    throw Error("cuMemCreate(" + format_bytes(bytes) + ") failed on cuda:" + std::to_string(ordinal_) +
                " with CUresult " + std::to_string(static_cast<int>(created)));
  }
  const auto ptr = reinterpret_cast<CUdeviceptr>(address);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult mapped = vm.map(ptr, bytes, 0, handle, 0);
  if (mapped == CUDA_SUCCESS) {
    mapped = vm.set_access(ptr, bytes, &access, 1);
    if (mapped != CUDA_SUCCESS) (void)vm.unmap(ptr, bytes);
  }
  driver_time_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  if (mapped != CUDA_SUCCESS) {
    (void)vm.release(handle);
    throw Error("cuMemMap/cuMemSetAccess of " + format_bytes(bytes) + " at " +
                format_address(reinterpret_cast<std::uintptr_t>(address)) + " failed on cuda:" +
                std::to_string(ordinal_) + " with CUresult " + std::to_string(static_cast<int>(mapped)));
  }
  std::lock_guard lock(state_->mutex);
  state_->mappings.emplace(reinterpret_cast<std::uintptr_t>(address), handle);
  return true;
}

void CudaDevice::unmap_memory(void* address, std::size_t bytes) noexcept {
  CUmemGenericAllocationHandle handle{};
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->mappings.find(reinterpret_cast<std::uintptr_t>(address));
    if (it == state_->mappings.end()) return;
    handle = it->second;
    state_->mappings.erase(it);
  }
  const DriverVm& vm = DriverVm::get();
  DeviceGuard guard(ordinal_);
  const auto start = std::chrono::steady_clock::now();
  // cuMemUnmap does not wait for work still using the pages (PyTorch synchronizes the
  // segment's stream first); the allocator only unmaps free pages, so wait for the device.
  (void)cudaDeviceSynchronize();
  (void)vm.unmap(reinterpret_cast<CUdeviceptr>(address), bytes);
  (void)vm.release(handle);
  driver_time_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  (void)cudaGetLastError();
}

DeviceMemInfo CudaDevice::mem_get_info() const {
  DeviceGuard guard(ordinal_);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) {
    throw_cuda("cudaMemGetInfo", err, ordinal_);
  }
  return {free_bytes, total_bytes};
}

std::size_t CudaDevice::process_used_bytes() const {
  std::size_t used = 0;
  if (nvml_process_used(state_->nvml_device, used)) return used;
  const DeviceMemInfo m = mem_get_info();
  return m.total_bytes - m.free_bytes;
}

StreamId CudaDevice::create_stream() {
  DeviceGuard guard(ordinal_);
  cudaStream_t stream = nullptr;
  // Non-blocking like PyTorch's pool streams: no implicit sync with the legacy stream 0.
  if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    throw_cuda("cudaStreamCreateWithFlags", err, ordinal_);
  }
  std::lock_guard lock(state_->mutex);
  const StreamId id = state_->next_stream++;
  state_->streams.emplace(id, stream);
  return id;
}

StreamId CudaDevice::adopt_native_stream(std::uintptr_t handle) {
  if (handle == 0) return 0;
  std::lock_guard lock(state_->mutex);
  const StreamId id = state_->next_stream++;
  state_->streams.emplace(id, reinterpret_cast<cudaStream_t>(handle));
  state_->adopted.insert(id);
  return id;
}

bool CudaDevice::has_stream(StreamId stream) const {
  std::lock_guard lock(state_->mutex);
  return stream == 0 || state_->streams.contains(stream);
}

void CudaDevice::destroy_stream(StreamId stream) noexcept {
  cudaStream_t handle = nullptr;
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->streams.find(stream);
    if (it == state_->streams.end()) return;
    handle = it->second;
    state_->streams.erase(it);
    if (state_->adopted.erase(stream) != 0) return;  // its owner destroys it
  }
  DeviceGuard guard(ordinal_);
  (void)cudaStreamDestroy(handle);
  (void)cudaGetLastError();
}

EventId CudaDevice::create_event() {
  DeviceGuard guard(ordinal_);
  cudaEvent_t event = nullptr;
  // Timing disabled: such events are cheaper to record and query, and we only order work.
  if (cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      err != cudaSuccess) {
    throw_cuda("cudaEventCreateWithFlags", err, ordinal_);
  }
  std::lock_guard lock(state_->mutex);
  const EventId id = state_->next_event++;
  state_->events.emplace(id, event);
  return id;
}

void CudaDevice::destroy_event(EventId event) noexcept {
  cudaEvent_t handle = nullptr;
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->events.find(event);
    if (it == state_->events.end()) return;
    handle = it->second;
    state_->events.erase(it);
  }
  DeviceGuard guard(ordinal_);
  (void)cudaEventDestroy(handle);
  (void)cudaGetLastError();
}

void CudaDevice::record_event(EventId event, StreamId stream) {
  cudaEvent_t ev = nullptr;
  cudaStream_t st = nullptr;  // StreamId 0: the legacy default stream
  {
    std::lock_guard lock(state_->mutex);
    auto e = state_->events.find(event);
    if (e == state_->events.end()) {
      throw Error("CudaDevice::record_event: event " + std::to_string(event) +
                  " was not created by this device or was destroyed");
    }
    ev = e->second;
    if (stream != 0) {
      auto s = state_->streams.find(stream);
      if (s == state_->streams.end()) {
        throw Error("CudaDevice::record_event: stream " + std::to_string(stream) +
                    " was not created by this device or was destroyed (0 is the default stream)");
      }
      st = s->second;
    }
  }
  DeviceGuard guard(ordinal_);
  if (cudaError_t err = cudaEventRecord(ev, st); err != cudaSuccess) {
    throw_cuda("cudaEventRecord", err, ordinal_);
  }
}

bool CudaDevice::query_event(EventId event) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard lock(state_->mutex);
    auto e = state_->events.find(event);
    if (e == state_->events.end()) {
      throw Error("CudaDevice::query_event: event " + std::to_string(event) +
                  " was not created by this device or was destroyed");
    }
    ev = e->second;
  }
  DeviceGuard guard(ordinal_);
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error
    return false;
  }
  throw_cuda("cudaEventQuery", err, ordinal_);
}

void CudaDevice::synchronize_event(EventId event) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard lock(state_->mutex);
    auto e = state_->events.find(event);
    if (e == state_->events.end()) {
      throw Error("CudaDevice::synchronize_event: event " + std::to_string(event) +
                  " was not created by this device or was destroyed");
    }
    ev = e->second;
  }
  DeviceGuard guard(ordinal_);
  if (cudaError_t err = cudaEventSynchronize(ev); err != cudaSuccess) {
    throw_cuda("cudaEventSynchronize", err, ordinal_);
  }
}

void CudaDevice::synchronize() {
  DeviceGuard guard(ordinal_);
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    throw_cuda("cudaDeviceSynchronize", err, ordinal_);
  }
}

double CudaDevice::driver_time_us() const {
  return static_cast<double>(driver_time_ns_.load(std::memory_order_relaxed)) / 1000.0;
}

}  // namespace mem
