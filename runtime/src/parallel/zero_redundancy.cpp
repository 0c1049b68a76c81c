// zero_redundancy.cpp — what DeepSpeed's ZeRO stage 1 and 2 allocate on each rank, in
// DeepSpeed's order (@edaa7221; line numbers are deepspeed/runtime/zero/stage_1_and_2.py's
// unless a file is named). With overlap_comm off (the default for stages 1 and 2) every
// buffer is on the current stream; the collectives move no memory through the allocator.
#include "parallel/zero_redundancy.hpp"

#include <algorithm>
#include <functional>
#include <unordered_set>

#include "engine/detail.hpp"
#include "parallel/nccl_memory.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::nn::detail {
namespace {

std::int64_t div_up(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// Per rank, the gradient elements ZeRO keeps: Σ numel of the parameters its partition
/// touches, and its padding.
std::vector<std::int64_t> kept_per_rank(const std::vector<std::int64_t>& numels, std::int64_t world) {
  std::int64_t total = 0;
  for (std::int64_t n : numels) total += n;
  const std::int64_t partition = div_up(total, 2 * world) * 2;
  std::vector<std::int64_t> kept(static_cast<std::size_t>(world), 0);
  std::int64_t offset = 0;
  for (std::int64_t n : numels) {
    if (n > 0) {
      for (std::int64_t r = offset / partition; r <= (offset + n - 1) / partition && r < world; ++r) {
        kept[static_cast<std::size_t>(r)] += n;
      }
    }
    offset += n;
  }
  for (std::int64_t r = 0; r < world; ++r) {
    kept[static_cast<std::size_t>(r)] +=
        std::clamp<std::int64_t>((r + 1) * partition - std::max(total, r * partition), 0, partition);
  }
  return kept;
}

}  // namespace

}  // namespace mem::nn::detail

namespace mem::nn {

std::size_t zero_heaviest_rank(const Module& root, std::size_t world_size) {
  std::vector<std::int64_t> numels;
  std::unordered_set<const detail::TensorImpl*> seen;
  const std::function<void(const Module&)> walk = [&](const Module& m) {
    for (const ParamSlot& slot : m.slots()) {
      if (slot.is_buffer || slot.frozen) continue;
      if (slot.tensor.defined() && !seen.insert(slot.tensor.impl()).second) continue;  // tied: once
      numels.push_back(slot.shape.numel());
    }
    for (const auto& [name, child] : m.children()) walk(*child);
  };
  walk(root);
  if (numels.empty() || world_size == 0) return 0;
  const auto kept = detail::kept_per_rank(numels, static_cast<std::int64_t>(world_size));
  return static_cast<std::size_t>(std::max_element(kept.begin(), kept.end()) - kept.begin());
}

}  // namespace mem::nn

namespace mem::nn::detail {

ZeroRedundancy::ZeroRedundancy(const ParallelConfig& config, const OptimizerConfig& optimizer, Module& root,
                               Runtime& runtime)
    : config_(config),
      optimizer_(optimizer),
      runtime_(runtime),
      comm_context_(intern_context("DeepSpeed gradient bucket", Phase::Backward)),
      weights_context_(intern_context("ZeRO flat parameters", Phase::None)),
      optimizer_context_(intern_context("ZeRO optimizer", Phase::Optimizer)),
      gradients_context_(intern_context("ZeRO gradients.grad", Phase::Backward)),
      other_context_(intern_context("engine", Phase::Backward)),
      offload_context_(intern_context("DeepSpeed offload_optimizer", Phase::Backward)) {
  check_zero_setup("zero", config, optimizer, runtime);
  // The optimizer's one parameter group: the trainable parameters, each once (the trainable
  // filter of __init__).
  std::unordered_set<const TensorImpl*> seen;
  for (const Tensor& t : root.trainable_parameters()) {
    if (!seen.insert(t.impl()).second) continue;
    Param p;
    p.tensor = t;
    p.numel = t.numel();
    params_.push_back(std::move(p));
  }
  if (params_.empty()) throw Error("zero has nothing to partition: every parameter is frozen");
  dtype_ = params_.front().tensor.dtype();
  for (const Param& p : params_) {
    if (p.tensor.dtype() != dtype_) {
      throw Error("zero flattens one dtype per parameter group; this model's trainable parameters are " +
                  std::string(dtype_name(dtype_)) + " and " + std::string(dtype_name(p.tensor.dtype())));
    }
  }
  const auto world = static_cast<std::int64_t>(config.world_size);
  const auto rank = static_cast<std::int64_t>(config.rank);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i].offset = total;
    total += params_[i].numel;
    index_[params_[i].tensor.impl()] = i;
  }
  // The whole group aligned to 2 x N elements (nccl_start_alignment_factor 2, 347 and 392):
  // N equal partitions, views of the flat buffer (1966-1984).
  padded_ = div_up(total, 2 * world) * 2 * world;
  partition_ = padded_ / world;
  const std::int64_t lo = rank * partition_, hi = lo + partition_;
  padding_ = std::clamp<std::int64_t>(hi - std::max(total, lo), 0, partition_);  // groups_padding: the last ranks
  for (Param& p : params_) {
    // params_in_partition: every parameter the partition touches, whole (get_partition_info).
    p.partition_slice = std::max<std::int64_t>(0, std::min(hi, p.offset + p.numel) - std::max(lo, p.offset));
    p.in_partition = p.partition_slice > 0;
    if (p.in_partition) {
      p.gradient_offset = gradients_in_partition_;
      gradients_in_partition_ += p.numel;
    }
  }
  reduce_bucket_size_ = static_cast<std::size_t>(config.reduce_bucket_size);

  // deepspeed.initialize broadcasts every parameter from rank 0 (engine.py:1870): NCCL connects.
  first_collective(runtime, config);
  ModuleScope scope(optimizer_context_);
  std::size_t entry = 0;
  if (optimizer.kind == OptimizerKind::Adam && !offload()) {
    // FusedAdam's _dummy_overflow_buf = IntTensor([0]) on the device (ops/adam/fused_adam.py:96).
    overflow_flag_ = make("FusedAdam overflow flag", 4, DType::U8, optimizer_context_, entry);
  }
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(dtype_));
  const std::size_t flat_bytes = static_cast<std::size_t>(padded_ * elem);
  // Flattened on the GPU when the device has the room (396-402), else through the host:
  // each parameter moves to the CPU behind a 1-element placeholder, then the flat buffer
  // comes back in one copy.
  const bool on_device = runtime.allocator().device().mem_get_info().free_bytes >= flat_bytes;
  std::vector<Tensor> placeholders;
  if (!on_device) {
    for (Param& p : params_) {
      Tensor one = empty(runtime, Shape{1}, DType::F32);
      p.tensor.impl()->storage = one.storage();  // param.data = torch.empty(1): the original is freed
      placeholders.push_back(std::move(one));
    }
  }
  Tensor pad;
  std::size_t pad_log = SIZE_MAX;
  if (on_device && padded_ > total) pad = make("flat padding", padded_ - total, dtype_, weights_context_, pad_log);
  flat_ = make("bit16 flat parameters (bit16_groups_flat)", padded_, dtype_, weights_context_, entry);
  if (pad.defined()) release(pad, pad_log);
  // _update_model_bit16_weights: each parameter becomes a view of the flat buffer, its own
  // storage (or placeholder) freed in turn.
  for (Param& p : params_) {
    TensorImpl* impl = p.tensor.impl();
    impl->storage = flat_.storage();
    impl->offset = p.offset;
  }
  placeholders.clear();
  // The fp32 master of this rank's partition: partition.clone() then .to(fp32) (492-493); with
  // offload_optimizer .to("cpu", fp32), pinned (492-497), and a bit16 host buffer for the copy
  // back (param_buffer_of_bit16_for_cpu_offload_groups, 498-507).
  if (offload()) {
    std::size_t clone_log = SIZE_MAX;
    Tensor clone = make("master weights' bit16 clone", partition_, dtype_, optimizer_context_, clone_log);
    master_ = host("fp32 master partition (host)", partition_, DType::F32, config.offload_pin_memory);
    release(clone, clone_log);
    host_bit16_ = host("bit16 partition buffer (host)", partition_, dtype_, config.offload_pin_memory);
    // 578-594: the largest parameter's elements (largest_param_numel), once on the host (read by
    // nothing after __init__) and once on the GPU, where gradient accumulation stages them.
    std::int64_t largest = 0;
    for (const Param& p : params_) largest = std::max(largest, p.numel);
    host_temp_ = host("temp_grad_buffer_for_cpu_offload (host)", largest, dtype_, config.offload_pin_memory);
    gpu_offload_buffer_ = make("temp_grad_buffer_for_gpu_offload", largest, dtype_, offload_context_, entry);
    // initialize_optimizer_states (837-855): the fp32 gradient of the master, kept on the host.
    host_grad_ = host("fp32 gradient partition (host)", partition_, DType::F32, config.offload_pin_memory);
    return;
  }
  {
    std::size_t clone_log = SIZE_MAX;
    Tensor clone = make("master weights' bit16 clone", partition_, dtype_, optimizer_context_, clone_log);
    if (dtype_ == DType::F32) {
      master_ = std::move(clone);  // .to(fp32) of an fp32 tensor is the tensor itself
      log_[clone_log].what = "fp32 master partition";
    } else {
      master_ = make("fp32 master partition", partition_, DType::F32, optimizer_context_, entry);
      release(clone, clone_log);
    }
  }
  // initialize_optimizer_states (837-856): a zero fp32 gradient, set and dropped at once.
  Tensor zeros = empty(runtime, Shape{partition_}, DType::F32);
}

Tensor ZeroRedundancy::host(const std::string& what, std::int64_t numel, DType dtype, bool pinned) {
  Tensor t = on_host_.make(numel, dtype, pinned);
  log_.push_back({what, t.nbytes(), "host", stage(), ""});
  return t;
}

void ZeroRedundancy::check_inf_or_nan(std::int64_t numel, bool logged) {
  // x.float() (x itself when fp32), isnan, isinf, logical_or, .float(), max (2486-2491); the
  // .float() copy goes with the expression, the locals when the function returns.
  const char* what = "inf/NaN check of the whole gradient";
  const auto part = [&](std::int64_t n, DType dtype, std::size_t& entry) {
    if (logged) return make(what, n, dtype, offload_context_, entry);
    return empty(runtime_, Shape{n}, dtype);
  };
  std::size_t log[6] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
  Tensor f = dtype_ == DType::F32 ? Tensor{} : part(numel, DType::F32, log[0]);
  Tensor nan = part(numel, DType::U8, log[1]);
  Tensor inf = part(numel, DType::U8, log[2]);
  Tensor either = part(numel, DType::U8, log[3]);
  Tensor g = part(numel, DType::F32, log[4]);
  Tensor m = logged ? make(what, 1, DType::F32, offload_context_, log[5]) : empty(runtime_, Shape{}, DType::F32);
  const std::pair<Tensor*, std::size_t> order[] = {{&g, log[4]},   {&f, log[0]},      {&nan, log[1]},
                                                   {&inf, log[2]}, {&either, log[3]}, {&m, log[5]}};
  for (const auto& [t, entry] : order) {
    if (t->defined()) release(*t, entry);
  }
}

void ZeroRedundancy::offload_gradient(Param& p) {
  // copy_grads_in_partition (1650-1668), at the accumulation boundary: the slice's norm in
  // fp64 (set_norm_for_param_grad_in_gpu, 1575-1588: the copy freed, the 0-dim norm kept until
  // the step's reset_cpu_buffers), the whole gradient checked for inf and NaN
  // (update_offload_overflow_tracker_for_param_grad), then the slice cast to fp32 and copied
  // into the host gradient (async_inplace_copy_grad_to_fp32_buffer_from_gpu, 1590-1605), the
  // parameter's gradient dropped. Each logged: DeepSpeed's own run on the CPU makes the same.
  std::size_t entry = SIZE_MAX, norm_entry = SIZE_MAX;
  Tensor fp64 = make("gradient slice in fp64 (for its norm)", p.partition_slice, DType::F64, offload_context_, entry);
  norms_.emplace_back(make("gradient norm (fp64, kept until the step)", 1, DType::F64, offload_context_, norm_entry),
                      norm_entry);
  release(fp64, entry);
  check_inf_or_nan(p.numel, true);
  if (dtype_ != DType::F32) {
    Tensor fp32 = make("fp32 copy of the gradient slice (to the host)", p.partition_slice, DType::F32,
                       offload_context_, entry);
    release(fp32, entry);
  }
  p.tensor.reset_grad();
}

std::string ZeroRedundancy::stage() const {
  if (steps_ == 0) return "construction";
  return "step " + std::to_string(steps_) + (in_backward_ ? " backward" : " optimizer");
}

Tensor ZeroRedundancy::make(const std::string& what, std::int64_t numel, DType dtype, ContextId context,
                            std::size_t& entry) {
  ModuleScope scope(context);
  Tensor t = empty(runtime_, Shape{numel}, dtype);
  entry = log_.size();
  log_.push_back({what, t.nbytes(), "default", stage(), ""});
  return t;
}

void ZeroRedundancy::release(Tensor& tensor, std::size_t entry) {
  tensor = Tensor{};
  if (entry < log_.size()) log_[entry].freed = stage();
}

void ZeroRedundancy::point_grad(Param& param, const Tensor& buffer, std::int64_t offset) {
  auto view = std::make_shared<TensorImpl>();
  view->storage = buffer.storage();
  view->shape = param.tensor.shape();
  view->strides = contiguous_strides(view->shape);
  view->offset = offset;
  view->dtype = buffer.dtype();
  param.tensor.impl()->grad = std::move(view);
}

std::size_t ZeroRedundancy::state_bytes() const noexcept {
  std::size_t n = master_.defined() ? master_.nbytes() : 0;
  for (const Tensor& m : moments_) n += m.nbytes();
  return n;
}

// --- backward -----------------------------------------------------------------------------

void ZeroRedundancy::pre_backward() {
  ++steps_;
  in_backward_ = true;
  // engine.backward: loss / gradient_accumulation_steps (engine.py:3238), then the loss
  // scaler's loss * scale (runtime/fp16/loss_scaler.py:155).
  ModuleScope scope(other_context_);
  loss_scalars_[0] = empty(runtime_, Shape{}, DType::F32);
  loss_scalars_[1] = empty(runtime_, Shape{}, DType::F32);
}

void ZeroRedundancy::grad_ready(TensorImpl& param) {
  const auto it = index_.find(&param);
  if (it == index_.end()) return;
  // setup_buckets (2493-2516): the gradient bucket, reduce_bucket_size elements of the
  // parameters' dtype, at the first gradient of each backward; a second with overlap_comm.
  if (!ipg_[0].defined()) {
    const bool overlap = config_.overlap_comm.value_or(false);
    for (int i = 0; i < (overlap ? 2 : 1); ++i) {
      ipg_[i] = make("gradient bucket (IPG buffer)", static_cast<std::int64_t>(reduce_bucket_size_), dtype_,
                     comm_context_, ipg_log_[i]);
    }
  }
  // Stage 1 reduces at the backward's end; stage 2 (and overlap_comm) in the hooks (1758-1763).
  if (stage2() || config_.overlap_comm.value_or(false)) process(it->second);
}

void ZeroRedundancy::process(std::size_t index) {
  // reduce_independent_p_g_buckets_and_remove_grads (1193-1253).
  Param& p = params_[index];
  if (!Tensor(p.tensor).grad().defined()) return;
  const auto limit = static_cast<std::int64_t>(reduce_bucket_size_);
  if (bucket_elements_ + p.numel > limit && (!bucket_.empty() || !large_.empty())) reduce_bucket();
  if (p.numel > limit) {
    large_.push_back(index);  // reduced from its own gradient at the next flush (1221-1227)
    return;
  }
  // Copied into the bucket; the gradient becomes its view and autograd's block is freed.
  point_grad(p, ipg_[0], bucket_elements_);
  bucket_elements_ += p.numel;
  bucket_.push_back(index);
}

void ZeroRedundancy::reduce_bucket() {
  // reduce_ipg_grads -> average_tensor: every slice of the bucket (a parameter's part in each
  // rank's partition) in one all-reduce of their torch.cat copy (allreduce_bucket, 1841); a
  // single slice is a view (flatten_dense_tensors), no copy.
  std::int64_t slices = 0;
  for (std::size_t i : bucket_) {
    const Param& p = params_[i];
    slices += div_up(p.offset + p.numel, partition_) - p.offset / partition_;
  }
  if (slices > 1) {
    std::size_t entry = 0;
    Tensor copy = make("bucket all-reduce copy (torch.cat of its slices)", bucket_elements_, dtype_, comm_context_, entry);
    release(copy, entry);
  }
  // copy_grads_in_partition (1650-1689): grads_in_partition, Σ numel of the parameters this
  // partition touches, at the first of them; the others' gradients are dropped.
  std::vector<std::size_t> all(bucket_);
  all.insert(all.end(), large_.begin(), large_.end());
  for (std::size_t i : all) {
    Param& p = params_[i];
    if (p.in_partition && offload()) {
      offload_gradient(p);  // no grads_in_partition on the GPU (1651-1668 return before it)
    } else if (p.in_partition) {
      if (!grads_in_partition_.defined()) {
        grads_in_partition_ =
            make("grads_in_partition", gradients_in_partition_, dtype_, gradients_context_, grads_log_);
      }
      point_grad(p, grads_in_partition_, p.gradient_offset);
    } else if (stage2()) {
      p.tensor.reset_grad();
    }
    // Stage 1 leaves the others' .grad a view of the bucket until the epilogue drops it.
  }
  bucket_.clear();
  large_.clear();
  bucket_elements_ = 0;
}

void ZeroRedundancy::finalize_backward() {
  // allreduce_gradients (engine.py:2903-2910). Stage 1: reduce_gradients walks the parameters
  // in order through the same buckets (861-882).
  if (!stage2() && !config_.overlap_comm.value_or(false)) {
    for (std::size_t i = 0; i < params_.size(); ++i) process(i);
  }
  // independent_gradient_partition_epilogue (919-968): the last bucket, then this rank's
  // gradients as a list of views (and zeros for its padding, 2184-2185), the bucket freed.
  if (!bucket_.empty() || !large_.empty()) reduce_bucket();
  if (padding_ > 0 && !offload()) {  // averaged_gradients are the GPU path's (935)
    padding_zeros_ = make("gradient padding zeros", padding_, dtype_, gradients_context_, padding_log_);
  }
  // _clear_param_grad_only: the buckets go with the .grads that view them (stage 1's).
  for (Param& p : params_) p.tensor.reset_grad();
  for (int i = 0; i < 2; ++i) {
    if (ipg_[i].defined()) release(ipg_[i], ipg_log_[i]);
    ipg_log_[i] = SIZE_MAX;
  }
  loss_scalars_[1] = Tensor{};
  loss_scalars_[0] = Tensor{};
  in_backward_ = false;
}

// --- step ---------------------------------------------------------------------------------

void ZeroRedundancy::step() {
  // The checks' transients are the step's temporaries; what it keeps is named below.
  static const ContextId temporaries = intern_context("ZeRO optimizer (optimizer temporaries)", Phase::Optimizer);
  ModuleScope scope(temporaries);
  if (offload()) {
    // has_overflow (2470-2482): the overflow found in backward, a ByteTensor on the device
    // for the all-reduce; complete_grad_norm_calculation_for_cpu_offload (1607-1647): the
    // norms' sum, a FloatTensor on the device for its all-reduce.
    { Tensor flag = empty(runtime_, Shape{1}, DType::U8); }
    { Tensor norm = empty(runtime_, Shape{1}, DType::F32); }
    // DeepSpeedCPUAdam: exp_avg and exp_avg_sq on the host at its first step, pageable
    // (ops/adam/cpu_adam.py:141-162). The master goes back through the host's bit16 buffer
    // straight into the flat buffer (2338-2341); reset_cpu_buffers drops the norms.
    if (moments_.empty()) {
      moments_.push_back(host("exp_avg (host)", partition_, DType::F32, false));
      moments_.push_back(host("exp_avg_sq (host)", partition_, DType::F32, false));
    }
    for (auto& [norm, entry] : norms_) release(norm, entry);
    norms_.clear();
    return;
  }
  // The tensors of averaged_gradients: each touched parameter's part in the partition, then
  // the padding.
  std::vector<std::int64_t> slices;
  for (const Param& p : params_) {
    if (p.in_partition) slices.push_back(p.partition_slice);
  }
  if (padding_ > 0) slices.push_back(padding_);
  // has_overflow_partitioned_grads_serial (2462-2491), on by default for bf16: per tensor
  // _has_inf_or_nan's transients.
  {
    Tensor flag = empty(runtime_, Shape{1}, DType::F32);
    for (const std::int64_t n : slices) check_inf_or_nan(n, false);
    Tensor any = empty(runtime_, Shape{1}, DType::U8);  // the flag as bool, then as uint8 (2468-2472)
    flag = Tensor{};
    Tensor byte = empty(runtime_, Shape{1}, DType::U8);
    any = Tensor{};
  }
  // get_grad_norm_direct (2054-2104): each part in fp64 for its norm, the norms kept and stacked.
  {
    std::vector<Tensor> norms;
    for (std::size_t i = 0; i + (padding_ > 0 ? 1 : 0) < slices.size(); ++i) {
      Tensor d = empty(runtime_, Shape{slices[i]}, DType::F64);
      norms.push_back(empty(runtime_, Shape{}, DType::F64));
    }
    Tensor stacked = empty(runtime_, Shape{static_cast<std::int64_t>(norms.size())}, DType::F64);
    Tensor squared = empty(runtime_, Shape{static_cast<std::int64_t>(norms.size())}, DType::F64);
    stacked = Tensor{};
    while (!norms.empty()) norms.pop_back();  // freed last to first
  }
  // Per group (2341-2387): the partition's gradients flattened (a view when one tensor) and
  // cast to fp32, grads_in_partition and the padding dropped, the optimizer step.
  Tensor flat;
  std::size_t flat_log = SIZE_MAX, grad_log = SIZE_MAX;
  if (slices.size() > 1) flat = make("flat gradient partition", partition_, dtype_, gradients_context_, flat_log);
  Tensor fp32_grad;
  if (dtype_ != DType::F32) {
    fp32_grad = make("fp32 gradient partition", partition_, DType::F32, gradients_context_, grad_log);
    if (flat.defined()) release(flat, flat_log);
  } else {
    fp32_grad = std::move(flat);  // .to(fp32) of an fp32 tensor is the tensor itself
    grad_log = flat_log;
  }
  if (grads_in_partition_.defined()) release(grads_in_partition_, grads_log_);
  if (padding_zeros_.defined()) release(padding_zeros_, padding_log_);
  if (moments_.empty()) {
    std::size_t entry = 0;
    // FusedAdam: exp_avg and exp_avg_sq at the first step (ops/adam/fused_adam.py:149-157);
    // torch's SGD with momentum clones the gradient into its buffer; multi_tensor_apply
    // allocates nothing else.
    if (optimizer_.kind == OptimizerKind::Adam) {
      moments_.push_back(make("exp_avg", partition_, DType::F32, optimizer_context_, entry));
      moments_.push_back(make("exp_avg_sq", partition_, DType::F32, optimizer_context_, entry));
    } else if (optimizer_.kind == OptimizerKind::SGD && optimizer_.momentum != 0) {
      moments_.push_back(make("momentum_buffer", partition_, DType::F32, optimizer_context_, entry));
    }
  }
  if (fp32_grad.defined()) release(fp32_grad, grad_log);
  // The bit16 partition is copied back in place and all-gathered in place into the flat
  // buffer (all_gather_into_tensor per group, runtime/utils.py:1005-1019): nothing allocated.
}

}  // namespace mem::nn::detail
