// runtime.hpp — the execution context of the autograd runtime: which allocator
// tensors live in, compute or dry run, the dropout RNG, FLOP counters and the
// mixed-precision (autocast) state.
//
//   auto device = mem::make_device("sim:a100-80g");        // dry run: addresses only
//   mem::CachingAllocator alloc{device};
//   mem::nn::Runtime rt{alloc, mem::nn::ExecMode::DryRun};
//   auto x = mem::nn::empty(rt, {256, 3, 224, 224}, mem::nn::DType::F32);  // 147 MiB block
//
// Compute mode needs host memory behind the device ("sim:a100-80g,backing=host").
// Both modes run the same code and perform the same allocations and frees in the
// same order; only the arithmetic is skipped in a dry run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/dtype.hpp"
#include "vramscope/runtime/stack.hpp"

namespace mem::nn {

class Tensor;
namespace detail {
struct TensorImpl;
}

/// Whether ops do arithmetic.
enum class ExecMode : std::uint8_t {
  Compute,  ///< real CPU arithmetic on host-backed device memory
  DryRun,   ///< every allocation and free, no arithmetic, no host memory
};
/// "compute", "dry-run".
std::string_view exec_mode_name(ExecMode mode) noexcept;
/// Accepts "compute", "dry-run", "dryrun", "dry". Throws mem::Error otherwise.
ExecMode parse_exec_mode(std::string_view name);

/// Floating-point operations by phase of a training step (multiply-add = 2).
struct FlopCounts {
  double forward = 0;    ///< first forward, including the loss
  double recompute = 0;  ///< forwards rerun by checkpointing
  double backward = 0;
  double optimizer = 0;
  double total() const noexcept { return forward + recompute + backward + optimizer; }
};

/// State of the counter-based dropout RNG (like CUDA's Philox seed and offset):
/// draw i of a call is a pure function of (seed, offset + i), so restoring the
/// state replays identical masks.
struct RngState {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  bool operator==(const RngState&) const = default;
};

/// One rank's place in context parallel's ring and the options of PyTorch's ring attention
/// (torch/distributed/tensor/experimental/_context_parallel/_attention.py, _cp_options):
/// the sequence split in 2 x world chunks, rank r holding chunks r and 2 x world - 1 - r when
/// load_balance (the head-tail balancer, context_parallel()'s default for causal attention),
/// and K and V exchanged by one all-gather (the default rotate method) or by an all-to-all each
/// step (set_rotate_method("alltoall")).
struct ContextParallel {
  std::size_t world = 1;
  std::size_t rank = 0;
  bool load_balance = true;
  bool all_to_all = false;
};

/// The context every tensor belongs to. Single-threaded: use one per thread.
/// Must outlive every tensor created in it.
class Runtime {
 public:
  /// `allocator` must outlive the runtime. Throws mem::Error for compute mode
  /// on a simulated device without host backing.
  Runtime(CachingAllocator& allocator, ExecMode mode, std::uint64_t seed = 0);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  CachingAllocator& allocator() const noexcept { return *allocator_; }
  ExecMode mode() const noexcept { return mode_; }
  /// True in compute mode: ops must do their arithmetic.
  bool computing() const noexcept { return mode_ == ExecMode::Compute; }
  /// The current stream: where new blocks are allocated (the caching allocator keeps a pool
  /// per stream; a block freed there is reused only by allocations on that stream).
  StreamId stream() const noexcept { return stream_; }
  void set_stream(StreamId stream) noexcept { stream_ = stream; }

  // --- dropout RNG -----------------------------------------------------------
  RngState rng_state() const noexcept { return rng_; }
  void set_rng_state(RngState state) noexcept { rng_ = state; }
  /// Reserves `count` draws and returns the state they start from. Advances in
  /// both modes so that compute and dry run stay in step.
  RngState take_rng(std::uint64_t count) noexcept {
    const RngState start = rng_;
    rng_.offset += count;
    return start;
  }
  /// Seed for parameter initialisation (separate stream from dropout).
  std::uint64_t init_seed() const noexcept { return init_seed_; }
  std::uint64_t next_init_stream() noexcept { return init_counter_++; }

  // --- FLOPs -------------------------------------------------------------------
  /// Adds FLOPs to the current phase (see current_phase()).
  void add_flops(double flops) noexcept;
  const FlopCounts& flops() const noexcept { return flops_; }
  void reset_flops() noexcept { flops_ = {}; }
  /// While set, each first-forward FLOP is also added to `(*by_context)[current_context()]`
  /// (grown as needed): what each module's forward costs, for `vramscope plan`. Null: off.
  void set_forward_flops_by_context(std::vector<double>* by_context) noexcept { flops_by_context_ = by_context; }
  /// Called for each operator of an operator-level model a first forward runs where a
  /// selective policy would see it (its name, inputs, outputs, whether it writes an input in
  /// place, its FLOPs), in the current context: what keeping each call costs and saves, and
  /// which outputs are changed in place later (keeping them fails), for `plan`.
  using OpObserver = std::function<void(std::string_view op, const std::vector<Tensor>& inputs,
                                        const std::vector<Tensor>& outputs, bool inplace, double flops)>;
  void set_op_observer(const OpObserver* observer) noexcept { op_observer_ = observer; }
  const OpObserver* op_observer() const noexcept { return op_observer_; }

  // --- mixed precision -------------------------------------------------------------
  /// While set, matrix products and convolutions run in this half type (autocast).
  std::optional<DType> autocast() const noexcept { return autocast_; }
  void set_autocast(std::optional<DType> dtype) noexcept { autocast_ = dtype; }
  /// The half copy of a leaf parameter, made once per autocast region as PyTorch's
  /// cast cache does (it lives until clear_autocast_cache() or the last user).
  Tensor cached_cast(const Tensor& param, DType dtype);
  /// Called when the autocast region ends (after forward and loss).
  void clear_autocast_cache() noexcept;

  // --- context parallel --------------------------------------------------------------
  /// While set, F.scaled_dot_product_attention runs as context parallel's ring attention,
  /// as inside torch.distributed.tensor.experimental.context_parallel().
  const std::optional<ContextParallel>& context_parallel() const noexcept { return context_parallel_; }
  void set_context_parallel(std::optional<ContextParallel> ring) noexcept { context_parallel_ = ring; }
  /// Bytes the collectives that ops run themselves (the ring's, a recording's all-to-alls)
  /// sent from this rank so far (the step's communication volume).
  void count_collective_sent(double bytes) noexcept { collective_sent_ += bytes; }
  double collective_sent() const noexcept { return collective_sent_; }

  // --- collectives in a recording ------------------------------------------------------
  /// One collective an operator of a recorded graph ran (expert parallel's all-to-alls): the
  /// operator, the bytes of the output it made (what it received), and in which pass.
  struct Collective {
    std::string op;
    std::size_t bytes = 0;
    bool backward = false;
  };
  void log_collective(Collective c) { collectives_.push_back(std::move(c)); }
  const std::vector<Collective>& collectives() const noexcept { return collectives_; }
  /// The ranks of the group the recording's collectives run in (expert parallel's N): an
  /// all-to-all sends (N - 1) / N of its input to the others (even routing); 1: all of it.
  void set_collective_ranks(std::size_t ranks) noexcept { collective_ranks_ = ranks < 1 ? 1 : ranks; }
  std::size_t collective_ranks() const noexcept { return collective_ranks_; }

  // --- cuBLAS workspaces -------------------------------------------------------------
  /// Called by every matrix product after its output is made, before its kernel. PyTorch
  /// 2.11 gives each thread's cuBLAS handle a workspace from the caching allocator at its
  /// first product and keeps it for the life of the process: one for the Python thread
  /// (forward, optimizer) and one for the autograd engine's thread (backward, and the reruns
  /// of checkpointing). 2.15 allocates one per product and frees it when the product returns
  /// (Stack::cublas_workspace_per_operation). `lt`: the product goes through cublasLt (addmm
  /// with a bias), which has its own.
  void gemm_workspace(bool lt);
  /// Bytes the workspaces hold so far (they stay allocated until the runtime ends).
  std::size_t gemm_workspace_bytes() const noexcept;
  /// torch._C._cuda_clearCublasWorkspaces(): every workspace goes (its block is freed); the
  /// next product allocates one again, on the stream current then.
  void clear_gemm_workspaces() noexcept;

  // --- libraries --------------------------------------------------------------------
  /// Called by every op that runs cuDNN's kernels (convolution, batch norm, fused
  /// attention): the first loads them on the device (DeviceInfo::cudnn_bytes). The first
  /// matrix product loads cuBLAS's the same way (gemm_workspace).
  void uses_cudnn();

  // --- pinned host memory -------------------------------------------------------------
  /// Pinned host memory as PyTorch's CachingHostAllocator keeps it (what save_on_cpu copies
  /// saved tensors into): a request takes a cached block of its size rounded up to a power of
  /// two, or pins a new one; a freed block stays cached for the next request of its size
  /// (aten/src/ATen/core/CachingHostAllocator.h: c10::llvm::PowerOf2Ceil, free lists by size).
  /// Returns the block's size.
  std::size_t pin_host(std::size_t bytes);
  void unpin_host(std::size_t block) noexcept;
  /// Bytes of every block pinned so far, in use or cached: what the process holds on the host.
  std::size_t pinned_host_bytes() const noexcept { return pinned_total_; }

  // --- the modelled stack -------------------------------------------------------------
  /// Which PyTorch, transformers and PEFT the ops and modules behave as (stack.hpp).
  const Stack& stack() const noexcept { return stack_; }
  void set_stack(const Stack& stack) noexcept { stack_ = stack; }

  // --- hooks ----------------------------------------------------------------------
  /// Runs after a leaf's AccumulateGrad, once its .grad is set (PyTorch's post hooks on
  /// the grad accumulator, where DDP's Reducer copies the gradient into its bucket).
  using GradReadyHook = std::function<void(detail::TensorImpl& leaf)>;
  void set_grad_ready_hook(GradReadyHook hook) { grad_ready_hook_ = std::move(hook); }
  const GradReadyHook& grad_ready_hook() const noexcept { return grad_ready_hook_; }
  /// Runs inside AccumulateGrad once a leaf's .grad is set, the incoming gradient already
  /// dropped (Tensor.register_post_accumulate_grad_hook, where DeepSpeed's ZeRO takes each
  /// gradient: replacing the .grad frees it then).
  void set_post_accumulate_grad_hook(GradReadyHook hook) { post_accumulate_grad_hook_ = std::move(hook); }
  const GradReadyHook& post_accumulate_grad_hook() const noexcept { return post_accumulate_grad_hook_; }

  /// deepspeed.zero.Init's memory-efficient linear (zero/linear.py): F.linear becomes
  /// LinearFunctionForZeroStage3, whose backward hands out the input's, the weight's and then
  /// the bias's gradient (addmm's hands the bias's first), the order ZeRO-3's bucket sees them.
  void set_zero3_linear(bool on) noexcept { zero3_linear_ = on; }
  bool zero3_linear() const noexcept { return zero3_linear_; }

  /// Variable._execution_engine.queue_callback: runs once when the current backward's graph
  /// is done, before backward() returns (and frees its implicit seed gradient).
  void queue_backward_callback(std::function<void()> callback) { backward_callbacks_.push_back(std::move(callback)); }
  /// Runs and clears the queued callbacks, in order (called by the engine).
  void run_backward_callbacks();
  void clear_backward_callbacks() noexcept { backward_callbacks_.clear(); }

  // --- warnings -------------------------------------------------------------------
  /// Records a warning once per distinct text (PyTorch's warnings.warn behaviour).
  void warn(std::string message);
  const std::vector<std::string>& warnings() const noexcept { return warnings_; }
  void clear_warnings() noexcept { warnings_.clear(); }

 private:
  CachingAllocator* allocator_;
  ExecMode mode_;
  StreamId stream_ = 0;
  RngState rng_;
  std::uint64_t init_seed_;
  std::uint64_t init_counter_ = 0;
  FlopCounts flops_;
  std::vector<double>* flops_by_context_ = nullptr;
  const OpObserver* op_observer_ = nullptr;
  std::optional<DType> autocast_;
  std::optional<ContextParallel> context_parallel_;
  double collective_sent_ = 0;
  std::vector<Collective> collectives_;
  std::size_t collective_ranks_ = 1;
  std::vector<std::pair<const detail::TensorImpl*, std::shared_ptr<detail::TensorImpl>>> cast_cache_;
  std::vector<std::string> warnings_;
  GradReadyHook grad_ready_hook_;
  GradReadyHook post_accumulate_grad_hook_;
  std::vector<std::function<void()>> backward_callbacks_;
  Stack stack_;
  std::unordered_map<std::size_t, std::size_t> pinned_free_;  ///< cached blocks by size
  std::size_t pinned_total_ = 0;
  bool cublas_loaded_ = false, cudnn_loaded_ = false;
  bool zero3_linear_ = false;
  std::shared_ptr<detail::TensorImpl> blas_workspace_[2], lt_workspace_[2];  // [forward, backward thread]
};

/// `with torch.cuda.stream(s)`: allocations in the scope go to stream `stream`.
class StreamGuard {
 public:
  StreamGuard(Runtime& runtime, StreamId stream) noexcept : runtime_(runtime), previous_(runtime.stream()) {
    runtime.set_stream(stream);
  }
  ~StreamGuard() { runtime_.set_stream(previous_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Runtime& runtime_;
  StreamId previous_;
};

/// Bytes of PyTorch's default cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG unset) on a GPU of
/// this compute capability: 4096 KiB x 8 on Hopper and Blackwell, else 4096 KiB x 2 + 16 KiB x 8.
std::size_t cublas_workspace_bytes(int compute_capability) noexcept;
/// Bytes of PyTorch's default cublasLt workspace (CUBLASLT_WORKSPACE_SIZE unset): 1 MiB.
std::size_t cublaslt_workspace_bytes() noexcept;

/// An autocast region (`with torch.autocast(...)`): sets the half type and, on
/// exit by return or by exception, clears the cast cache and restores the
/// previous setting, so an out-of-memory error leaves no cast copies behind.
class AutocastRegion {
 public:
  AutocastRegion(Runtime& runtime, std::optional<DType> dtype) noexcept
      : runtime_(runtime), previous_(runtime.autocast()) {
    runtime_.set_autocast(dtype);
  }
  ~AutocastRegion() {
    runtime_.clear_autocast_cache();
    runtime_.set_autocast(previous_);
  }
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  Runtime& runtime_;
  std::optional<DType> previous_;
};

// --- per-thread execution state ------------------------------------------------------

/// Phase of the current thread (Forward by default); drives FLOP accounting and the
/// phase of module scopes.
Phase current_phase() noexcept;
/// Sets the phase for a scope; restores the previous one on destruction.
class PhaseGuard {
 public:
  explicit PhaseGuard(Phase phase) noexcept;
  ~PhaseGuard();
  PhaseGuard(const PhaseGuard&) = delete;
  PhaseGuard& operator=(const PhaseGuard&) = delete;

 private:
  Phase previous_;
};

/// True while checkpointing reruns a forward (BatchNorm then updates its running statistics a
/// second time, as PyTorch's recompute does, and says so through Runtime::warn).
bool recomputing() noexcept;

}  // namespace mem::nn
