// data_parallel.hpp — one rank of a data-parallel job: what the engine adds to that GPU's
// training step. Each rank of DistributedDataParallel runs the whole step on its own batch,
// so one rank's allocator is the step's plus the engine's buffers, and every rank is alike.
//
//   mem::nn::TrainConfig cfg;  ...
//   cfg.parallel = mem::nn::parse_parallel("ddp:8", "bucket_cap_mb=50");
//   auto report = mem::nn::train(cfg);   // what each of the 8 GPUs holds
//
// DDP (torch/nn/parallel/distributed.py and the C++ Reducer, PyTorch 2.11) adds:
//   - at construction, the metadata check of the parameters' shapes and the broadcast of the
//     parameters and buffers from rank 0 (flat copies of up to 250 MiB, two in flight);
//   - the gradient buckets: one flat buffer per dtype holding every gradient until the
//     first backward has shown the order gradients become ready; the second forward frees
//     it and allocates the rebuilt buckets (a 1 MiB first bucket, then 25 MiB ones);
//   - each backward, every gradient copied into its bucket (with gradient_as_bucket_view
//     the gradient then becomes the bucket's view and its own block is freed), and after
//     the all-reduce copied back;
//   - each forward of a module with buffers, their broadcast (flat copies again).
// FSDP2 (torch.distributed.fsdp.fully_shard on each block, then the root; PyTorch 2.11's
// _fully_shard/*) keeps a padded 1/N shard of every parameter and adds, per group of
// parameters: the all-gather output and the unsharded parameters while the group runs (again
// in backward), the reduce-scatter input and output, on FSDP's own streams.
// The collectives' own memory (NCCL's buffers, outside the caching allocator) is not here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vramscope/runtime/dtype.hpp"

namespace mem::nn {

enum class ParallelEngine : std::uint8_t {
  None,  ///< one GPU
  Ddp,   ///< torch.nn.parallel.DistributedDataParallel, one process per GPU
  Fsdp,  ///< FSDP2: torch.distributed.fsdp.fully_shard per block, then on the root
  Zero1, ///< DeepSpeed ZeRO stage 1: the optimizer's state partitioned
  Zero2, ///< DeepSpeed ZeRO stage 2: the gradients partitioned too
  Zero3, ///< DeepSpeed ZeRO stage 3: the parameters partitioned too, gathered around each module
  /// torch.nn.DataParallel: one process, the module replicated onto every GPU at each
  /// forward, the batch scattered, the outputs gathered and the gradients summed on GPU 0
  Dp,
};

/// torch.distributed.pipelining's schedules (PyTorch 2.15, schedules.py): which forward and
/// backward of which micro-batch each rank runs when.
enum class PipelineSchedule : std::uint8_t {
  GPipe,  ///< ScheduleGPipe: every micro-batch's forward, then every backward
  OneF1B, ///< Schedule1F1B (torchtitan's default): P - s forwards, then one backward, one forward
  /// ScheduleInterleaved1F1B: several stages per rank (rank r holds stages r, r + P, ...), run
  /// by _PipelineScheduleRuntime from its lowered actions (sends, receives and their waits)
  Interleaved1F1B,
  /// ScheduleInterleavedZeroBubble (ZB1P): interleaved 1F1B's stages with each backward split
  /// into its input half (I, the gradient sent back) and its weight half (W, run later to fill
  /// the bubbles), warming up with one forward less per rank
  InterleavedZeroBubble,
  /// ScheduleZBVZeroBubble: two stages per rank in a V (rank r holds r and 2P - 1 - r), the
  /// backward split into I and W
  ZBVZeroBubble,
  /// ScheduleDualPipeV (DeepSeek's DualPipe, V-shaped): ZBV's stages, the steady state running a
  /// forward of one stage and a whole backward of the other as one overlapped action
  DualPipeV,
};
std::string_view schedule_name(PipelineSchedule schedule) noexcept;
/// Whether rank r holds several stages (run by _PipelineScheduleRuntime's lowered actions).
bool multi_stage(PipelineSchedule schedule) noexcept;
/// Whether rank r holds stages r and 2P - 1 - r (ZBV's and DualPipeV's V).
bool v_shaped(PipelineSchedule schedule) noexcept;
/// The pipeline rank that holds stage `stage` of `ranks` x `per_rank`: stage % P (the loop
/// style), or, under ZBV's and DualPipeV's V, s for s < P and 2P - 1 - s after.
std::size_t pipeline_rank_of(PipelineSchedule schedule, std::size_t ranks, std::size_t stage) noexcept;
/// The stage that pipeline rank `rank` holds `k`-th: r + kP, or, in a V, r and 2P - 1 - r.
std::size_t pipeline_stage_of(PipelineSchedule schedule, std::size_t ranks, std::size_t rank, std::size_t k) noexcept;

/// How a node's GPUs talk, which decides NCCL's own memory on each (nccl_memory below).
enum class Topology : std::uint8_t {
  Auto,     ///< NVSwitch for data-center GPUs (A100, H100, H200, B200, V100), else PCIe
  NvSwitch, ///< 8 GPUs per node on NVLink through NVSwitches
  Pcie,     ///< GPUs on PCIe, peer to peer
  None,     ///< leave NCCL's memory out
};

/// How the step is spread over GPUs, with the engine's own argument names.
struct ParallelConfig {
  ParallelEngine engine = ParallelEngine::None;
  std::size_t world_size = 1;  ///< the engine's ranks (the data-parallel dimension of a mesh)
  /// Pipeline parallel, the mesh's outermost dimension (pp:N): the decoder's layers split into N
  /// stages as torchtitan splits them, one per GPU, micro-batches through a schedule; 1: none.
  std::size_t pipeline_parallel = 1;
  PipelineSchedule schedule = PipelineSchedule::OneF1B;
  /// torchtitan's pipeline_parallel_layers_per_stage: each stage's layers (the embedding and the
  /// final norm with lm_head counting as one each), so ceil((L + 2) / N) / P stages per rank;
  /// 0: unset (one stage per rank, two under an interleaved schedule).
  std::size_t layers_per_stage = 0;
  /// n_microbatches of the schedule; 0: the batch, one sample each (torchtitan's default
  /// pipeline_parallel_microbatch_size = 1).
  std::size_t microbatches = 0;
  /// schedule.step(..., return_outputs=True), PyTorch's default: the last stage keeps every
  /// micro-batch's output (the logits) until the next step and returns them concatenated.
  bool return_outputs = true;
  /// The pipeline rank simulated (its stage); the others' layers are not on this GPU.
  std::size_t stage = 0;
  /// Whether `stage` was asked for (stage=S); otherwise sweeps show every stage.
  bool stage_chosen = false;
  /// Tensor + sequence parallel, the mesh's innermost dimension (tp:N, fsdp:MxTP:N):
  /// torchtitan's Llama plan through DTensor's parallelize_module over N GPUs; 1: none.
  std::size_t tensor_parallel = 1;
  /// Context parallel (cp:C, fsdp:MxCP:C), torchtitan's layout: each GPU holds 1/C of every
  /// sequence, SDPA runs as ring attention around the C GPUs, and FSDP2 shards over the
  /// flattened dp_shard x cp mesh (world_size counts both; rank % C is the place in the ring).
  /// 1: none.
  std::size_t context_parallel = 1;
  /// context_parallel()'s head-tail load balancer (on for causal attention by default).
  bool cp_load_balance = true;
  /// set_rotate_method("alltoall"): K and V passed on by an all-to-all each step, instead of
  /// one all-gather (the default).
  bool cp_all_to_all = false;
  /// Expert parallel (ep:N, fsdp:M with ep_size=N), transformers' DistributedConfig(fsdp_size=M,
  /// ep_size=N): each GPU holds num_experts / N whole experts, tokens reach them by all-to-all,
  /// and FSDP2 shards the experts over the efsdp mesh of M / N ranks (the dense modules over M).
  /// The model is one rank's recording (vramscope.export --expert-parallel N); 1: none.
  std::size_t expert_parallel = 1;
  /// torchtitan's loss_parallel (its default): lm_head's output stays sharded on the
  /// vocabulary and the loss is computed on the shards; false: the logits are gathered whole.
  bool loss_parallel = true;
  // DistributedDataParallel(...)'s arguments, at PyTorch's defaults.
  std::optional<double> bucket_cap_mb;  ///< unset: 25 MiB buckets after a 1 MiB first one
  bool gradient_as_bucket_view = false;
  bool broadcast_buffers = true;
  bool init_sync = true;
  bool static_graph = false;
  bool find_unused_parameters = false;
  // fully_shard(...)'s arguments, at PyTorch's defaults.
  std::optional<bool> reshard_after_forward;  ///< unset (None): true for blocks, false for the root
  /// reshard_after_forward=k (an int, 1 < k < N, dividing N): after forward each block keeps
  /// a 1/k slice of its gathered parameters and gathers over k ranks in backward; 0: not used.
  std::size_t reshard_after_forward_to = 0;
  std::optional<DType> param_dtype;           ///< MixedPrecisionPolicy(param_dtype=...)
  std::optional<DType> reduce_dtype;          ///< MixedPrecisionPolicy(reduce_dtype=...)
  /// fsdp's offload_policy=CPUOffloadPolicy(): the sharded parameters, their gradients and the
  /// optimizer's state live on the host and the optimizer steps there; each unshard copies the
  /// shards to the GPU first, each reduce-scatter's output is copied back. zero1 and zero2's
  /// offload_optimizer=cpu (DeepSpeed's offload_optimizer.device "cpu"): the fp32 master
  /// partition, its gradient and Adam's state on the host, DeepSpeedCPUAdam steps there.
  bool cpu_offload = false;
  /// zero3's offload_param=cpu (DeepSpeed's offload_param.device "cpu", ZeRO-Infinity): each
  /// parameter's partition lives on the host, and every gather first copies it to the GPU.
  bool offload_param = false;
  /// pin_memory=...: the host copies in pinned memory (the default of both).
  bool offload_pin_memory = true;
  /// How the model reaches the GPU: built on the meta device and materialized sharded
  /// (`with torch.device("meta")`, then to_empty: what large models need), or built on the
  /// GPU whole and sharded there (small scripts; the full model's segments stay cached).
  bool meta_init = true;
  // DeepSpeed's zero_optimization keys, at its defaults (runtime/zero/config.py).
  double reduce_bucket_size = 5e8;     ///< elements of the gradient bucket (IPG buffer)
  std::optional<bool> overlap_comm;    ///< unset: false for stages 1 and 2, true for stage 3
  // Stage 3's (the stage3_ keys of the zero_optimization section; elements, not bytes).
  double prefetch_bucket_size = 5e7;          ///< stage3_prefetch_bucket_size
  double param_persistence_threshold = 1e5;   ///< stage3_param_persistence_threshold
  double model_persistence_threshold = 9.223372036854775807e18;  ///< stage3_model_persistence_threshold
  double max_live_parameters = 1e9;           ///< stage3_max_live_parameters
  double max_reuse_distance = 1e9;            ///< stage3_max_reuse_distance
  double sub_group_size = 1e9;                ///< sub_group_size
  /// The model built under deepspeed.zero.Init (each parameter partitioned as it is made:
  /// what transformers' from_pretrained does under a stage 3 config), or whole on the GPU
  /// and partitioned by deepspeed.initialize (zero3_init_flag=false).
  bool zero3_init = true;
  /// The rank simulated (nn.DataParallel: the GPU, gpu=K; 0 holds the module and the optimizer,
  /// the others a replica per forward). FSDP: ranks differ only where dim 0 does not split evenly (the
  /// last ranks hold fewer rows, so smaller optimizer states); rank 0 holds the most.
  /// ZeRO: each rank keeps the gradients of the parameters its partition touches.
  std::size_t rank = 0;
  /// The machine (--topology): what NCCL's communicator holds on each GPU.
  Topology topology = Topology::Auto;
  /// Every other rank of the node also made a CUDA context on GPU 0 (it never called
  /// torch.cuda.set_device): rank 0's GPU holds them too, the classic "rank 0 uses more".
  bool stray_contexts = false;

  bool enabled() const noexcept {
    return engine != ParallelEngine::None || tensor_parallel > 1 || pipeline_parallel > 1;
  }
  /// Every GPU of the job (the mesh's product).
  std::size_t gpus() const noexcept { return pipeline_parallel * world_size * tensor_parallel; }
  /// Whether the engine shards the parameters over the ranks (FSDP2, ZeRO-3): each rank holds
  /// its shard of the weights, not all of them.
  bool shards_parameters() const noexcept {
    return engine == ParallelEngine::Fsdp || engine == ParallelEngine::Zero3 || tensor_parallel > 1;
  }
  /// Whether the engine hooks modules as they run (FSDP2 wraps the blocks, ZeRO-3 gathers
  /// each module's parameters): the engines that shard them. checkpoint_sequential's segments
  /// would cut across them, so such a step runs without segments (marks on modules work).
  bool hooks_modules() const noexcept { return shards_parameters(); }
  friend bool operator==(const ParallelConfig&, const ParallelConfig&) = default;
};

/// One buffer the engine allocated for its collectives on a rank: what it is, its bytes as
/// requested (the allocator rounds them up), the stream it belongs to, and when it was made
/// and freed ("construction", "step 2 forward", ...; freed "" while it lives).
struct CommunicationBuffer {
  std::string what;
  std::size_t bytes = 0;
  std::string stream = "default";
  std::string allocated;
  std::string freed;
};

/// torch.chunk's piece of `n` rows for `index` of `parts`: ceil(n / parts) rows, the last
/// pieces fewer and empty past the end (FSDP2's _chunk_with_empty, a DTensor Shard's local size).
inline std::int64_t chunk_size(std::int64_t n, std::size_t parts, std::size_t index) noexcept {
  const auto p = static_cast<std::int64_t>(parts);
  const std::int64_t chunk = (n + p - 1) / p;
  const std::int64_t left = n - static_cast<std::int64_t>(index) * chunk;
  return left < 0 ? 0 : left < chunk ? left : chunk;
}

/// The most micro-batches a pipeline schedule is modelled with (each a forward and a backward
/// of the stage: a bound on the work a batch can ask for).
inline constexpr std::size_t kMaxMicrobatches = 1024;

/// The most GPUs a job may name (a bound for hostile input; the largest jobs are 10^5).
inline constexpr std::size_t kMaxWorldSize = std::size_t{1} << 20;

/// "ddp:8", "fsdp:8", "tp:8", "fsdp:8xtp:8", "pp:4", "pp:4xtp:8", "dp:2", "ep:8" (or "none"), and "key=value,..." in the engine's own names: for dp
/// gpu (the GPU shown); for ddp
/// bucket_cap_mb, gradient_as_bucket_view, broadcast_buffers, init_sync, static_graph,
/// find_unused_parameters; for fsdp reshard_after_forward, param_dtype, reduce_dtype, and
/// init (meta or cuda), ep_size and rank; for zero1 / zero2 (DeepSpeed) reduce_bucket_size,
/// overlap_comm and rank; for zero3 those and stage3_prefetch_bucket_size,
/// stage3_param_persistence_threshold, stage3_model_persistence_threshold,
/// stage3_max_live_parameters, stage3_max_reuse_distance, sub_group_size and zero3_init_flag;
/// for tp sequence_parallel (true: the only plan modelled), loss_parallel and rank; for pp
/// schedule (gpipe, 1f1b, interleaved1f1b), layers_per_stage, microbatches, return_outputs and stage. Throws mem::Error naming what is wrong and what is valid; an
/// option of another engine, or options without an engine, is an error too.
ParallelConfig parse_parallel(std::string_view spec, std::string_view options = {});
/// "ddp:8", then the options that differ from the defaults ("ddp:8 bucket_cap_mb=50").
std::string parallel_label(const ParallelConfig& config);

/// NCCL's memory on one GPU for the job's communicator, outside the caching allocator (it
/// shows in nvidia-smi only), made at the first collective (NCCL_RUNTIME_CONNECT=1): bytes,
/// and the assumptions behind them in one line. From NCCL's sources (@5067397c): per ring
/// channel a receive buffer (LL 512 KiB + LL128 4,915,200 B + SIMPLE 4 MiB, rounded to the 2
/// MiB of CUDA IPC: 10 MiB) and a send header (2 MiB); on NVSwitch, 16 channels, and with
/// Hopper or newer NVLink SHARP (NVLS): 32 MiB per head, a head per GPU of the node.
struct NcclMemory {
  std::size_t bytes = 0;
  std::string assumptions;
};
NcclMemory nccl_memory(const ParallelConfig& config, std::string_view device_name, int compute_capability);
/// "auto", "nvswitch", "pcie", "none". Throws mem::Error naming them.
Topology parse_topology(std::string_view name);
std::string_view topology_name(Topology topology) noexcept;

/// What a compute action runs on its micro-batch.
enum class PipelineCompute : std::uint8_t {
  Forward,         ///< F: forward_one_chunk
  Backward,        ///< B: backward_one_chunk, the whole backward
  BackwardInput,   ///< I: backward_one_chunk(full_backward=False), the input's gradient only
  BackwardWeight,  ///< W: backward_weight_one_chunk, the weights' gradients of an earlier I
};
/// One compute action of a pipeline rank's schedule: a forward or a backward (or half of one)
/// of a micro-batch on one of the rank's stages (its index among all P x V stages).
struct PipelineAction {
  PipelineCompute compute = PipelineCompute::Forward;
  std::size_t microbatch = 0;
  std::size_t stage = 0;
  /// Runs with the next action as one (DualPipeV's OVERLAP_F_B: a forward, then a backward).
  bool overlapped = false;
  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
};
/// The order `schedule` runs micro-batches on pipeline rank `rank` of `ranks`, with
/// `stages_per_rank` stages each (schedules.py, torch 2.15): GPipe's forwards then backwards;
/// 1F1B's min(M, P - s) warm-up forwards, then a backward and a forward in turn; interleaved
/// 1F1B's _get_1f1b_rank_ops (warm-up (V - 1) x M/rounds + 2 (P - 1 - r) forwards, depth
/// first). Throws mem::Error for micro-batches the schedule refuses.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, std::size_t ranks, std::size_t rank,
                                             std::size_t microbatches, std::size_t stages_per_rank = 1);
/// torchtitan's split of `layers` decoder layers over `stages` (generate_llm_fqn_per_model_part
/// with input_weight = output_weight = 1): each stage's [first, last) layers. Throws mem::Error
/// when a stage would be empty.
std::vector<std::pair<std::size_t, std::size_t>> pipeline_split(std::size_t layers, std::size_t stages);
/// The stages each pipeline rank holds (torchtitan's pipeline_llm): with layers_per_stage N,
/// ceil((layers + 2) / N) / P, which P must divide; else 1 under gpipe and 1f1b, 2 under an
/// interleaved schedule. Throws mem::Error where torchtitan raises (a single-stage schedule
/// given several stages per rank, an interleaved one given one).
std::size_t pipeline_stages_per_rank(const ParallelConfig& config, std::size_t layers);

class Module;
/// Whether every parameter of the model splits evenly on dim 0 over `world_size` ranks: then
/// every FSDP rank holds the same shards; otherwise the last rank holds the fewest rows.
bool fsdp_ranks_alike(const Module& root, std::size_t world_size);
/// The repeated blocks of a model, in forward order: a module with children and parameters
/// beside at least one sibling of its type (decoder layers, residual blocks), looking inside
/// a repeated Sequential that holds such blocks itself (a ResNet stage's Bottlenecks). What
/// fully_shard wraps before the root, and what `plan` checkpoints evenly.
std::vector<Module*> repeated_blocks(Module& root);
/// The ZeRO rank that keeps the most gradient elements (each rank keeps, whole, the
/// gradients of the parameters its partition touches, plus its padding): the lowest such.
std::size_t zero_heaviest_rank(const Module& root, std::size_t world_size);

}  // namespace mem::nn
