// nn_data_parallel.cpp — one GPU of torch.nn.DataParallel: the replicas' broadcast, their
// lifetimes and the gradients' reduction to GPU 0 (see nn_data_parallel.hpp for the sources).
#include "parallel/nn_data_parallel.hpp"

#include <algorithm>
#include <map>
#include <utility>
#include <unordered_set>

#include "engine/detail.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {
namespace {

/// comm.broadcast_coalesced's and comm.reduce_add_coalesced's buffer_size (10485760).
constexpr std::size_t kCoalesceBytes = 10485760;

/// c10::ScalarType's number (take_tensors orders its open groups by it).
int scalar_type(DType dtype) noexcept {
  switch (dtype) {
    case DType::U8: return 0;
    case DType::I32: return 3;
    case DType::I64: return 4;
    case DType::F16: return 5;
    case DType::F32: return 6;
    case DType::F64: return 7;
    case DType::Bool: return 11;
    case DType::BF16: return 15;
  }
  return 64;
}

/// Gather's backward (_functions.py: Scatter.apply of the gradient over the GPUs): GPU 0's
/// piece is a view of the whole gradient (torch.chunk, then .to() its own device: no copy).
class GatherBackward final : public Node {
 public:
  explicit GatherBackward(std::int64_t rows) : rows_(rows) {}
  TensorList apply(TensorList& grads) override { return {grads[0].narrow(0, 0, rows_)}; }
  std::string_view name() const noexcept override { return "GatherBackward"; }

 private:
  std::int64_t rows_;
};

}  // namespace

std::vector<NnDataParallel::Group> NnDataParallel::take_tensors(const std::vector<Tensor>& tensors,
                                                                std::size_t limit) {
  std::vector<Group> out;
  std::map<int, Group> open;  // by ScalarType
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    Group& group = open[scalar_type(tensors[i].dtype())];
    group.add(i, tensors[i]);
    if (group.bytes >= limit) out.push_back(std::exchange(group, Group{}));
  }
  for (auto& [type, group] : open) {
    if (!group.members.empty()) out.push_back(std::move(group));
  }
  return out;
}

std::vector<NnDataParallel::Group> NnDataParallel::take_tensors_python(const std::vector<Tensor>& tensors,
                                                                       std::size_t limit) {
  std::vector<Group> out;
  std::vector<Group> open;  // one per dtype, in the order first seen
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto it = std::find_if(open.begin(), open.end(), [&](const Group& g) { return g.dtype == tensors[i].dtype(); });
    if (it == open.end()) {
      it = open.insert(open.end(), Group{});
      it->dtype = tensors[i].dtype();
    }
    if (it->bytes + tensors[i].nbytes() > limit && it->bytes > 0) {
      out.push_back(std::exchange(*it, Group{}));
      it->dtype = tensors[i].dtype();
    }
    it->add(i, tensors[i]);
  }
  for (Group& group : open) {
    if (!group.members.empty()) out.push_back(std::move(group));
  }
  return out;
}

NnDataParallel::NnDataParallel(const ParallelConfig& config, Module& root, Runtime& runtime)
    : config_(config),
      runtime_(runtime),
      weights_context_(intern_context("DataParallel replica (parameters)", Phase::None)),
      buffer_context_(intern_context("DataParallel broadcast", Phase::Forward)),
      gather_context_(intern_context("DataParallel gather (output)", Phase::Forward)),
      scatter_context_(intern_context("DataParallel scatter", Phase::Backward)) {
  // replicate() broadcasts network.parameters(), frozen ones too (Broadcast marks their copies
  // non-differentiable).
  std::unordered_set<const TensorImpl*> seen;
  for (const Tensor& p : root.parameters()) {
    if (!seen.insert(p.impl()).second) continue;
    index_[p.impl()] = params_.size();
    params_.push_back(p);
  }
  if (params_.empty()) throw Error("dp (nn.DataParallel): the model has no parameter to replicate");
  seen.clear();
  std::vector<Tensor> buffers;
  for (const Tensor& b : root.buffers()) {
    if (seen.insert(b.impl()).second) buffers.push_back(b);
  }
  param_groups_ = take_tensors(params_, kCoalesceBytes);
  buffer_groups_ = take_tensors(buffers, kCoalesceBytes);
  group_of_.assign(params_.size(), 0);
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    std::size_t trained = 0;
    for (std::size_t i : param_groups_[g].members) {
      group_of_[i] = g;
      trained += params_[i].requires_grad() ? 1 : 0;
    }
    trained_.push_back(trained);
  }
}

Tensor NnDataParallel::make(const std::string& what, std::int64_t numel, DType dtype, std::size_t& entry) {
  Tensor t = empty(runtime_, Shape{numel}, dtype);
  entry = log_.size();
  log_.push_back({what, t.nbytes(), "default", stage_, ""});
  return t;
}

void NnDataParallel::release(Tensor& tensor, std::size_t entry) {
  tensor = Tensor{};
  if (entry < log_.size()) log_[entry].freed = stage_;
}

void NnDataParallel::broadcast(const std::vector<Group>& groups, const std::string& what,
                               std::vector<std::pair<Tensor, std::size_t>>& received) {
  for (const Group& group : groups) {
    sent_ += static_cast<double>(group.bytes);
    if (holds_module()) {
      // flatten_dense_tensors: a group of one tensor is its view; of several, a cat, freed at
      // the end of the group's iteration. GPU 0's replica is the module itself.
      if (group.members.size() < 2) continue;
      std::size_t entry = 0;
      Tensor flat = make(what + " flattened for the broadcast", group.numel, group.dtype, entry);
      release(flat, entry);
      continue;
    }
    // broadcast(): at::empty of the flat group on every other GPU; unflattened into views.
    std::size_t entry = 0;
    Tensor flat = make(what + " received", group.numel, group.dtype, entry);
    received.emplace_back(std::move(flat), entry);
  }
}

void NnDataParallel::sweep() {
  std::erase_if(watched_, [&](const auto& watched) {
    if (!watched.second.expired()) return false;
    log_[watched.first].freed = stage_;
    return true;
  });
}

Tensor NnDataParallel::gather(const Tensor& piece, std::int64_t batch, const std::string& what) {
  ModuleScope scope(gather_context_);
  Shape shape = piece.shape();
  shape[0] = batch;
  Tensor whole = empty(runtime_, shape, piece.dtype());
  log_.push_back({what, whole.nbytes(), "default", stage_, ""});
  watched_.emplace_back(log_.size() - 1, whole.storage());
  if (piece.requires_grad()) {
    auto node = std::make_shared<GatherBackward>(piece.shape()[0]);
    init_node(*node);
    node->add_input(piece);
    set_history(whole, node);
  }
  return whole;
}

Tensor NnDataParallel::scattered_gradient(const Tensor& piece) {
  ModuleScope scope(scatter_context_);
  return empty(runtime_, piece.shape(), piece.dtype());
}

void NnDataParallel::replicate() {
  ++forwards_;
  stage_ = "step " + std::to_string(forwards_) + " forward";
  sweep();  // the last step's reduced gradients went with this step's zero_grad
  // Parameters: _broadcast_coalesced_reshape(params, devices, detach=False), Broadcast.apply.
  // A replica's received groups are its weights; GPU 0's flattened copies are only in transit.
  {
    ModuleScope scope(holds_module() ? buffer_context_ : weights_context_);
    broadcast(param_groups_, "parameters", received_params_);
  }
  // A group goes once its trained parameters' gradients are in; one of frozen parameters alone
  // waits for the backward's end (no gradient tells when the nodes that saved them have run).
  due_ = trained_;
  // Buffers that do not require grad: comm.broadcast_coalesced(buffers, devices) (detached).
  ModuleScope scope(buffer_context_);
  broadcast(buffer_groups_, "buffers", received_buffers_);
}

void NnDataParallel::end_step() { sweep(); }

void NnDataParallel::forward_done() {
  sweep();  // a gathered output the forward dropped (Trainer.compute_loss keeps the loss alone)
  // The replica modules die with DataParallel.forward's locals, and with them the buffers'
  // copies that nothing saved: an integer group (num_batches_tracked). Batch norm's backward
  // keeps the running statistics it was given (derivatives.yaml, native_batch_norm), so the
  // floating groups stay until the backward is done.
  for (auto& [tensor, entry] : received_buffers_) {
    if (tensor.defined() && !is_floating(tensor.dtype())) release(tensor, entry);
  }
  stage_ = "step " + std::to_string(forwards_) + " backward";
}

void NnDataParallel::grad_ready(TensorImpl& param) {
  if (holds_module()) return;
  const auto it = index_.find(&param);
  if (it == index_.end()) return;
  const std::size_t g = group_of_[it->second];
  if (g >= due_.size() || due_[g] == 0) return;
  // PyTorch frees a received group when the last saved view of it goes, which is at the latest
  // when the last of its parameters' gradients is made (the node that saved a weight makes its
  // gradient): vramscope frees it then. A group nothing saved goes earlier in PyTorch.
  if (--due_[g] == 0) release(received_params_[g].first, received_params_[g].second);
}

void NnDataParallel::finalize_backward() {
  ModuleScope scope(intern_context("DataParallel reduce_add_coalesced", Phase::Backward));
  // What is left of the replica's groups (a parameter no gradient reached, the buffers' running
  // statistics) goes with the graph.
  for (auto* received : {&received_params_, &received_buffers_}) {
    for (auto& [tensor, entry] : *received) {
      if (tensor.defined()) release(tensor, entry);
    }
    received->clear();
  }
  // Broadcast.backward's gradients, one per parameter: a frozen one's (its non-differentiable
  // copy's) and one the backward never reached are zeros, as a custom Function's undefined
  // gradients are materialized (set_materialize_grads); ReduceAddCoalesced sums them all.
  std::vector<Tensor> grads;
  for (const Tensor& p : params_) {
    Tensor g = p.grad();
    if (!g.defined()) g = zeros(runtime_, p.shape(), p.dtype());
    grads.push_back(std::move(g));
  }
  // reduce_add_coalesced: per group, the flat copies of each GPU (the list rebinds, so the last
  // two groups' live at once), reduce_add's result on GPU 0 (empty_like, NCCL reduce).
  std::vector<std::pair<Tensor, std::size_t>> flats;
  std::vector<std::pair<Tensor, std::vector<std::size_t>>> results;
  for (const Group& group : take_tensors_python(grads, kCoalesceBytes)) {
    sent_ += static_cast<double>(group.bytes);
    std::pair<Tensor, std::size_t> flat;
    if (group.members.size() > 1) flat.first = make("gradients flattened for the reduce", group.numel, group.dtype, flat.second);
    if (flats.size() == 1) {
      release(flats.front().first, flats.front().second);
      flats.clear();
    }
    if (flat.first.defined()) flats.push_back(std::move(flat));
    if (holds_module()) {
      ModuleScope gradients(intern_context("DataParallel reduce_add_coalesced (gradients)", Phase::Backward));
      std::size_t entry = 0;
      Tensor result = make("reduced gradients (the parameters' .grad)", group.numel, group.dtype, entry);
      watched_.emplace_back(entry, result.storage());
      results.emplace_back(std::move(result), group.members);
    }
  }
  for (auto& [tensor, entry] : flats) release(tensor, entry);
  // Broadcast.backward returns: GPU 0's trained parameters take views of the reduced buffers as
  // their .grad (AccumulateGrad steals them; the frozen ones' sums are dropped, and a buffer
  // only they view goes), and the gradients that waited in its input buffer go; a replica's go
  // with the graph.
  for (auto& [result, members] : results) {
    std::int64_t offset = 0;
    for (std::size_t i : members) {
      Tensor& p = params_[i];
      const std::int64_t n = p.numel();
      Tensor view = result.narrow(0, offset, n).view(p.shape());
      offset += n;
      if (!p.requires_grad()) continue;
      p.reset_grad();
      p.set_grad(view);
    }
  }
  results.clear();
  if (!holds_module()) {
    for (Tensor& p : params_) p.reset_grad();
  }
  grads.clear();
  sweep();  // a reduced buffer only frozen parameters viewed
  stage_ = "step " + std::to_string(forwards_) + " optimizer";
}

}  // namespace mem::nn::detail
