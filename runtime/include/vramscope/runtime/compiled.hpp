// compiled.hpp — the torch.compile'd training step: AOTAutograd's joint graph, which forward
// values its min-cut partitioner keeps for the backward, and the two graphs run through the
// caching allocator.
//
// `python -m vramscope.export ... --compile` records the joint forward-backward graph that
// inductor hands to AOTAutograd's partitioner (after its joint-graph passes and CSE), with
// PyTorch's facts about each node (docs/OPERATORS.md, "Compiled steps"). vramscope then makes
// the partitioner's choice itself (min_cut_partition.cpp, a port of the decisions in
// torch/_functorch/partitioners.py, min_cut_rematerialization_partition), under any
// torch._functorch.config.activation_memory_budget:
//
//   mem::nn::JointGraph joint = ...;                      // models/ reads it from a file
//   std::vector<int> saved = mem::nn::choose_saved_values(joint, 0.5);
//
// and runs the compiled step (compiled_step.cpp): the forward graph keeps those values, the
// backward recomputes the rest of what it needs, each graph's intermediate buffers live
// from their kernel to their last reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"

#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

/// One node of the joint graph, as the partitioner sees it.
struct JointNode {
  enum class Op : std::uint8_t { Placeholder, CallFunction, GetAttr, Output };
  /// Opaque: a BackwardState, script object or opaque value, which the partitioner weighs 0.
  enum class Value : std::uint8_t { Tensor, Sym, Opaque, Other };
  enum class Input : std::uint8_t { None, Primal, Tangent, FwdSeed, BwdSeed };
  /// PyTorch's facts about a node: its operator's class in get_default_op_list() and what the
  /// partitioner reads from its meta.
  enum Flag : std::uint32_t {
    Fusible = 1u << 0,
    ComputeIntensive = 1u << 1,
    Random = 1u << 2,
    View = 1u << 3,
    Recomputable = 1u << 4,
    Cat = 1u << 5,
    GetItem = 1u << 6,
    LiftFresh = 1u << 7,
    NonBuiltin = 1u << 8,
    MustBeInBackward = 1u << 9,
    DeviceValue = 1u << 10,
    MustSave = 1u << 11,
    MustRecompute = 1u << 12,
    EpilogueMutation = 1u << 13,
    Static = 1u << 14,  ///< a parameter (static lifetime input)
    Collective = 1u << 15,
    Reduction = 1u << 16,  ///< fewer elements out than in (sum, amax): a buffer of its own
    Impure = 1u << 17,     ///< fx's is_impure: dead-code elimination keeps it
  };
  std::string name;
  Op op = Op::CallFunction;
  std::string target;             ///< "aten.mm.default"
  std::vector<std::int32_t> users;  ///< in PyTorch's order; the output node included
  std::vector<std::int32_t> args;   ///< the direct node arguments (repeats kept)
  std::vector<std::int32_t> inputs; ///< every node it reads
  Value value = Value::Tensor;
  Input input = Input::None;
  std::int64_t bytes = 0;           ///< partitioners.py _size_of
  std::int64_t sym_size = 0;
  std::int32_t storage = -1;        ///< the storage it lives in (-1: none)
  std::uint32_t flags = 0;
  std::int64_t flops = -1;          ///< estimate_runtime's FLOPs (-1: not recorded)
  std::int64_t conv_groups = 0;     ///< aten.convolution's groups (0: not a convolution)
  Shape shape;
  DType dtype = DType::BF16;
  /// A primal: what it is ("param: model.norm.weight", "buffer: ...", "input: input_ids").
  std::string primal;
  std::int32_t grad = -1;  ///< a primal's gradient among the backward's outputs (-1: none)
  bool has(Flag f) const noexcept { return (flags & f) != 0; }
};

/// The partitioner's configuration (torch._functorch.config) the graph was recorded with.
struct PartitionerConfig {
  bool recompute_views = false;
  bool treat_parameters_as_free_to_save = true;
  std::int64_t max_dist_from_bw = 1000;
  bool ban_recompute_used_far_apart = true;
  bool ban_recompute_long_fusible_chains = true;
  bool ban_recompute_materialized_backward = true;
  bool ban_recompute_not_in_allowlist = true;
  bool ban_recompute_reductions = true;
  bool aggressive_recomputation = false;
};

/// One compiled region's joint graph. Invariants (checked by the reader): node indices in
/// range, inputs before users, one output node, last.
struct JointGraph {
  std::vector<JointNode> nodes;
  std::vector<std::int32_t> outputs;  ///< the output node's tensors: forward's, then backward's
  std::int32_t forward_outputs = 0;
  PartitionerConfig config;
  std::string traced_on;  ///< "cpu"
  std::string torch;      ///< the PyTorch that recorded it

  /// Whether node `b` can take node `a` into its kernel (partitioners.py, is_fusible): both
  /// fusible, or `b` a cat (memory fusion into its output).
  bool fusible(std::int32_t a, std::int32_t b) const noexcept {
    return nodes[b].has(JointNode::Cat) || (nodes[a].has(JointNode::Fusible) && nodes[b].has(JointNode::Fusible));
  }
};

/// How torch.compile runs the step: under which activation_memory_budget AOTAutograd's partitioner
/// cuts it, and whether mode="reduce-overhead" replays the two graphs as CUDA graphs (inductor's
/// CUDA graph trees, with their private memory pool).
struct CompileMode {
  double memory_budget = 1.0;
  bool cudagraphs = false;
  friend bool operator==(const CompileMode&, const CompileMode&) = default;
};
/// The steps a run with CUDA graphs takes at least: a graph's first call is its warmup, the
/// second records it, the third is the first replay.
inline constexpr std::size_t kCudaGraphSteps = 3;

/// A model file's "compiled": the joint graph torch.compile recorded, its sizes evaluated at the
/// run's batch (and sequence length).
struct CompiledModel {
  std::int64_t batch = 0;  ///< the recorded batch
  std::int64_t seq = 0;    ///< the recorded sequence length; 0: the model takes none
  /// Why the sizes hold at the recorded batch (and sequence) only ("" : they are formulas, any
  /// batch runs).
  std::string fixed;
  JointGraph graph;
};

/// The forward values the partitioner saves for the backward, as node indices in graph order
/// (choose_saved_values_set): the min cut, and under a budget below 1 the knapsack over the
/// nodes it would not recompute. Throws mem::Error for a budget outside [0, 1] or a graph the
/// cut cannot partition.
std::vector<std::int32_t> choose_saved_values(const JointGraph& graph, double memory_budget = 1.0);

/// The compiled step on the runtime's allocator: the forward graph, then the backward graph.
/// How the buffers live (what is modelled of inductor, docs/OPERATORS.md):
/// - a value gets a buffer when a reader cannot fuse it (a matrix product, convolution,
///   attention or other operator outside PyTorch's fusible list, as the partitioner's
///   is_materialized says), when it is a reduction's output, or when it leaves its graph (the
///   loss, a saved value, a gradient); a fusible operator read only by fusible ones runs inside
///   its reader's kernel and has none. A view shares its base's buffer.
/// - a buffer is freed after its graph's last reader (inductor's wrapper deletes it there, and
///   the backward's saved inputs too); what the caching allocator then reuses stands for
///   inductor's own reuse of a freed buffer.
/// - parameters and buffers are the model's own; the batch's inputs are allocated at the start.
/// - inductor's layout optimization (torch/_inductor/graph.py, decide_layout_opt, its rule for
///   GPUs in training): when the forward's convolutions qualify, each parameter or input a
///   convolution reads gets a channels-last copy at the forward's start, kept into the
///   backward when the backward reads that parameter or input, to its last reader there.
/// With CUDA graphs (mode="reduce-overhead", torch/_inductor/cudagraph_trees.py, PyTorch 2.15):
/// - one private pool per device for both graphs, made when the tree manager starts (its empty
///   capture keeps the pool alive), and one side stream both graphs run on;
/// - a graph's first call is its warmup: it runs in the pool (_use_cuda_memory_pool_manager);
///   the second records it: torch.cuda.graph empties the cache first, the batch's tensors (the
///   forward's inputs that are not parameters or buffers) and the loss's gradient (the
///   backward's tangent) are copied into the pool before the capture and freed inside it
///   after their last reader; later calls replay it into the same memory, which this model
///   runs again in the pool;
/// - the forward's saved values and the backward's gradients live in the pool (a parameter's
///   .grad too, until zero_grad sets it to None);
/// - cuBLAS's workspaces are cleared before and after each warmup and recording
///   (clear_cublas_manager), so a graph's workspace is allocated in the pool.
class CompiledStep {
 public:
  /// Throws mem::Error when a primal names a parameter or buffer `root` does not have.
  CompiledStep(std::shared_ptr<const CompiledModel> model, CompileMode mode, Module& root);
  ~CompiledStep();
  CompiledStep(const CompiledStep&) = delete;
  CompiledStep& operator=(const CompiledStep&) = delete;

  /// Runs the forward graph (Phase::Forward): returns the loss, keeps the saved values.
  Tensor forward(Runtime& rt);
  /// Runs the backward graph (Phase::Backward, its recomputed forward nodes as
  /// Phase::Recompute) from the loss's gradient: each parameter's gradient into its .grad
  /// (added to one already there, as AccumulateGrad does). Frees the saved values.
  void backward(Runtime& rt);
  /// The step is over: the batch goes (the training loop's variables).
  void end_step();

  const std::vector<std::int32_t>& saved() const noexcept { return saved_; }
  /// Bytes of the saved values the backward reads that are not parameters or inputs (what the
  /// forward keeps).
  std::int64_t saved_activation_bytes() const noexcept { return saved_bytes_; }
  std::size_t recomputed_nodes() const noexcept { return recomputed_; }
  /// The most bytes a graph's buffers hold at once as the schedule above plans them, with the
  /// backward's saved values and tangent while it reads them (parameters and the batch not
  /// counted): what inductor's wrapper code holds inside the graph's call.
  std::int64_t forward_buffer_peak() const noexcept { return forward_peak_; }
  std::int64_t backward_buffer_peak() const noexcept { return backward_peak_; }
  double memory_budget() const noexcept { return mode_.memory_budget; }
  const CompileMode& mode() const noexcept { return mode_; }
  /// CUDA graphs' private pool (0: none yet, or no CUDA graphs).
  PoolId graph_pool() const noexcept;
  /// Inductor's layout optimization took the forward's convolutions to channels last.
  bool channels_last() const noexcept { return channels_last_; }

 private:
  struct State;
  /// Inductor's layout optimization of the forward's convolutions, and the copies it makes.
  void plan_layout_copies(const JointGraph& graph, const std::vector<bool>& in_forward,
                          const std::vector<bool>& in_backward);
  std::unique_ptr<State> state_;
  std::vector<std::int32_t> saved_;
  std::int64_t saved_bytes_ = 0;
  std::size_t recomputed_ = 0;
  std::int64_t forward_peak_ = 0, backward_peak_ = 0;
  bool channels_last_ = false;
  CompileMode mode_;
};

}  // namespace mem::nn
