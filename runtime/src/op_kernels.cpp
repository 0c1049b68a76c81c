// op_kernels.cpp — recorded operators onto the runtime's own ops (op_kernels.hpp).
#include "op_kernels.hpp"

#include <optional>
#include <string_view>

#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {

namespace {

/// "aten.convolution.default" -> "convolution".
std::string_view base_name(std::string_view op) {
  if (op.starts_with("aten.")) op.remove_prefix(5);
  return op.substr(0, op.find('.'));
}

bool has(const OpGraph::OpSpec& op, std::string_view key) {
  for (const auto& [k, v] : op.args) {
    if (k == key) return true;
  }
  return false;
}

std::int64_t integer(const OpGraph::OpSpec& op, std::string_view key) { return static_cast<std::int64_t>(op.arg(key)); }

}  // namespace

std::optional<TensorList> run_mapped(const OpGraph::OpSpec& op, const TensorList& in) {
  const std::string_view name = base_name(op.op);
  if (name == "convolution" && in.size() >= 2 && in[0].dim() == 4 && in[1].dim() == 4 && has(op, "stride") &&
      has(op, "padding") && has(op, "dilation") && has(op, "groups") && op.arg("transposed") == 0) {
    // aten.convolution(input, weight, bias, stride, padding, dilation, transposed, ...): the
    // recording gives stride, padding and dilation when they are the same along both sides.
    return TensorList{conv2d(in[0], in[1], in.size() > 2 ? in[2] : Tensor{}, integer(op, "stride"),
                             integer(op, "padding"), integer(op, "dilation"), integer(op, "groups"))};
  }
  if (name == "native_batch_norm" && in.size() == 5 && in[0].dim() >= 2 && has(op, "training")) {
    // native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps).
    return TensorList{batch_norm(in[0], in[1], in[2], in[3], in[4], op.arg("training") != 0, op.arg("momentum"),
                                 op.arg("eps")),
                      Tensor{}, Tensor{}};
  }
  const auto attention_shapes = [&] {
    // What the runtime's op takes: q [B, H, S, d], k and v alike [B, H_kv, S_kv, d], H a multiple
    // of H_kv. DeepSeek's MLA (v's head dim below q's and k's) takes the generic path.
    return in.size() == 3 && in[0].dim() == 4 && in[1].dim() == 4 && in[1].shape() == in[2].shape() &&
           in[0].size(0) == in[1].size(0) && in[0].size(3) == in[1].size(3) && in[1].size(1) > 0 &&
           in[0].size(1) % in[1].size(1) == 0;
  };
  if (name == "_scaled_dot_product_efficient_attention" && attention_shapes()) {
    // Without a mask, the runtime's own attention op: flash or memory-efficient as
    // sdp_utils.cpp picks for the run's dtype, with its saved tensors and backward workspaces.
    const SdpaBackend backend = flash_supports(in[0].dtype(), in[0].size(3)) ? SdpaBackend::Flash : SdpaBackend::Efficient;
    return TensorList{scaled_dot_product_attention(in[0], in[1], in[2], backend, op.arg("is_causal") != 0,
                                                   op.arg("dropout_p")),
                      Tensor{}, Tensor{}, Tensor{}};
  }
  return std::nullopt;
}

bool is_product(const OpGraph::OpSpec& op) noexcept {
  const std::string_view name = base_name(op.op);
  return name == "mm" || name == "addmm" || name == "bmm" || name == "baddbmm";
}

void backward_effects(Runtime& runtime, const OpGraph::OpSpec& op, double forward_flops, const TensorList& grads) {
  if (is_product(op)) {
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

double device_effects(Runtime& runtime, const OpGraph::OpSpec& op, const TensorList& in, const TensorList& out) {
  const std::string_view name = base_name(op.op);
  const auto dims = [&](std::size_t i) { return i < in.size() && in[i].defined() ? in[i].shape() : Shape{}; };
  if ((name == "mm" || name == "addmm") && !out.empty() && out[0].defined()) {
    // addmm with a bias runs through cublasLt (ops_linear.cpp: linear).
    const Shape a = dims(name == "addmm" ? 1 : 0);
    runtime.gemm_workspace(name == "addmm");
    const double flops = a.size() == 2 ? linear_flops(a[0], out[0].shape().back(), a[1]) : 0;
    runtime.add_flops(flops);
    return flops;
  }
  if ((name == "bmm" || name == "baddbmm") && !out.empty() && out[0].defined()) {
    const Shape a = dims(name == "baddbmm" ? 1 : 0);
    runtime.gemm_workspace(false);
    const double flops = a.size() == 3 ? static_cast<double>(a[0]) * linear_flops(a[1], out[0].shape().back(), a[2]) : 0;
    runtime.add_flops(flops);
    return flops;
  }
  double elements = 0;
  for (const Tensor& t : out) {
    if (t.defined() && is_floating(t.dtype())) elements += static_cast<double>(t.numel());
  }
  runtime.add_flops(elements);
  return elements;
}

}  // namespace mem::nn::detail
