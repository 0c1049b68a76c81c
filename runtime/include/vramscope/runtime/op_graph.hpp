// op_graph.hpp — a model recorded at the level of PyTorch's operators, run by the engine.
//
// `python -m vramscope.export` records one training forward of any nn.Module as ATen
// operators on meta tensors (docs/EXPORT.md): each operator with its inputs and outputs,
// which outputs view or write an input, the module call it ran in, and what its autograd
// node keeps for backward (read from PyTorch's own SavedVariables). An OpGraph is that
// recording at one set of sizes; op_graph_module() turns it into modules, one per module
// call, whose forward runs the operators through the caching allocator:
//
//   auto graph = std::make_shared<mem::nn::OpGraph>(...);   // models/ reads it from a file
//   auto root = mem::nn::op_graph_module(graph);            // "conv1", "layer1.0", ...
//   root->materialize(rt, mem::nn::DType::BF16);
//   mem::nn::Tensor logits = (*root)(input);
//
// Every output that is not a view is one allocation; a view or an in-place write shares
// its input's storage. A tensor is dropped where the recording saw the program's last
// reference to it go (a rebound variable, a call's return), and its storage is freed once
// no view and no node's saved tensor holds it. Nodes keep exactly
// the recorded tensors and, in backward, allocate each input's gradient unless PyTorch's
// formula hands the incoming gradient on (op_rules.hpp). Module calls are Modules, so
// per-module attribution, hooks, checkpoint marks (apply_activation_checkpointing by path)
// and the data-parallel engines' hooks work as on any model. Dry runs only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vramscope/runtime/modules.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

/// One recorded forward at concrete sizes. Tensors and calls are referred to by index.
/// Invariants (checked by the reader, models/src/op_model.cpp): every index is in range; an
/// op reads only inputs, parameters, buffers, constants and outputs of earlier ops; each
/// activation is the output of exactly one op (an in-place op's output is its input's
/// index); a call's parent comes before it; a base comes before the tensor viewing it.
struct OpGraph {
  /// Host: a CPU tensor or wrapped Python number the ops read or make, on no device.
  enum class Kind : std::uint8_t { Input, Param, Buffer, Const, Activation, Host };
  struct TensorSpec {
    Kind kind = Kind::Activation;
    Shape shape;
    DType dtype = DType::F32;
    /// The run's floating dtype (the recording's "float"), rather than a fixed one.
    bool follows_run_dtype = false;
    std::int32_t base = -1;  ///< the tensor whose storage this one views (-1: its own)
    std::string name;        ///< parameters and buffers: the dotted name
    bool requires_grad = false;
  };
  struct OpSpec {
    std::string op;                   ///< "aten.convolution.default"
    std::vector<std::int32_t> in, out;
    std::vector<std::int32_t> alias;  ///< per output: the input index it views or writes, -1: new
    std::vector<std::int32_t> saves;  ///< tensors the node keeps for backward
    /// Tensors the program's last reference to went right after this op (the recording saw
    /// them die): the runtime drops them then. Saved tensors live on in their nodes.
    std::vector<std::int32_t> frees;
    /// Tensors whose last reference went once the op's call had returned to the enclosing call
    /// named first (a local of that call going at its return): {call, tensor} pairs.
    std::vector<std::pair<std::int32_t, std::int32_t>> frees_after;
    std::int32_t call = 0;
    bool inplace = false;
    std::string node;                 ///< PyTorch's node ("ConvolutionBackward0"); "": none
    std::string line;                 ///< the user's source line
    /// The scalar arguments the runtime reads (attention's is_causal and dropout_p;
    /// autocast_cache: autocast's cast of a parameter, kept in its cache).
    std::vector<std::pair<std::string, double>> args;
    double arg(std::string_view key) const noexcept {
      for (const auto& [k, v] : args) {
        if (k == key) return v;
      }
      return 0;
    }
  };
  struct CallSpec {
    std::string module;  ///< the full path ("" for the root)
    std::string cls;
    std::int32_t parent = -1;
    CheckpointMark checkpoint = CheckpointMark::None;
    /// The tensors passed to it positionally: what checkpoint() keeps as its inputs (its
    /// _NoopSaveInputs takes *args; keyword arguments stay with the checkpoint's closure).
    std::vector<std::int32_t> args;
    /// Code of the enclosing call rather than a module of its own (a function forward ran under
    /// torch.utils.checkpoint): no path segment, its memory the enclosing module's.
    bool inline_code = false;
  };
  std::vector<TensorSpec> tensors;
  std::vector<OpSpec> ops;
  std::vector<CallSpec> calls;      ///< calls[0] is the root's
  std::vector<std::int32_t> inputs;  ///< the forward's tensor arguments, in order
  std::int32_t output = -1;         ///< what the loss starts from
  std::string recorded_with;        ///< "torch 2.15.0"
  /// Recorded under CUDA's autocast in this half type (its casts are ops of the graph; the
  /// run's dtype is f32): it runs only under the same autocast (--dtype amp / amp-bf16).
  std::optional<DType> autocast;
  /// Where the program read a value from a tensor, and what the recording took (its "assumed").
  std::vector<std::string> assumed;
};

/// The modules that run `graph`: the root call, inline (its children are named by their
/// paths), taking the graph's first input and returning its output; the other inputs are
/// allocated when it starts (a batch's further tensors: labels, masks). Throws mem::Error
/// when the graph breaks an invariant above.
std::unique_ptr<Module> op_graph_module(std::shared_ptr<const OpGraph> graph);

}  // namespace mem::nn
