// data_parallel.cpp — what DistributedDataParallel allocates on each rank, in PyTorch
// 2.11's order: torch/nn/parallel/distributed.py (DistributedDataParallel.__init__,
// _pre_forward) and torch/csrc/distributed/c10d/reducer.cpp and comm.cpp. The collectives
// themselves move no memory through the caching allocator (NCCL's buffers are its own).
#include "parallel/data_parallel.hpp"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "engine/detail.hpp"
#include "parallel/nccl_memory.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::nn::detail {
namespace {

// distributed.py: broadcast_bucket_size = int(250 * 1024 * 1024), the flat copies of the
// construction's and each forward's broadcasts.
constexpr std::size_t kBroadcastBucketBytes = 250 * MiB;
// reducer.hpp: kDefaultFirstBucketBytes and kDefaultBucketBytesCap.
constexpr std::size_t kFirstBucketBytes = 1 * MiB;
constexpr std::size_t kBucketBytesCap = 25 * MiB;

/// Tensors listed once (a tied weight is one parameter), in order.
std::vector<Tensor> unique(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out;
  std::unordered_set<const TensorImpl*> seen;
  for (const Tensor& t : tensors) {
    if (t.defined() && seen.insert(t.impl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<Tensor>& tensors,
                                                     const std::vector<std::size_t>& order,
                                                     const std::vector<std::size_t>& limits, bool sort) {
  struct Open {
    std::vector<std::size_t> indices;
    std::size_t bytes = 0;
    std::size_t limit = 0;  // index into limits
  };
  std::map<DType, Open> open;  // BucketKey(scalar_type, device): one device here
  std::vector<std::vector<std::size_t>> out;
  for (std::size_t i : order) {
    const Tensor& t = tensors[i];
    Open& bucket = open[t.dtype()];
    bucket.indices.push_back(i);
    bucket.bytes += t.nbytes();
    if (bucket.bytes >= limits[bucket.limit]) {
      out.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      if (bucket.limit + 1 < limits.size()) ++bucket.limit;
    }
  }
  // The buckets still open, in PyTorch from an unordered_map (in no stated order); by dtype here.
  for (auto& [dtype, bucket] : open) {
    if (!bucket.indices.empty()) out.push_back(std::move(bucket.indices));
  }
  if (sort) {
    std::sort(out.begin(), out.end(), [](const std::vector<std::size_t>& a, const std::vector<std::size_t>& b) {
      return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
    });
  }
  return out;
}

Tensor DataParallel::make(const std::string& what, std::int64_t numel, DType dtype, std::size_t& entry) {
  Tensor t = empty(runtime_, Shape{numel}, dtype);
  entry = log_.size();
  log_.push_back({what, t.nbytes(), "default", stage_, ""});
  return t;
}

Tensor DataParallel::make_int32s(const std::string& what, std::size_t n, std::size_t& entry) {
  // As bytes: the runtime has no int32 dtype, and only the size counts here.
  return make(what, 4 * static_cast<std::int64_t>(n), DType::U8, entry);
}

void DataParallel::release(Tensor& tensor, std::size_t entry) {
  tensor = Tensor{};
  if (entry < log_.size()) log_[entry].freed = stage_;
}

bool DataParallel::rebuilds() const noexcept {
  // reducer.hpp should_rebuild_buckets: (static_graph_ || !find_unused_parameters_).
  return config_.static_graph || !config_.find_unused_parameters;
}

/// comm.cpp broadcast_coalesced(tensors, 250 MiB): buckets by size in list order, each
/// flattened into one copy (flatten_dense_tensors: a bucket of one contiguous tensor is a
/// view, no copy), at most two in flight; a bucket's copy is freed once it is finished
/// (copied back through views) and dropped, before the bucket two after it is flattened.
void DataParallel::broadcast_coalesced(const std::vector<Tensor>& tensors, const std::string& what) {
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::deque<std::pair<Tensor, std::size_t>> in_flight;
  const auto finish = [&] {
    if (in_flight.front().first.defined()) release(in_flight.front().first, in_flight.front().second);
    in_flight.pop_front();
  };
  for (const auto& bucket : assign_buckets(tensors, order, {kBroadcastBucketBytes}, true)) {
    if (in_flight.size() >= 2) finish();  // constexpr auto max_in_flight = 2
    if (bucket.size() == 1) {
      in_flight.emplace_back(Tensor{}, SIZE_MAX);  // the tensor itself is broadcast: a slot, no copy
      continue;
    }
    std::int64_t numel = 0;
    for (std::size_t i : bucket) numel += tensors[i].numel();
    std::size_t log = 0;
    Tensor flat = make(what + " broadcast copy", numel, tensors[bucket.front()].dtype(), log);
    in_flight.emplace_back(std::move(flat), log);
  }
  while (!in_flight.empty()) finish();
}

DataParallel::DataParallel(const ParallelConfig& config, Module& root, Runtime& runtime)
    : config_(config), runtime_(runtime), context_(intern_context("DistributedDataParallel", Phase::Forward)) {
  ModuleScope scope(context_);
  // _build_params_for_reducer: the parameters that require grad, each once.
  params_ = unique(root.trainable_parameters());
  if (params_.empty()) {
    throw Error("DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                "gradient (PyTorch's error): every parameter is frozen");
  }
  for (std::size_t i = 0; i < params_.size(); ++i) index_[params_[i].impl()] = i;
  buffers_ = unique(root.buffers());

  if (config.init_sync) {
    first_collective(runtime, config);  // the shape check's all-gather
    // distributed.py: `if init_sync:` both the shape check and the broadcast.
    // _verify_param_shape_across_processes (reducer.cpp verify_params_across_processes): the
    // parameter count, its all-gathered copies (one 8 B tensor per rank, logged as one row)
    // and the shapes' metadata, Σ 2·dim int64, all freed on return.
    std::size_t count_log = 0, gathered_log = 0, metadata_log = 0;
    Tensor count = make("parameter count (verify_params_across_processes)", 1, DType::I64, count_log);
    std::vector<Tensor> gathered(config.world_size);
    for (Tensor& t : gathered) t = empty(runtime, Shape{1}, DType::I64);
    gathered_log = log_.size();
    log_.push_back({"parameter count all-gathered, one 8 B tensor from each of " + std::to_string(config.world_size) +
                        " ranks",
                    8 * config.world_size, "default", stage_, ""});
    std::int64_t dims = 0;
    for (const Tensor& p : params_) dims += 2 * static_cast<std::int64_t>(p.dim());
    Tensor metadata = make("parameter shapes (verify_params_across_processes)", dims, DType::I64, metadata_log);
    release(metadata, metadata_log);
    release(count, count_log);
    gathered.clear();
    log_[gathered_log].freed = stage_;
    // _sync_module_states: named_parameters() (frozen ones too), then named_buffers() when
    // broadcast_buffers, broadcast from rank 0, before the Reducer exists.
    std::vector<Tensor> states = unique(root.parameters());
    if (config.broadcast_buffers) states.insert(states.end(), buffers_.begin(), buffers_.end());
    broadcast_coalesced(states, "parameters and buffers");
  }

  // The Reducer: with find_unused_parameters=False (or static_graph) every gradient of a
  // dtype in one bucket until the first backward shows their order (distributed.py:
  // bucket_size_limits = [sys.maxsize]); otherwise [1 MiB, cap] buckets for good. The
  // Reducer gets the list reversed.
  const bool rebuildable = rebuilds();
  std::vector<std::size_t> order(params_.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::size_t> limits{std::numeric_limits<std::size_t>::max()};
  if (!rebuildable) {
    limits = config.bucket_cap_mb ? std::vector<std::size_t>{rebuild_limits().back()} : rebuild_limits();
  }
  auto assignment = assign_buckets(params_, order, limits, true);
  std::reverse(assignment.begin(), assignment.end());
  initialize_buckets(assignment, rebuildable ? " (every gradient of its dtype, until the rebuild)" : "");
  // local_used_map_dev_: int32 per parameter for the whole run, made by the Reducer's
  // constructor with find_unused_parameters, by set_static_graph with static_graph (both:
  // the second replaces the first).
  if (config.find_unused_parameters) {
    local_used_map_ = make_int32s("local_used_map (int32 per parameter)", params_.size(), local_used_log_);
  }
  if (config.static_graph) {
    std::size_t log = 0;
    Tensor replacement = make_int32s("local_used_map (int32 per parameter)", params_.size(), log);
    release(local_used_map_, local_used_log_);
    local_used_map_ = std::move(replacement);
    local_used_log_ = log;
  }
  stage_ = "step 1";
}

DataParallel::~DataParallel() = default;

std::vector<std::size_t> DataParallel::rebuild_limits() const {
  // reducer.cpp rebuild_buckets: {first_bucket_bytes_cap_, bucket_bytes_cap_}; the first
  // bucket is 1 MiB only when bucket_cap_mb was left at its default (distributed.py).
  if (!config_.bucket_cap_mb) return {kFirstBucketBytes, kBucketBytesCap};
  const auto cap = static_cast<std::size_t>(*config_.bucket_cap_mb * 1024 * 1024);
  return {std::max<std::size_t>(cap, 1), std::max<std::size_t>(cap, 1)};
}

void DataParallel::initialize_buckets(const std::vector<std::vector<std::size_t>>& assignment,
                                      const std::string& note) {
  // initialize_buckets: bucket by bucket, bucket.gradients = at::empty({Σ numel}) of the
  // parameters' dtype, uninitialised; the views into it allocate nothing.
  // Built aside and taken only whole: an out-of-memory error part-way leaves no buckets and
  // every parameter without one (grad_ready then skips it), never a half-filled map.
  ModuleScope scope(context_);
  std::vector<Bucket> fresh;
  std::vector<std::pair<std::size_t, std::size_t>> where(params_.size(), {SIZE_MAX, 0});
  for (const auto& indices : assignment) {
    Bucket bucket;
    std::int64_t numel = 0;
    for (std::size_t i : indices) {
      where[i] = {fresh.size(), bucket.params.size()};
      bucket.params.push_back(i);
      bucket.offsets.push_back(numel);
      numel += params_[i].numel();
    }
    const std::string what = "gradient bucket " + std::to_string(fresh.size()) + note;
    bucket.flat = make(what, numel, params_[indices.front()].dtype(), bucket.log);
    fresh.push_back(std::move(bucket));
  }
  buckets_ = std::move(fresh);
  where_ = std::move(where);
}

Tensor DataParallel::bucket_view(std::size_t param) const {
  const auto [b, k] = where_[param];
  const Tensor& p = params_[param];
  return buckets_[b].flat.narrow(0, buckets_[b].offsets[k], p.numel()).view(p.shape());
}

void DataParallel::pre_forward() {
  ModuleScope scope(context_);
  stage_ = "step " + std::to_string(forwards_ + 1) + " forward";
  // _pre_forward: reducer._rebuild_buckets() once the first synced backward has recorded the
  // order gradients became ready (should_rebuild_buckets: static_graph or not
  // find_unused_parameters), before the buffers' broadcast.
  if (rebuilds() && !rebuilt_ && !ready_order_.empty()) {
    // Parameters that never became ready keep their place after the others.
    std::vector<std::size_t> order = ready_order_;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
    const auto assignment = assign_buckets(params_, order, rebuild_limits(), false);
    {
      // sync_bucket_indices: the indices and the bucket sizes broadcast from rank 0 as two
      // int32 device tensors, freed on return.
      std::size_t indices_log = 0, sizes_log = 0;
      Tensor indices = make_int32s("bucket indices (sync_bucket_indices, int32)", params_.size() + 1, indices_log);
      Tensor sizes = make_int32s("bucket sizes (sync_bucket_indices, int32)", assignment.size(), sizes_log);
      release(sizes, sizes_log);
      release(indices, indices_log);
    }
    // buckets_.clear() frees the old buckets first; only gradients still held as views
    // of them (gradient_as_bucket_view with grads kept) keep them until moved across.
    std::vector<Bucket> old = std::move(buckets_);
    buckets_.clear();
    where_.assign(params_.size(), {SIZE_MAX, 0});
    const bool keep_old = config_.gradient_as_bucket_view &&
                          std::any_of(params_.begin(), params_.end(), [](const Tensor& p) { return p.grad().defined(); });
    const auto free_old = [&] {
      for (Bucket& b : old) release(b.flat, b.log);
      old.clear();
    };
    if (!keep_old) free_old();
    initialize_buckets(assignment, " (rebuilt)");
    rebuilt_ = true;
    if (keep_old) {
      // initialize_bucket_views: bucket_view.copy_(grad); grad = bucket_view.
      for (std::size_t i = 0; i < params_.size(); ++i) {
        Tensor& p = params_[i];
        if (!p.grad().defined()) continue;
        Tensor view = bucket_view(i);
        if (runtime_.computing()) copy_raw(view, p.grad());
        p.set_grad(view);
      }
      free_old();
    }
  }
  // _sync_buffers (every forward with grad enabled, broadcast_buffers and buffers present):
  // the same coalesced broadcast over named_buffers(), non-persistent ones included.
  if (config_.broadcast_buffers && !buffers_.empty()) broadcast_coalesced(buffers_, "buffers");
}

std::vector<Tensor> DataParallel::post_forward(std::vector<Tensor> outputs) {
  // distributed.py _post_forward: _DDPSink.apply when find_unused_parameters and not
  // static_graph, or on static_graph's first iteration; its forward clones each tensor of the
  // output, in the output's order (a causal LM's: the loss, then the logits).
  const bool sink = (config_.find_unused_parameters && !config_.static_graph) || (config_.static_graph && forwards_ == 0);
  ++forwards_;
  stage_ = "step " + std::to_string(forwards_) + " backward";
  if (!sink) return outputs;
  for (Tensor& t : outputs) {
    if (t.defined()) t = clone(t);  // the copy counts where the output does, not as DDP's buffer
  }
  return outputs;
}

void DataParallel::grad_ready(TensorImpl& param) {
  const auto it = index_.find(&param);
  if (it == index_.end()) return;  // not a parameter of the Reducer
  const std::size_t i = it->second;
  // rebuilt_params_: pushed by autograd_hook in the first backward that syncs (the second
  // with static_graph, whose first returns early).
  if (config_.static_graph && backwards_ == 0) return;  // autograd_hook: static_graph_first_iteration
  if (!rebuilt_ && backwards_ == (config_.static_graph ? 1 : 0)) ready_order_.push_back(i);
  copy_into_bucket(i);
  if (!config_.init_sync) first_collective(runtime_, config_);  // the first bucket's all-reduce, at the latest
}

void DataParallel::copy_into_bucket(std::size_t i) {
  Tensor& p = params_[i];
  const Tensor grad = p.grad();
  if (!grad.defined() || where_[i].first >= buckets_.size()) return;
  // mark_variable_ready_dense: mul_out(bucket_view, grad, 1 / world_size) or, with a hook,
  // bucket_view.copy_(grad): into the bucket, nothing allocated.
  Tensor view = bucket_view(i);
  if (grad.storage() == view.storage() && grad.offset() == view.offset()) return;  // already the view
  if (runtime_.computing()) copy_raw(view, grad);
  // gradient_as_bucket_view: grad = bucket_view; the autograd gradient's block is freed here.
  if (config_.gradient_as_bucket_view) p.set_grad(view);
}

void DataParallel::finalize_backward() {
  // static_graph's first backward: the hooks returned early; delay_all_reduce copies every
  // gradient into its bucket at the end of backward (and with gradient_as_bucket_view makes
  // it the view then), so until then the gradients and the buckets both live.
  if (config_.static_graph && backwards_ == 0) {
    for (std::size_t i = 0; i < params_.size(); ++i) copy_into_bucket(i);
  }
  // finalize_backward then waits on each bucket's future and copies its result back into the
  // gradients (copy_bucket_to_grad: grad.copy_(bucket_view), or the view itself): nothing
  // allocated, and the values unchanged, since every rank holds the same gradients here;
  // parameters without a gradient were unused on every rank and keep none. Every bucket was
  // all-reduced (a ring: reduce-scatter, then all-gather, 2 (n - 1) / n of it sent).
  const double n = static_cast<double>(config_.world_size);
  for (const Bucket& b : buckets_) sent_ += 2 * (n - 1) / n * static_cast<double>(b.flat.nbytes());
  ++backwards_;
}

std::vector<std::size_t> DataParallel::bucket_bytes() const {
  std::vector<std::size_t> out;
  for (const Bucket& b : buckets_) out.push_back(b.flat.nbytes());
  return out;
}

}  // namespace mem::nn::detail
