// runtime.cpp — the execution context: mode, RNG, FLOP counters, autocast cache,
// warnings, and the per-thread phase.
#include "vramscope/runtime/runtime.hpp"

#include <algorithm>

#include "engine/detail.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/runtime/ops.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {
namespace {
thread_local Phase tls_phase = Phase::Forward;
}  // namespace

std::string_view exec_mode_name(ExecMode mode) noexcept {
  return mode == ExecMode::Compute ? "compute" : "dry-run";
}

ExecMode parse_exec_mode(std::string_view name) {
  if (name == "compute") return ExecMode::Compute;
  if (name == "dry-run" || name == "dryrun" || name == "dry") return ExecMode::DryRun;
  throw Error("unknown execution mode '" + std::string(name) + "'; expected compute or dry-run");
}

Runtime::Runtime(CachingAllocator& allocator, ExecMode mode, std::uint64_t seed)
    : allocator_(&allocator), mode_(mode), rng_{seed, 0}, init_seed_(seed * 0x9e3779b97f4a7c15ull + 17) {
  if (mode == ExecMode::Compute) {
    // Compute mode writes through device pointers: they must be host memory.
    const auto* sim = dynamic_cast<const SimDevice*>(&allocator.device());
    if (sim == nullptr || sim->config().backing != SimBacking::Host) {
      throw Error("compute mode needs host memory behind the device, but '" +
                  allocator.device().info().name +
                  "' has none; use a simulated device with backing=host "
                  "(e.g. sim:a100-80g,backing=host) or the dry-run mode");
    }
  }
}

Runtime::~Runtime() { clear_autocast_cache(); }  // the workspaces go with the members

std::size_t cublas_workspace_bytes(int compute_capability) noexcept {
  // PyTorch 2.x, CublasHandlePool.cpp: a larger default on sm90 / sm100 (measured on an
  // H100 with PyTorch 2.11: 33,554,432 B per handle).
  if (compute_capability == 90 || compute_capability == 100) return std::size_t{4096} * 1024 * 8;
  return std::size_t{4096} * 1024 * 2 + std::size_t{16} * 1024 * 8;
}

std::size_t cublaslt_workspace_bytes() noexcept { return std::size_t{1} << 20; }

std::size_t Runtime::gemm_workspace_bytes() const noexcept {
  std::size_t total = 0;
  for (const auto* slots : {&blas_workspace_, &lt_workspace_}) {
    for (const auto& slot : *slots) total += slot ? Tensor(slot).nbytes() : 0;
  }
  return total;
}

void Runtime::clear_gemm_workspaces() noexcept {
  for (auto* slots : {&blas_workspace_, &lt_workspace_}) {
    for (auto& slot : *slots) slot.reset();
  }
}

void Runtime::uses_cudnn() {
  if (cudnn_loaded_) return;
  allocator_->load_module("cuDNN's kernels", allocator_->device().info().cudnn_bytes);
  cudnn_loaded_ = true;
}

void Runtime::gemm_workspace(bool lt) {
  if (!cublas_loaded_) {
    allocator_->load_module("cuBLAS's kernels", allocator_->device().info().cublas_bytes);
    cublas_loaded_ = true;
  }
  if (stack_.cublas_workspace_per_operation()) {
    // The product's own workspace: made after its output, gone when it returns (a cublasLt
    // product takes cublasLt's alone; its handle keeps cuBLAS's default workspace, not ours).
    const ContextInfo& here = context_info(current_context());
    const char* which = lt ? "cublasLt workspace" : "cuBLAS workspace";
    ModuleScope scope(intern_context(here.path.empty() ? std::string("(") + which + ")" : here.path + " (" + which + ")",
                                     here.phase));
    const std::size_t bytes =
        lt ? cublaslt_workspace_bytes() : cublas_workspace_bytes(allocator_->device().info().compute_capability);
    (void)empty(*this, Shape{static_cast<std::int64_t>(bytes)}, DType::U8);
    return;
  }
  const int thread = tls_phase == Phase::Backward || tls_phase == Phase::Recompute ? 1 : 0;
  // Named after the module whose product took it first, and counted as a workspace.
  auto reserve = [&](std::shared_ptr<detail::TensorImpl>& slot, std::size_t bytes, const char* which) {
    if (slot != nullptr) return;
    const ContextInfo& here = context_info(current_context());
    ModuleScope scope(intern_context(here.path.empty() ? std::string("(") + which + ")"
                                                       : here.path + " (" + which + ")",
                                     here.phase));
    slot = empty(*this, Shape{static_cast<std::int64_t>(bytes)}, DType::U8).impl_ptr();
  };
  // getCUDABlasLtWorkspace() asks for the handle (and its workspace) first.
  reserve(blas_workspace_[thread], cublas_workspace_bytes(allocator_->device().info().compute_capability),
          "cuBLAS workspace");
  if (lt) reserve(lt_workspace_[thread], cublaslt_workspace_bytes(), "cublasLt workspace");
}

void Runtime::add_flops(double flops) noexcept {
  switch (tls_phase) {
    case Phase::Recompute: flops_.recompute += flops; break;
    case Phase::Backward: flops_.backward += flops; break;
    case Phase::Optimizer: flops_.optimizer += flops; break;
    default:
      flops_.forward += flops;
      if (flops_by_context_ != nullptr) {
        const ContextId context = current_context();
        if (context >= flops_by_context_->size()) flops_by_context_->resize(context + 1, 0.0);
        (*flops_by_context_)[context] += flops;
      }
      break;
  }
}

Tensor Runtime::cached_cast(const Tensor& param, DType dtype) {
  for (const auto& [key, value] : cast_cache_) {
    if (key == param.impl() && value->dtype == dtype) return Tensor(value);
  }
  Tensor cast = to_dtype(param, dtype);
  cast_cache_.emplace_back(param.impl(), cast.impl_ptr());
  return cast;
}

void Runtime::clear_autocast_cache() noexcept { cast_cache_.clear(); }

void Runtime::run_backward_callbacks() {
  // A callback may queue another (PyTorch runs those too, in order).
  for (std::size_t i = 0; i < backward_callbacks_.size(); ++i) {
    auto callback = std::move(backward_callbacks_[i]);
    callback();
  }
  backward_callbacks_.clear();
}

void Runtime::warn(std::string message) {
  if (std::find(warnings_.begin(), warnings_.end(), message) == warnings_.end()) {
    warnings_.push_back(std::move(message));
  }
}

Phase current_phase() noexcept { return tls_phase; }
PhaseGuard::PhaseGuard(Phase phase) noexcept : previous_(tls_phase) { tls_phase = phase; }
PhaseGuard::~PhaseGuard() { tls_phase = previous_; }
bool recomputing() noexcept { return tls_phase == Phase::Recompute; }

std::size_t Runtime::pin_host(std::size_t bytes) {
  std::size_t block = 1;
  while (block < bytes) block <<= 1;  // PowerOf2Ceil
  if (auto it = pinned_free_.find(block); it != pinned_free_.end() && it->second > 0) {
    --it->second;
  } else {
    pinned_total_ += block;
  }
  return block;
}

void Runtime::unpin_host(std::size_t block) noexcept {
  try {
    ++pinned_free_[block];
  } catch (...) {
    // The map could not grow: the block stays counted as pinned, never reused.
  }
}

namespace detail {
OutputCache*& output_cache_slot() noexcept {
  thread_local OutputCache* slot = nullptr;
  return slot;
}
}  // namespace detail

}  // namespace mem::nn
