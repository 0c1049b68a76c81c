// zero_stage3.cpp — what DeepSpeed's ZeRO stage 3 allocates on each rank, in DeepSpeed's order
// (@edaa7221; files under deepspeed/runtime/). The coordinator's logic (trace, prefetch,
// release) follows zero/partitioned_param_coordinator.py; the buffers' sizes and lifetimes
// are those recorded from DeepSpeed itself (tests/data/deepspeed-cpu-2026-11-26). With
// overlap_comm (stage 3's default) the all-gathers run on their own stream and the gradient
// reductions on another, and their blocks stay in those streams' pools.
#include "parallel/zero_stage3.hpp"

#include <algorithm>
#include <map>
#include <unordered_set>

#include "engine/detail.hpp"
#include "engine/hook_node.hpp"
#include "parallel/nccl_memory.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem::nn::detail {
namespace {

std::int64_t div_up(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// Beyond this many short chunks in one reduce-scatter, their paddings are counted a block per
/// gradient (reduce_bucket below).
constexpr std::int64_t kMaxPaddings = 1 << 16;

/// The coordinator's "never fetched" step (a defaultdict of int(-1e10)).
constexpr std::int64_t kNeverFetched = -10'000'000'000;

/// A module's own parameters as iter_params(module, recurse=False) sees them: its slots, and
/// those of inline children (code of its forward, not modules PyTorch would have).
/// A tied head's weight is the embedding's Parameter, and so its own too.
void direct_parameters(const Module& m, std::vector<const TensorImpl*>& out) {
  for (const ParamSlot& slot : m.slots()) {
    if (!slot.is_buffer && slot.tensor.defined()) out.push_back(slot.tensor.impl());
  }
  if (const auto* tied = dynamic_cast<const TiedLinear*>(&m); tied != nullptr && tied->weight().defined()) {
    out.push_back(tied->weight().impl());
  }
  for (const auto& [name, child] : m.children()) {
    if (child->is_inline()) direct_parameters(*child, out);
  }
}

/// The modules below `m` that DeepSpeed hooks (_register_deepspeed_module: children depth
/// first), looking through inline code at any depth.
void hooked_children(Module& m, std::vector<Module*>& out) {
  for (const auto& [name, child] : m.children()) {
    if (!child->is_inline()) out.push_back(child.get());
    hooked_children(*child, out);
  }
}

}  // namespace

ZeroStage3::ZeroStage3(const ParallelConfig& config, const OptimizerConfig& optimizer, Module& root,
                       Runtime& runtime)
    : config_(config),
      optimizer_(optimizer),
      runtime_(runtime),
      root_(root),
      gather_context_(intern_context("DeepSpeed ZeRO-3 gathered parameters", Phase::Forward)),
      partitions_context_(intern_context("ZeRO-3 parameter partitions", Phase::None)),
      bucket_context_(intern_context("DeepSpeed gradient bucket", Phase::Backward)),
      gradients_context_(intern_context("ZeRO gradients.grad", Phase::Backward)),
      optimizer_context_(intern_context("ZeRO optimizer", Phase::Optimizer)),
      temporaries_context_(intern_context("ZeRO optimizer (optimizer temporaries)", Phase::Optimizer)) {
  check_zero_setup("zero3", config, optimizer, runtime);
  if (config.offload_param && config.world_size == 1) {
    // One rank gathers nothing: the parameter would be a view of its partition on the host.
    throw Error("zero3:1 with offload_param=cpu is not modelled (a single rank never gathers, so its parameters "
                "would stay on the host); give zero3:2 or more");
  }
  // overlap_comm (true for stage 3, zero/config.py): the coordinator's __allgather_stream and
  // stage3.py's reduce_and_partition_stream are streams of their own.
  if (config.overlap_comm.value_or(true)) {
    Device& device = runtime.allocator().device();
    allgather_stream_ = device.create_stream();
    reduce_stream_ = device.create_stream();
  } else {
    allgather_stream_ = reduce_stream_ = runtime.stream();
  }
  const auto world = static_cast<std::int64_t>(config.world_size);

  // The parameters in named_parameters order (ds_id), a tied one once.
  for (const Tensor& t : root.parameters()) {
    if (!t.defined() || index_.count(t.impl()) != 0) continue;
    Param p;
    p.tensor = t;
    p.data = t.storage();
    p.numel = t.numel();
    p.partition = div_up(p.numel, world);
    p.trainable = t.requires_grad();
    index_[t.impl()] = params_.size();
    params_.push_back(std::move(p));
  }
  bool any_trainable = false;
  for (const Param& p : params_) any_trainable = any_trainable || p.trainable;
  if (!any_trainable) throw Error("zero3 has nothing to optimize: every parameter is frozen");
  // The model's dtype, the one most of its elements have: DeepSpeed's bf16 or fp16 config casts
  // every parameter to it (engine.py:1537-1544, zero.Init's dtype) and communicates in it
  // (communication_data_type, engine.py:1405-1416), PEFT's f32 adapters included.
  {
    std::map<DType, std::int64_t> elements;
    for (const Param& p : params_) elements[p.tensor.dtype()] += p.numel;
    dtype_ = std::max_element(elements.begin(), elements.end(), [](const auto& a, const auto& b) {
               return a.second < b.second;
             })->first;
  }
  // mark_persistent_parameters (zero/parameter_offload.py:311): small parameters stay gathered,
  // up to the model's threshold, in named_parameters order.
  double persistent_numel = 0;
  for (Param& p : params_) {
    const auto n = static_cast<double>(p.numel);
    if (n + persistent_numel > config.model_persistence_threshold) continue;
    if (n <= config.param_persistence_threshold) {
      p.persistent = true;
      persistent_numel += n;
    }
  }
  // The hooked modules and their own parameters, by ds_id.
  std::vector<Module*> modules{&root};
  hooked_children(root, modules);
  for (Module* m : modules) {
    Hooked h;
    h.module = m;
    h.name = m == &root ? "(root)" : m->path();
    std::vector<const TensorImpl*> own;
    direct_parameters(*m, own);
    for (const TensorImpl* impl : own) {
      const auto it = index_.find(impl);
      if (it != index_.end() && std::find(h.params.begin(), h.params.end(), it->second) == h.params.end()) {
        h.params.push_back(it->second);
      }
    }
    std::sort(h.params.begin(), h.params.end());
    module_index_[m] = modules_.size();
    modules_.push_back(std::move(h));
  }
  for (Module* m : modules) {
    if (auto* seq = dynamic_cast<Sequential*>(m)) add_containers(*seq);
  }
  // _create_fp16_sub_groups (stage3.py:1160): the trainable parameters in sub groups of at
  // least sub_group_size partition elements; one group when the whole fits.
  std::int64_t sub_total = 0;
  for (Param& p : params_) {
    if (!p.trainable) continue;
    trainable_partition_ += p.partition;
  }
  const bool one_group = config.sub_group_size >= static_cast<double>(trainable_partition_);
  for (Param& p : params_) {
    if (!p.trainable) continue;
    if (sub_groups_.empty()) sub_groups_.push_back(0), sub_group_params_.push_back(0);
    p.sub_group = sub_groups_.size() - 1;
    sub_groups_.back() += p.partition;
    ++sub_group_params_.back();
    sub_total += p.partition;
    if (!one_group && static_cast<double>(sub_groups_.back()) >= config.sub_group_size && sub_total < trainable_partition_) {
      sub_groups_.push_back(0);
      sub_group_params_.push_back(0);
    }
  }

  // The NCCL communicator: zero.Init's and the engine's broadcasts.
  first_collective(runtime, config);
  std::size_t entry = 0;
  const auto fused_adam_flag = [&] {
    // FusedAdam's _dummy_overflow_buf = IntTensor([0]) on the device (ops/adam/fused_adam.py:96).
    // Under offload_optimizer the optimizer is DeepSpeedCPUAdam, which has none.
    if (optimizer.kind == OptimizerKind::Adam && !config.cpu_offload) {
      overflow_flag_ = make("FusedAdam overflow flag", 4, DType::U8, optimizer_context_, entry);
    }
  };
  // zero.Init (zero/partition_parameters.py:1808): each parameter's partition of ceil(n/N)
  // elements, the whole parameter freed. Under zero.Init the whole parameter is made just
  // before (the module's constructor), one at a time; otherwise the model sits whole on the
  // GPU and deepspeed.initialize partitions it there.
  if (!config.zero3_init) fused_adam_flag();
  // Under offload_param zero.Init's remote_device is the host (partition_parameters.py:1147-1155):
  // each partition is made there, pinned unless pin_memory=false (1808-1816).
  for (Param& p : params_) {
    std::size_t whole_log = SIZE_MAX;
    if (config.zero3_init) {
      ModuleScope scope(partitions_context_);
      p.data->allocate();
      whole_log = note("whole parameter (zero.Init: made, then partitioned)", p.data->nbytes());
    }
    const std::string partition_name = std::string(dtype_name(dtype_of(p))) + " parameter partition (ds_tensor)";
    p.own_partition = config.offload_param
                          ? host(partition_name, p.partition, dtype_of(p), config.offload_pin_memory, p.partition_log)
                          : make(partition_name, p.partition, dtype_of(p), partitions_context_, p.partition_log);
    p.data->free();
    if (whole_log < log_.size()) log_[whole_log].freed = stage();
  }
  if (config.zero3_init) {
    // The buffers (norms' statistics, rotary tables) are not partitioned: whole on the GPU.
    for (Tensor& b : root.buffers()) b.storage()->allocate();
    fused_adam_flag();
  }
  // DeepSpeedZeroOptimizer_Stage3.__init__ (stage3.py:330): the inf/nan tracker.
  inf_or_nan_ = make("inf_or_nan_tracker", 1, DType::U8, optimizer_context_, entry);
  // _create_fp16_partitions_with_defragmentation (utils.py:213-229): the trainable
  // partitions move into one flat buffer; on a GPU they go through the host and are freed
  // before the buffer is made. Under offload_param the flat buffer is the host's, made first
  // and always pinned (_create_param_groups_fp16_flat_cpu_memory, stage3.py:839-858), and each
  // partition is copied into it and dropped (_move_to_flat_buffer).
  if (config.offload_param) {
    lp_buffer_ = host(std::string(dtype_name(dtype_)) + " flat partition buffer (param_groups_fp16_flat_cpu_memory)",
                      trainable_partition_, dtype_, true, entry);
  }
  for (Param& p : params_) {
    if (!p.trainable) continue;
    release(p.own_partition, p.partition_log);
    p.partition_log = SIZE_MAX;
  }
  if (!config.offload_param) {
    lp_buffer_ = make(std::string(dtype_name(dtype_)) + " flat partition buffer (lp_param_buffer)",
                      trainable_partition_, dtype_, partitions_context_, entry);
  }
  // _setup_for_real_optimizer (stage3.py:1106-1122): per sub group the fp32 master, the
  // partition's .float() then its clone; .float() of an fp32 partition is the partition, so an
  // fp32 model's flat partitions are the master already (1112-1117). Under offload_optimizer
  // it is .to("cpu", fp32) then its clone, pageable, whatever the model's dtype (1106-1110).
  if (dtype_ != DType::F32 || offload()) {
    for (const std::int64_t n : sub_groups_) {
      std::size_t conversion_log = SIZE_MAX;
      Tensor conversion = on_optimizer_device("fp32 master conversion (before its clone)", n, DType::F32,
                                              optimizer_context_, false, conversion_log);
      masters_.push_back(on_optimizer_device("fp32 master partition", n, DType::F32, optimizer_context_, false, entry));
      release(conversion, conversion_log);
    }
  }
  // initialize_optimizer_states (stage3.py:1251-1256): one zero fp32 gradient of the largest
  // sub group, shared by all of them, dropped on return (on the host under offload_optimizer,
  // which gives each sub group its own fp32 gradient there, pinned by default: 1281-1288).
  {
    std::size_t placeholder_log = SIZE_MAX;
    const std::int64_t largest = *std::max_element(sub_groups_.begin(), sub_groups_.end());
    Tensor placeholder = on_optimizer_device("fp32 gradient placeholder (initialize_optimizer_states)", largest,
                                             DType::F32, optimizer_context_, false, placeholder_log);
    if (offload()) {
      for (const std::int64_t n : sub_groups_) {
        host_grads_.push_back(host("fp32 gradient partition (host)", n, DType::F32, config.offload_pin_memory, entry));
      }
    }
    release(placeholder, placeholder_log);
  }
  // The IPG bucket, reduce_bucket_size elements, made once and kept (stage3.py:733), and the
  // flat gradient partitions (stage3.py:742).
  bucket_ = make("IPG bucket (reduce_bucket_size)", static_cast<std::int64_t>(config.reduce_bucket_size), dtype_,
                 bucket_context_, entry);
  // Under offload_optimizer on the host, pinned by default (stage3.py:742-746: device=self.device).
  grad_partitions_ = on_optimizer_device("gradient partitions (grad_partitions_flat_buffer)", trainable_partition_,
                                         dtype_, gradients_context_, config.offload_pin_memory, entry);
  // create_reduce_and_remove_grad_hooks: each trainable parameter gathered once (N x its
  // partition, partition_parameters.py:2112) and partitioned again.
  for (Param& p : params_) {
    if (!p.trainable || world == 1) continue;  // one rank gathers nothing
    std::size_t gather_log = SIZE_MAX;
    Tensor gathered = make("gathered parameter (blocking all_gather, N x partition)", world * p.partition,
                           dtype_of(p), gather_context_, gather_log);
    // _allgather_params_sequential: all_gather_into_tensor(flat, ds_tensor.to(device)) (2116).
    Tensor copy = to_device(p);
    release(copy, copy_log_);
    release(gathered, gather_log);
  }
  for (Hooked& h : modules_) {
    if (h.module != nullptr) h.module->set_forward_hooks(this);
  }
  runtime.set_zero3_linear(true);
}

ZeroStage3::~ZeroStage3() {
  for (Hooked& h : modules_) {
    if (h.module != nullptr) h.module->set_forward_hooks(nullptr);
  }
  runtime_.set_zero3_linear(false);
}

std::string ZeroStage3::stage() const {
  switch (phase_) {
    case Phase3::Construction: return "construction";
    case Phase3::Forward: return "step " + std::to_string(steps_) + " forward";
    case Phase3::Backward: return "step " + std::to_string(steps_) + " backward";
    case Phase3::Optimizer: return "step " + std::to_string(steps_) + " optimizer";
  }
  return "";
}

Tensor ZeroStage3::make(const std::string& what, std::int64_t numel, DType dtype, ContextId context,
                        std::size_t& entry) {
  ModuleScope scope(context);
  Tensor t = empty(runtime_, Shape{numel}, dtype);
  entry = note(what, t.nbytes());
  return t;
}

Tensor ZeroStage3::host(const std::string& what, std::int64_t numel, DType dtype, bool pinned, std::size_t& entry) {
  Tensor t = on_host_.make(numel, dtype, pinned);
  log_.push_back({what, t.nbytes(), "host", stage(), ""});
  entry = log_.size() - 1;
  return t;
}

Tensor ZeroStage3::to_device(const Param& p) {
  // offload_param: ds_tensor.to(get_accelerator().current_device_name()), a copy of the host
  // partition on the GPU for the gather to send (partition_parameters.py 1332, 1368, 2014, 2116).
  copy_log_ = SIZE_MAX;
  if (!config_.offload_param) return Tensor{};
  return make("partition copied to the device (offload_param)", p.partition, dtype_of(p), gather_context_, copy_log_);
}

Tensor ZeroStage3::on_optimizer_device(const std::string& what, std::int64_t numel, DType dtype, ContextId context,
                                       bool pinned, std::size_t& entry) {
  return offload() ? host(what, numel, dtype, pinned, entry) : make(what, numel, dtype, context, entry);
}

std::size_t ZeroStage3::note(const std::string& what, std::size_t bytes) {
  const StreamId s = runtime_.stream();
  log_.push_back({what, bytes,
                  s == 0                 ? "default"
                  : s == allgather_stream_ ? "all-gather"
                                           : "reduce-scatter",
                  stage(), ""});
  return log_.size() - 1;
}

void ZeroStage3::release(Tensor& tensor, std::size_t entry) {
  tensor = Tensor{};
  if (entry < log_.size()) log_[entry].freed = stage();
}

std::size_t ZeroStage3::state_bytes() const noexcept {
  std::size_t n = 0;
  for (const Tensor& t : masters_) n += t.nbytes();
  for (const Tensor& t : moments_) n += t.nbytes();
  return n;
}

std::int64_t ZeroStage3::parameter_bytes() const {
  if (config_.offload_param) return 0;  // every partition is on the host
  std::int64_t n = lp_buffer_.defined() ? static_cast<std::int64_t>(lp_buffer_.nbytes()) : 0;
  for (const Param& p : params_) {
    if (p.own_partition.defined()) n += static_cast<std::int64_t>(p.own_partition.nbytes());
  }
  return n;
}

// --- the forward and backward hooks (zero/parameter_offload.py) ----------------------------

Tensor ZeroStage3::pre_forward(Module& module, const Tensor& input) {
  // _start_of_forward_hook on the root, registered first: a new step for the coordinator.
  if (&module == &root_) {
    ++steps_;
    phase_ = Phase3::Forward;
    reset_step();
  }
  Tensor in = input;
  // A container's hooks run once around its children's; a checkpoint's recompute reruns the
  // child only.
  if (const auto it = opens_.find(&module); it != opens_.end() && phase_ != Phase3::Backward) {
    for (const std::size_t c : it->second) in = enter(c, in);
  }
  return enter(module_index_.at(&module), in);
}

Tensor ZeroStage3::post_forward(Module& module, const Tensor& output) {
  Tensor out = leave(module_index_.at(&module), output);
  if (const auto it = closes_.find(&module); it != closes_.end() && phase_ != Phase3::Backward) {
    for (const std::size_t c : it->second) out = leave(c, out);
  }
  return out;
}

Tensor ZeroStage3::enter(std::size_t i, const Tensor& input) {
  // pre_sub_module_forward_function: trace_prologue, record_module, fetch_sub_module.
  record(modules_[i]);
  fetch(modules_[i], /*forward=*/true);
  // _post_backward_module_hook: PostBackwardFunctionModule on the inputs that require grad;
  // its backward releases the module (a module whose inputs need no grad never runs it). A
  // module that passes its input through uses none of it for what it makes.
  const Module* m = modules_[i].module;
  if (grad_enabled() && input.requires_grad() && !(m != nullptr && m->passes_input_through())) {
    return with_backward_hook(input, [this, i] { release_module(modules_[i], /*forward=*/false); },
                              "PostBackwardFunctionModuleBackward");
  }
  return input;
}

Tensor ZeroStage3::leave(std::size_t i, const Tensor& output) {
  release_module(modules_[i], /*forward=*/true);
  // _pre_backward_module_hook: PreBackwardFunctionForModule on the outputs; its backward
  // fetches the module's parameters again before the module's own backward runs.
  const Module* m = modules_[i].module;
  if (grad_enabled() && output.defined() && output.requires_grad() && !(m != nullptr && m->passes_input_through())) {
    return with_backward_hook(output,
                              [this, i] {
                                Hooked& h = modules_[i];
                                record(h);
                                // active_backward_submodules: a dict by ds_id, so once (fetch_sub_module, 337-338).
                                if (std::find(active_backward_.begin(), active_backward_.end(), i) == active_backward_.end()) {
                                  active_backward_.push_back(i);
                                }
                                fetch(h, /*forward=*/false);
                              },
                              "PreBackwardFunctionForModuleBackward");
  }
  return output;
}

void ZeroStage3::add_containers(Sequential& seq) {
  // Each dotted prefix of a child's name that names no child is a container PyTorch calls
  // (LlamaModel's "model", ResNet's "layer1"), unless it is a nested run of numbered children
  // ("model.layers.0", "transformer.h.0"): a ModuleList its parent iterates, never called.
  const auto& children = seq.children();
  std::vector<std::pair<std::string, std::pair<std::size_t, std::size_t>>> spans;  // prefix -> [first, last]
  for (std::size_t c = 0; c < children.size(); ++c) {
    const std::string& name = children[c].first;
    for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
      const std::string prefix = name.substr(0, dot);
      bool is_child = false;
      for (const auto& [other, module] : children) is_child = is_child || other == prefix;
      const std::string_view rest = std::string_view(name).substr(dot + 1);
      const bool numbered = !rest.empty() && rest.front() >= '0' && rest.front() <= '9';
      if (is_child || (numbered && prefix.find('.') != std::string::npos)) continue;
      auto it = std::find_if(spans.begin(), spans.end(), [&](const auto& s) { return s.first == prefix; });
      if (it == spans.end()) {
        spans.push_back({prefix, {c, c}});
      } else {
        it->second.second = c;
      }
    }
  }
  // Outermost first on entry (a shorter prefix encloses a longer one), innermost first on exit.
  std::stable_sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.first.size() < b.first.size(); });
  for (const auto& [prefix, range] : spans) {
    Hooked h;
    h.name = seq.path().empty() ? prefix : seq.path() + "." + prefix;
    modules_.push_back(std::move(h));
    opens_[children[range.first].second.get()].push_back(modules_.size() - 1);
    auto& closing = closes_[children[range.second].second.get()];
    closing.insert(closing.begin(), modules_.size() - 1);
  }
}

// --- the coordinator (zero/partitioned_param_coordinator.py) -------------------------------

void ZeroStage3::clean_inflight() {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].handle) continue;
    wait(i);
    release_param(i);
  }
}

void ZeroStage3::reset_step() {
  // reset_step (251-290): a recorded trace becomes the parameter trace; the first step records.
  clean_inflight();
  if (trace_mode_ != Trace::Complete) {
    if (trace_mode_ == Trace::Record) {
      param_order_.clear();
      for (const std::size_t m : submodule_order_) {
        std::deque<std::int64_t>& steps = module_steps_[m];
        const std::int64_t step = steps.empty() ? 0 : steps.front();
        if (!steps.empty()) steps.pop_front();
        for (const std::size_t p : modules_[m].params) param_order_.push_back({p, step});
      }
      trace_mode_ = Trace::Complete;
    } else {
      trace_mode_ = Trace::Record;
    }
  }
  param_queue_.assign(param_order_.begin(), param_order_.end());
  fetched_for_.clear();
  module_steps_.clear();
  step_id_ = 0;
  available_numel_ = 0;
}

void ZeroStage3::record(const Hooked& m) {
  const std::size_t i = static_cast<std::size_t>(&m - modules_.data());
  if (trace_mode_ == Trace::Complete) {
    // trace_prologue (202-219): a module out of the recorded order invalidates the trace.
    if (static_cast<std::size_t>(step_id_) >= submodule_order_.size() ||
        submodule_order_[static_cast<std::size_t>(step_id_)] != i) {
      // _invalidate_trace (195-200).
      trace_mode_ = Trace::Invalid;
      submodule_order_.clear();
      param_order_.clear();
      param_queue_.clear();
      fetched_for_.clear();
      module_steps_.clear();
      clean_inflight();
    }
    return;
  }
  if (trace_mode_ == Trace::Record) {
    submodule_order_.push_back(i);
    module_steps_[i].push_back(step_id_);
  }
}

void ZeroStage3::fetch(const Hooked& m, bool forward) {
  std::vector<std::size_t> to_gather;
  for (const std::size_t p : m.params) {
    if (params_[p].status == Status::NotAvailable) to_gather.push_back(p);
  }
  if (!to_gather.empty()) all_gather(to_gather);
  // A forward inside the backward is a checkpoint's recompute: its frozen parameters stay
  // with the module whose backward is running (update_recompute_parameters, 37-40, 388-394).
  Hooked* owner = forward && phase_ == Phase3::Backward && !active_backward_.empty()
                      ? &modules_[active_backward_.back()]
                      : nullptr;
  const auto add_active = [](std::vector<const Module*>& active, const Module* module) {
    if (std::find(active.begin(), active.end(), module) == active.end()) active.push_back(module);  // a set
  };
  for (const std::size_t p : m.params) {
    add_active(params_[p].active, m.module);
    if (owner != nullptr && !params_[p].trainable) {
      add_active(params_[p].active, owner->module);
      if (std::find(owner->recompute_params.begin(), owner->recompute_params.end(), p) == owner->recompute_params.end()) {
        owner->recompute_params.push_back(p);
      }
    }
    if (params_[p].handle) wait(p);
  }
  if (trace_mode_ == Trace::Complete) {
    // The module's own parameters leave the queue; then the next ones, up to
    // prefetch_bucket_size elements (and max_live_parameters), are gathered ahead (422-489).
    std::size_t not_fetched = 0;
    for (const std::size_t p : m.params) {
      const auto it = fetched_for_.find(p);
      if ((it == fetched_for_.end() ? kNeverFetched : it->second) < step_id_) ++not_fetched;
    }
    std::unordered_set<std::size_t> discarded;
    while (!param_queue_.empty() && discarded.size() < not_fetched) {
      const ParamUse use = param_queue_.front();
      param_queue_.pop_front();
      fetched_for_[use.param] = use.step;
      discarded.insert(use.param);
    }
    if (config_.prefetch_bucket_size > 0) {
      const double budget = std::min(config_.max_live_parameters - static_cast<double>(available_numel_),
                                     config_.prefetch_bucket_size);
      std::vector<std::size_t> prefetch;
      double numel = 0;
      while (!param_queue_.empty() && numel < budget) {
        const ParamUse use = param_queue_.front();
        param_queue_.pop_front();
        const bool gather = params_[use.param].status == Status::NotAvailable &&
                            std::find(prefetch.begin(), prefetch.end(), use.param) == prefetch.end();
        const auto it = fetched_for_.find(use.param);
        fetched_for_[use.param] = std::max(it == fetched_for_.end() ? kNeverFetched : it->second, use.step);
        if (gather) {
          prefetch.push_back(use.param);
          numel += static_cast<double>(params_[use.param].numel);
        }
      }
      if (!prefetch.empty()) all_gather(prefetch);
    }
  }
  ++step_id_;
}

void ZeroStage3::all_gather(const std::vector<std::size_t>& params) {
  // __all_gather_params_ and all_gather_coalesced (partition_parameters.py), on the all-gather
  // stream: one parameter is gathered into an N x partition buffer it then views; several
  // into one flat buffer of N x their partitions, copied out into each at the first wait.
  StreamGuard on(runtime_, allgather_stream_);
  const auto world = static_cast<std::int64_t>(config_.world_size);
  auto handle = std::make_shared<Handle>();
  std::vector<std::size_t> sorted(params);
  std::sort(sorted.begin(), sorted.end());
  handle->params = sorted;
  handle->waiting = sorted.size();
  std::int64_t partitions = 0;
  for (const std::size_t i : sorted) {
    partitions += params_[i].partition;
    available_numel_ += params_[i].numel;
  }
  if (world == 1) {
    // _no_gather_coalesced (partition_parameters.py:1531, 60-75): the partition is the
    // whole parameter, and the parameter becomes a view of it.
    handle->copied = true;
  } else if (sorted.size() == 1) {
    Param& p = params_[sorted.front()];
    ModuleScope scope(gather_context_);
    p.data->allocate(static_cast<std::size_t>(world * p.partition) * dtype_size(dtype_of(p)));
    p.data_log = note("gathered parameter (all_gather buffer, N x partition)", p.data->nbytes());
    // _all_gather_sequential (1368): the partition's device copy goes to the asynchronous
    // all-gather, whose work holds it until it is waited.
    handle->device_copy = to_device(p);
    handle->device_copy_log = copy_log_;
    handle->copied = true;
  } else {
    handle->flat = make("all-gather flat buffer (N x sum of partitions)", world * partitions,
                        dtype_of(params_[sorted.front()]), gather_context_, handle->log);
    // _all_gather_dtype (1332): torch.cat of each partition's device copy into this rank's
    // slice; the copies go when the cat returns.
    std::vector<std::pair<Tensor, std::size_t>> copies;
    for (const std::size_t i : sorted) {
      Tensor copy = to_device(params_[i]);
      copies.emplace_back(std::move(copy), copy_log_);
    }
    for (auto& [copy, log] : copies) release(copy, log);
  }
  for (const std::size_t i : sorted) {
    params_[i].status = Status::Inflight;
    params_[i].handle = handle;
  }
}

void ZeroStage3::wait(std::size_t index) {
  std::shared_ptr<Handle> handle = std::move(params_[index].handle);
  if (!handle->copied) {
    // AllGatherCoalescedHandle.wait (partition_parameters.py:784): every parameter of the
    // handle gets its own copy out of the flat buffer.
    StreamGuard on(runtime_, allgather_stream_);
    ModuleScope scope(gather_context_);
    for (const std::size_t i : handle->params) {
      Param& p = params_[i];
      p.data->allocate(static_cast<std::size_t>(p.numel) * dtype_size(dtype_of(p)));
      p.data_log = note("gathered parameter (copy out of the flat buffer)", p.data->nbytes());
    }
    handle->copied = true;
  }
  for (const std::size_t i : handle->params) params_[i].status = Status::Available;
  if (handle->device_copy.defined()) release(handle->device_copy, handle->device_copy_log);
  // The flat buffer goes when the last parameter waiting on it leaves the registry.
  if (--handle->waiting == 0 && handle->flat.defined()) release(handle->flat, handle->log);
}

std::vector<std::size_t> ZeroStage3::params_to_release(const Hooked& m) {
  // __params_to_release (634-665): not the persistent ones, not those whose next use a
  // prefetch already passed, nor those used again within max_reuse_distance elements.
  std::vector<std::size_t> out;
  for (const std::size_t p : m.params) {
    const auto it = fetched_for_.find(p);
    if (!params_[p].persistent && (it == fetched_for_.end() || it->second <= step_id_)) out.push_back(p);
  }
  double traversed = 0;
  for (std::size_t s = static_cast<std::size_t>(step_id_); s < submodule_order_.size() && !out.empty(); ++s) {
    if (traversed >= config_.max_reuse_distance) break;
    for (const std::size_t p : modules_[submodule_order_[s]].params) {
      out.erase(std::remove(out.begin(), out.end(), p), out.end());
      traversed += static_cast<double>(params_[p].numel);
    }
  }
  return out;
}

void ZeroStage3::release_module(const Hooked& m, bool forward) {
  // release_sub_module (494-535): with no complete trace, all of the module's parameters.
  std::vector<std::size_t> to_release = trace_mode_ == Trace::Complete ? params_to_release(m) : m.params;
  std::vector<std::size_t> module_params = m.params;
  const std::size_t i = static_cast<std::size_t>(&m - modules_.data());
  if (!forward) {
    // The recompute's frozen parameters go with the module, persistent ones aside.
    for (const std::size_t p : modules_[i].recompute_params) {
      if (!params_[p].persistent) to_release.push_back(p);
    }
    module_params = take_backward_params(modules_[i]);
    active_backward_.erase(std::remove(active_backward_.begin(), active_backward_.end(), i), active_backward_.end());
  }
  for (const std::size_t p : module_params) {
    leave_active(p, m.module);
    if (std::find(to_release.begin(), to_release.end(), p) != to_release.end()) release_param(p);
  }
}

std::vector<std::size_t> ZeroStage3::take_backward_params(Hooked& m) {
  std::vector<std::size_t> out = m.params;
  for (const std::size_t p : m.recompute_params) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  m.recompute_params.clear();
  return out;
}

void ZeroStage3::leave_active(std::size_t param, const Module* module) {
  std::vector<const Module*>& active = params_[param].active;
  const auto it = std::find(active.begin(), active.end(), module);
  if (it != active.end()) active.erase(it);
}

void ZeroStage3::release_param(std::size_t index) {
  // __release_param (624-632): only a gathered parameter no active module holds.
  Param& p = params_[index];
  if (p.status != Status::Available || !p.active.empty()) return;
  p.data->free();
  if (p.data_log < log_.size()) log_[p.data_log].freed = stage();
  p.data_log = SIZE_MAX;
  p.status = Status::NotAvailable;
  available_numel_ -= p.numel;
}

void ZeroStage3::release_backward_leftovers() {
  // release_backward_leftovers (554-567): modules whose post-backward hook never fired (the
  // first layer, whose input needs no grad), their persistent parameters kept.
  while (!active_backward_.empty()) {
    Hooked& m = modules_[active_backward_.back()];
    active_backward_.pop_back();
    for (const std::size_t p : take_backward_params(m)) {
      leave_active(p, m.module);
      if (!params_[p].persistent) release_param(p);
    }
  }
}

void ZeroStage3::release_and_reset_all() {
  // release_and_reset_all (537-552), at the step: every parameter partitioned again.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].handle) wait(i);
    params_[i].active.clear();
    release_param(i);
  }
}

void ZeroStage3::gather_persistent() {
  // _post_step (stage3.py:2566): the persistent parameters gathered, each into its own N x
  // partition buffer (partition_parameters.py:2024), kept until the next step.
  const auto world = static_cast<std::int64_t>(config_.world_size);
  ModuleScope scope(gather_context_);
  // _allgather_params_coalesced (1994-2060): under offload_param every partition's device copy
  // first (local_tensors, 2014), then each gathered buffer; the copies go on return.
  std::vector<std::pair<Tensor, std::size_t>> copies;
  if (world > 1) {
    for (Param& p : params_) {
      if (!p.persistent || p.status != Status::NotAvailable) continue;
      Tensor copy = to_device(p);
      copies.emplace_back(std::move(copy), copy_log_);
    }
  }
  for (Param& p : params_) {
    if (!p.persistent || p.status != Status::NotAvailable) continue;
    if (world == 1) {  // no gather: a view of the partition
      p.status = Status::Available;
      continue;
    }
    p.data->allocate(static_cast<std::size_t>(world * p.partition) * dtype_size(dtype_of(p)));
    p.data_log = note("gathered parameter (blocking coalesced all_gather, N x partition)", p.data->nbytes());
    p.status = Status::Available;
  }
  for (auto& [copy, log] : copies) release(copy, log);
}

// --- the gradients (stage3.py) -------------------------------------------------------------

void ZeroStage3::pre_backward() { phase_ = Phase3::Backward; }

void ZeroStage3::grad_ready(TensorImpl& param) {
  const auto it = index_.find(&param);
  if (it == index_.end()) return;
  Param& p = params_[it->second];
  Tensor t = p.tensor;
  if (!t.grad().defined()) return;
  // reduce_independent_p_g_buckets_and_remove_grads (1519-1539): a full bucket is reduced
  // first; the gradient is copied into the bucket (its own block freed) when it fits there.
  const auto limit = static_cast<std::int64_t>(config_.reduce_bucket_size);
  if (bucket_elements_ + p.numel > limit && bucket_elements_ > 0) reduce_bucket();
  if (bucket_elements_ + p.numel <= limit) {
    t.reset_grad();
  } else {
    p.held_grad = t.grad();  // reduced from its own block (__avg_scatter_grads)
  }
  in_bucket_.push_back(it->second);
  bucket_elements_ += p.numel;
}

void ZeroStage3::reduce_bucket() {
  // __reduce_and_partition_ipg_grads (1570-1615) -> reduce_scatter_coalesced
  // (comm/coalesced_collectives.py:170-199), on the reduction stream: each gradient's N
  // chunks interleaved rank by rank, short chunks padded, in one torch.cat; a single
  // gradient that splits evenly is reduced in place.
  if (in_bucket_.empty()) return;
  StreamGuard on(runtime_, reduce_stream_);
  std::sort(in_bucket_.begin(), in_bucket_.end());
  const auto world = static_cast<std::int64_t>(config_.world_size);
  const bool in_place = in_bucket_.size() == 1 && params_[in_bucket_.front()].numel % world == 0;
  if (!in_place) {
    std::vector<std::pair<Tensor, std::size_t>> paddings;
    std::int64_t partitions = 0, padded_chunks = 0;
    for (const std::size_t i : in_bucket_) {
      const Param& p = params_[i];
      partitions += p.partition;
      padded_chunks += world - p.numel / p.partition;  // the ranks whose chunk falls short
    }
    if (padded_chunks <= kMaxPaddings) {
      for (std::int64_t r = 0; r < world; ++r) {
        for (const std::size_t i : in_bucket_) {
          const Param& p = params_[i];
          const std::int64_t chunk = std::clamp<std::int64_t>(p.numel - r * p.partition, 0, p.partition);
          if (chunk < p.partition) {
            std::size_t log = SIZE_MAX;
            Tensor pad = make("reduce-scatter padding", p.partition - chunk, dtype_, bucket_context_, log);
            paddings.emplace_back(std::move(pad), log);
          }
        }
      }
    } else {
      // Far more ranks than elements (hundreds of thousands of tiny paddings): one block per
      // gradient for its paddings, each counted as the 512 B block the allocator gives it, so
      // that the work stays bounded by the bucket, not the world size.
      for (const std::size_t i : in_bucket_) {
        const Param& p = params_[i];
        const std::int64_t short_chunks = world - p.numel / p.partition;
        std::size_t log = SIZE_MAX;
        Tensor pad = make("reduce-scatter paddings (one block for " + std::to_string(short_chunks) + ")",
                          short_chunks * 512, DType::U8, bucket_context_, log);
        paddings.emplace_back(std::move(pad), log);
      }
    }
    std::size_t flat_log = SIZE_MAX;
    Tensor flat = make("reduce-scatter buffer (N x sum of partitions, interleaved)", world * partitions, dtype_,
                       bucket_context_, flat_log);
    while (!paddings.empty()) {
      release(paddings.back().first, paddings.back().second);
      paddings.pop_back();
    }
    // partition_grads: this rank's reduced chunk is copied into grad_partitions_.
    release(flat, flat_log);
  }
  if (offload()) {
    // partition_grads (1886-1932) with the gradient partitions on the host: each partition of
    // real data (a rank past the parameter's end has none, 1892-1896) is copied there, then
    // back to the device for the rest (grad_buffer.to(grad_partition.device)), kept until the
    // next one; at the accumulation boundary _offload_grad_partition_at_boundary (1393-1410):
    // its norm through an fp64 copy (_constant_buffered_norm2, 1843-1850: the norm, its square,
    // the root kept until the step), then an fp32 copy sent into the host's fp32 gradient.
    const auto rank = static_cast<std::int64_t>(config_.rank);
    for (const std::size_t i : in_bucket_) {
      const Param& p = params_[i];
      if (p.partition * rank >= p.numel) continue;
      ModuleScope scope(gradients_context_);
      Tensor on_device = empty(runtime_, Shape{p.partition}, dtype_);
      std::size_t log = SIZE_MAX;
      Tensor fp64 = make("fp64 gradient partition (grad norm)", p.partition, DType::F64, gradients_context_, log);
      Tensor norm = empty(runtime_, Shape{}, DType::F64);
      Tensor squared = empty(runtime_, Shape{}, DType::F64);
      norms_.push_back(empty(runtime_, Shape{}, DType::F64));
      norm = squared = Tensor{};
      release(fp64, log);
      Tensor fp32 = make("fp32 gradient partition (to the host)", p.partition, DType::F32, gradients_context_, log);
      release(fp32, log);
    }
  }
  for (const std::size_t i : in_bucket_) {
    Param& p = params_[i];
    p.held_grad = Tensor{};
    Tensor(p.tensor).reset_grad();
  }
  in_bucket_.clear();
  bucket_elements_ = 0;
}

void ZeroStage3::finalize_backward() {
  // independent_gradient_partition_epilogue (1357), then backward_epilogue (2790-2802).
  reduce_bucket();
  release_backward_leftovers();
}

// --- the step (stage3.py step()) -----------------------------------------------------------

void ZeroStage3::step() {
  phase_ = Phase3::Optimizer;
  release_and_reset_all();
  if (offload()) {
    // complete_grad_norm_calculation_for_cpu_offload (1858-1880): the norms summed on the device
    // (scalars); then per sub group DeepSpeedCPUAdam on the host, its moments made at the first
    // step, pageable (ops/adam/cpu_adam.py:141-162), and the master copied into the bf16 flat
    // partition in place.
    {
      ModuleScope scope(temporaries_context_);
      Tensor total = empty(runtime_, Shape{1}, DType::F32);
      Tensor root = empty(runtime_, Shape{}, DType::F32);
    }
    if (moments_.empty() && optimizer_.kind == OptimizerKind::Adam) {
      for (const std::int64_t n : sub_groups_) {
        std::size_t entry = SIZE_MAX;
        moments_.push_back(host("exp_avg", n, DType::F32, false, entry));
        moments_.push_back(host("exp_avg_sq", n, DType::F32, false, entry));
      }
    }
    norms_.clear();
    gather_persistent();
    return;
  }
  // _get_norm_groups (2285-2302): each partition in fp64 for its norm, the norms kept and
  // stacked.
  {
    ModuleScope scope(temporaries_context_);
    std::vector<Tensor> norms;
    for (const Param& p : params_) {
      if (!p.trainable) continue;
      std::size_t log = SIZE_MAX;
      Tensor d = make("fp64 gradient partition (grad norm)", p.partition, DType::F64, temporaries_context_, log);
      norms.push_back(empty(runtime_, Shape{}, DType::F64));
      release(d, log);
    }
    const auto n = static_cast<std::int64_t>(norms.size());
    Tensor stacked = empty(runtime_, Shape{n}, DType::F64);
    Tensor squared = empty(runtime_, Shape{n}, DType::F64);
    stacked = Tensor{};
    Tensor total = empty(runtime_, Shape{}, DType::F64);
    squared = Tensor{};
    while (!norms.empty()) norms.pop_back();
  }
  // Per sub group: _prepare_sub_group (the gradient partitions flattened, then as fp32), the
  // optimizer's step (FusedAdam's moments at the first), _release_sub_group.
  const bool first = moments_.empty();
  for (std::size_t g = 0; g < sub_groups_.size(); ++g) {
    const std::int64_t n = sub_groups_[g];
    std::size_t flat_log = SIZE_MAX, grad_log = SIZE_MAX, entry = SIZE_MAX;
    // One gradient partition flattens to a view of itself, and .float() of an fp32 one is itself.
    Tensor flat;
    if (sub_group_params_[g] > 1) {
      flat = make("flat " + std::string(dtype_name(dtype_)) + " gradient (flatten of the partitions)", n, dtype_,
                  temporaries_context_, flat_log);
    }
    Tensor fp32;
    if (dtype_ != DType::F32) {
      fp32 = make("fp32 gradient partition", n, DType::F32, temporaries_context_, grad_log);
      if (flat.defined()) release(flat, flat_log);
    } else {
      fp32 = std::move(flat);
      grad_log = flat_log;
    }
    if (first && optimizer_.kind == OptimizerKind::Adam) {
      moments_.push_back(make("exp_avg", n, DType::F32, optimizer_context_, entry));
      moments_.push_back(make("exp_avg_sq", n, DType::F32, optimizer_context_, entry));
    } else if (first && optimizer_.kind == OptimizerKind::SGD && optimizer_.momentum != 0) {
      moments_.push_back(make("momentum_buffer", n, DType::F32, optimizer_context_, entry));
    }
    release(fp32, grad_log);
  }
  gather_persistent();
}

}  // namespace mem::nn::detail
