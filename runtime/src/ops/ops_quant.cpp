// ops_quant.cpp — bitsandbytes' 4-bit matmul (QLoRA's frozen base weights): MatMul4Bit
// of bitsandbytes 0.45 (autograd/_functions.py) over dequantize_4bit (functional.py).
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

/// dequantize_4bit: with double quantization the blocks' f32 absmax is rebuilt first
/// (dequantize_blockwise, [ceil(n / 64)] f32, freed on return), then the whole [out, in]
/// weight is written in the dtype it was loaded in; .to(A.dtype) copies when they differ.
Tensor dequantize(const Nf4Weight& w, DType compute) {
  Runtime& rt = w.packed.runtime();
  Tensor weight;
  {
    Tensor absmax;
    if (w.double_quant) absmax = empty(rt, Shape{(w.out * w.in + 63) / 64}, DType::F32);
    weight = empty(rt, Shape{w.out, w.in}, w.dtype);
  }
  return to_dtype(weight, compute);
}

/// MatMul4Bit.backward: grad_A = grad_output @ dequantize_4bit(B).to(grad.dtype).t(); B
/// gets no gradient. The node keeps only the packed weight (ctx.tensors = (None, B)),
/// which the module holds anyway: no activation is saved.
class MatMul4BitBackward final : public Node {
 public:
  explicit MatMul4BitBackward(Nf4Weight w) : w_(std::move(w)) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor weight = dequantize(w_, g.dtype());
    return {linear_kn(g, weight)};
  }
  void release_variables() noexcept override { w_ = Nf4Weight{}; }
  std::string_view name() const noexcept override { return "MatMul4BitBackward"; }

 private:
  Nf4Weight w_;
};

}  // namespace

Tensor matmul_4bit(const Tensor& x, const Nf4Weight& w) {
  Runtime& rt = x.runtime();
  if (rt.computing()) {
    throw Error("4-bit (NF4) weights run in dry runs only: compute mode has no 4-bit kernels");
  }
  if (x.size(-1) != w.in) {
    throw Error("matmul_4bit: input " + x.shape().str() + " for a [" + std::to_string(w.out) + ", " +
                std::to_string(w.in) + "] weight");
  }
  Tensor out;
  {
    NoGradGuard no_grad;  // the dequantized weight is a temporary, not saved
    const Tensor weight = dequantize(w, x.dtype());
    out = linear(x, weight);
  }
  if (needs_grad({&x})) set_history(out, detail::make_node<MatMul4BitBackward>({&x}, w));
  return out;
}

}  // namespace mem::nn
