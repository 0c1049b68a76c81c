// split_backward.hpp — a pipeline stage's backward in two halves (internal), as the zero-bubble
// schedules run it (torch 2.15, torch/distributed/pipelining/_backward.py):
//
//   - backward_input (stage_backward_input): torch.autograd.grad from the stage's output (or
//     loss) to its input alone, retain_graph=True, so every saved tensor stays; a pre-hook on
//     each "intermediate" (the first node on the input's path that a weight's gradient flows
//     through: a projection's MmBackward, a norm's MulBackward) stashes the gradients it
//     receives. get_param_groups groups the weights by those intermediates.
//   - backward_weight (stage_backward_weight): for each group, torch.autograd.grad from the
//     intermediates with the stashed gradients to the group's weights, retain_graph=False;
//     each gradient is assigned to .grad or added in place. The stash goes group by group; the
//     graph (and what its nodes saved) when the groups go.
#pragma once

#include <memory>
#include <vector>

#include "vramscope/runtime/autograd.hpp"

namespace mem::nn::detail {

/// get_param_groups' group: weights whose gradients flow through the same intermediates.
struct ParamGroup {
  std::vector<std::shared_ptr<Node>> intermediates;
  std::vector<TensorList> grads;  ///< what each intermediate received in backward_input
  std::vector<Tensor> params;
};

/// What backward_input keeps for backward_weight.
struct InputBackward {
  Tensor input_grad;  ///< the gradient of the stage's input (undefined when none reached it)
  std::vector<ParamGroup> groups;
};

/// stage_backward_input: `roots` (the output's edges with the gradients received, or the loss
/// with ones) to `input`, a leaf requiring grad, whose .grad it sets.
InputBackward backward_input(const std::vector<GradientRoot>& roots, Tensor& input, const std::vector<Tensor>& weights);

/// stage_backward_weight: each group's weights' gradients, into their .grad; the groups' stash
/// is released as each is done.
void backward_weight(std::vector<ParamGroup>& groups);

}  // namespace mem::nn::detail
