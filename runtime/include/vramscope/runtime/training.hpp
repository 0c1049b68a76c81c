// training.hpp — training steps of a model with per-step allocator statistics:
// the API the `vramscope` command sweeps and traces with.
//
//   mem::nn::TrainConfig cfg;
//   cfg.model = mem::models::find("resnet50");   // or a ModelFile of your own
//   cfg.model_options.batch = 256;
//   cfg.segments = 4;                       // checkpoint_sequential(body, 4, x)
//   cfg.precision = mem::nn::Precision::Amp;
//   auto report = mem::nn::train(cfg);      // dry run on sim:a100-80g
//   report.steps.back().peak_allocated;     // max allocated during the step
//
// Or keep the allocator to attach recorders first:
//   auto device = mem::make_device(mem::nn::device_spec_for(cfg));
//   mem::CachingAllocator alloc{device};
//   mem::attach(alloc);                     // per-module attribution
//   mem::nn::Trainer trainer{cfg, alloc};
//   auto s1 = trainer.step();
//
// A step is: zero_grad (frees last step's gradients), input and target upload,
// forward + loss (Phase::Forward; recompute runs as Phase::Recompute), backward
// (Phase::Backward), optimizer step (Phase::Optimizer). Per-phase peaks come
// from an observer of the allocator's totals; its own peak statistics are never reset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/runtime/compiled.hpp"
#include "vramscope/instrumentation/peak_composition.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"
#include "vramscope/runtime/data_parallel.hpp"
#include "vramscope/runtime/models.hpp"
#include "vramscope/runtime/optim.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {

enum class Precision : std::uint8_t {
  F32,      ///< everything f32
  F16,      ///< model.half(): parameters, activations, gradients and state in f16
  BF16,     ///< the same in bf16
  Amp,      ///< autocast f16: f32 master weights, f16 matmul/conv activations
  AmpBF16,  ///< autocast bf16
};
/// "f32", "f16", "bf16", "amp", "amp-bf16".
std::string_view precision_name(Precision precision) noexcept;
/// Throws mem::Error listing the valid names.
Precision parse_precision(std::string_view name);
/// dtype of parameters for a precision (f32 for the amp modes).
DType parameter_dtype(Precision precision) noexcept;
/// The half type autocast runs in for `precision` (f16 for amp, bf16 for amp-bf16); none otherwise.
std::optional<DType> autocast_dtype(Precision precision) noexcept;

struct TrainConfig {
  /// The model (mem::models::find(name), mem::models::ModelFile::load(path)); required.
  std::shared_ptr<const ModelSource> model;
  ModelOptions model_options;
  ExecMode mode = ExecMode::DryRun;
  /// Device for train(config) and device_spec_for(); compute mode adds ",backing=host"
  /// to simulated specs that do not set a backing.
  std::string device = "sim:a100-80g";
  std::string alloc_conf;             ///< PYTORCH_CUDA_ALLOC_CONF syntax
  std::size_t steps = 2;
  /// checkpoint_sequential segments over the model body; 1 = no checkpointing.
  std::size_t segments = 1;
  CheckpointMode checkpoint_mode = CheckpointMode::NonReentrant;
  /// apply_activation_checkpointing with a check function naming modules: exactly these
  /// module paths run checkpointed in checkpoint_mode, every other mark (a model file's,
  /// --gradient-checkpointing's) cleared (mark_checkpointed). nullopt: the model's own marks.
  std::optional<std::vector<std::string>> checkpoint_modules;
  /// Selective checkpointing: every checkpointed region keeps these operators' outputs for its
  /// recompute (checkpoint.hpp). An operator-level model's, non-reentrant; nullopt: plain.
  std::optional<SelectivePolicy> selective;
  /// torch.compile: the step runs as the joint graph a model file recorded (compiled.hpp), its
  /// saved values chosen by AOTAutograd's partitioner under the mode's activation_memory_budget
  /// (1: PyTorch's default), as CUDA graphs with mode="reduce-overhead" (3 steps or more:
  /// warmup, recording, replay). nullopt: eager. One GPU, no checkpointing, the recorded dtype.
  std::optional<CompileMode> compile;
  /// Activation offloading: the forward (and the loss) under save_on_cpu(pin_memory=True), so
  /// what autograd saves waits in pinned host memory and comes back in backward (SaveOnCpu).
  bool offload_activations = false;
  Precision precision = Precision::F32;
  /// Gradient accumulation: each step() is one micro-batch; the gradients are zeroed before
  /// the first of every `accumulation` steps and the optimizer steps after the last, so the
  /// micro-batches between run with every gradient (and the optimizer's state) live. One GPU.
  std::size_t accumulation = 1;
  OptimizerConfig optimizer;
  bool input_requires_grad = false;   ///< the batch as a leaf requiring grad
  /// The PyTorch, transformers and PEFT versions the step behaves as (stack.hpp).
  Stack stack;
  /// Data parallelism (data_parallel.hpp): the step is one rank's, with the engine's buffers.
  ParallelConfig parallel;
  std::uint64_t seed = 0;
};

/// Allocator figures over one phase. Peaks are since the phase began.
struct PhaseStats {
  std::int64_t allocated_begin = 0;
  std::int64_t allocated_end = 0;
  std::int64_t peak_allocated = 0;   ///< max_memory_allocated within the phase
  std::int64_t reserved_end = 0;
  std::int64_t peak_reserved = 0;
  std::int64_t device_used_end = 0;  ///< nvidia-smi view
  std::int64_t peak_device_used = 0;
  std::int64_t allocations = 0;      ///< blocks handed out during the phase
};

struct StepStats {
  std::size_t step = 0;              ///< 1-based
  PhaseStats forward;                ///< input upload, forward and loss
  PhaseStats backward;
  PhaseStats optimizer;              ///< zero_grad of the next step is not included
  std::int64_t peak_allocated = 0;   ///< max over the phases
  std::int64_t peak_reserved = 0;
  std::int64_t peak_device_used = 0;
  std::int64_t allocated_end = 0;    ///< after the optimizer step
  std::int64_t reserved_end = 0;
  std::int64_t device_used_end = 0;
  double loss = 0;                   ///< compute mode; NaN in a dry run
  FlopCounts flops;                  ///< this step's FLOPs by phase
  /// Extra forward FLOPs from recomputation as a fraction of one forward (0 without
  /// checkpointing; about 1 when everything but the tail is checkpointed).
  double recompute_ratio = 0;
  std::size_t params_without_grad = 0;  ///< parameters whose grad stayed undefined
  /// Bytes this GPU sent over collectives in the step, as its engines issued them: a ring
  /// all-gather or reduce-scatter (n - 1) / n of the gathered tensor, an all-reduce twice that,
  /// a pipeline's send whole (tensor parallel's per-token loss all-reduces left out). 0 on one GPU.
  double communication_bytes = 0;
  double wall_ms = 0;                ///< host time of the step
  DeviceStats stats;                 ///< full allocator statistics after the step
  /// The live bytes at the step's peak by kind: weights, gradients, optimizer state,
  /// activations, logits and loss, other.
  MemoryComposition peak_composition;
};

struct TrainReport {
  ModelInfo model;
  TrainConfig config;
  SegmentPlan plan;                  ///< how the body was split
  std::vector<StepStats> steps;
  std::int64_t peak_allocated = 0;   ///< max over steps
  std::int64_t peak_reserved = 0;
  std::int64_t peak_device_used = 0;
  std::int64_t parameter_bytes = 0;  ///< as allocated (master weights for amp)
  std::int64_t optimizer_state_bytes = 0;
  /// Where offloading keeps them (FSDP2's CPUOffloadPolicy: both; ZeRO's offload_optimizer:
  /// the optimizer's state): on the host, not on the GPU.
  bool parameters_on_host = false, optimizer_state_on_host = false;
  /// True when some parameter got no gradient (reentrant checkpoint with no input
  /// requiring grad): a lower peak is then missing work, never a saving.
  bool gradients_missing = false;
  std::size_t params_without_grad = 0;
  std::vector<std::string> warnings;
  std::string device_name;
  std::string device_assumptions;    ///< print beside any figure
  double recompute_ratio = 0;        ///< of the last step
  MemoryComposition peak_composition;  ///< at the highest step peak
  /// Pinned host memory the run holds at its end (blocks are cached, never given back): what
  /// offloading put on the host (TrainConfig::offload_activations); 0 without it.
  std::int64_t pinned_host_bytes = 0;
};

/// The device spec train() uses for `config` (adds host backing in compute mode).
std::string device_spec_for(const TrainConfig& config);

/// Owns the runtime, model and optimizer on a caller's allocator (which must
/// outlive it). Construction materializes the parameters.
class CompiledStep;
namespace detail {
class PhasePeaks;
class DataParallel;
class NnDataParallel;
class FullyShard;
class PipelineParallel;
class TensorParallel;
class ZeroOptimizer;
}

class Trainer {
 public:
  /// Throws mem::Error for unknown models, bad options, segments outside
  /// [1, modules], or compute mode on a device without host memory.
  Trainer(const TrainConfig& config, CachingAllocator& allocator);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Runs one training step and returns its statistics.
  StepStats step();
  /// Forward and loss only (no graph unless `with_grad`): for inference figures.
  Tensor forward(bool with_grad);

  const TrainConfig& config() const noexcept { return config_; }
  const ModelInfo& info() const noexcept;
  const SegmentPlan& plan() const noexcept { return plan_; }
  Runtime& runtime() noexcept { return *runtime_; }
  Model& model() noexcept { return *model_; }
  Optimizer* optimizer() noexcept { return optimizer_.get(); }
  CachingAllocator& allocator() noexcept { return *allocator_; }
  /// The compiled step (config.compile), or null.
  const CompiledStep* compiled() const noexcept { return compiled_.get(); }
  /// Builds the report from the steps run so far.
  TrainReport report() const;
  /// DDP's gradient buckets in bytes, in the order they are reduced (empty without DDP).
  std::vector<std::size_t> ddp_bucket_bytes() const;
  /// Every buffer the data-parallel engine allocated so far, with its lifetime (empty
  /// on one GPU).
  std::vector<CommunicationBuffer> communication_buffers() const;
  /// Bytes sent over collectives since the trainer was made (StepStats has each step's).
  double communication_sent() const;

 private:
  Tensor run_forward(const Tensor& input);
  /// The model's loss of its output, or tensor parallel's on vocabulary-sharded logits.
  Tensor loss_of(const Tensor& output, const Tensor& target);
  /// nn.DataParallel's forward and backward on this GPU (scatter, replicate, gather, the loss
  /// on GPU 0, the scattered gradient, the reduction), into the step's batch, target, output
  /// and loss (GPU 0's; a replica's batch piece only), which live until the step ends.
  void data_parallel_step(StepStats& s, DType data_dtype, Tensor& input, Tensor& target, Tensor& output, Tensor& loss);

  TrainConfig config_;
  CachingAllocator* allocator_;
  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  SegmentPlan plan_;
  std::vector<StepStats> steps_;
  std::vector<std::size_t> collectives_by_step_;  // Runtime::collectives() logged by the end of each step
  /// Watches allocator totals for per-phase peaks, so the allocator's own
  /// peak statistics (max_memory_allocated) are never reset behind the user's back.
  std::unique_ptr<detail::PhasePeaks> peaks_;
  /// Live bytes by kind, for what the peak is made of.
  std::unique_ptr<PeakComposition> composition_;
  /// The data-parallel engine's side of the step (config.parallel), or null.
  std::unique_ptr<detail::DataParallel> ddp_;
  std::unique_ptr<detail::FullyShard> fsdp_;
  std::unique_ptr<detail::ZeroOptimizer> zero_;  // DeepSpeed: any stage
  std::unique_ptr<detail::TensorParallel> tp_;
  std::unique_ptr<detail::PipelineParallel> pp_;  // the rank's stage and its schedule
  std::unique_ptr<detail::NnDataParallel> dp_;     // nn.DataParallel's GPU
  std::unique_ptr<CompiledStep> compiled_;         // torch.compile's graphs, or null
  std::int64_t dp_batch_ = 0;                      // nn.DataParallel: the whole batch, on GPU 0
};

/// Creates the device (device_spec_for) and allocator, runs config.steps steps.
TrainReport train(const TrainConfig& config);
/// The same on a caller's allocator (observers attached beforehand see every event).
TrainReport train(const TrainConfig& config, CachingAllocator& allocator);

}  // namespace mem::nn
