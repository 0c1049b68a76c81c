// kernels.cpp — BLAS GEMM and the dtype helpers shared by the ops.
#include <cblas.h>

#include <algorithm>

#include "engine/detail.hpp"

namespace mem::nn::detail {

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) noexcept {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
          const double* a, std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c,
          std::int64_t ldc) noexcept {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

DType promote(DType a, DType b) noexcept {
  if (a == b) return a;
  if (a == DType::F64 || b == DType::F64) return DType::F64;
  if (a == DType::F32 || b == DType::F32) return DType::F32;
  if (is_half(a) && is_half(b)) return DType::F32;  // f16 + bf16 -> f32
  return is_floating(a) ? a : b;
}

Tensor empty_following(const Tensor& like, const Shape& shape, DType dtype) {
  Runtime& rt = like.runtime();
  if (!like.defined() || !(like.shape() == shape) || like.is_contiguous() || shape.size() < 2) {
    return empty(rt, shape, dtype);
  }
  // Dense, in `like`'s dimension order, dense or not (a head of a fused qkv projection has
  // gaps): c10's infer_dense_strides (TensorUtils.cpp), which empty_like(preserve_format) and
  // TensorIterator's output permutation follow. An insertion sort from the innermost
  // dimension by stride, then size; a stride of 0 (an expanded dimension) decides nothing.
  const std::size_t n = shape.size();
  const Shape& strides = like.strides();
  std::vector<std::size_t> perm(n);  // perm[0] is the innermost dimension
  for (std::size_t i = 0; i < n; ++i) perm[i] = n - 1 - i;
  const auto should_swap = [&](std::size_t a, std::size_t b) {
    if (strides[a] == 0 || strides[b] == 0) return 0;
    if (strides[a] != strides[b]) return strides[a] < strides[b] ? -1 : 1;
    return shape[a] > shape[b] ? 1 : 0;
  };
  for (std::size_t i = 1; i < n; ++i) {
    std::size_t b = i;
    for (std::size_t j = 1; j <= i; ++j) {
      const std::size_t a = i - j;
      const int comparison = should_swap(perm[a], perm[b]);
      if (comparison > 0) {
        std::swap(perm[a], perm[b]);
        b = a;
      } else if (comparison < 0) {
        break;
      }
    }
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = shape;
  std::int64_t stride = 1;
  for (const std::size_t d : perm) {
    impl->strides[d] = stride;
    if (shape[d] > 1) stride *= shape[d];
  }
  impl->storage = empty(rt, Shape{shape.numel()}, dtype).storage();
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (!grad.defined() || grad.shape() == shape) return grad;
  Tensor out = zeros(grad.runtime(), shape, grad.dtype());
  grad.runtime().add_flops(static_cast<double>(grad.numel()));
  if (!grad.runtime().computing()) return out;
  // Walk the gradient in row-major order with `out` seen through stride-0 views.
  Shape strides;
  const Shape own = contiguous_strides(shape);
  const std::size_t lead = grad.dim() - shape.size();
  for (std::size_t i = 0; i < grad.dim(); ++i) {
    strides.push_stride(i < lead || shape[i - lead] != grad.shape()[i] ? 0 : own[i - lead]);
  }
  dispatch(grad.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> G(grad);
    std::vector<T> acc(static_cast<std::size_t>(shape.numel()), T{0});
    for_each_offset(grad.shape(), strides, 0, [&](std::int64_t i, std::int64_t off) {
      acc[static_cast<std::size_t>(off)] += G[i];
    });
    HostOut<T> Y(out);
    for (std::size_t i = 0; i < acc.size(); ++i) Y[static_cast<std::int64_t>(i)] = acc[i];
  });
  return out;
}

Tensor match_dtype(const Tensor& grad, DType dtype) {
  if (!grad.defined() || grad.dtype() == dtype) return grad;
  return to_dtype(grad, dtype);
}

Tensor autocast_half(const Tensor& x) {
  if (!x.defined()) return x;
  const auto target = x.runtime().autocast();
  if (!target || x.dtype() != DType::F32) return x;
  // autocast caches casts of leaves requiring grad (parameters) per region.
  if (x.is_leaf() && x.requires_grad()) return x.runtime().cached_cast(x, *target);
  return to_dtype(x, *target);
}

Tensor autocast_f32(const Tensor& x) {
  if (!x.defined() || !x.runtime().autocast() || !is_half(x.dtype())) return x;
  return to_dtype(x, DType::F32);
}

}  // namespace mem::nn::detail
