// op_kernels.cpp — recorded operators onto the runtime's own ops (op_kernels.hpp).
#include "graph/op_kernels.hpp"

#include <algorithm>
#include <optional>
#include <string_view>

#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {

namespace {

bool has(const OpGraph::OpSpec& op, std::string_view key) {
  for (const auto& [k, v] : op.args) {
    if (k == key) return true;
  }
  return false;
}

std::int64_t integer(const OpGraph::OpSpec& op, std::string_view key) { return static_cast<std::int64_t>(op.arg(key)); }

/// What the runtime's attention op takes: q [B, H, S, d], k and v alike [B, H_kv, S_kv, d], H a
/// multiple of H_kv. DeepSeek's MLA (v's head dim below q's and k's) takes the generic path.
bool attention_shapes(const TensorList& in) {
  return in.size() == 3 && in[0].dim() == 4 && in[1].dim() == 4 && in[1].shape() == in[2].shape() &&
         in[0].size(0) == in[1].size(0) && in[0].size(3) == in[1].size(3) && in[1].size(1) > 0 &&
         in[0].size(1) % in[1].size(1) == 0;
}

}  // namespace

std::optional<TensorList> run_mapped(const OpRule& rule, const OpGraph::OpSpec& op, const TensorList& in) {
  switch (rule.kernel) {
    case OpKernel::None:
      return std::nullopt;
    case OpKernel::Convolution:
      // aten.convolution(input, weight, bias, stride, padding, dilation, transposed, ...): the
      // recording gives stride, padding and dilation when they are the same along both sides.
      if (in.size() >= 2 && in[0].dim() == 4 && in[1].dim() == 4 && has(op, "stride") && has(op, "padding") &&
          has(op, "dilation") && has(op, "groups") && op.arg("transposed") == 0) {
        return TensorList{conv2d(in[0], in[1], in.size() > 2 ? in[2] : Tensor{}, integer(op, "stride"),
                                 integer(op, "padding"), integer(op, "dilation"), integer(op, "groups"))};
      }
      return std::nullopt;
    case OpKernel::BatchNorm:
      // native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps).
      if (in.size() == 5 && in[0].dim() >= 2 && has(op, "training")) {
        return TensorList{batch_norm(in[0], in[1], in[2], in[3], in[4], op.arg("training") != 0, op.arg("momentum"),
                                     op.arg("eps")),
                          Tensor{}, Tensor{}};
      }
      return std::nullopt;
    case OpKernel::Attention:
      // Without a mask, the runtime's own attention op: flash or memory-efficient as
      // sdp_utils.cpp picks for the run's dtype, with its saved tensors and backward workspaces.
      if (attention_shapes(in)) {
        const SdpaBackend backend =
            flash_supports(in[0].dtype(), in[0].size(3)) ? SdpaBackend::Flash : SdpaBackend::Efficient;
        return TensorList{scaled_dot_product_attention(in[0], in[1], in[2], backend, op.arg("is_causal") != 0,
                                                       op.arg("dropout_p")),
                          Tensor{}, Tensor{}, Tensor{}};
      }
      return std::nullopt;
  }
  return std::nullopt;
}

namespace {

/// A collective sends its inputs' bytes, (N - 1) / N of them to the other ranks of its group.
void count_sent(Runtime& runtime, const TensorList& sent) {
  double bytes = 0;
  for (const Tensor& t : sent) {
    if (t.defined()) bytes += static_cast<double>(t.nbytes());
  }
  const auto ranks = static_cast<double>(runtime.collective_ranks());
  runtime.count_collective_sent(bytes * (ranks - 1 > 0 ? (ranks - 1) / ranks : 1.0));
}

}  // namespace

void backward_effects(Runtime& runtime, const OpRule& rule, double forward_flops, const TensorList& grads) {
  if (rule.collective) {
    count_sent(runtime, grads);  // the gradient goes back the way the input came
    return;
  }
  if (rule.product != OpProduct::None) {
    runtime.gemm_workspace(false);
    runtime.add_flops(2 * forward_flops);
    return;
  }
  double elements = 0;
  for (const Tensor& t : grads) {
    if (t.defined()) elements += static_cast<double>(t.numel());
  }
  runtime.add_flops(elements);
}

double device_effects(Runtime& runtime, const OpRule& rule, const TensorList& in, const TensorList& out, bool runs) {
  if (rule.collective) {
    // Communication, no arithmetic: the received output is written by NCCL.
    if (runs) count_sent(runtime, in);
    return 0;
  }
  const auto dims = [&](std::size_t i) { return i < in.size() && in[i].defined() ? in[i].shape() : Shape{}; };
  const bool biased = rule.product == OpProduct::Addmm || rule.product == OpProduct::Baddbmm;
  if (rule.product != OpProduct::None && !out.empty() && out[0].defined()) {
    // The left matrix is input 0, or input 1 after addmm's and baddbmm's bias; addmm with a
    // bias runs through cublasLt (ops_linear.cpp: linear).
    const Shape a = dims(biased ? 1 : 0);
    if (runs) runtime.gemm_workspace(rule.product == OpProduct::Addmm);
    const bool batched = rule.product == OpProduct::Bmm || rule.product == OpProduct::Baddbmm;
    double flops = 0;
    if (!batched && a.size() == 2) flops = linear_flops(a[0], out[0].shape().back(), a[1]);
    if (batched && a.size() == 3) flops = static_cast<double>(a[0]) * linear_flops(a[1], out[0].shape().back(), a[2]);
    if (runs) runtime.add_flops(flops);
    return flops;
  }
  // One FLOP per element made; a view or an in-place write's output is its input's storage (a
  // transpose computes nothing; an in-place op's own elements are counted once).
  double elements = 0;
  for (const Tensor& t : out) {
    if (!t.defined() || !is_floating(t.dtype())) continue;
    const bool aliases = std::any_of(in.begin(), in.end(), [&](const Tensor& i) {
      return i.defined() && i.storage() == t.storage() && !(i.shape() == t.shape() && i.is_same(t));
    });
    if (!aliases) elements += static_cast<double>(t.numel());
  }
  if (runs) runtime.add_flops(elements);
  return elements;
}

}  // namespace mem::nn::detail
