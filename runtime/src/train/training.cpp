// training.cpp — the training step (zero_grad, upload, forward + loss, backward,
// optimizer) with per-phase allocator statistics, and train() for sweeps.
#include "vramscope/runtime/training.hpp"

#include <algorithm>
#include <numeric>
#include <chrono>
#include <cmath>
#include <limits>

#include "parallel/data_parallel.hpp"
#include "parallel/fully_shard.hpp"
#include "parallel/nn_data_parallel.hpp"
#include "parallel/pipeline_parallel.hpp"
#include "parallel/tensor_parallel.hpp"
#include "parallel/zero_redundancy.hpp"
#include "parallel/zero_stage3.hpp"
#include "engine/detail.hpp"
#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "vramscope/instrumentation/peaks.hpp"

namespace mem::nn {
namespace {

constexpr std::size_t kAll = static_cast<std::size_t>(StatType::All);

}  // namespace

namespace detail {
/// Per-phase peaks from the allocator's event totals (an observer), instead of
/// resetting the allocator's peak statistics at every phase boundary.
class PhasePeaks final : public AllocatorObserver {
 public:
  void on_event(const TraceEvent& e) noexcept override { (void)totals.update(e); }
  PeakTotals totals;
};
}  // namespace detail

namespace {

PhaseStats begin_phase(CachingAllocator& alloc, detail::PhasePeaks& peaks) {
  const DeviceStats s = alloc.stats();
  peaks.totals.start(s);
  PhaseStats p;
  p.allocated_begin = s.allocated_bytes[kAll].current;
  p.allocations = s.allocation[kAll].allocated;
  return p;
}

void end_phase(CachingAllocator& alloc, const detail::PhasePeaks& peaks, PhaseStats& p) {
  const DeviceStats s = alloc.stats();
  p.allocated_end = s.allocated_bytes[kAll].current;
  p.peak_allocated = peaks.totals.allocated;
  p.reserved_end = s.reserved_bytes[kAll].current;
  p.peak_reserved = peaks.totals.reserved;
  p.device_used_end = s.device_used_bytes.current;
  p.peak_device_used = peaks.totals.device_used;
  p.allocations = s.allocation[kAll].allocated - p.allocations;
}

/// Selective checkpointing names PyTorch's operators: it needs a model that runs them (an
/// operator-level model) and non-reentrant checkpointed modules, whose checkpoints it is given
/// to (apply_activation_checkpointing's checkpoint_wrapper with a context_fn). A checkpoint
/// written in the model's own forward (inline code) stays as the model has it.
void apply_selective(const TrainConfig& config, Model& model) {
  const ModelInfo& info = model.info();
  if (info.operators == 0) {
    throw Error("selective checkpointing keeps PyTorch operators' outputs, and " + info.name +
                " is a model of modules, not of operators; record it at the operator level first "
                "(python3 -m vramscope.export ... writes one) or checkpoint whole modules");
  }
  const SelectivePolicy& selective = *config.selective;
  if (selective.empty()) throw Error("selective checkpointing: the policy keeps no operator");
  // One region policy per distinct list (a scope's, or the one for every other module).
  std::vector<std::pair<const std::vector<std::string>*, std::shared_ptr<const SelectivePolicy>>> policies;
  std::vector<bool> scope_used(selective.scopes.size(), false);
  std::size_t given = 0;
  for (Module* m : named_modules(model.body())) {
    if (m->checkpoint_mark() == CheckpointMark::None || m->is_inline()) continue;
    const std::vector<std::string>* ops = selective.for_module(m->path(), m->type_name());
    for (std::size_t k = 0; k < selective.scopes.size(); ++k) scope_used[k] = scope_used[k] || ops == &selective.scopes[k].save;
    if (ops == nullptr) continue;
    if (m->checkpoint_mark() == CheckpointMark::Reentrant) {
      throw Error("selective checkpointing runs under non-reentrant checkpoints only, and " + m->path() +
                  " is checkpointed reentrant (PyTorch: \"Passing `context_fn` or `debug` is only supported when "
                  "use_reentrant=False\")");
    }
    auto it = std::find_if(policies.begin(), policies.end(), [&](const auto& p) { return p.first == ops; });
    if (it == policies.end()) {
      it = policies.insert(policies.end(), {ops, std::make_shared<const SelectivePolicy>(SelectivePolicy{*ops, {}})});
    }
    m->set_selective_policy(it->second);
    ++given;
  }
  for (std::size_t k = 0; k < selective.scopes.size(); ++k) {
    if (!scope_used[k]) {
      throw Error("selective checkpointing: the scope '" + selective.scopes[k].modules + "' names no checkpointed "
                  "module of " + info.name + " (a module's path or type name, '*' for any characters; checkpoint "
                  "it with --checkpoint-modules)");
    }
  }
  if (given == 0) {
    throw Error("selective checkpointing applies inside checkpointed modules, and " + info.name +
                " checkpoints none here; name them (--checkpoint-modules, TrainConfig::checkpoint_modules)");
  }
}

/// torch.compile's step for `model` (TrainConfig::compile): what the file recorded, refused
/// where the run is not the recorded one or adds what the compiled graphs do not model.
std::unique_ptr<CompiledStep> make_compiled(const TrainConfig& config, Model& model) {
  const ModelInfo& info = model.info();
  if (!info.compiled) {
    throw Error("--compile: " + info.name + " has no compiled step recorded; record one with "
                "python3 -m vramscope.export ... --compile (an operator-level file)");
  }
  const CompiledModel& c = *info.compiled;
  if (config.parallel.engine != ParallelEngine::None) throw Error("--compile with --parallel is not modelled yet");
  if (config.segments > 1 || config.checkpoint_modules || config.selective || info.checkpointed_modules > 0) {
    throw Error("--compile with activation checkpointing is not modelled: torch.compile's partitioner decides what "
                "the step recomputes (give --compile=BUDGET, an activation_memory_budget, instead)");
  }
  if (config.offload_activations) throw Error("--compile with --offload activations is not modelled");
  if (config.mode == ExecMode::Compute) {
    throw Error("--compile runs dry: the compiled graphs' kernels are inductor's, not computed here (leave out --compute)");
  }
  if (autocast_dtype(config.precision)) {
    throw Error("--compile under autocast is not modelled yet: run the recorded dtype (--dtype bf16)");
  }
  const std::int64_t seq = config.model_options.size("seq").value_or(c.seq);
  if (!c.fixed.empty() && (info.batch != c.batch || (c.seq > 0 && seq != c.seq))) {
    throw Error("--compile: the compiled step was recorded at batch " + std::to_string(c.batch) +
                (c.seq > 0 ? ", sequence " + std::to_string(c.seq) : std::string()) + "; this run asks batch " +
                std::to_string(info.batch) + (c.seq > 0 ? ", sequence " + std::to_string(seq) : std::string()) +
                " (" + c.fixed + "; record the file at that size)");
  }
  if (config.compile->cudagraphs && config.steps < kCudaGraphSteps) {
    throw Error("--compile reduce-overhead: CUDA graph trees warm each graph up at its first call, record it at the "
                "second and replay it from the third: run " + std::to_string(kCudaGraphSteps) +
                " steps or more (this run asks " +
                std::to_string(config.steps) + ")");
  }
  if (config.compile->cudagraphs && config.accumulation > 1) {
    throw Error("--compile reduce-overhead with gradient accumulation is not modelled (the graphs' gradients are "
                "added into .grad between replays)");
  }
  return std::make_unique<CompiledStep>(info.compiled, *config.compile, model.body());
}

}  // namespace

std::optional<DType> autocast_dtype(Precision p) noexcept {
  if (p == Precision::Amp) return DType::F16;
  if (p == Precision::AmpBF16) return DType::BF16;
  return std::nullopt;
}

std::string_view precision_name(Precision precision) noexcept {
  switch (precision) {
    case Precision::F32: return "f32";
    case Precision::F16: return "f16";
    case Precision::BF16: return "bf16";
    case Precision::Amp: return "amp";
    case Precision::AmpBF16: return "amp-bf16";
  }
  return "unknown";
}

Precision parse_precision(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return Precision::F32;
  if (name == "f16" || name == "fp16" || name == "half") return Precision::F16;
  if (name == "bf16" || name == "bfloat16") return Precision::BF16;
  if (name == "amp" || name == "amp-f16") return Precision::Amp;
  if (name == "amp-bf16") return Precision::AmpBF16;
  throw Error("unknown precision '" + std::string(name) + "'; expected f32, f16, bf16, amp or amp-bf16");
}

DType parameter_dtype(Precision precision) noexcept {
  switch (precision) {
    case Precision::F16: return DType::F16;
    case Precision::BF16: return DType::BF16;
    default: return DType::F32;
  }
}

std::string device_spec_for(const TrainConfig& config) {
  std::string spec = config.device;
  if (config.mode != ExecMode::Compute || spec.rfind("sim", 0) != 0 || spec.find("backing=") != std::string::npos) {
    return spec;
  }
  if (spec == "sim" || spec == "sim:") return "sim:" + default_sim_preset() + ",backing=host";
  return spec + ",backing=host";
}

Trainer::Trainer(const TrainConfig& config, CachingAllocator& allocator)
    : config_(config), allocator_(&allocator) {
  runtime_ = std::make_unique<Runtime>(allocator, config.mode, config.seed);
  runtime_->set_stack(config.stack);
  if (!config.model) throw Error("TrainConfig.model is not set: give one, e.g. mem::models::find(\"mlp\")");
  model_ = config.model->build(config.model_options);
  if (config.parallel.engine == ParallelEngine::Dp) {
    // nn.DataParallel runs the module on torch.chunk's piece of the batch on each GPU.
    dp_batch_ = model_->info().batch;
    const std::size_t gpus = config.parallel.world_size;
    const std::int64_t chunk = chunk_size(dp_batch_, gpus, config.parallel.rank);
    if (chunk <= 0) {
      const std::int64_t piece = chunk_size(dp_batch_, gpus, 0);
      throw Error("dp:" + std::to_string(gpus) + ": torch.chunk cuts a batch of " + std::to_string(dp_batch_) +
                  " into " + std::to_string((dp_batch_ + piece - 1) / piece) + " pieces of at most " +
                  std::to_string(piece) + ", and GPU " + std::to_string(config.parallel.rank) +
                  " gets none: DataParallel leaves it idle, holding nothing of the step; give a batch that "
                  "gives each GPU a sample (a multiple of " + std::to_string(gpus) + " does)");
    }
    if (config.offload_activations) {
      // parallel_apply runs each replica in a thread of its own, passing on grad mode and
      // autocast only: save_on_cpu's hooks (thread-local) never see the replicas' forwards.
      throw Error("dp (nn.DataParallel) with --offload activations is not modelled: parallel_apply runs each "
                  "replica in a thread of its own, where save_on_cpu's thread-local hooks do not apply; leave "
                  "--offload out");
    }
    if (config.input_requires_grad) {
      throw Error("dp (nn.DataParallel) with an input that requires grad is not modelled yet (Scatter's backward "
                  "gathers the whole input's gradient on GPU 0); leave --input-requires-grad out");
    }
    ModelOptions per_gpu = config.model_options;
    per_gpu.batch = chunk;
    model_ = config.model->build(per_gpu);
  }
  if (const std::size_t ring = config.parallel.context_parallel; ring > 1) {
    // context_parallel() shards the batch on the sequence before the forward: each GPU runs
    // the model on its 1/C (two chunks of 1/2C each under the load balancer), and sequence
    // parallel inside splits that share over the tensor-parallel ranks again.
    const ModelInfo& info = model_->info();
    if (info.input_dtype != DType::I64 || info.input_shape.size() != 2) {
      throw Error("cp:" + std::to_string(ring) + " splits a sequence of tokens over the GPUs; " + info.name +
                  " takes " + info.input_shape.str() + " " + std::string(dtype_name(info.input_dtype)) +
                  " (a transformers decoder does)");
    }
    const auto chunks = static_cast<std::int64_t>(config.parallel.cp_load_balance ? 2 * ring : ring);
    const auto tp = static_cast<std::int64_t>(config.parallel.tensor_parallel);
    const std::int64_t multiple = std::lcm(chunks, static_cast<std::int64_t>(ring) * tp);
    if (info.input_shape[1] % multiple != 0) {
      throw Error("cp:" + std::to_string(ring) + " splits each sequence into " + std::to_string(chunks) + " chunks" +
                  (config.parallel.cp_load_balance ? " (the load balancer gives each GPU two)" : "") +
                  (tp > 1 ? " and sequence parallel each GPU's share over tp:" + std::to_string(tp) : std::string{}) +
                  "; give a sequence length that is a multiple of " + std::to_string(multiple) + ", not " +
                  std::to_string(info.input_shape[1]));
    }
    ModelOptions per_rank = config.model_options;
    per_rank.seq = info.input_shape[1] / static_cast<std::int64_t>(ring);
    model_ = config.model->build(per_rank);
    runtime_->set_context_parallel(ContextParallel{ring, config.parallel.rank % ring, config.parallel.cp_load_balance,
                                                   config.parallel.cp_all_to_all});
  }
  {
    // Expert parallel: the model is one rank's recording under it (its all-to-alls and its
    // share of the experts are in the graph), made for one number of ranks.
    const ModelInfo& info = model_->info();
    const std::size_t ep = config.parallel.expert_parallel;
    if (info.expert_parallel > 0 && ep != info.expert_parallel) {
      const std::string n = std::to_string(info.expert_parallel);
      throw Error(info.name + " is one GPU's recording under expert parallel over " + n + " GPUs (its experts and "
                  "all-to-alls are in it): give --parallel ep:" + n + ", or fsdp:M with ep_size=" + n +
                  (ep > 1 ? ", or record it again with vramscope.export --expert-parallel " + std::to_string(ep)
                          : std::string{}));
    }
    if (ep > 1 && info.expert_parallel == 0) {
      throw Error("expert parallel over " + std::to_string(ep) + " GPUs runs a mixture of experts recorded under it: " +
                  info.name + " is not; record it with python3 -m vramscope.export --hf-config CONFIG.json "
                  "--expert-parallel " + std::to_string(ep) + " (or give --hf-config to the command)");
    }
    if (ep > 1) runtime_->set_collective_ranks(ep);
  }
  if (config.accumulation > 1 && config.parallel.enabled()) {
    throw Error("gradient accumulation is modelled on one GPU only (DDP's no_sync, FSDP's and ZeRO's "
                "accumulation keep other buffers); give accumulation 1 with --parallel");
  }
  if (config.checkpoint_modules) {
    if (config.segments > 1) {
      throw Error("checkpoint modules and checkpoint_sequential's segments both given: the segments would "
                  "checkpoint the named modules again; give one of them");
    }
    mark_checkpointed(model_->body(), *config.checkpoint_modules, config.checkpoint_mode);
  }
  if (config.segments > 1 && !config.checkpoint_modules && model_->info().checkpointed_modules > 0) {
    throw Error(model_->info().name + " checkpoints " + std::to_string(model_->info().checkpointed_modules) +
                " of its modules itself (checkpoint marks); checkpoint_sequential's segments do not apply to it: "
                "give 0 segments, or remove the marks");
  }
  plan_ = plan_segments(model_->info().sequence_length, config.segments);
  if (config.selective) apply_selective(config, *model_);
  // Blocks carry their module and phase (what the peak's composition is read from); the
  // observer follows them from the first parameter on.
  attach(allocator);
  // A model whose output is its loss (a recorded transformers LM called with labels) computes
  // it in its own forward, outside its modules (loss_function): those blocks are the loss's.
  composition_ = std::make_unique<PeakComposition>(model_->info().loss == LossKind::None ? MemoryKind::Logits
                                                                                         : MemoryKind::Other);
  allocator.add_observer(composition_.get());
  try {
    if (config.parallel.enabled() && config.parallel.stray_contexts && config.parallel.rank == 0) {
      // Every other rank of the node made its CUDA context on GPU 0 before (or without)
      // torch.cuda.set_device: each holds about a context there (pytorch/pytorch#49481, #135279).
      const std::size_t others = std::min<std::size_t>(config.parallel.gpus(), 8) - 1;
      if (others > 0) {
        allocator.load_module("the other ranks' CUDA contexts", others * allocator.device().info().context_bytes);
      }
    }
    const bool fsdp = config.parallel.engine == ParallelEngine::Fsdp;
    const bool zero3 = config.parallel.engine == ParallelEngine::Zero3;
    const bool tp = config.parallel.tensor_parallel > 1;
    // Before the model is built (on the meta device for fsdp): FullyShard and ZeroRedundancy
    // refuse compute mode too, with the same words.
    if (config.mode == ExecMode::Compute && config.parallel.enabled() && config.parallel.engine != ParallelEngine::Ddp) {
      throw Error(std::string(config.parallel.pipeline_parallel > 1 ? "pp runs as a dry run only: its receives"
                            : config.parallel.engine == ParallelEngine::Dp ? "dp runs as a dry run only: its replicas"
                              : tp      ? "tp runs as a dry run only: its all-gathers"
                              : fsdp  ? "fsdp runs as a dry run only: its all-gathers"
                              : zero3 ? "zero3 runs as a dry run only: its all-gathers"
                                      : "zero runs as a dry run only: its collectives") +
                  " on one simulated rank bring no data from the others");
    }
    if (config.parallel.pipeline_parallel > 1) {
      if (config.offload_activations) throw Error("pp with --offload activations is not modelled yet; give one of them");
      if (plan_.checkpointed.size() > 0) {
        throw Error("pp does not combine with checkpoint_sequential's segments (each stage runs its own layers); "
                    "checkpoint the decoder layers instead (--gradient-checkpointing, --checkpoint-modules)");
      }
      if (config.optimizer.kind == OptimizerKind::Adam8bit) {
        throw Error("pp with adam8bit is not modelled yet (its state is made for the stage's parameters only); give adam");
      }
      // torchtitan's pipeline_module_split: the stage's modules only, before they are made.
      pp_ = std::make_unique<detail::PipelineParallel>(config.parallel, model_->body(), model_->info().input_shape);
    }
    if (tp) {
      if (model_->info().fused_linear_loss) {
        throw Error("tp with Liger's fused linear cross entropy (loss=liger-flce) is not modelled: the loss reads "
                    "lm_head's vocabulary-sharded weight outside lm_head's forward");
      }
      if (config.offload_activations) {
        // save_on_cpu packs what autograd saves by its size and dtype: a DTensor's are the
        // global tensor's, and its pinned copies under tensor parallel are not measured yet.
        throw Error("tp with --offload activations is not modelled yet (save_on_cpu of DTensor activations); "
                    "give one of them");
      }
      if (plan_.checkpointed.size() > 0) {
        throw Error("tp does not combine with checkpoint_sequential's segments (its plan hooks the modules); "
                    "checkpoint the decoder layers instead (--gradient-checkpointing, --checkpoint-modules)");
      }
      if (config.optimizer.kind != OptimizerKind::Adam && config.optimizer.kind != OptimizerKind::None) {
        throw Error("tp is modelled with adam and adamw (what the optimizer copies out of the embedding's "
                    "whole-table gradient) or none; " + std::string(optimizer_name(config.optimizer.kind)) +
                    " is not yet");
      }
      // parallelize_module before the parameters exist: each is declared as this rank's shard.
      tp_ = std::make_unique<detail::TensorParallel>(config.parallel, model_->body());
      const Shape& in = model_->info().input_shape;
      const auto ranks = static_cast<std::int64_t>(config.parallel.tensor_parallel);
      if (in.size() < 2 || in[1] % ranks != 0) {
        throw Error("tp:" + std::to_string(ranks) + ": sequence parallel splits the sequence over the ranks; give "
                    "a sequence length that is a multiple of " + std::to_string(ranks));
      }
    }
    if ((fsdp || zero3) && model_->info().fused_linear_loss) {
      // lm_head's hooks gather its weight around its forward, which Liger's loss skips.
      throw Error(std::string(fsdp ? "fsdp" : "zero3") + " with Liger's fused linear cross entropy (loss=liger-flce) "
                  "is not modelled: the loss reads lm_head's weight outside lm_head's forward, where the engine "
                  "gathers it");
    }
    if (zero3 && plan_.checkpointed.size() > 0) {
      throw Error("zero3 does not combine with checkpoint_sequential's segments (its hooks gather each module's "
                  "parameters as it runs); checkpoint modules instead (checkpoint marks, --gradient-checkpointing)");
    }
    if (fsdp && plan_.checkpointed.size() > 0) {
      throw Error("fsdp does not combine with checkpoint_sequential's segments (its hooks wrap the blocks); "
                  "checkpoint the blocks themselves instead (checkpoint marks, --gradient-checkpointing)");
    }
    {
      // FSDP2 at scale: the model is built on the meta device and fully_shard materializes
      // only the shards (init=cuda builds it whole on the GPU first).
      std::optional<MetaParameters> meta;
      if ((fsdp && config.parallel.meta_init) || (zero3 && config.parallel.zero3_init)) meta.emplace();
      // nn.DataParallel: the module lives on GPU 0; the others hold a replica per forward.
      if (config.parallel.engine == ParallelEngine::Dp && config.parallel.rank != 0) meta.emplace();
      model_->materialize(*runtime_, parameter_dtype(config.precision));
    }
    if (tp_) tp_->materialized();
    model_->body().train(true);
    if (config.parallel.engine == ParallelEngine::Ddp) {
      // model = DistributedDataParallel(model) before the optimizer is made, as scripts do.
      ddp_ = std::make_unique<detail::DataParallel>(config.parallel, model_->body(), *runtime_);
      runtime_->set_grad_ready_hook([ddp = ddp_.get()](detail::TensorImpl& leaf) { ddp->grad_ready(leaf); });
    } else if (config.parallel.engine == ParallelEngine::Dp) {
      // model = nn.DataParallel(model).cuda(): GPU 0 holds it; the optimizer is made there.
      dp_ = std::make_unique<detail::NnDataParallel>(config.parallel, model_->body(), *runtime_);
      runtime_->set_grad_ready_hook([dp = dp_.get()](detail::TensorImpl& leaf) { dp->grad_ready(leaf); });
    } else if (fsdp) {
      fsdp_ = std::make_unique<detail::FullyShard>(config.parallel, model_->body(), *runtime_,
                                                   model_->info().fsdp_groups);
      if (pp_) fsdp_->label_with(&pp_->action());
      if (pp_ && pp_->stages_per_rank() > 1) fsdp_->assign_stages(model_->body(), pp_->parts());
    } else if (config.parallel.engine != ParallelEngine::None) {
      // deepspeed.initialize: ZeRO's optimizer wraps the one the config names.
      if (zero3) {
        zero_ = std::make_unique<detail::ZeroStage3>(config.parallel, config.optimizer, model_->body(), *runtime_);
      } else {
        zero_ = std::make_unique<detail::ZeroRedundancy>(config.parallel, config.optimizer, model_->body(), *runtime_);
      }
      runtime_->set_post_accumulate_grad_hook([zero = zero_.get()](detail::TensorImpl& leaf) { zero->grad_ready(leaf); });
    }
    if (config.compile) compiled_ = make_compiled(config, *model_);
    // After fully_shard, model.parameters() are the shards.
    if (!zero_ && !(dp_ && !dp_->holds_module())) {
      optimizer_ = make_optimizer(config.optimizer, fsdp_ ? fsdp_->parameters() : model_->parameters());
    }
  } catch (...) {
    allocator.remove_observer(composition_.get());  // the destructor will not run
    runtime_->set_grad_ready_hook(nullptr);
    runtime_->set_post_accumulate_grad_hook(nullptr);
    ddp_.reset();
    dp_.reset();
    fsdp_.reset();
    zero_.reset();
    tp_.reset();
    pp_.reset();
    throw;
  }
  peaks_ = std::make_unique<detail::PhasePeaks>();
  allocator.add_observer(peaks_.get());
}

Trainer::~Trainer() {
  allocator_->remove_observer(peaks_.get());
  allocator_->remove_observer(composition_.get());
  runtime_->set_grad_ready_hook(nullptr);
  runtime_->set_post_accumulate_grad_hook(nullptr);
  optimizer_.reset();
  ddp_.reset();
  dp_.reset();
  fsdp_.reset();
  zero_.reset();
  tp_.reset();
  pp_.reset();
  if (model_) model_->body().release();
}

const ModelInfo& Trainer::info() const noexcept { return model_->info(); }

Tensor Trainer::run_forward(const Tensor& input) {
  if (plan_.checkpointed.empty()) return model_->body()(input);
  CheckpointOptions options;
  options.mode = config_.checkpoint_mode;
  const auto modules = model_->body().modules();
  return checkpoint_sequential(modules, config_.segments, input, options);
}

Tensor Trainer::loss_of(const Tensor& output, const Tensor& target) {
  // Under loss_parallel the logits are the rank's vocabulary: the loss is tensor parallel's.
  return tp_ && tp_->loss_parallel() ? tp_->causal_lm_loss(output, target) : model_->loss(output, target);
}

void Trainer::data_parallel_step(StepStats& s, DType data_dtype, Tensor& input, Tensor& target, Tensor& output,
                                 Tensor& loss) {
  Runtime& rt = *runtime_;
  CachingAllocator& alloc = *allocator_;
  static const ContextId input_ctx = intern_context("input", Phase::Forward);
  static const ContextId loss_fwd = intern_context("loss", Phase::Forward);
  static const ContextId loss_bwd = intern_context("loss", Phase::Backward);
  const bool gpu0 = dp_->holds_module();
  // A model that computes its own loss (a transformers LM called with labels) does so in each
  // replica, on its piece of the labels, which DataParallel scatters like the inputs.
  const bool own_loss = model_->info().loss == LossKind::CausalLM;
  const std::int64_t rows = model_->info().batch;
  Tensor edge;  // a replica's output (or loss), gone to GPU 0: where its backward starts
  {
    PhaseGuard phase(Phase::Forward);
    {
      ModuleScope scope(input_ctx);
      if (gpu0) {
        // The training loop's batch on GPU 0 (input.cuda()), whole, and the target beside it;
        // scatter's first piece of the batch is a view of it.
        const auto whole = [&](const Tensor& like) {
          Shape shape = like.shape();
          shape[0] = dp_batch_;
          return empty(rt, shape, like.dtype());
        };
        Tensor like_input, like_target;
        {
          MetaDevice shapes_only;
          like_input = model_->make_input(rt, data_dtype, s.step);
          like_target = model_->make_target(rt, data_dtype, s.step);
        }
        input = whole(like_input);
        if (like_target.defined()) target = whole(like_target);
      } else {
        // Scatter's copy of this GPU's piece (.to(device) of a slice of GPU 0's batch), and of
        // the labels' when the model takes them.
        input = model_->make_input(rt, data_dtype, s.step);
        if (own_loss) target = model_->make_target(rt, data_dtype, s.step);
      }
    }
    dp_->replicate();
    AutocastRegion autocast(rt, autocast_dtype(config_.precision));
    Tensor piece = run_forward(gpu0 ? input.narrow(0, 0, rows) : input);
    if (own_loss) {
      // The replica's forward ends with its loss (transformers' loss_function on its logits).
      Tensor piece_loss;
      {
        ModuleScope scope(loss_fwd);
        BackwardContextGuard backward_scope(loss_bwd);
        piece_loss = loss_of(piece, gpu0 ? target.narrow(0, 0, rows) : target);
      }
      if (gpu0) {
        // Gather of the output object, field by field: the logits of the whole batch, and the
        // replicas' scalar losses unsqueezed into a vector of N (_functions.py Gather.forward).
        output = dp_->gather(piece, dp_batch_, "gathered output (the whole batch's)");
        loss = dp_->gather(piece_loss.view(Shape{1}), static_cast<std::int64_t>(config_.parallel.world_size),
                           "gathered losses (one per GPU)");
      } else {
        edge = detail::gradient_edge(piece_loss);  // its loss went to GPU 0
      }
    } else if (gpu0) {
      // `out = model(x)`: the whole batch's output
      output = dp_->gather(piece, dp_batch_, "gathered output (the whole batch's)");
    } else {
      edge = detail::gradient_edge(piece);  // the output went to GPU 0
    }
    piece = Tensor{};  // parallel_apply's outputs go with DataParallel.forward's return
    // Trainer.compute_loss returns outputs["loss"] alone: the gathered logits go with the output
    // object; training_step takes the mean of the GPUs' losses (args.n_gpu > 1).
    if (own_loss) output = Tensor{};
    if (gpu0 && own_loss) {
      ModuleScope scope(loss_fwd);
      BackwardContextGuard backward_scope(loss_bwd);
      loss = mean_last(loss);
    }
    dp_->forward_done();
    if (gpu0 && !own_loss) {
      ModuleScope scope(loss_fwd);
      BackwardContextGuard backward_scope(loss_bwd);
      loss = loss_of(output, target);
    }
  }
  end_phase(alloc, *peaks_, s.forward);
  s.backward = begin_phase(alloc, *peaks_);
  {
    PhaseGuard phase(Phase::Backward);
    if (gpu0) {
      // One engine run: the loss, Gather's backward (GPU 0's piece of the gradient a view of it),
      // the replica's nodes.
      ModuleScope scope(loss_bwd);
      backward(loss);
    } else {
      // Scatter's copy of this GPU's piece of the output's (or the losses') gradient, handed to
      // the replica's first node and freed once it has run.
      Tensor grad = dp_->scattered_gradient(edge);
      backward(edge, std::move(grad));
      edge = Tensor{};
    }
    dp_->finalize_backward();
  }
}

Tensor Trainer::forward(bool with_grad) {
  std::optional<NoGradGuard> no_grad;
  if (!with_grad) no_grad.emplace();
  PhaseGuard phase(Phase::Forward);
  const DType in_dtype = is_half(parameter_dtype(config_.precision)) ? parameter_dtype(config_.precision) : DType::F32;
  const Tensor input = model_->make_input(*runtime_, in_dtype, steps_.size() + 1);
  const Tensor target = model_->make_target(*runtime_, in_dtype, steps_.size() + 1);
  AutocastRegion autocast(*runtime_, autocast_dtype(config_.precision));
  // `with torch.autograd.graph.save_on_cpu(pin_memory=True): loss = loss_fn(model(x), y)`.
  std::optional<SaveOnCpu> offload;
  if (config_.offload_activations && with_grad) offload.emplace();
  Tensor out = model_->body()(input);
  ModuleScope scope("loss", Phase::Forward);
  return loss_of(out, target);
}

StepStats Trainer::step() {
  const auto start = std::chrono::steady_clock::now();
  Runtime& rt = *runtime_;
  CachingAllocator& alloc = *allocator_;
  StepStats s;
  s.step = steps_.size() + 1;
  rt.reset_flops();
  static const ContextId input_ctx = intern_context("input", Phase::Forward);
  static const ContextId loss_fwd = intern_context("loss", Phase::Forward);
  static const ContextId loss_bwd = intern_context("loss", Phase::Backward);

  // Accumulating, only the first micro-batch of an optimizer step zeroes the gradients, and
  // only the last one steps: `(loss / k).backward()` k times, then `opt.step(); opt.zero_grad()`.
  const std::size_t k = std::max<std::size_t>(config_.accumulation, 1);
  const bool first_micro = steps_.size() % k == 0, last_micro = (steps_.size() + 1) % k == 0;
  // optimizer.zero_grad(set_to_none=True): last step's gradients go back to the cache.
  if (first_micro && optimizer_) {
    optimizer_->zero_grad(true);
  } else if (first_micro) {
    for (Tensor& p : model_->parameters()) p.reset_grad();
  }

  // The batch, target and output live until the end of the step, as the Python
  // variables of `out = model(x); loss = crit(out, y); loss.backward(); opt.step()` do.
  const DType param_dtype = parameter_dtype(config_.precision);
  const DType data_dtype = is_half(param_dtype) ? param_dtype : DType::F32;
  Tensor input, target, output, loss;

  composition_->restart();
  const double sent_before = communication_sent();
  s.forward = begin_phase(alloc, *peaks_);
  if (pp_) {
    if (tp_) tp_->begin_step();
    {
      // torchtitan's train_step moves the batch and the labels to every rank's GPU; stage 0
      // reads the one, the last stage the other.
      PhaseGuard phase(Phase::Forward);
      ModuleScope scope(input_ctx);
      input = model_->make_input(rt, data_dtype, s.step);
      target = model_->make_target(rt, data_dtype, s.step);
    }
    AutocastRegion autocast(rt, autocast_dtype(config_.precision));
    detail::PipelineParallel::Calls calls;
    // The stage module is FSDP's root when fsdp shards inside the stage: its hooks run around
    // each micro-batch's forward, and perform_reduce_grad finalizes the step's gradients.
    // Under an interleaved schedule each stage is a root of its own: the root's hooks belong to
    // the stage that holds the root's parameters, and the runtime unshards and reduces per stage.
    const bool staged = fsdp_ && pp_->stages_per_rank() > 1;
    calls.forward = [this, staged](const Tensor& x, std::size_t local) {
      if (!fsdp_ || (staged && !fsdp_->stage_has_root(local))) return pp_->stage_forward(model_->body(), local, x);
      const std::optional<std::size_t> root = staged ? std::optional<std::size_t>(local) : std::nullopt;
      return fsdp_->root_post_forward({pp_->stage_forward(model_->body(), local, fsdp_->root_pre_forward(x, root))}, root)
          .front();
    };
    calls.loss = [this](const Tensor& out, const Tensor& tgt) { return loss_of(out, tgt); };
    calls.weights = [this](std::size_t local) { return pp_->stage_weights(model_->body(), local); };
    calls.backward_begins = [&] {
      end_phase(alloc, *peaks_, s.forward);
      s.backward = begin_phase(alloc, *peaks_);
    };
    if (fsdp_) {
      fsdp_->begin_step();
      if (staged) {
        calls.unshard = [this](std::size_t local) { fsdp_->unshard_stage(local); };
        calls.wait_unshard = [this](std::size_t local) { fsdp_->wait_stage(local); };
        calls.reduce_stage = [this](std::size_t local) { fsdp_->reduce_stage(local); };
        calls.reshard = [this](std::size_t local) { fsdp_->reshard_stage(local); };
      } else {
        calls.reduce_grads = [this] { fsdp_->finalize_backward(); };
      }
    }
    // The hidden states between stages: FSDP's param_dtype when it casts the parameters (the
    // embedding's output is in it), else the parameters' dtype (autocast keeps the residual
    // stream in it).
    const DType hidden = fsdp_ && config_.parallel.param_dtype ? *config_.parallel.param_dtype : param_dtype;
    pp_->step(rt, input, target, hidden, calls);
  } else if (dp_) {
    data_parallel_step(s, data_dtype, input, target, output, loss);
  } else if (compiled_) {
    PhaseGuard phase(Phase::Forward);
    loss = compiled_->forward(rt);
  } else {
    PhaseGuard phase(Phase::Forward);
    {
      ModuleScope scope(input_ctx);
      input = model_->make_input(rt, data_dtype, s.step);
      if ((config_.input_requires_grad || model_->info().input_requires_grad) && is_floating(input.dtype())) {
        input.set_requires_grad(true);
      }
      target = model_->make_target(rt, data_dtype, s.step);
    }
    if (tp_) tp_->begin_step();
    if (ddp_) ddp_->pre_forward();  // DDP's forward: the buckets' rebuild, the buffers' broadcast
    AutocastRegion autocast(rt, autocast_dtype(config_.precision));
    // `with torch.autograd.graph.save_on_cpu(pin_memory=True):` around the forward and the loss.
    std::optional<SaveOnCpu> offload;
    if (config_.offload_activations) offload.emplace();
    output = run_forward(fsdp_ ? fsdp_->root_pre_forward(input) : input);
    const bool own_loss = model_->info().loss == LossKind::CausalLM;
    // The root's post-forward hook sees what the model returns, as DDP's sink does.
    if (fsdp_ && !own_loss) output = fsdp_->root_post_forward({std::move(output)}).front();
    // DDP's forward ends with the model's output: before the training loop's loss, or, for
    // a model that computes its own, after it (the output object holds the loss and logits).
    if (ddp_ && !own_loss) output = ddp_->post_forward({std::move(output)}).front();
    ModuleScope scope(loss_fwd);
    BackwardContextGuard backward_scope(loss_bwd);
    loss = loss_of(output, target);
    if (fsdp_ && own_loss) {
      auto hooked = fsdp_->root_post_forward({std::move(loss), std::move(output)});
      loss = std::move(hooked[0]);
      output = std::move(hooked[1]);
    }
    if (ddp_ && own_loss) {
      auto sunk = ddp_->post_forward({std::move(loss), std::move(output)});
      loss = std::move(sunk[0]);
      output = std::move(sunk[1]);
    }
    // A model that computes its own loss returns it in an output object the training loop
    // drops at once: `loss = model(input_ids=x, labels=x).loss`, and Trainer.compute_loss
    // (transformers/trainer.py) returns only the loss. The logits are gone before backward.
    if (own_loss) output = Tensor{};
  }
  if (!pp_ && !dp_) {
    end_phase(alloc, *peaks_, s.forward);
    s.backward = begin_phase(alloc, *peaks_);
  }
  if (!pp_ && !dp_) {
    PhaseGuard phase(Phase::Backward);
    ModuleScope scope(loss_bwd);
    if (zero_) zero_->pre_backward();  // engine.backward(loss)
    if (compiled_) {
      compiled_->backward(rt);
    } else {
      backward(loss);
    }
    if (ddp_) ddp_->finalize_backward();
    if (zero_) zero_->finalize_backward();
  }
  end_phase(alloc, *peaks_, s.backward);
  // (ZeRO has taken every gradient into its partition by now: .grad is None by design; an
  // nn.DataParallel replica's went to GPU 0.)
  if (!zero_ && !(dp_ && !dp_->holds_module())) {
    for (const Tensor& p : fsdp_ ? fsdp_->parameters() : model_->parameters()) {
      s.params_without_grad += p.grad().defined() ? 0 : 1;
    }
  }

  s.optimizer = begin_phase(alloc, *peaks_);
  if (last_micro && optimizer_) {
    PhaseGuard phase(Phase::Optimizer);
    // CPUOffloadPolicy: the parameters and gradients are on the host, and so the optimizer's
    // state and its step: nothing of it on the GPU.
    std::optional<MetaDevice> on_host;
    if (fsdp_ && fsdp_->offloads()) on_host.emplace();
    optimizer_->step();
  } else if (last_micro && zero_) {
    PhaseGuard phase(Phase::Optimizer);
    zero_->step();  // engine.step()
  }
  end_phase(alloc, *peaks_, s.optimizer);

  s.loss = rt.computing() ? to_values(loss)[0] : std::numeric_limits<double>::quiet_NaN();
  input = target = output = loss = Tensor{};
  if (dp_) dp_->end_step();
  if (compiled_) compiled_->end_step();

  const DeviceStats end = alloc.stats();
  s.stats = end;
  s.peak_allocated = std::max({s.forward.peak_allocated, s.backward.peak_allocated, s.optimizer.peak_allocated});
  s.peak_reserved = std::max({s.forward.peak_reserved, s.backward.peak_reserved, s.optimizer.peak_reserved});
  s.peak_device_used =
      std::max({s.forward.peak_device_used, s.backward.peak_device_used, s.optimizer.peak_device_used});
  s.peak_composition = composition_->at_peak();
  s.allocated_end = end.allocated_bytes[kAll].current;
  s.reserved_end = end.reserved_bytes[kAll].current;
  s.device_used_end = end.device_used_bytes.current;
  s.flops = rt.flops();
  s.communication_bytes = communication_sent() - sent_before;
  collectives_by_step_.push_back(runtime_->collectives().size());
  if (config_.parallel.context_parallel > 1 && runtime_->collective_sent() == 0) {
    // context_parallel() replaces F.scaled_dot_product_attention only: eager attention would
    // attend within each GPU's share of the sequence, a different model.
    throw Error("cp:" + std::to_string(config_.parallel.context_parallel) + ": " + model_->info().name +
                " ran no F.scaled_dot_product_attention, the only attention context_parallel() turns into ring "
                "attention (eager attention would attend within each GPU's share alone); give --attn sdpa");
  }
  s.recompute_ratio = s.flops.forward > 0 ? s.flops.recompute / s.flops.forward : 0.0;
  s.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  steps_.push_back(s);
  return s;
}

TrainReport Trainer::report() const {
  TrainReport r;
  r.model = model_->info();
  r.config = config_;
  r.plan = plan_;
  r.steps = steps_;
  for (const StepStats& s : steps_) {
    if (s.peak_allocated > r.peak_allocated) r.peak_composition = s.peak_composition;
    r.peak_allocated = std::max(r.peak_allocated, s.peak_allocated);
    r.peak_reserved = std::max(r.peak_reserved, s.peak_reserved);
    r.peak_device_used = std::max(r.peak_device_used, s.peak_device_used);
    r.params_without_grad = std::max(r.params_without_grad, s.params_without_grad);
  }
  r.gradients_missing = r.params_without_grad > 0;
  // Each rank's: the shards under fsdp (their padded storage).
  if (fsdp_) {
    for (const Tensor& p : fsdp_->parameters()) r.parameter_bytes += static_cast<std::int64_t>(p.storage()->nbytes());
  } else if (zero_ && zero_->parameter_bytes() >= 0) {
    r.parameter_bytes = zero_->parameter_bytes();
  } else {
    for (const Tensor& p : model_->parameters()) r.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
  }
  r.parameters_on_host = (fsdp_ && fsdp_->offloads()) || (zero_ && config_.parallel.offload_param);
  r.optimizer_state_on_host = (fsdp_ && fsdp_->offloads()) || (zero_ && config_.parallel.cpu_offload);
  r.optimizer_state_bytes = optimizer_ ? static_cast<std::int64_t>(optimizer_->state_bytes())
                             : zero_    ? static_cast<std::int64_t>(zero_->state_bytes())
                                        : 0;
  r.warnings = runtime_->warnings();
  if (r.gradients_missing) {
    r.warnings.push_back(std::to_string(r.params_without_grad) +
                         " parameters received no gradient: the lower memory is missing work, not a saving");
  }
  const DeviceInfo& info = allocator_->device().info();
  r.device_name = info.name;
  r.device_assumptions = info.assumptions;
  r.recompute_ratio = steps_.empty() ? 0.0 : steps_.back().recompute_ratio;
  r.pinned_host_bytes = static_cast<std::int64_t>(runtime_->pinned_host_bytes());
  return r;
}

std::vector<CommunicationBuffer> Trainer::communication_buffers() const {
  // A mesh: the pipeline's buffers, then FSDP's, then tensor parallel's (each list in its own order).
  std::vector<CommunicationBuffer> all;
  const auto add = [&](const std::vector<CommunicationBuffer>& log) { all.insert(all.end(), log.begin(), log.end()); };
  if (pp_) add(pp_->buffers());
  if (fsdp_) add(fsdp_->buffers());
  if (zero_) add(zero_->buffers());
  if (tp_) add(tp_->buffers());
  if (ddp_) add(ddp_->buffers());
  if (dp_) add(dp_->buffers());
  // The collectives a recorded graph ran itself (expert parallel's all-to-alls): each output,
  // a buffer of its own the graph frees after its last use.
  const auto& collectives = runtime_->collectives();
  std::size_t step = 0;
  for (std::size_t i = 0; i < collectives.size(); ++i) {
    while (step < collectives_by_step_.size() && i >= collectives_by_step_[step]) ++step;
    const auto& c = collectives[i];
    all.push_back({c.op + " output" + (c.backward ? " (backward)" : ""), c.bytes, "default",
                   "step " + std::to_string(step + 1) + (c.backward ? " backward" : " forward"), "after its last use"});
  }
  return all;
}

double Trainer::communication_sent() const {
  return (pp_ ? pp_->sent() : 0) + (fsdp_ ? fsdp_->sent() : 0) + (tp_ ? tp_->sent() : 0) + (ddp_ ? ddp_->sent() : 0) +
         (dp_ ? dp_->sent() : 0) + runtime_->collective_sent();
}

std::vector<std::size_t> Trainer::ddp_bucket_bytes() const { return ddp_ ? ddp_->bucket_bytes() : std::vector<std::size_t>{}; }

TrainReport train(const TrainConfig& config, CachingAllocator& allocator) {
  Trainer trainer(config, allocator);
  for (std::size_t i = 0; i < config.steps; ++i) trainer.step();
  return trainer.report();
}

TrainReport train(const TrainConfig& config) {
  auto device = make_device(device_spec_for(config));
  CachingAllocator allocator(device, AllocatorConfig::parse(config.alloc_conf));
  return train(config, allocator);
}

}  // namespace mem::nn
