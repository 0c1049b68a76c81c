// detail.hpp — internals shared by the op files: host access to tensor data in
// compute mode (conversion from 16-bit types and gathering of strided views into
// host scratch, which a GPU kernel would not need and which therefore never goes
// through the allocator), dtype dispatch, GEMM, node construction and autocast.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/ops.hpp"
#include "vramscope/runtime/tensor.hpp"

namespace mem::nn::detail {

/// Reads element `i` of raw storage of type `dtype` as a double.
inline double load(const void* base, DType dtype, std::int64_t i) noexcept {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::F64: return static_cast<const double*>(base)[i];
    case DType::F16: return half_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::BF16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::I64: return static_cast<double>(static_cast<const std::int64_t*>(base)[i]);
    case DType::I32: return static_cast<const std::int32_t*>(base)[i];
    case DType::U8: case DType::Bool: return static_cast<const std::uint8_t*>(base)[i];
  }
  return 0;
}

inline void store(void* base, DType dtype, std::int64_t i, double v) noexcept {
  switch (dtype) {
    case DType::F32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(base)[i] = v; break;
    case DType::F16: static_cast<std::uint16_t*>(base)[i] = float_to_half(static_cast<float>(v)); break;
    case DType::BF16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::I64: static_cast<std::int64_t*>(base)[i] = static_cast<std::int64_t>(v); break;
    case DType::I32: static_cast<std::int32_t*>(base)[i] = static_cast<std::int32_t>(v); break;
    case DType::U8: case DType::Bool: static_cast<std::uint8_t*>(base)[i] = static_cast<std::uint8_t>(v); break;
  }
}

/// Calls fn(logical index, storage element offset) for every element in row-major order.
template <class Fn>
void for_each_offset(const Shape& shape, const Shape& strides, std::int64_t offset, Fn&& fn) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  const std::size_t nd = shape.size();
  if (nd == 0) {
    fn(std::int64_t{0}, offset);
    return;
  }
  std::array<std::int64_t, kMaxDims> idx{};
  std::int64_t off = offset;
  const std::int64_t inner = shape[nd - 1];
  const std::int64_t istride = strides[nd - 1];
  for (std::int64_t lin = 0; lin < n; lin += inner) {
    for (std::int64_t j = 0; j < inner; ++j) fn(lin + j, off + j * istride);
    for (std::ptrdiff_t d = static_cast<std::ptrdiff_t>(nd) - 2; d >= 0; --d) {
      ++idx[d];
      off += strides[d];
      if (idx[d] < shape[d]) break;
      off -= strides[d] * shape[d];
      idx[d] = 0;
    }
  }
}

template <class T>
constexpr DType dtype_of() noexcept {
  return std::is_same_v<T, double> ? DType::F64 : DType::F32;
}

/// A tensor's elements as a contiguous host array of T (zero-copy when possible).
template <class T>
class HostIn {
 public:
  explicit HostIn(const Tensor& t) {
    if (!t.defined()) return;
    const char* base = static_cast<const char*>(t.storage()->data());
    if (t.dtype() == dtype_of<T>() && t.is_contiguous()) {
      ptr_ = reinterpret_cast<const T*>(base) + t.offset();
      return;
    }
    buf_.resize(static_cast<std::size_t>(t.numel()));
    const DType dt = t.dtype();
    for_each_offset(t.shape(), t.strides(), t.offset(), [&](std::int64_t i, std::int64_t off) {
      buf_[static_cast<std::size_t>(i)] = static_cast<T>(load(base, dt, off));
    });
    ptr_ = buf_.data();
  }
  const T* data() const noexcept { return ptr_; }
  const T& operator[](std::int64_t i) const noexcept { return ptr_[i]; }

 private:
  std::vector<T> buf_;
  const T* ptr_ = nullptr;
};

/// Write access to a contiguous tensor as T; converts back on destruction when the
/// tensor is 16-bit. `read` loads the current values first (in-place updates).
template <class T>
class HostOut {
 public:
  explicit HostOut(const Tensor& t, bool read = false) : t_(t) {
    if (!t.is_contiguous()) throw Error("internal: output tensor is not contiguous");
    char* base = static_cast<char*>(t.storage()->data());
    if (t.dtype() == dtype_of<T>()) {
      ptr_ = reinterpret_cast<T*>(base) + t.offset();
      return;
    }
    buf_.resize(static_cast<std::size_t>(t.numel()));
    if (read) {
      for (std::int64_t i = 0, n_ = t.numel(); i < n_; ++i) buf_[i] = static_cast<T>(load(base, t.dtype(), t.offset() + i));
    }
    ptr_ = buf_.data();
  }
  ~HostOut() {
    if (buf_.empty()) return;
    char* base = static_cast<char*>(t_.storage()->data());
    for (std::int64_t i = 0, n_ = t_.numel(); i < n_; ++i) store(base, t_.dtype(), t_.offset() + i, buf_[i]);
  }
  HostOut(const HostOut&) = delete;
  HostOut& operator=(const HostOut&) = delete;
  T* data() noexcept { return ptr_; }
  T& operator[](std::int64_t i) noexcept { return ptr_[i]; }

 private:
  Tensor t_;
  std::vector<T> buf_;
  T* ptr_ = nullptr;
};

/// Calls f(float{}) or f(double{}): the compute type of a floating dtype.
template <class F>
void dispatch(DType dtype, F&& f) {
  if (dtype == DType::F64) {
    f(double{});
  } else {
    f(float{});
  }
}

/// Row-major C = alpha * op(A) op(B) + beta * C with op = transpose when flagged.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) noexcept;
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
          const double* a, std::int64_t lda, const double* b, std::int64_t ldb, double beta,
          double* c, std::int64_t ldc) noexcept;

/// Uniform double in [0, 1) for draw `counter` of stream `seed` (splitmix64).
inline double uniform01(std::uint64_t seed, std::uint64_t counter) noexcept {
  std::uint64_t z = seed + (counter + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

/// A node whose gradient passes to its input unchanged (CloneBackward0; AddBackward1, tensor
/// plus scalar). `name` is PyTorch's, a string literal.
class PassThroughBackward final : public Node {
 public:
  explicit PassThroughBackward(std::string_view name) noexcept : name_(name) {}
  TensorList apply(TensorList& grads) override { return {grads[0]}; }
  std::string_view name() const noexcept override { return name_; }

 private:
  std::string_view name_;
};

/// Creates a node of type N, stamps it and wires one edge per input.
template <class N, class... Args>
std::shared_ptr<N> make_node(std::initializer_list<const Tensor*> inputs, Args&&... args) {
  auto node = std::make_shared<N>(std::forward<Args>(args)...);
  init_node(*node);
  for (const Tensor* t : inputs) node->add_input(t != nullptr ? *t : Tensor{});
  return node;
}

/// Kernel-level writes into a tensor an op is producing: no version bump (PyTorch's
/// functional ops return tensors at version 0; only in-place ops bump).
void fill_raw(const Tensor& tensor, double value);
void uniform_raw(const Tensor& tensor, double low, double high, std::uint64_t seed);
void copy_raw(const Tensor& dst, const Tensor& src);

/// PyTorch's check_inplace, for an in-place op that will record history (grad mode
/// on, some input requiring grad): `self` may not be a leaf requiring grad. Throws
/// AutogradError("a leaf Variable that requires grad is being used in an in-place
/// operation.") otherwise.
void check_inplace(const Tensor& self, bool records_history);
/// rebase_history for the result `out` of an in-place op: gives it the node's
/// history and notes the node on the storage (the grad_fn PyTorch's version-mismatch
/// message names for tensors saved before the op).
void rebase_history(Tensor& out, const std::shared_ptr<Node>& node);

/// Autocast's lower-precision cast: f32 inputs become the autocast half type
/// (parameters through the per-region cache). Other tensors pass unchanged.
Tensor autocast_half(const Tensor& x);
/// Autocast's f32 cast for ops on the fp32 list (softmax, layer_norm, losses).
Tensor autocast_f32(const Tensor& x);

/// Common dtype of a binary op (f32 wins over 16-bit, f64 over all).
DType promote(DType a, DType b) noexcept;

/// grad summed down to `shape` (at::sum_to: what a broadcast input receives); the same
/// tensor when the shapes agree, else one allocation of `shape`.
Tensor sum_to(const Tensor& grad, const Shape& shape);

/// grad cast back to the dtype of the input it flows to (allocates when different).
Tensor match_dtype(const Tensor& grad, DType dtype);

/// The output of a pointwise op as TensorIterator allocates it, and empty_like(preserve_format):
/// when `like` has the output's shape and is not contiguous, dense in `like`'s memory order
/// (its dimensions sorted by stride), so that x.transpose(1, 2) * c keeps x's layout (and a
/// later reshape copies where PyTorch's does); otherwise contiguous.
Tensor empty_following(const Tensor& like, const Shape& shape, DType dtype);

/// Writes `values` (row-major over t's logical shape) into t, whatever its strides.
template <class T>
void store_logical(const Tensor& t, const std::vector<T>& values) {
  void* base = t.storage()->data();
  for_each_offset(t.shape(), t.strides(), t.offset(), [&](std::int64_t i, std::int64_t off) {
    store(base, t.dtype(), off, static_cast<double>(values[static_cast<std::size_t>(i)]));
  });
}

/// out[i] = f(x[i]) into a new tensor of x's shape, dtype and layout (TensorIterator), one
/// flop per element; no history (the caller sets its node).
template <class F>
Tensor unary(const Tensor& x, F f) {
  Runtime& rt = x.runtime();
  Tensor out = empty_following(x, x.shape(), x.dtype());
  rt.add_flops(static_cast<double>(x.numel()));
  if (rt.computing()) {
    dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      std::vector<T> y(static_cast<std::size_t>(x.numel()));
      for (std::size_t i = 0; i < y.size(); ++i) y[i] = f(X[static_cast<std::int64_t>(i)]);
      store_logical(out, y);
    });
  }
  return out;
}

/// x.mean(dims, keepdim=True) over its trailing dimensions, `out_shape` being x's shape with
/// those set to 1 (mean_last, the 1x1 adaptive average pool). Saves nothing (MeanBackward1);
/// backward allocates the input's shape.
Tensor mean_trailing(const Tensor& x, const Shape& out_shape);

/// A tensor on `base`'s storage with its own layout (no allocation, no history): a view, or the
/// result of an in-place op. `dtype` defaults to base's (an undefined optional).
inline Tensor alias_of(const Tensor& base, const Shape& shape, const Shape& strides, std::int64_t offset,
                       std::optional<DType> dtype = std::nullopt) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype.value_or(base.dtype());
  return Tensor(std::move(impl));
}

/// A new uninitialised tensor in the same runtime.
inline Tensor new_empty(const Tensor& like, const Shape& shape, DType dtype) {
  return empty(like.runtime(), shape, dtype);
}

/// Selective checkpointing's seam into the runtime's own ops that an operator graph runs
/// (graph/op_kernels.cpp: convolution, batch norm, attention), which allocate their outputs
/// themselves. Installed on the thread for one call (OutputCacheGuard); the op takes it at its
/// start (take_output_cache), so the ops it calls do not see it. Its outputs are then those a
/// selective checkpoint kept (`reuse`: the rerun takes them, and the op neither allocates nor
/// computes: no FLOPs, no workspace), or are handed to `kept` as they are made (the forward).
struct OutputCache {
  const TensorList* reuse = nullptr;
  TensorList* kept = nullptr;
  bool reused() const noexcept { return reuse != nullptr; }
  /// Output k: the kept one in a rerun, else make()'s.
  template <class Make>
  Tensor output(std::size_t k, Make&& make) {
    if (reuse != nullptr) return k < reuse->size() ? (*reuse)[k] : Tensor{};
    Tensor t = make();
    if (kept != nullptr) {
      if (kept->size() <= k) kept->resize(k + 1);
      (*kept)[k] = t;
    }
    return t;
  }
};
OutputCache*& output_cache_slot() noexcept;
/// The cache installed for the op that calls it (empty when none), uninstalled.
inline OutputCache take_output_cache() noexcept {
  OutputCache*& slot = output_cache_slot();
  if (slot == nullptr) return {};
  OutputCache cache = *slot;
  slot = nullptr;
  return cache;
}
class OutputCacheGuard {
 public:
  explicit OutputCacheGuard(OutputCache& cache) noexcept : previous_(output_cache_slot()) { output_cache_slot() = &cache; }
  ~OutputCacheGuard() { output_cache_slot() = previous_; }
  OutputCacheGuard(const OutputCacheGuard&) = delete;
  OutputCacheGuard& operator=(const OutputCacheGuard&) = delete;

 private:
  OutputCache* previous_;
};

/// torch.autograd.graph.GradientEdge of an output whose tensor is dropped: backward starts
/// from its node without its storage (a pipeline stage's sent output, nn.DataParallel's
/// gathered replica output).
inline Tensor gradient_edge(const Tensor& output) {
  auto edge = std::make_shared<TensorImpl>();
  const TensorImpl& of = *output.impl();
  edge->storage = std::make_shared<Storage>(output.runtime(), 0);
  edge->shape = of.shape;
  edge->strides = of.strides;
  edge->dtype = of.dtype;
  edge->requires_grad = of.requires_grad;
  edge->grad_fn = of.grad_fn;
  edge->output_nr = of.output_nr;
  return Tensor(std::move(edge));
}

}  // namespace mem::nn::detail
