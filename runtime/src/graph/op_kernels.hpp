// op_kernels.hpp — recorded operators that the runtime runs with its own ops (ops.hpp), so
// that a rule lives in one place: a convolution of a recorded model allocates, keeps and
// frees what the built-in Conv2d does, cuDNN's load included, and so on for batch norm and
// attention. Every other operator runs through the generic path (op_graph.cpp). Which op runs
// an operator is its rule's (op_rules.hpp).
#pragma once

#include <optional>

#include "graph/op_rules.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/op_graph.hpp"

namespace mem::nn::detail {

/// Runs `op` on `in` with the runtime's own op `rule` names when these arguments suit it, and
/// returns its outputs (undefined where the graph has an output the runtime's op keeps to
/// itself, such as batch norm's saved statistics); nullopt otherwise.
std::optional<TensorList> run_mapped(const OpRule& rule, const OpGraph::OpSpec& op, const TensorList& in);

/// What the device does besides allocating outputs, for the operators the generic path runs:
/// a matrix product takes cuBLAS's workspace (and loads cuBLAS) as the built-in ops do, and
/// every op counts its FLOPs (a multiply-add is 2; elementwise ops one per element). Returns
/// the FLOPs it counted. `runs` false: the op is not run (a selective checkpoint's rerun takes
/// its kept outputs): nothing happens, and the FLOPs it would count are returned.
double device_effects(Runtime& runtime, const OpRule& rule, const TensorList& in, const TensorList& out,
                      bool runs = true);
/// The same in the op's backward (its node's apply): a matrix product's gradients are two
/// more products on cuBLAS (the backward's own workspace, as the built-in Linear takes), and
/// `grads` elements for the others.
void backward_effects(Runtime& runtime, const OpRule& rule, double forward_flops, const TensorList& grads);

}  // namespace mem::nn::detail
