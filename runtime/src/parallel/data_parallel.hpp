// data_parallel.hpp — DistributedDataParallel's side of one rank's step (internal): the
// construction's checks and broadcasts, the gradient buckets and their rebuild, the
// per-forward buffer broadcast. Each fact carries its PyTorch 2.11 source.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

/// compute_bucket_assignment_by_size (torch/csrc/distributed/c10d/reducer.cpp): the tensors
/// in `order`, one open bucket per dtype; a tensor is added, then the bucket closes once its
/// bytes reach the dtype's current limit, and that dtype's limits advance (the last one
/// repeats). Buckets come out as they closed, then the open ones; with `sort` (no order was
/// given to PyTorch) by their smallest tensor index. Each bucket lists tensor indices.
std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<Tensor>& tensors,
                                                     const std::vector<std::size_t>& order,
                                                     const std::vector<std::size_t>& limits, bool sort);

class DataParallel {
 public:
  /// DistributedDataParallel(model, ...) on a materialized model: the shape check and
  /// the broadcast from rank 0, then the Reducer's first buckets.
  DataParallel(const ParallelConfig& config, Module& root, Runtime& runtime);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// _pre_forward of a forward with grad enabled: the buckets' rebuild (once: at the second
  /// forward, the third with static_graph, never with find_unused_parameters), then the
  /// buffers' broadcast.
  void pre_forward();
  /// _post_forward's _DDPSink: with find_unused_parameters (not static_graph), and on
  /// static_graph's first forward, every output is cloned (_ddp_sink_clone).
  std::vector<Tensor> post_forward(std::vector<Tensor> outputs);
  /// The Reducer's autograd hook, after `param`'s AccumulateGrad ran.
  void grad_ready(TensorImpl& param);
  /// The end of backward (the Reducer's finalize_backward; static_graph's first delay_all_reduce).
  void finalize_backward();

  /// The buckets' sizes in bytes, in the order they are reduced (the flat buffers allocate
  /// each rounded up to 512 B).
  std::vector<std::size_t> bucket_bytes() const;
  /// Every buffer it allocated so far, in order, with its lifetime.
  const std::vector<CommunicationBuffer>& buffers() const noexcept { return log_; }
  /// Bytes sent in the buckets' all-reduces so far (a ring: 2 (n - 1) / n of each bucket).
  double sent() const noexcept { return sent_; }

 private:
  struct Bucket {
    std::size_t log = 0;               // its entry in log_
    Tensor flat;                       // bucket.gradients
    std::vector<std::size_t> params;   // indices into params_
    std::vector<std::int64_t> offsets; // element offset of each in flat
  };
  void initialize_buckets(const std::vector<std::vector<std::size_t>>& assignment, const std::string& note);
  /// The rebuilt buckets' limits: {first_bucket_bytes_cap_, bucket_bytes_cap_}.
  std::vector<std::size_t> rebuild_limits() const;
  Tensor bucket_view(std::size_t param) const;
  /// Allocates `numel` elements of `dtype` as `what`, logged (freed through release()).
  Tensor make(const std::string& what, std::int64_t numel, DType dtype, std::size_t& entry);
  /// `n` int32 elements, logged as make() does.
  Tensor make_int32s(const std::string& what, std::size_t n, std::size_t& entry);
  void release(Tensor& tensor, std::size_t entry);
  /// reducer.hpp should_rebuild_buckets' first half: the buckets are rebuilt once.
  bool rebuilds() const noexcept;
  /// mark_variable_ready_dense: the gradient into its bucket view (mul_out by 1 / world size,
  /// or copy_ with a hook: nothing allocated); with gradient_as_bucket_view the gradient
  /// then becomes the view and its own block is freed.
  void copy_into_bucket(std::size_t param);
  void broadcast_coalesced(const std::vector<Tensor>& tensors, const std::string& what);

  ParallelConfig config_;
  Runtime& runtime_;
  ContextId context_;                       // where its blocks are attributed
  std::vector<Tensor> params_;              // the Reducer's: trainable, in named_parameters order
  std::unordered_map<const TensorImpl*, std::size_t> index_;  // parameter -> its index
  std::vector<Tensor> buffers_;             // named_buffers()
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::size_t, std::size_t>> where_;  // per param: (bucket, index in it)
  std::vector<std::size_t> ready_order_;    // rebuilt_params_: the first synced backward's order
  std::size_t backwards_ = 0;               // backward passes finalized
  std::size_t forwards_ = 0;                // forwards with grad
  bool rebuilt_ = false;
  Tensor local_used_map_;                   // find_unused_parameters / static_graph: int32 per param
  std::size_t local_used_log_ = SIZE_MAX;
  std::vector<CommunicationBuffer> log_;
  std::string stage_ = "construction";      // where the step is, for log_
  double sent_ = 0;                         // bytes sent in all-reduces
};

}  // namespace mem::nn::detail
