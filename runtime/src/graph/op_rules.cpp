// op_rules.cpp — the per-operator facts of op_rules.hpp, with their sources.
#include "graph/op_rules.hpp"

#include <string>
#include <unordered_map>

#include "vramscope/runtime/ops.hpp"

namespace mem::nn::detail {

namespace {

constexpr std::uint32_t kAll = ~std::uint32_t{0};

std::unordered_map<std::string, OpRule> make_rules() {
  std::unordered_map<std::string, OpRule> rules;
  // Views whose backward is a view of the gradient (derivatives.yaml: view, _unsafe_view and
  // reshape give grad.reshape_symint(self.sym_sizes()); permute permute_backwards; transpose
  // and t grad.transpose / grad.t(); unsqueeze grad.squeeze(dim); squeeze unsqueeze_to; alias
  // and detach hand grad on). select, slice, narrow, split, unbind, as_strided and diagonal
  // are not here: their backward allocates a zero gradient of the whole input
  // (select_backward, slice_backward, ...).
  for (const char* view : {"view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t",
                           "unsqueeze", "squeeze", "alias", "view_as", "unflatten", "flatten", "detach", "lift_fresh",
                           "movedim", "swapaxes", "numpy_T", "mT", "expand_as"}) {
    rules[view].passes = kAll;
  }
  // expand: at::sum_to(grad, self.sym_sizes()) returns grad itself when nothing was expanded.
  rules["expand"].passes = kAll;
  // AddBackward0: self: grad, other: maybe_multiply(grad, alpha) (grad itself at alpha 1);
  // SubBackward0: self: grad, other: -grad (new). CloneBackward0: grad. ToCopyBackward0:
  // grad.to(self.options()) (no copy at the same dtype). copy_: self: zeros_like(grad), src: grad.
  for (const char* add : {"add", "add_"}) rules[add].passes = kAll;
  for (const char* sub : {"sub", "sub_", "rsub"}) rules[sub].passes = 1;
  for (const char* same : {"clone", "contiguous", "_to_copy", "to", "_copy_from_and_resize"}) rules[same].passes = kAll;
  rules["copy_"].passes = 2;
  rules["_to_copy"].conversion = true;
  // Run by the runtime's own ops (op_kernels.cpp): their saved tensors, workspaces and backward
  // are the built-in layers'.
  rules["convolution"].kernel = OpKernel::Convolution;
  rules["native_batch_norm"].kernel = OpKernel::BatchNorm;
  // Matrix products: addmm with a bias runs through cublasLt (ops_linear.cpp: linear).
  rules["mm"].product = OpProduct::Mm;
  rules["addmm"].product = OpProduct::Addmm;
  rules["bmm"].product = OpProduct::Bmm;
  rules["baddbmm"].product = OpProduct::Baddbmm;
  // The fused attention kernels return their philox seed and offset as CPU tensors
  // (attention.cu, _efficient_attention_forward: at::empty({}, at::dtype(at::kLong));
  // _flash_attention_forward likewise), and the logsumexp rows are the kernel's choice.
  OpRule& efficient = rules["_scaled_dot_product_efficient_attention"];
  efficient.host_outputs = (1u << 2) | (1u << 3);
  efficient.attention_logsumexp = true;
  efficient.kernel = OpKernel::Attention;
  OpRule& flash = rules["_scaled_dot_product_flash_attention"];
  flash.host_outputs = (1u << 6) | (1u << 7);
  flash.attention_logsumexp = true;
  // Collectives (torch/distributed/_functional_collectives.py over the ops of
  // torch/csrc/distributed/c10d/Functional.cpp): all_to_all_single makes its output of the
  // received rows and its autograd backward (_c10d_functional_autograd) sends the gradient back
  // by another all-to-all into a new tensor of the input's size (the default rule). wait_tensor
  // returns its input and _wrap_tensor_autograd wraps it (the recording aliases both);
  // alltoall_base_ (dist.all_to_all_single) writes into the output it is given.
  for (const char* collective : {"_c10d_functional.all_to_all_single", "_c10d_functional.all_gather_into_tensor",
                                 "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_reduce",
                                 "_c10d_functional_autograd.all_to_all_single", "c10d.alltoall_base_",
                                 "c10d.allgather_into_tensor_coalesced_", "c10d.allreduce_", "c10d._allgather_base_"}) {
    rules[collective].collective = true;
  }
  for (const char* same : {"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"}) {
    rules[same].passes = kAll;
  }
  return rules;
}

}  // namespace

std::string_view op_base_name(std::string_view op) noexcept {
  if (op.starts_with("aten.")) {
    op.remove_prefix(5);
    return op.substr(0, op.find('.'));
  }
  // Another namespace stays in the name: "_c10d_functional.wait_tensor".
  const std::size_t dot = op.find('.');
  return dot == std::string_view::npos ? op : op.substr(0, op.find('.', dot + 1));
}

const OpRule& op_rule(std::string_view op) {
  static const std::unordered_map<std::string, OpRule> rules = make_rules();
  static const OpRule none{};
  const auto it = rules.find(std::string(op_base_name(op)));
  return it == rules.end() ? none : it->second;
}

Shape attention_logsumexp_shape(const Shape& q, DType dtype, bool masked) {
  // Flash: softmax_lse {B, H, S} (flash_api.cpp); efficient: {B, H, ceil(S / 32) * 32}
  // (attention.cu, kAlignLSE = 32). sdp_utils.cpp picks flash for half inputs without a mask.
  const std::int64_t b = q.size() > 0 ? q[0] : 1, h = q.size() > 1 ? q[1] : 1, s = q.size() > 2 ? q[2] : 1;
  const std::int64_t d = q.size() > 3 ? q[3] : 1;
  if (!masked && flash_supports(dtype, d)) return Shape{b, h, s};
  return Shape{b, h, (s + 31) / 32 * 32};
}

}  // namespace mem::nn::detail
