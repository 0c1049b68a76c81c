// fully_shard.cpp — what FSDP2 allocates on each rank, in PyTorch 2.11's order, read in
// torch/distributed/fsdp/_fully_shard/ (_fsdp_state.py, _fsdp_param_group.py,
// _fsdp_param.py, _fsdp_collectives.py) and checked against rank 0's memory snapshots
// recorded on an H100 (tests/data/h100-parallel-2026-11-26). The collectives move no
// memory through the caching allocator (NCCL's buffers are its own).
#include "parallel/fully_shard.hpp"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "engine/detail.hpp"
#include "engine/hook_node.hpp"
#include "parallel/nccl_memory.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::nn::detail {
namespace {

/// The copy kernels' launch metadata (aten/src/ATen/native/cuda/TensorShape.cu): blocks of
/// 128 threads moving 16 B each.
constexpr std::int64_t kBytesPerBlock = 128 * 16;

std::int64_t div_up(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

bool has_parameters(const Module& m) { return m.parameter_count() > 0 || m.parameter_tensors() > 0; }

/// Which children of `m` are blocks: children and parameters of their own, and a sibling of
/// their type that has them too. Inline code of a parent's forward (ViT's residuals inside an
/// EncoderBlock) is no module to wrap. One pass over the children (their types counted once):
/// a decoder of 10,000 layers is not asked 10,000 times about each sibling.
std::vector<bool> block_children(const Module& m, std::size_t min_alike = 2) {
  const auto& kids = m.children();
  std::vector<bool> block(kids.size(), false);
  std::unordered_map<std::string_view, std::size_t> alike;
  for (std::size_t i = 0; i < kids.size(); ++i) {
    const Module& c = *kids[i].second;
    block[i] = !c.is_inline() && !c.children().empty() && has_parameters(c);
    if (block[i]) ++alike[c.type_name()];
  }
  for (std::size_t i = 0; i < kids.size(); ++i) block[i] = block[i] && alike[kids[i].second->type_name()] >= min_alike;
  return block;
}

bool contains_block(const Module& m, std::size_t min_alike) {
  const std::vector<bool> block = block_children(m, min_alike);
  for (std::size_t i = 0; i < block.size(); ++i) {
    if (block[i] || contains_block(*m.children()[i].second, min_alike)) return true;
  }
  return false;
}

/// The blocks under `m`. `min_alike` 1 takes a lone block too: a pipeline stage may hold one
/// decoder layer, which torchtitan wraps as it wraps every layer.
void collect_blocks(Module& m, std::vector<Module*>& out, std::size_t min_alike = 2) {
  const std::vector<bool> block = block_children(m, min_alike);
  for (std::size_t i = 0; i < block.size(); ++i) {
    Module& child = *m.children()[i].second;
    if (block[i] && !(child.type_name() == "Sequential" && contains_block(child, min_alike))) {
      out.push_back(&child);
    } else {
      collect_blocks(child, out, min_alike);
    }
  }
}

/// Slot indices of a module's own parameters (not buffers), in registration order.
std::vector<std::size_t> parameter_slots(const Module& m) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < m.slots().size(); ++i) {
    if (!m.slots()[i].is_buffer && m.slots()[i].tensor.defined()) out.push_back(i);
  }
  return out;
}

/// The module's parameters that no block below it owns: (module, slot) in named_parameters
/// order (a module's own, then its children's, depth first).
void own_parameters(Module& m, const std::unordered_map<const Module*, std::size_t>& blocks, bool top,
                    std::vector<std::pair<Module*, std::size_t>>& out) {
  if (!top && blocks.count(&m) != 0) return;
  for (std::size_t slot : parameter_slots(m)) out.emplace_back(&m, slot);
  for (const auto& [name, child] : m.children()) own_parameters(*child, blocks, false, out);
}

/// A leaf over `storage` with the shape given, contiguous, carrying `like`'s autograd
/// identity (name, requires_grad, the contexts of its gradient).
Tensor leaf_over(const std::shared_ptr<Storage>& storage, const Shape& shape, DType dtype, const Tensor& like) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage;
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->requires_grad = like.requires_grad();
  impl->name = like.impl()->name;
  impl->grad_context = like.impl()->grad_context;
  impl->grad_label = like.impl()->grad_label;
  return Tensor(std::move(impl));
}

}  // namespace

}  // namespace mem::nn::detail

namespace mem::nn {

bool fsdp_ranks_alike(const Module& root, std::size_t world_size) {
  for (const ParamSlot& slot : root.slots()) {
    if (slot.is_buffer) continue;
    const std::int64_t rows = slot.shape.size() == 0 ? 1 : slot.shape[0];
    if (rows % static_cast<std::int64_t>(world_size) != 0) return false;
  }
  for (const auto& [name, child] : root.children()) {
    if (!fsdp_ranks_alike(*child, world_size)) return false;
  }
  return true;
}

std::vector<Module*> repeated_blocks(Module& root) {
  std::vector<Module*> out;
  detail::collect_blocks(root, out);
  return out;
}

}  // namespace mem::nn

namespace mem::nn::detail {

FullyShard::FullyShard(const ParallelConfig& config, Module& root, Runtime& runtime,
                       const std::vector<ModelInfo::ShardGroup>& plan)
    : config_(config),
      runtime_(runtime),
      context_(intern_context("FullyShardedDataParallel", Phase::Forward)),
      pipelined_(config.pipeline_parallel > 1) {
  if (runtime.computing()) {
    throw Error("fsdp runs as a dry run only: its all-gathers on one simulated rank bring no data from the others");
  }
  // FSDPCommContext.lazy_init's streams (never destroyed, as PyTorch keeps them). The
  // all-gather stream allocates nothing (the output is made on the copy-in stream), nor does
  // HSDP's all-reduce stream here.
  Device& device = runtime.allocator().device();
  copy_in_stream_ = device.create_stream();
  reduce_scatter_stream_ = device.create_stream();
  // Each fully_shard call's modules (one group), in call order, the root last: the repeated
  // blocks (torchtitan's apply_fsdp), or the engine's own calls where the model records them
  // (expert parallel: transformers' apply_fully_sharded_data_parallelism).
  struct Call {
    std::vector<Module*> members;
    std::optional<bool> reshard_after_forward;  // the engine's value; unset: the options'
    bool experts = false;
  };
  std::vector<Call> calls;
  if (plan.empty()) {
    std::vector<Module*> blocks_found;
    collect_blocks(root, blocks_found, pipelined_ ? 1 : 2);
    for (Module* m : blocks_found) calls.push_back({{m}, std::nullopt, false});
    calls.push_back({{&root}, std::nullopt, false});
  } else {
    std::unordered_map<std::string, Module*> by_path;
    const auto visit = [&](auto& self, Module& m) -> void {
      by_path.emplace(&m == &root ? std::string{} : m.path(), &m);
      for (const auto& [name, child] : m.children()) self(self, *child);
    };
    visit(visit, root);
    for (const ModelInfo::ShardGroup& spec : plan) {
      Call call{{}, spec.reshard_after_forward, spec.experts};
      for (const std::string& path : spec.modules) {
        const auto it = by_path.find(path);
        if (it == by_path.end()) throw Error("fsdp: the model has no module '" + path + "' to shard");
        call.members.push_back(it->second);
      }
      calls.push_back(std::move(call));
    }
    if (calls.back().members != std::vector<Module*>{&root}) throw Error("fsdp: the last fully_shard call is the root's");
  }
  for (std::size_t i = 0; i < calls.size(); ++i) {
    for (Module* m : calls[i].members) group_index_[m] = i;
  }
  std::unordered_map<const Module*, std::size_t> blocks(group_index_);
  blocks.erase(&root);

  // fully_shard(block) for each block, then fully_shard(model): each FSDPParam's
  // _init_sharded_param allocates its padded shard (new_zeros of chunk rows, _fsdp_param.py),
  // and the group's original parameters are freed once the call returns.
  groups_.reserve(calls.size());
  for (const Call& call : calls) {
    Group group;
    group.module = call.members.front();
    group.members = call.members;
    for (const Module* m : call.members) group.path += (group.path.empty() ? "" : "+") + m->path();
    const bool is_root = group.module == &root;
    if (is_root) group.path.clear();
    const bool expert = call.experts;
    // Experts: the efsdp mesh, world / ep ranks; this rank's place in it is rank / ep (ranks
    // holding the same experts are ep apart: transformers' DistributedConfig.efsdp_size).
    group.ranks = expert ? config.world_size / config.expert_parallel : config.world_size;
    group.rank = expert ? config.rank / config.expert_parallel : config.rank;
    group.experts = expert;
    const std::size_t world = group.ranks;
    // reshard_after_forward=None: True, except for the root (_fully_shard.py). In a pipeline
    // torchtitan passes False, "to avoid per-microbatch all-gathers" (apply_fsdp's default
    // policy: reshard_after_forward = not pp_enabled). transformers passes True for experts.
    group.reshard_after_forward =
        call.reshard_after_forward.value_or(config.reshard_after_forward.value_or(!is_root && !pipelined_));
    // An int applies to every group it is given to, the root included (fully_shard(model, ...)).
    group.post_forward_ranks = call.reshard_after_forward ? 0 : config.reshard_after_forward_to;
    std::vector<std::pair<Module*, std::size_t>> owned;
    for (Module* member : call.members) own_parameters(*member, blocks, true, owned);
    std::vector<Tensor> originals;
    for (auto& [owner, slot] : owned) {
      const Tensor original = owner->slots()[slot].tensor;
      Param p;
      p.module = owner;
      p.slot = slot;
      const Shape& shape = original.shape();
      const std::int64_t rows = shape.size() == 0 ? 1 : shape[0];
      p.row_numel = rows == 0 ? 0 : original.numel() / rows;
      p.chunk_rows = div_up(rows, static_cast<std::int64_t>(world));  // _chunk_with_empty
      const std::int64_t local_rows = chunk_size(rows, world, group.rank);
      // MixedPrecisionPolicy applies to floating parameters (a packed 4-bit weight keeps its bytes).
      p.unsharded_dtype = config.param_dtype && is_floating(original.dtype()) ? *config.param_dtype : original.dtype();
      // _fsdp_params_with_wider_grad_dtype (torch 2.15 _fsdp_param_group.py): the gradient's
      // dtype (reduce_dtype, else the parameter's own) holds more than the compute dtype's.
      p.wider_grad = is_floating(original.dtype()) && dtype_size(config.reduce_dtype.value_or(original.dtype())) >
                                                          dtype_size(p.unsharded_dtype);
      // One context per group: its unsharded parameters are weights, as the shards are.
      p.weight_context = intern_context(label(group) + " unsharded parameters", Phase::None);
      {
        ModuleScope scope(owner->context(Phase::None));  // the shard: its module's weights
        Shape padded = shape.size() == 0 ? Shape{1} : shape;
        padded[0] = p.chunk_rows;
        // CPUOffloadPolicy: _init_sharded_param moves the padded shard to the CPU and pins it
        // (padded_sharded_param.cpu().pin_memory(), _fsdp_param.py): no block on the GPU.
        std::optional<MetaDevice> host;
        if (config.cpu_offload) host.emplace();
        Tensor shard = empty(runtime, padded, original.dtype());
        if (config.cpu_offload && config.offload_pin_memory) host_shards_.push_back(runtime.pin_host(shard.nbytes()));
        Shape local = padded;
        local[0] = local_rows;
        p.sharded = leaf_over(shard.storage(), local, original.dtype(), original);
        // The unsharded parameter: a view of its all-gather output (chunk rows x N), no block yet.
        Shape unsharded = padded;
        unsharded[0] = p.chunk_rows * static_cast<std::int64_t>(world);
        std::shared_ptr<Storage> storage;
        {
          MetaDevice meta;
          storage = empty(runtime, unsharded, p.unsharded_dtype).storage();
        }
        p.unsharded = leaf_over(storage, shape, p.unsharded_dtype, original);
        // Tensor parallel inside: a gradient of another placement than the parameter's stays so.
        p.unsharded.impl()->redistributed_grad = original.impl()->redistributed_grad;
        // init_unsharded_param: unsharded_param.grad_dtype = unsharded_grad_dtype.
        if (p.wider_grad) p.unsharded.impl()->grad_dtype = config.reduce_dtype.value_or(original.dtype());
      }
      originals.push_back(original);
      group.params.push_back(std::move(p));
    }
    if (!group.params.empty()) {
      log_.push_back({label(group) + " shards", shard_bytes(group), config.cpu_offload ? "host" : "default", stage(), ""});
    }
    for (Param& p : group.params) p.module->replace_parameter(p.slot, p.unsharded);
    originals.clear();  // the full parameters go back to the cache, in order
    if (!is_root) {
      for (Module* member : call.members) member->set_forward_hooks(this);
    }
    groups_.push_back(std::move(group));
  }
  order_parameters(root);
  if (config.meta_init) {
    // model.to_empty(device="cuda") after fully_shard: the buffers get their blocks now.
    for (Tensor& b : root.buffers()) b.storage()->allocate();
  }
}

FullyShard::~FullyShard() {
  for (Group& g : groups_) {
    for (Module* member : g.members) member->set_forward_hooks(nullptr);
  }
  for (std::size_t block : host_shards_) runtime_.unpin_host(block);
  release_host_gradients(true);
}

void FullyShard::release_host_gradients(bool all) {
  std::erase_if(host_gradients_, [&](const auto& gradient) {
    if (!all && !gradient.first.expired()) return false;
    runtime_.unpin_host(gradient.second);
    return true;
  });
}

void FullyShard::order_parameters(Module& root) {
  // named_parameters order: the module tree's, which the groups split; a tied one once.
  std::unordered_map<const TensorImpl*, Tensor> sharded_of;
  for (const Group& g : groups_) {
    for (const Param& p : g.params) sharded_of.emplace(p.unsharded.impl(), p.sharded);
  }
  std::unordered_set<const TensorImpl*> seen;
  for (const Tensor& t : root.parameters()) {
    const auto it = sharded_of.find(t.impl());
    if (it != sharded_of.end() && it->second.requires_grad() && seen.insert(it->second.impl()).second) {
      parameters_.push_back(it->second);
    }
  }
}

std::string FullyShard::label(const Group& g) { return g.path.empty() ? "root" : g.path; }

std::size_t FullyShard::shard_bytes(const Group& g) {
  std::size_t bytes = 0;
  for (const Param& p : g.params) bytes += p.sharded.storage()->nbytes();
  return bytes;
}

std::string FullyShard::stage() const {
  if (action_ != nullptr) return *action_;
  if (steps_ == 0) return "construction";
  return "step " + std::to_string(steps_) + (in_backward_ ? " backward" : " forward");
}

Tensor FullyShard::make(const std::string& what, std::size_t bytes, const std::string& stream, std::size_t& entry) {
  ModuleScope scope(context_);
  Tensor t = empty(runtime_, Shape{static_cast<std::int64_t>(bytes)}, DType::U8);
  entry = log_.size();
  log_.push_back({what, bytes, stream, stage(), ""});
  return t;
}

void FullyShard::release(Tensor& tensor, std::size_t entry) {
  tensor = Tensor{};
  if (entry < log_.size()) log_[entry].freed = stage();
}

void FullyShard::kernel_metadata(std::int64_t int64s) {
  // pack_vecs: the vectors in one pinned host tensor copied to the device, freed on return.
  ModuleScope scope(context_);
  Tensor t = empty(runtime_, Shape{int64s}, DType::I64);
}

FullyShard::Group& FullyShard::group_of(Module& module) { return groups_.at(group_index_.at(&module)); }

// --- unshard / reshard -----------------------------------------------------------------

void FullyShard::unshard(Group& g) {
  // FSDPParamGroup.unshard: a no-op while an all-gather waits or when unsharded.
  if (g.all_gather_output.defined() || g.unsharded || g.params.empty()) return;
  if (g.ranks == 1) {
    wait_for_unshard(g);  // no collective: the copy-out copies the shard
    return;
  }
  first_collective(runtime_, config_);  // the first all-gather connects NCCL
  // get_all_gather_streams: FSDP's copy-in stream in forward and pre-backward.
  const bool implicit = g.state == State::Forward || g.state == State::PreBackward;
  const StreamId stream = implicit ? copy_in_stream_ : runtime_.stream();
  const std::string stream_name = implicit ? "all-gather copy-in" : "default";
  StreamGuard on(runtime_, stream);
  // foreach_all_gather (_fsdp_collectives.py): _get_param_all_gather_inputs copies every
  // parameter with a param_dtype (_init_dtype_attrs leaves it None for a parameter already in
  // it) into one new flat buffer of that dtype, freed once the output exists: cast from the
  // shards, or copied from the post-forward slices, which are in param_dtype already. The
  // other parameters' inputs are their shards (or slices) themselves.
  std::size_t input_bytes = 0, copy_in_bytes = 0;
  std::size_t ranks = g.ranks;
  for (const Param& p : g.params) {
    // The backward all-gather of reshard_after_forward=k gathers over k ranks from the 1/k
    // slices kept after forward.
    const std::size_t bytes =
        g.sharded_post_forward ? p.post_forward.nbytes()
                               : static_cast<std::size_t>(p.chunk_rows * p.row_numel) * dtype_size(p.unsharded_dtype);
    input_bytes += bytes;
    if (p.unsharded_dtype != p.sharded.dtype()) copy_in_bytes += bytes;
  }
  if (g.sharded_post_forward) ranks = g.post_forward_ranks;
  Tensor copy_in;
  std::size_t copy_in_log = SIZE_MAX;
  std::vector<Tensor> from_host;
  if (config_.cpu_offload && !g.sharded_post_forward) {
    // CPUOffloadPolicy: no foreach copy-in; each parameter's all_gather_inputs is its shard
    // copied to the GPU (sharded_param_data.to(device, non_blocking=True)), cast to param_dtype
    // if one is set (the copy then goes), alive until the all-gather output is filled.
    std::size_t bytes = 0;
    ModuleScope scope(context_);
    for (const Param& p : g.params) {
      Tensor input = empty(runtime_, Shape{p.chunk_rows * p.row_numel}, p.sharded.dtype());
      if (p.unsharded_dtype != p.sharded.dtype()) input = empty(runtime_, Shape{p.chunk_rows * p.row_numel}, p.unsharded_dtype);
      bytes += input.nbytes();
      from_host.push_back(std::move(input));
    }
    copy_in_log = log_.size();
    log_.push_back({label(g) + " all-gather inputs (copied from the host)", bytes, stream_name, stage(), ""});
  } else if (copy_in_bytes != 0) {
    copy_in = make(label(g) + " all-gather input (param_dtype)", copy_in_bytes, stream_name, copy_in_log);
  }
  g.all_gather_output = make(label(g) + " all-gather output", input_bytes * ranks, stream_name, g.all_gather_log);
  if (!from_host.empty()) {
    from_host.clear();
    log_[copy_in_log].freed = stage();
  }
  sent_ += static_cast<double>(input_bytes) * static_cast<double>(ranks - 1);  // a ring: its input to each other rank
  if (copy_in.defined()) release(copy_in, copy_in_log);
}

void FullyShard::wait_for_unshard(Group& g) {
  if (g.unsharded || g.params.empty()) return;
  if (!g.all_gather_output.defined() && g.ranks > 1) return;  // no preceding unshard
  const bool forward = g.state == State::Forward;
  // PyTorch 2.15 releases the previous group's all-gather output before this copy-out
  // (release_all_gather_state_for_comm_reuse); 2.11 holds it in a local until the copy-out
  // is done (`if prev_all_gather_state := ...`), as its snapshots show.
  const bool release_first = runtime_.stack().torch >= Version{2, 15};
  if (forward && release_first) release_all_gather_state();
  // foreach_all_gather_copy_out: each parameter's all_gather_outputs gets its block on the
  // current stream (init_all_gather_outputs the first time, alloc_storage after), then
  // split_with_sizes_copy fills them; the unsharded parameters are views of them.
  std::size_t bytes = 0;
  for (const Param& p : g.params) {
    ModuleScope scope(p.weight_context);
    p.unsharded.storage()->allocate();
    bytes += p.unsharded.storage()->nbytes();
  }
  g.unsharded_log = log_.size();
  log_.push_back({label(g) + " unsharded parameters", bytes, "default", stage(), ""});
  if (g.ranks > 1) {
    const bool one_dtype = std::all_of(g.params.begin(), g.params.end(), [&](const Param& p) {
      return p.unsharded_dtype == g.params.front().unsharded_dtype;
    });
    if (one_dtype) {
      // split_with_sizes_copy_out_cuda_contiguous_no_cast: dst and src addresses and chunk
      // sizes per split, block_idx_to_split_idx (a block per 2 KiB of a split's chunk,
      // times iters_per_chunk) and blocks_cumsums, as int64s. The grid is capped at
      // 2 x SMs x threads per SM / 128 blocks (unknown SMs: no cap).
      const auto& info = runtime_.allocator().device().info();
      const std::int64_t splits = static_cast<std::int64_t>(g.params.size());
      const auto chunks = static_cast<std::int64_t>(g.sharded_post_forward ? g.post_forward_ranks : g.ranks);
      // Each split is a parameter's share of one rank's input: its padded shard, or its 1/k slice.
      const auto split_bytes = [&](const Param& p) {
        return g.sharded_post_forward ? static_cast<std::int64_t>(p.post_forward.nbytes())
                                      : p.chunk_rows * p.row_numel * static_cast<std::int64_t>(dtype_size(p.unsharded_dtype));
      };
      std::int64_t first = 0;
      for (const Param& p : g.params) first += div_up(split_bytes(p), kBytesPerBlock);
      std::int64_t iters_per_chunk = 1;
      if (info.multiprocessors > 0 && info.max_threads_per_multiprocessor > 0) {
        const std::int64_t max_blocks =
            static_cast<std::int64_t>(info.multiprocessors) * info.max_threads_per_multiprocessor / 128 * 2;
        const std::int64_t iter_factor = div_up(first * chunks, max_blocks);
        const std::int64_t chunks_per_block =
            std::min(static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(iter_factor)))), chunks);
        iters_per_chunk = div_up(iter_factor, chunks_per_block);
      }
      std::int64_t blocks = 0;
      for (const Param& p : g.params) blocks += div_up(split_bytes(p), kBytesPerBlock * iters_per_chunk);
      kernel_metadata(4 * splits + 1 + blocks);
    }
  }
  g.unsharded = true;
  if (g.sharded_post_forward) {
    // to_unsharded: the post-forward slices go once the copy-out is done.
    drop_post_forward(g);
  }
  if (forward && !release_first) release_all_gather_state();
  if (forward && g.ranks > 1) {
    // Kept for the overlap of this copy-out with the next all-gather: freed at the next
    // group's copy-out, or at the root's post-forward.
    all_gather_state_ = std::move(g.all_gather_output);
    all_gather_state_log_ = g.all_gather_log;
  } else if (g.all_gather_output.defined()) {
    release(g.all_gather_output, g.all_gather_log);  // backward: freed right after its copy-out
  }
  g.all_gather_output = Tensor{};
}

void FullyShard::release_all_gather_state() {
  if (all_gather_state_.defined()) release(all_gather_state_, all_gather_state_log_);
}

void FullyShard::reshard_post_forward(Group& g) {
  // to_sharded_post_forward (_fsdp_param.py): per parameter, a clone of its rank's 1/k of the
  // all-gather output on the current stream, then its unsharded storage freed.
  std::size_t total = 0;
  for (Param& p : g.params) {
    ModuleScope scope(p.weight_context);
    const auto bytes = static_cast<std::int64_t>(p.unsharded.storage()->nbytes() / g.post_forward_ranks);
    p.post_forward = empty(runtime_, Shape{bytes}, DType::U8);
    p.unsharded.storage()->free();
    total += static_cast<std::size_t>(bytes);
  }
  g.post_forward_log = log_.size();
  log_.push_back({label(g) + " post-forward shards", total, "default", stage(), ""});
  if (g.unsharded_log < log_.size()) log_[g.unsharded_log].freed = stage();
  g.unsharded = false;
  g.sharded_post_forward = true;
}

void FullyShard::drop_post_forward(Group& g) {
  for (Param& p : g.params) p.post_forward = Tensor{};
  if (g.post_forward_log < log_.size()) log_[g.post_forward_log].freed = stage();
  g.sharded_post_forward = false;
}

void FullyShard::reshard(Group& g) {
  if (g.sharded_post_forward) drop_post_forward(g);  // _to_sharded from the post-forward state
  if (!g.unsharded) return;
  // to_sharded -> free_unsharded_param: storage.resize_(0), parameter by parameter.
  for (Param& p : g.params) p.unsharded.storage()->free();
  if (g.unsharded_log < log_.size()) log_[g.unsharded_log].freed = stage();
  g.unsharded = false;
}

// --- forward ------------------------------------------------------------------------------

Tensor FullyShard::group_pre_forward(Group& g, const Tensor& input) {
  Tensor in = input;
  // _cast_forward_inputs: MixedPrecisionPolicy(cast_forward_inputs=True) casts floating inputs.
  if (config_.param_dtype && is_floating(in.dtype()) && in.dtype() != *config_.param_dtype) {
    in = to_dtype(in, *config_.param_dtype);
  }
  g.state = State::Forward;
  unshard(g);
  wait_for_unshard(g);
  // _register_post_backward_hook: on the inputs that require grad.
  if (grad_enabled() && in.requires_grad()) {
    in = with_backward_hook(in, [this, &g] { post_backward(g); }, "RegisterPostBackwardFunctionBackward");
  }
  return in;
}

std::vector<Tensor> FullyShard::group_post_forward(Group& g, std::vector<Tensor> outputs) {
  // FSDPParamGroup.post_forward: reshard (unless reshard_after_forward=False; to the k-rank
  // group with an int), then the post-forward order backward prefetching follows.
  if (g.reshard_after_forward && g.post_forward_ranks > 1 && g.unsharded) {
    reshard_post_forward(g);
  } else if (g.reshard_after_forward) {
    reshard(g);
  }
  std::vector<std::size_t>& order = post_forward_orders_.at(g.stage);
  g.post_forward_indices.push_back(order.size());
  order.push_back(static_cast<std::size_t>(&g - groups_.data()));
  g.state = State::Idle;
  // _register_pre_backward_hook: a hook on each output that requires grad.
  for (Tensor& out : outputs) {
    if (grad_enabled() && out.defined() && out.requires_grad()) {
      out = with_backward_hook(out, [this, &g] { pre_backward(g); }, "RegisterPreBackwardFunctionBackward");
    }
  }
  return outputs;
}

void FullyShard::begin_step() {
  ++steps_;
  in_backward_ = false;
  release_host_gradients(false);  // zero_grad(set_to_none) dropped the host gradients
  // The gradients the last step's reduce-scatter outputs held were set to None since.
  std::erase_if(gradient_outputs_, [&](const auto& output) {
    if (!output.first.expired()) return false;
    if (output.second < log_.size()) log_[output.second].freed = stage();
    return true;
  });
}

FullyShard::Group& FullyShard::root_group(std::optional<std::size_t> stage) {
  for (std::size_t i = groups_.size() - root_count_; stage && i < groups_.size(); ++i) {
    if (groups_[i].stage == *stage) return groups_[i];
  }
  return groups_.back();
}

Tensor FullyShard::root_pre_forward(const Tensor& input, std::optional<std::size_t> stage) {
  if (!pipelined_) begin_step();  // a pipeline runs the root's forward once per micro-batch
  in_backward_ = false;
  return group_pre_forward(root_group(stage), input);
}

std::vector<Tensor> FullyShard::root_post_forward(std::vector<Tensor> outputs, std::optional<std::size_t> stage) {
  outputs = group_post_forward(root_group(stage), std::move(outputs));
  // The root's _post_forward frees the last all-gather output kept for overlap.
  release_all_gather_state();
  return outputs;
}

Tensor FullyShard::pre_forward(Module& module, const Tensor& input) {
  Group& g = group_of(module);
  if (g.members.size() > 1) {
    // fully_shard([norm, lm_head]): the group's pre-forward runs once per pass, at the first
    // of its modules to run (_register_group_forward_hooks; unshard and the post-backward hook
    // are gated on the group's state).
    if (g.to_run != 0) return input;
    g.to_run = g.members.size();
  }
  return group_pre_forward(g, input);
}

Tensor FullyShard::post_forward(Module& module, const Tensor& output) {
  Group& g = group_of(module);
  // ... and its post-forward when the last of them has run.
  if (g.members.size() > 1 && g.to_run > 0 && --g.to_run != 0) return output;
  return group_post_forward(g, {output}).front();
}

// --- backward -----------------------------------------------------------------------------

void FullyShard::pre_backward(Group& g) {
  in_backward_ = true;
  if (!callback_queued_) {
    // _register_root_post_backward_final_callback, once per backward (by the root of the group
    // whose backward ran: the stage's, under an interleaved schedule).
    callback_queued_ = true;
    callback_stage_ = g.stage;
    runtime_.queue_backward_callback([this] { root_post_backward_final_callback(); });
  }
  if (g.state == State::PreBackward) return;
  g.state = State::PreBackward;
  unshard(g);  // a no-op if prefetched
  wait_for_unshard(g);
  set_unsharded_grad_dtypes(g, true);
  // _backward_prefetch: the group whose post-forward ran just before this one's.
  if (g.post_forward_indices.empty()) return;
  const std::size_t index = g.post_forward_indices.back();
  g.post_forward_indices.pop_back();
  if (index == 0) return;
  Group& target = groups_[post_forward_orders_.at(g.stage)[index - 1]];
  const State saved = target.state;
  target.state = State::PreBackward;  // use_training_state(PRE_BACKWARD)
  unshard(target);
  target.state = saved;
}

void FullyShard::set_unsharded_grad_dtypes(Group& g, bool defer) {
  const bool reduce_grads = !pipelined_ || finalizing_;
  for (Param& p : g.params) {
    if (!p.wider_grad || !p.unsharded.requires_grad()) continue;
    const DType wide = config_.reduce_dtype.value_or(p.sharded.dtype());
    Tensor grad = p.unsharded.grad();
    if (defer) {
      // Left in the dtype autograd makes it in (the reduce-scatter's copy-in casts it), or
      // added in place to the wider one an earlier micro-batch left.
      if (grad.defined() || reduce_grads) p.unsharded.impl()->grad_dtype.reset();
      continue;
    }
    if (grad.defined() && grad.dtype() != wide) {
      // param.grad = grad.to(dtype): made while deferred, kept to accumulate.
      ModuleScope scope(p.module->context(Phase::Backward));
      Tensor cast = empty(runtime_, grad.shape(), wide);
      grad = Tensor{};
      p.unsharded.set_grad(cast);
    }
    p.unsharded.impl()->grad_dtype = wide;
  }
}

void FullyShard::post_backward(Group& g) {
  g.state = State::PostBackward;
  if (pipelined_ && !finalizing_) {
    // reduce_grads is False (set_requires_gradient_sync(False)): the gradients stay on the
    // unsharded parameters for perform_reduce_grad, and with reshard_after_backward False the
    // parameters stay gathered for the next micro-batch.
    g.post_backward_pending = true;
    set_unsharded_grad_dtypes(g, false);
    if (g.gradients_log == SIZE_MAX) {
      std::size_t bytes = 0;
      for (const Param& p : g.params) bytes += p.unsharded.grad().defined() ? p.unsharded.grad().nbytes() : 0;
      if (bytes != 0) {
        g.gradients_log = log_.size();
        log_.push_back({label(g) + " unsharded gradients (accumulated)", bytes, "default", stage(), ""});
      }
    }
    return;
  }
  g.post_backward_pending = false;
  // The unsharded gradients, in parameter order, taken from the parameters.
  std::vector<std::pair<Param*, Tensor>> grads;
  for (Param& p : g.params) {
    Tensor grad = p.unsharded.grad();
    if (!grad.defined()) continue;
    p.unsharded.reset_grad();
    if (p.unsharded.impl()->redistributed_grad) {
      // FSDPParam._get_grad_inner_tensor: a DTensor gradient of another placement than the
      // tensor-parallel spec's is redistributed first (the rank's rows of the embedding's
      // whole-table gradient, the all-reduce of a norm's Partial one): a copy of the local
      // parameter's size, then the gradient it came from is freed (torch 2.15, measured).
      ModuleScope scope(p.module->context(Phase::Backward));
      grad = empty(runtime_, p.unsharded.shape(), grad.dtype());
      log_.push_back({p.module->path() + " gradient redistributed", grad.nbytes(), "default",
                      stage(), ""});
    }
    grads.emplace_back(&p, std::move(grad));
  }
  set_unsharded_grad_dtypes(g, false);
  reshard(g);
  // The previous group's reduce-scatter input goes once this one's post-backward waits on it.
  if (reduce_scatter_state_.defined()) release(reduce_scatter_state_, reduce_scatter_state_log_);
  if (!grads.empty()) foreach_reduce(g, grads);
  if (g.gradients_log < log_.size()) log_[g.gradients_log].freed = stage();
  g.gradients_log = SIZE_MAX;
}

void FullyShard::foreach_reduce(Group& g, std::vector<std::pair<Param*, Tensor>>& grads) {
  const auto world = static_cast<std::int64_t>(g.ranks);
  // The reduce dtype: MixedPrecisionPolicy's reduce_dtype, else the gradients' own.
  const DType grad_dtype = grads.front().second.dtype();
  const DType reduce_dtype = config_.reduce_dtype.value_or(grad_dtype);
  const auto elem = static_cast<std::int64_t>(dtype_size(reduce_dtype));
  std::int64_t input_numel = 0;
  for (auto& [p, grad] : grads) input_numel += p->padded_unsharded_numel(g.ranks);
  const std::int64_t output_numel = input_numel / world;
  // reduce_scatter_input on the current stream; chunk_cat copies (and casts) the gradients in.
  std::size_t input_log = SIZE_MAX;
  Tensor input = make(label(g) + " reduce-scatter input", static_cast<std::size_t>(input_numel * elem), "default",
                      input_log);
  sent_ += static_cast<double>(output_numel * elem) * static_cast<double>(world - 1);  // every other rank's chunk
  {
    // _chunk_cat_out_cuda_contiguous's metadata: per tensor its source, start byte, start
    // block, size, padded chunk size and blocks (6T + 2), and a block index per 2 KiB of
    // each padded chunk, in the reduce dtype.
    const auto tensors = static_cast<std::int64_t>(grads.size());
    std::int64_t blocks = 0;
    for (auto& [p, grad] : grads) blocks += div_up(p->chunk_rows * p->row_numel * elem, kBytesPerBlock);
    kernel_metadata(6 * tensors + 2 + blocks);
  }
  // unsharded_grads.clear(): CPython drops a list's items last to first; the last gradient
  // is still held by a local until foreach_reduce returns.
  Tensor held = grads.back().second;
  for (std::size_t i = grads.size(); i-- > 0;) grads[i].second = Tensor{};
  Tensor output;
  std::size_t output_log = SIZE_MAX;
  {
    StreamGuard on(runtime_, reduce_scatter_stream_);
    ModuleScope scope(intern_context((g.path.empty() ? std::string("root") : g.path) + ".sharded_grads.grad",
                                     Phase::Backward));
    output = empty(runtime_, Shape{output_numel}, reduce_dtype);
    output_log = log_.size();
    log_.push_back({label(g) + " reduce-scatter output (sharded gradients)", output.nbytes(), "reduce-scatter",
                    stage(), ""});
    if (g.ranks == 1 && g.experts && config_.world_size > 1) {
      // One rank in the group: the output is a copy of the input, and the experts' divide
      // factor (transformers sets dp_size) makes `reduce_scatter_input / gradient_divide_factor`
      // a temporary of the input's size first (foreach_reduce, torch 2.15 _fsdp_collectives.py).
      Tensor divided = empty(runtime_, Shape{input_numel}, reduce_dtype);
    }
    const DType orig = grads.front().first->sharded.dtype();
    if (orig != reduce_dtype) {
      // _to_dtype_if_needed: the sharded gradients in the parameters' dtype, on the same stream.
      Tensor cast = empty(runtime_, Shape{output_numel}, orig);
      log_[output_log].freed = stage();
      output_log = log_.size();
      log_.push_back({label(g) + " sharded gradients (cast to the parameters' dtype)", cast.nbytes(),
                      "reduce-scatter", stage(), ""});
      output = std::move(cast);
    }
  }
  // _cast_and_view_sharded_grads: each sharded gradient is a view of the output.
  std::int64_t offset = 0;
  for (auto& [p, grad] : grads) {
    Tensor view = leaf_over(output.storage(), p->sharded.shape(), output.dtype(), p->sharded);
    view.impl()->requires_grad = false;
    view.impl()->offset = offset;
    offset += p->chunk_rows * p->row_numel;
    Tensor existing = p->sharded.grad();
    if (config_.cpu_offload) {
      // CPUOffloadPolicy: new_sharded_grad.to("cpu", non_blocking=pin_memory and nothing to add
      // to) (_fsdp_collectives.py); a non-blocking copy to the CPU lands in pinned memory
      // (_to_copy's pin_out, TensorConversions.cpp). The GPU output is not kept.
      Tensor on_host;
      {
        MetaDevice host;
        on_host = leaf_over(empty(runtime_, view.shape(), view.dtype()).storage(), view.shape(), view.dtype(),
                            p->sharded);
      }
      on_host.impl()->requires_grad = false;
      if (existing.defined()) continue;  // a pageable copy, added into the host gradient
      if (config_.offload_pin_memory) {
        host_gradients_.emplace_back(on_host.storage(), runtime_.pin_host(on_host.nbytes()));
      }
      p->sharded.set_grad(on_host);
    } else if (existing.defined()) {
      add_(existing, view);  // gradient accumulation adds into the existing gradient
    } else {
      p->sharded.set_grad(view);
    }
  }
  // The output lives while the sharded gradients view it: until zero_grad(set_to_none), or
  // now when they were added into existing gradients.
  std::weak_ptr<Storage> watched = output.storage();
  output = Tensor{};
  if (watched.expired()) {
    log_[output_log].freed = stage();
  } else {
    gradient_outputs_.emplace_back(std::move(watched), output_log);
  }
  held = Tensor{};
  reduce_scatter_state_ = std::move(input);
  reduce_scatter_state_log_ = input_log;
}

void FullyShard::root_post_backward_final_callback() {
  // _root_post_backward_final_callback: the groups whose post-backward did not run (their
  // inputs needed no gradient: the root's, usually), in module order, the root first.
  callback_queued_ = false;
  const std::size_t blocks = groups_.size() - root_count_;
  for (std::size_t k = 0; k < groups_.size(); ++k) {
    Group& g = groups_[k < root_count_ ? blocks + k : k - root_count_];
    if (staged_ && (g.stage != callback_stage_ || g.params.empty())) continue;  // another root's
    if (g.state != State::PostBackward) post_backward(g);
    g.state = State::Idle;
  }
  if (pipelined_) {
    // Manual finalization: a micro-batch's backward ends with its gradients kept; the
    // all-gather output kept for overlap goes (release_all_gather_state_on_current_stream),
    // and the post-forward order waits for finalize_backward.
    release_all_gather_state();
    return;
  }
  end_backward_iteration();
}

void FullyShard::end_backward_iteration(std::optional<std::size_t> stage) {
  // wait_for_gradient_reduction (_end_backward_iteration): the last reduce-scatter input, and
  // any all-gather output kept; the root's post-forward order starts again.
  if (reduce_scatter_state_.defined()) release(reduce_scatter_state_, reduce_scatter_state_log_);
  release_all_gather_state();
  for (std::size_t k = 0; k < post_forward_orders_.size(); ++k) {
    if (!stage || k == *stage) post_forward_orders_[k].clear();
  }
  for (Group& g : groups_) {
    if (!stage || g.stage == *stage) g.post_forward_indices.clear();
  }
}

void FullyShard::finalize_backward() { finalize_root(std::nullopt); }

void FullyShard::finalize_root(std::optional<std::size_t> stage) {
  // set_requires_gradient_sync(True), set_reshard_after_backward(True), then
  // FSDPState.finalize_backward over the root's states in reverse (the last block first, the
  // root last): a group with gradients pending runs its post-backward now (take, reshard,
  // reduce-scatter), any other reshards; then the wait (the stage scales the sharded gradients
  // in place after).
  finalizing_ = true;
  in_backward_ = true;
  const auto finalize = [&](Group& g) {
    if (g.post_backward_pending) {
      post_backward(g);
    } else {
      reshard(g);
    }
    g.state = State::Idle;
  };
  for (std::size_t i = groups_.size() - root_count_; i-- > 0;) {
    if (!stage || groups_[i].stage == *stage) finalize(groups_[i]);
  }
  for (std::size_t i = groups_.size() - root_count_; i < groups_.size(); ++i) {
    if (!stage || (!groups_[i].params.empty() && groups_[i].stage == *stage)) finalize(groups_[i]);
  }
  end_backward_iteration(stage);
  finalizing_ = false;
}

// --- an interleaved schedule's roots -----------------------------------------------------

void FullyShard::assign_stages(const Module& body, const std::vector<std::vector<bool>>& parts) {
  const auto& children = body.children();
  const auto stage_of_child = [&](const Module* m) {
    for (std::size_t i = 0; i < children.size(); ++i) {
      if (children[i].second.get() != m) continue;
      for (std::size_t k = 0; k < parts.size(); ++k) {
        if (i < parts[k].size() && parts[k][i]) return k;
      }
    }
    throw Error("fsdp inside an interleaved schedule: " + m->path() + " is in none of the rank's stages");
  };
  for (std::size_t i = 0; i + 1 < groups_.size(); ++i) groups_[i].stage = stage_of_child(groups_[i].module);
  Group& root = groups_.back();
  // The root's parameters are the embedding's (the first stage) or the norm's and lm_head's (the
  // last); a rank of middle stages has none, and no root group that runs. A V's rank 0 holds
  // both: each of its two stages is a root of its own (torchtitan's fully_shard per model part).
  if (!root.params.empty()) {
    root.stage = stage_of_child(root.params.front().module);
    std::vector<Param> other;
    for (auto it = root.params.begin(); it != root.params.end();) {
      if (stage_of_child(it->module) == root.stage) {
        ++it;
      } else {
        other.push_back(std::move(*it));
        it = root.params.erase(it);
      }
    }
    if (!other.empty()) {
      const std::size_t second = stage_of_child(other.front().module);
      for (const Param& p : other) {
        if (stage_of_child(p.module) != second) {
          throw Error("fsdp inside an interleaved schedule: the root's parameters are split over three of the "
                      "rank's stages");
        }
      }
      // The same fully_shard options, the other stage's parameters (no step has run yet: the
      // root holds nothing else).
      Group split = root;
      split.params = std::move(other);
      split.stage = second;
      // Two fully_shard calls made the two roots' shards: the construction's entry says so.
      for (std::size_t i = log_.size(); i-- > 0;) {
        if (log_[i].what != "root shards") continue;
        CommunicationBuffer other_shards = log_[i];
        log_[i].bytes = shard_bytes(root);
        other_shards.bytes = shard_bytes(split);
        log_.insert(log_.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::move(other_shards));
        break;
      }
      groups_.push_back(std::move(split));
      root_count_ = 2;
    }
  }
  post_forward_orders_.assign(parts.size(), {});
  staged_ = true;
}

bool FullyShard::stage_has_root(std::size_t local) const noexcept {
  for (std::size_t i = groups_.size() - root_count_; i < groups_.size(); ++i) {
    if (!groups_[i].params.empty() && groups_[i].stage == local) return true;
  }
  return false;
}

std::vector<std::size_t> FullyShard::stage_groups(std::size_t local) const {
  std::vector<std::size_t> out;
  for (std::size_t i = groups_.size() - root_count_; i < groups_.size(); ++i) {
    if (!groups_[i].params.empty() && groups_[i].stage == local) out.push_back(i);
  }
  for (std::size_t i = 0; i + root_count_ < groups_.size(); ++i) {
    if (groups_[i].stage == local) out.push_back(i);
  }
  return out;
}

void FullyShard::unshard_stage(std::size_t local) {
  // The runtime's UNSHARD: `for submodule in stage.submod.modules(): submodule.unshard(async_op=True)`,
  // outside forward: the all-gather runs on the current stream.
  for (std::size_t i : stage_groups(local)) unshard(groups_[i]);
}

void FullyShard::wait_stage(std::size_t local) {
  for (std::size_t i : stage_groups(local)) wait_for_unshard(groups_[i]);
}

void FullyShard::reshard_stage(std::size_t local) {
  for (std::size_t i : stage_groups(local)) reshard(groups_[i]);
}

void FullyShard::reduce_stage(std::size_t local) {
  // start_gradient_reduction, then wait_for_gradient_reduction, on the stage's root.
  finalize_root(local);
}

}  // namespace mem::nn::detail
