// losses.hpp — loss functions (mean reduction), differentiable like any op.
#pragma once

#include "vramscope/runtime/tensor.hpp"

namespace mem::nn {

/// Mean squared error. Allocates the scalar loss; saves input and target.
/// Backward allocates one gradient of the input's shape.
Tensor mse_loss(const Tensor& input, const Tensor& target);

/// cross_entropy = log_softmax (allocates [M, C], saves its output) followed by
/// nll_loss (allocates the scalar loss and the scalar total_weight; saves the
/// log-probabilities, the target and total_weight). `target` holds i64 class
/// indices of shape input.shape[:-1]. Under autocast the logits are first cast to f32.
Tensor cross_entropy(const Tensor& logits, const Tensor& target);
/// binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss): float targets in [0, 1] of the
/// input's shape. Two input-sized temporaries while it runs (log_sigmoid and the
/// elementwise loss), the scalar loss after; saves input and target; backward allocates
/// one gradient of the input's shape. Under autocast the input is first cast to f32.
Tensor bce_with_logits(const Tensor& input, const Tensor& target);

/// Liger's fused linear cross entropy (LigerFusedLinearCrossEntropyFunction, mean reduction):
/// the loss of input [BT, H] @ weight [V, H]^T against i64 target [BT] without the logits. It
/// walks the tokens in chunks of about BT x H logits (one buffer, or one per chunk under
/// autocast), computing the gradients in the forward: grad_input [BT, H] (and grad_weight [V, H]
/// when the weight trains) are allocated there and saved; backward allocates nothing of size.
Tensor fused_linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& target);

}  // namespace mem::nn
