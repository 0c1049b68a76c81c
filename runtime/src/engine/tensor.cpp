// tensor.cpp — shapes, storage blocks, tensor handles and factories.
#include "vramscope/runtime/tensor.hpp"

#include <string>

#include "engine/detail.hpp"

namespace mem::nn {

Shape::Shape(std::initializer_list<std::int64_t> dims)
    : Shape(std::span<const std::int64_t>(dims.begin(), dims.size())) {}

namespace {

// A shape's element count must fit in int64 (numel() is then exact, never a wrap): checked
// wherever a shape is built from numbers, as a model's sizes multiply into its shapes.
void check_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    if (d > 0 && __builtin_mul_overflow(n, d, &n)) {
      throw Error("tensor of shape " + shape.str() +
                  " has more than 2^63 elements; no device holds it (check the sizes given)");
    }
  }
}

}  // namespace

Shape::Shape(std::span<const std::int64_t> dims) {
  if (dims.size() > kMaxDims) {
    throw Error("tensor with " + std::to_string(dims.size()) + " dimensions; at most " +
                std::to_string(kMaxDims) + " are supported");
  }
  for (std::size_t i = 0; i < dims.size(); ++i) d_[i] = dims[i];
  n_ = static_cast<std::uint8_t>(dims.size());
  check_numel(*this);
}

void Shape::push_back(std::int64_t v) {
  if (n_ == kMaxDims) throw Error("tensor with more than " + std::to_string(kMaxDims) + " dimensions");
  d_[n_++] = v;
  try {
    check_numel(*this);
  } catch (...) {
    --n_;  // unchanged on error
    throw;
  }
}

void Shape::push_stride(std::int64_t v) {
  if (n_ == kMaxDims) throw Error("tensor with more than " + std::to_string(kMaxDims) + " dimensions");
  d_[n_++] = v;
}

std::int64_t Shape::numel() const noexcept {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < n_; ++i) n *= d_[i];
  return n;
}

std::string Shape::str() const {
  std::string s = "[";
  for (std::size_t i = 0; i < n_; ++i) {
    if (i) s += ", ";
    s += std::to_string(d_[i]);
  }
  return s + "]";
}

bool Shape::operator==(const Shape& other) const noexcept {
  if (n_ != other.n_) return false;
  for (std::size_t i = 0; i < n_; ++i) {
    if (d_[i] != other.d_[i]) return false;
  }
  return true;
}

Shape contiguous_strides(const Shape& shape) noexcept {
  Shape strides = shape;
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
  return strides;
}

namespace {
thread_local bool tls_meta_device = false;
}

MetaDevice::MetaDevice() noexcept : previous_(tls_meta_device) { tls_meta_device = true; }
MetaDevice::~MetaDevice() { tls_meta_device = previous_; }
bool MetaDevice::active() noexcept { return tls_meta_device; }

Storage::Storage(Runtime& runtime, std::size_t nbytes) : runtime_(&runtime), nbytes_(nbytes) {
  // Zero-byte tensors get no block, as in PyTorch (the allocator rejects 0 B).
  if (nbytes > 0 && !tls_meta_device) data_ = runtime.allocator().allocate(nbytes, runtime.stream());
}

void Storage::allocate() {
  if (data_ == nullptr && nbytes_ > 0) data_ = runtime_->allocator().allocate(nbytes_, runtime_->stream());
}

void Storage::allocate(std::size_t nbytes) {
  if (data_ != nullptr) throw Error("Storage::allocate(" + std::to_string(nbytes) + "): the storage holds a block already");
  nbytes_ = nbytes;
  allocate();
}

void Storage::free() noexcept {
  if (data_ == nullptr) return;
  try {
    runtime_->allocator().deallocate(data_);
  } catch (...) {
    // deallocate only throws for pointers it never handed out: an invariant violation.
  }
  data_ = nullptr;
}

Storage::~Storage() { free(); }

std::int64_t Tensor::size(std::int64_t d) const {
  const auto n = static_cast<std::int64_t>(dim());
  if (d < 0) d += n;
  if (d < 0 || d >= n) throw Error("dimension " + std::to_string(d) + " out of range for " + shape().str());
  return shape()[static_cast<std::size_t>(d)];
}

bool Tensor::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  const Shape& sh = shape();
  const Shape& st = strides();
  for (std::size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  if (!runtime().computing()) {
    throw Error("tensor data accessed in a dry run: device addresses have no memory behind them");
  }
  return static_cast<char*>(storage()->data()) + offset() * static_cast<std::int64_t>(dtype_size(dtype()));
}

Tensor& Tensor::set_requires_grad(bool value) {
  if (!is_leaf()) throw Error("set_requires_grad: only leaf tensors (no grad_fn) can change requires_grad");
  if (value && !is_floating(dtype())) {
    throw Error(std::string("set_requires_grad: only floating tensors can require grad, not ") +
                std::string(dtype_name(dtype())));
  }
  impl_->requires_grad = value;
  return *this;
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = impl_->storage;
  impl->shape = impl_->shape;
  impl->strides = impl_->strides;
  impl->offset = impl_->offset;
  impl->dtype = impl_->dtype;
  return Tensor(std::move(impl));
}

Tensor empty(Runtime& runtime, const Shape& shape, DType dtype) {
  for (auto d : shape) {
    if (d < 0) throw Error("empty: negative extent in " + shape.str());
  }
  check_numel(shape);  // a shape changed through operator[] since it was built
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<std::size_t>(shape.numel()), dtype_size(dtype), &bytes)) {
    throw Error("tensor of shape " + shape.str() + " needs more than 2^64 bytes; no device holds it");
  }
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = std::make_shared<Storage>(runtime, bytes);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor empty_like(const Tensor& like) { return empty(like.runtime(), like.shape(), like.dtype()); }

Tensor zeros(Runtime& runtime, const Shape& shape, DType dtype) { return full(runtime, shape, 0.0, dtype); }

Tensor full(Runtime& runtime, const Shape& shape, double value, DType dtype) {
  Tensor t = empty(runtime, shape, dtype);
  detail::fill_raw(t, value);  // a fresh tensor: torch.full returns version 0
  return t;
}

Tensor uniform(Runtime& runtime, const Shape& shape, double low, double high, DType dtype,
               std::uint64_t seed) {
  Tensor t = empty(runtime, shape, dtype);
  detail::uniform_raw(t, low, high, seed);
  return t;
}

Tensor arange(Runtime& runtime, std::int64_t n, DType dtype) {
  std::vector<double> values(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) values[static_cast<std::size_t>(i)] = static_cast<double>(i);
  return from_values(runtime, Shape{n}, values, dtype);
}

Tensor from_values(Runtime& runtime, const Shape& shape, std::span<const double> values, DType dtype) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel()) {
    throw Error("from_values: " + std::to_string(values.size()) + " values for shape " + shape.str());
  }
  Tensor t = empty(runtime, shape, dtype);
  if (runtime.computing()) {
    void* base = t.storage()->data();
    for (std::size_t i = 0; i < values.size(); ++i) {
      detail::store(base, dtype, static_cast<std::int64_t>(i), values[i]);
    }
  }
  return t;
}

std::vector<double> to_values(const Tensor& tensor) {
  if (!tensor.runtime().computing()) throw Error("to_values: no data in a dry run");
  std::vector<double> out(static_cast<std::size_t>(tensor.numel()));
  const void* base = tensor.storage()->data();
  detail::for_each_offset(tensor.shape(), tensor.strides(), tensor.offset(),
                          [&](std::int64_t i, std::int64_t off) {
                            out[static_cast<std::size_t>(i)] = detail::load(base, tensor.dtype(), off);
                          });
  return out;
}

void fill_(const Tensor& tensor, double value) {
  tensor.bump_version();
  detail::fill_raw(tensor, value);
}

void uniform_(const Tensor& tensor, double low, double high, std::uint64_t seed) {
  tensor.bump_version();
  detail::uniform_raw(tensor, low, high, seed);
}

void copy_(const Tensor& dst, const Tensor& src) {
  if (dst.numel() != src.numel()) {
    throw Error("copy_: " + src.shape().str() + " into " + dst.shape().str());
  }
  dst.bump_version();
  detail::copy_raw(dst, src);
}

namespace detail {

void fill_raw(const Tensor& tensor, double value) {
  if (!tensor.runtime().computing()) return;
  void* base = tensor.storage()->data();
  if (tensor.dtype() == DType::F32 && tensor.is_contiguous()) {
    float* p = static_cast<float*>(base) + tensor.offset();
    std::fill(p, p + tensor.numel(), static_cast<float>(value));
    return;
  }
  detail::for_each_offset(tensor.shape(), tensor.strides(), tensor.offset(),
                          [&](std::int64_t, std::int64_t off) { detail::store(base, tensor.dtype(), off, value); });
}

void uniform_raw(const Tensor& tensor, double low, double high, std::uint64_t seed) {
  if (!tensor.runtime().computing()) return;
  void* base = tensor.storage()->data();
  if (tensor.dtype() == DType::F32 && tensor.is_contiguous()) {
    float* p = static_cast<float*>(base) + tensor.offset();
    for (std::int64_t i = 0, n = tensor.numel(); i < n; ++i) {
      p[i] = static_cast<float>(low + (high - low) * detail::uniform01(seed, static_cast<std::uint64_t>(i)));
    }
    return;
  }
  detail::for_each_offset(tensor.shape(), tensor.strides(), tensor.offset(),
                          [&](std::int64_t i, std::int64_t off) {
                            const double u = detail::uniform01(seed, static_cast<std::uint64_t>(i));
                            detail::store(base, tensor.dtype(), off, low + (high - low) * u);
                          });
}

}  // namespace detail

namespace {

/// Converts n contiguous elements with the dtype switch outside the loop.
template <class Load, class Store>
void convert_loop(std::int64_t n, Load load, Store store) {
  for (std::int64_t i = 0; i < n; ++i) store(i, load(i));
}

bool convert_contiguous(void* dst, DType dd, const void* src, DType sd, std::int64_t n) {
  auto from = [&](auto store) {
    switch (sd) {
      case DType::F32: convert_loop(n, [&](std::int64_t i) { return static_cast<const float*>(src)[i]; }, store); return true;
      case DType::F16:
        convert_loop(n, [&](std::int64_t i) { return half_to_float(static_cast<const std::uint16_t*>(src)[i]); }, store);
        return true;
      case DType::BF16:
        convert_loop(n, [&](std::int64_t i) { return bf16_to_float(static_cast<const std::uint16_t*>(src)[i]); }, store);
        return true;
      default: return false;
    }
  };
  switch (dd) {
    case DType::F32: return from([&](std::int64_t i, float v) { static_cast<float*>(dst)[i] = v; });
    case DType::F16: return from([&](std::int64_t i, float v) { static_cast<std::uint16_t*>(dst)[i] = float_to_half(v); });
    case DType::BF16: return from([&](std::int64_t i, float v) { static_cast<std::uint16_t*>(dst)[i] = float_to_bf16(v); });
    default: return false;
  }
}

}  // namespace

namespace detail {

void copy_raw(const Tensor& dst, const Tensor& src) {
  if (dst.numel() != src.numel()) {
    throw Error("copy_: " + src.shape().str() + " into " + dst.shape().str());
  }
  if (!dst.runtime().computing()) return;
  const void* sbase = src.storage()->data();
  void* dbase = dst.storage()->data();
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    const std::size_t es = dtype_size(src.dtype());
    std::memmove(static_cast<char*>(dbase) + dst.offset() * static_cast<std::int64_t>(es),
                 static_cast<const char*>(sbase) + src.offset() * static_cast<std::int64_t>(es),
                 static_cast<std::size_t>(src.numel()) * es);
    return;
  }
  if (src.is_contiguous() && dst.is_contiguous()) {
    const char* s = static_cast<const char*>(sbase) + src.offset() * static_cast<std::int64_t>(dtype_size(src.dtype()));
    char* d = static_cast<char*>(dbase) + dst.offset() * static_cast<std::int64_t>(dtype_size(dst.dtype()));
    if (convert_contiguous(d, dst.dtype(), s, src.dtype(), src.numel())) return;
  }
  std::vector<double> values(static_cast<std::size_t>(src.numel()));
  detail::for_each_offset(src.shape(), src.strides(), src.offset(), [&](std::int64_t i, std::int64_t off) {
    values[static_cast<std::size_t>(i)] = detail::load(sbase, src.dtype(), off);
  });
  detail::for_each_offset(dst.shape(), dst.strides(), dst.offset(), [&](std::int64_t i, std::int64_t off) {
    detail::store(dbase, dst.dtype(), off, values[static_cast<std::size_t>(i)]);
  });
}

}  // namespace detail

}  // namespace mem::nn
