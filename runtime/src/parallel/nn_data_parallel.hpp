// nn_data_parallel.hpp — one GPU of torch.nn.DataParallel (internal): one process drives N
// GPUs; GPU 0 holds the module, its gradients and the optimizer, and every forward replicates
// the module onto the others (PyTorch 2.15, torch/nn/parallel: data_parallel.py, replicate.py,
// _functions.py, comm.py; torch/csrc/cuda/comm.cpp and utils/tensor_flatten.cpp).
//
// Each forward (DataParallel.forward):
//   - scatter: the batch, on GPU 0, split by torch.chunk (ceil(B / N) samples each, the last
//     ones fewer); GPU 0's chunk is a view, the others' are copies made on their GPUs;
//   - replicate: the parameters through Broadcast (autograd), then the buffers through
//     comm.broadcast_coalesced, each list cut by take_tensors into groups of one dtype that close
//     once they reach 10 MiB; a group of several tensors is flattened (one copy on GPU 0, freed
//     when the group is sent), and every other GPU receives the group's flat buffer and views
//     it. GPU 0 keeps using its own tensors (outputs[0] = tensors);
//   - each replica runs on its chunk; gather: GPU 0 makes the whole output (at::empty of the
//     batch) and copies each chunk's in; a replica's output goes with the forward.
// Backward: the gathered output's gradient is scattered (GPU 0's chunk a view, copies on the
// others); each replica's parameter gradients wait in Broadcast's input buffer until every
// replica is done (a frozen parameter's as zeros: its copy is non-differentiable, and a custom
// Function's undefined gradients are materialized); then ReduceAddCoalesced (comm.reduce_add_coalesced) cuts them by
// torch._utils._take_tensors (a group closes before a tensor that would pass 10 MiB), flattens
// each group on every GPU (a copy when it holds several; the last two groups' alive at once,
// the loop rebinding its list) and NCCL-reduces it into a new buffer on GPU 0, whose views
// become the parameters' .grad. A replica's parameters are views of its received groups and
// die with what autograd saved of them: vramscope frees a group once every trained parameter
// in it has its gradient (one of frozen parameters alone at the backward's end); the buffers' groups of running statistics stay until the backward is done (batch
// norm's backward keeps them), an integer group (num_batches_tracked) goes with the forward.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn::detail {

class NnDataParallel {
 public:
  /// model = nn.DataParallel(model) on GPU `config.rank` of `config.world_size`: on GPU 0 the
  /// module is materialized there, on the others it is not (each forward brings a replica).
  /// Throws mem::Error for a model without parameters.
  NnDataParallel(const ParallelConfig& config, Module& root, Runtime& runtime);

  /// Whether this GPU holds the module (GPU 0) rather than a replica per forward.
  bool holds_module() const noexcept { return config_.rank == 0; }
  /// replicate(): the broadcast of the parameters and buffers at the forward's start.
  void replicate();
  /// GPU 0's Gather of the replicas' outputs: at::empty of the whole batch's output (`batch`
  /// rows), each piece copied in; its backward hands GPU 0's piece of the gradient on as a
  /// view (Scatter's chunk on its own device).
  Tensor gather(const Tensor& piece, std::int64_t batch, const std::string& what);
  /// A replica's piece of the output's gradient: Scatter's copy onto its GPU.
  Tensor scattered_gradient(const Tensor& piece);
  /// The forward returned: the replica modules go, and with them the buffers' copies that
  /// backward does not keep.
  void forward_done();
  /// A parameter's gradient is in (AccumulateGrad ran): on a replica, its group's received
  /// buffer goes once each of the group's parameters has one.
  void grad_ready(TensorImpl& param);
  /// Broadcast's backward, once every replica's gradients are in: ReduceAddCoalesced.
  void finalize_backward();
  /// The training step's end (its variables dropped): what went by then is logged freed.
  void end_step();

  const std::vector<CommunicationBuffer>& buffers() const noexcept { return log_; }
  /// Bytes this GPU sent or received over the bus so far (the replicas in, the gradients out).
  double sent() const noexcept { return sent_; }

 private:
  struct Group {
    std::vector<std::size_t> members;  ///< indices into the list it was cut from
    std::int64_t numel = 0;
    std::size_t bytes = 0;
    DType dtype = DType::F32;
    void add(std::size_t index, const Tensor& t) {
      members.push_back(index);
      numel += t.numel();
      bytes += t.nbytes();
      dtype = t.dtype();
    }
  };
  /// utils::take_tensors (C++, comm.cpp's broadcast_coalesced): one open group per dtype; a
  /// tensor joins, and the group closes once its bytes reach `limit`; the open ones last, by
  /// dtype (ScalarType's order).
  static std::vector<Group> take_tensors(const std::vector<Tensor>& tensors, std::size_t limit);
  /// torch._utils._take_tensors (Python, reduce_add_coalesced): a dtype's group closes before a
  /// tensor that would take it past `limit`; the open ones last, in the order first seen.
  static std::vector<Group> take_tensors_python(const std::vector<Tensor>& tensors, std::size_t limit);
  /// broadcast_coalesced of `groups` as `what`: GPU 0's flattened copies, a replica's
  /// received groups (kept in `received`).
  void broadcast(const std::vector<Group>& groups, const std::string& what,
                 std::vector<std::pair<Tensor, std::size_t>>& received);
  Tensor make(const std::string& what, std::int64_t numel, DType dtype, std::size_t& entry);
  void release(Tensor& tensor, std::size_t entry);
  /// Marks the watched buffers whose storage went (the gathered output, the reduced gradients
  /// at zero_grad) as freed by now.
  void sweep();

  ParallelConfig config_;
  Runtime& runtime_;
  ContextId weights_context_, buffer_context_, gather_context_, scatter_context_;
  std::vector<Tensor> params_;   ///< model.parameters(), each once
  std::unordered_map<const TensorImpl*, std::size_t> index_;  ///< parameter -> its index
  // The broadcast's groups of the parameters and of the buffers, cut once (their sizes never
  // change), and a replica's received ones.
  std::vector<Group> param_groups_, buffer_groups_;
  std::vector<std::pair<Tensor, std::size_t>> received_params_, received_buffers_;
  std::vector<std::size_t> group_of_;
  /// Per parameter group, its trained parameters (the gradients a replica's group waits for),
  /// and how many of them are still due this step.
  std::vector<std::size_t> trained_, due_;
  /// GPU 0's gathered outputs and reduced buffers (which the .grad views hold), by their log
  /// entries: freed when the training loop or the optimizer's zero_grad drops them.
  std::vector<std::pair<std::size_t, std::weak_ptr<Storage>>> watched_;
  std::vector<CommunicationBuffer> log_;
  std::string stage_ = "construction";
  std::size_t forwards_ = 0;
  double sent_ = 0;
};

}  // namespace mem::nn::detail
