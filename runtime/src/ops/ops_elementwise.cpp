// ops_elementwise.cpp — add (and in place), scalar multiply, the causal mask,
// cat, split, dtype casts, embedding and sum.
#include "engine/detail.hpp"

namespace mem::nn {
namespace {

using detail::HostIn;
using detail::HostOut;

using detail::alias_of;

/// out[i] = a[i] + b[i] computed into `out` (which may alias a).
void add_into(const Tensor& out, const Tensor& a, const Tensor& b) {
  Runtime& rt = out.runtime();
  rt.add_flops(static_cast<double>(out.numel()));
  if (!rt.computing()) return;
  detail::dispatch(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> A(a), B(b);
    const bool alias = same_storage(out, a);
    std::vector<T> a_copy;
    const T* ap = A.data();
    if (alias) {
      a_copy.assign(A.data(), A.data() + a.numel());
      ap = a_copy.data();
    }
    // Through store_logical: `out` may follow a permuted or strided input's layout.
    std::vector<T> y(static_cast<std::size_t>(out.numel()));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = ap[i] + B[static_cast<std::int64_t>(i)];
    detail::store_logical(out, y);
  });
}

/// AddBackward0: the gradient goes to both inputs unchanged (cast when dtypes differ).
class AddBackward final : public Node {
 public:
  AddBackward(DType a, DType b) : a_(a), b_(b) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    return {needs_input_grad(0) ? detail::match_dtype(g, a_) : Tensor{},
            needs_input_grad(1) ? detail::match_dtype(g, b_) : Tensor{}};
  }
  std::string_view name() const noexcept override { return "AddBackward0"; }

 private:
  DType a_, b_;
};

/// Shape of a broadcast of a and b (numpy rules, trailing dimensions aligned).
Shape broadcast_shape(const Shape& a, const Shape& b, const char* op) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t x = i + a.size() >= n ? a[i + a.size() - n] : 1;
    const std::int64_t y = i + b.size() >= n ? b[i + b.size() - n] : 1;
    if (x != y && x != 1 && y != 1) {
      throw Error(std::string(op) + ": shapes " + a.str() + " and " + b.str() + " do not broadcast");
    }
    out.push_back(x == 1 ? y : x);
  }
  return out;
}

/// `t` as a stride-0 view of `shape` (no autograd; for kernels to read).
Tensor broadcast_view(const Tensor& t, const Shape& shape) {
  Shape strides;
  const std::size_t lead = shape.size() - t.dim();
  for (std::size_t i = 0; i < shape.size(); ++i) {
    strides.push_stride(i < lead || t.shape()[i - lead] != shape[i] ? 0 : t.strides()[i - lead]);
  }
  return alias_of(t, shape, strides, t.offset());
}

/// A binary op's output: in the layout of the first operand of the output's shape.
Tensor binary_output(const Tensor& a, const Tensor& b, const Shape& shape, DType dtype) {
  return detail::empty_following(a.shape() == shape ? a : b, shape, dtype);
}

/// out = f(a, b) elementwise over the broadcast shape of `out` (any strides).
template <class F>
void binary_into(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  Runtime& rt = out.runtime();
  rt.add_flops(static_cast<double>(out.numel()));
  if (!rt.computing()) return;
  detail::dispatch(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> A(broadcast_view(a, out.shape())), B(broadcast_view(b, out.shape()));
    std::vector<T> y(static_cast<std::size_t>(out.numel()));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = f(A[static_cast<std::int64_t>(i)], B[static_cast<std::int64_t>(i)]);
    detail::store_logical(out, y);
  });
}

/// What the engine hands an input of `shape` and `dtype` (validate_outputs in
/// torch/csrc/autograd/engine.cpp): the gradient summed down to the shape, then cast.
Tensor to_input(const Tensor& grad, const Shape& shape, DType dtype) {
  return detail::match_dtype(detail::sum_to(grad, shape), dtype);
}

/// MulBackward0: grad_a = (g * b).to(a's dtype) (saves b when a needs grad), grad_b = (g * a)
/// .to(b's dtype) (saves a when b needs grad), as derivatives.yaml's mul.Tensor entry
/// (mul_tensor_backward); broadcast inputs then get the sum down to their shape.
class MulBackward final : public Node {
 public:
  MulBackward(Shape a_shape, DType a_dtype, Shape b_shape, DType b_dtype)
      : a_shape_(a_shape), b_shape_(b_shape), a_dtype_(a_dtype), b_dtype_(b_dtype) {}
  SavedTensor a_, b_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const auto times = [&](const Tensor& other, const Shape& shape, DType dtype) {
      Tensor out = binary_output(g, other, g.shape(), detail::promote(g.dtype(), other.dtype()));
      binary_into(out, g, other, [](auto x, auto y) { return x * y; });
      return to_input(detail::match_dtype(out, dtype), shape, dtype);
    };
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = times(b_.unpack(), a_shape_, a_dtype_);
    if (needs_input_grad(1)) gb = times(a_.unpack(), b_shape_, b_dtype_);
    return {ga, gb};
  }
  void release_variables() noexcept override {
    a_.reset();
    b_.reset();
  }
  std::string_view name() const noexcept override { return "MulBackward0"; }

 private:
  Shape a_shape_, b_shape_;
  DType a_dtype_, b_dtype_;
};

/// AddBackward0 with broadcasting: each input gets the gradient summed down to its shape
/// (sum_to in validate_outputs; allocates only where a shape was broadcast).
class AddBroadcastBackward final : public Node {
 public:
  AddBroadcastBackward(Shape a_shape, DType a, Shape b_shape, DType b)
      : a_shape_(a_shape), b_shape_(b_shape), a_(a), b_(b) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    return {needs_input_grad(0) ? to_input(g, a_shape_, a_) : Tensor{},
            needs_input_grad(1) ? to_input(g, b_shape_, b_) : Tensor{}};
  }
  std::string_view name() const noexcept override { return "AddBackward0"; }

 private:
  Shape a_shape_, b_shape_;
  DType a_, b_;
};

class MulScalarBackward final : public Node {
 public:
  explicit MulScalarBackward(double s) : s_(s) {}
  TensorList apply(TensorList& grads) override { return {mul_scalar(grads[0], s_)}; }
  std::string_view name() const noexcept override { return "MulBackward1"; }

 private:
  double s_;
};

void causal_fill(const Tensor& src, const Tensor& out, double value) {
  Runtime& rt = src.runtime();
  rt.add_flops(static_cast<double>(src.numel()));
  if (!rt.computing()) return;
  detail::dispatch(src.dtype(), [&](auto tag) {
    using T = decltype(tag);
    HostIn<T> X(src);
    HostOut<T> Y(out);
    const std::int64_t t = src.size(-1), rows = src.size(-2), mats = src.numel() / (t * rows);
    for (std::int64_t m = 0; m < mats; ++m) {
      for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t j = 0; j < t; ++j) {
          const std::int64_t k = (m * rows + i) * t + j;
          Y[k] = j > i ? static_cast<T>(value) : X[k];
        }
      }
    }
  });
}

/// WhereBackward0 for the causal mask: the constant mask buffer is all it keeps.
class CausalMaskBackward final : public Node {
 public:
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    Tensor gx = empty(g.runtime(), g.shape(), g.dtype());
    causal_fill(g, gx, 0.0);
    return {gx};
  }
  std::string_view name() const noexcept override { return "WhereBackward0"; }
};

/// CatBackward0: each input gets a narrow view of the gradient (no allocation).
class CatBackward final : public Node {
 public:
  CatBackward(std::vector<std::int64_t> sizes, std::vector<DType> dtypes, std::int64_t dim)
      : sizes_(std::move(sizes)), dtypes_(std::move(dtypes)), dim_(dim) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    TensorList out;
    std::int64_t start = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      Shape shape = g.shape();
      shape[static_cast<std::size_t>(dim_)] = sizes_[i];
      const std::int64_t offset = g.offset() + start * g.strides()[static_cast<std::size_t>(dim_)];
      out.push_back(needs_input_grad(i) ? detail::match_dtype(alias_of(g, shape, g.strides(), offset), dtypes_[i])
                                        : Tensor{});
      start += sizes_[i];
    }
    return out;
  }
  std::string_view name() const noexcept override { return "CatBackward0"; }

 private:
  std::vector<std::int64_t> sizes_;
  std::vector<DType> dtypes_;
  std::int64_t dim_;
};

/// SplitWithSizesBackward0: the output gradients concatenated (zeros where none came).
class SplitBackward final : public Node {
 public:
  SplitBackward(Shape in_shape, DType dtype, std::vector<std::int64_t> sizes, std::int64_t dim)
      : in_shape_(in_shape), dtype_(dtype), sizes_(std::move(sizes)), dim_(dim) {}
  TensorList apply(TensorList& grads) override {
    Runtime* rt = nullptr;
    for (const Tensor& g : grads) {
      if (g.defined()) rt = &g.runtime();
    }
    Tensor gx = empty(*rt, in_shape_, dtype_);
    rt->add_flops(static_cast<double>(gx.numel()));
    if (rt->computing()) {
      detail::fill_raw(gx, 0.0);
      std::int64_t start = 0;
      for (std::size_t i = 0; i < sizes_.size(); ++i) {
        Shape shape = in_shape_;
        shape[static_cast<std::size_t>(dim_)] = sizes_[i];
        if (grads[i].defined()) {
          detail::copy_raw(alias_of(gx, shape, gx.strides(), start * gx.strides()[static_cast<std::size_t>(dim_)]), grads[i]);
        }
        start += sizes_[i];
      }
    }
    return {gx};
  }
  std::string_view name() const noexcept override { return "SplitWithSizesBackward0"; }

 private:
  Shape in_shape_;
  DType dtype_;
  std::vector<std::int64_t> sizes_;
  std::int64_t dim_;
};

class ToCopyBackward final : public Node {
 public:
  explicit ToCopyBackward(DType dtype) : dtype_(dtype) {}
  TensorList apply(TensorList& grads) override { return {detail::match_dtype(grads[0], dtype_)}; }
  std::string_view name() const noexcept override { return "ToCopyBackward0"; }

 private:
  DType dtype_;
};

class EmbeddingBackward final : public Node {
 public:
  EmbeddingBackward(Shape weight_shape, DType dtype) : weight_shape_(weight_shape), dtype_(dtype) {}
  SavedTensor indices_;
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    const Tensor idx = indices_.unpack();
    Tensor gw = empty(g.runtime(), weight_shape_, dtype_);
    g.runtime().add_flops(static_cast<double>(g.numel()));
    if (g.runtime().computing()) {
      detail::dispatch(dtype_, [&](auto tag) {
        using T = decltype(tag);
        HostIn<T> G(g);
        HostOut<T> GW(gw);
        const std::int64_t d = weight_shape_[1];
        for (std::int64_t i = 0, n_ = gw.numel(); i < n_; ++i) GW[i] = T{0};
        HostIn<double> I(idx);
        for (std::int64_t r = 0, n_ = idx.numel(); r < n_; ++r) {
          const auto row = static_cast<std::int64_t>(I[r]);
          for (std::int64_t j = 0; j < d; ++j) GW[row * d + j] += G[r * d + j];
        }
      });
    }
    return {gw, Tensor{}};
  }
  void release_variables() noexcept override { indices_.reset(); }
  std::string_view name() const noexcept override { return "EmbeddingBackward0"; }

 private:
  Shape weight_shape_;
  DType dtype_;
};

/// SumBackward0: the gradient expanded (a stride-0 view, no allocation).
class SumBackward final : public Node {
 public:
  explicit SumBackward(Shape shape) : shape_(shape) {}
  TensorList apply(TensorList& grads) override {
    Shape strides = shape_;
    for (std::size_t i = 0; i < strides.size(); ++i) strides[i] = 0;
    return {alias_of(grads[0], shape_, strides, grads[0].offset())};
  }
  std::string_view name() const noexcept override { return "SumBackward0"; }

 private:
  Shape shape_;
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  if (a.shape() == b.shape() && a.is_contiguous()) {
    Tensor out = empty(a.runtime(), a.shape(), detail::promote(a.dtype(), b.dtype()));
    add_into(out, a, b);
    if (needs_grad({&a, &b})) set_history(out, detail::make_node<AddBackward>({&a, &b}, a.dtype(), b.dtype()));
    return out;
  }
  const Shape shape = broadcast_shape(a.shape(), b.shape(), "add");
  Tensor out = binary_output(a, b, shape, detail::promote(a.dtype(), b.dtype()));
  binary_into(out, a, b, [](auto x, auto y) { return x + y; });
  if (needs_grad({&a, &b})) {
    set_history(out, detail::make_node<AddBroadcastBackward>({&a, &b}, a.shape(), a.dtype(), b.shape(), b.dtype()));
  }
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  const Shape shape = broadcast_shape(a.shape(), b.shape(), "mul");
  Tensor out = binary_output(a, b, shape, detail::promote(a.dtype(), b.dtype()));
  binary_into(out, a, b, [](auto x, auto y) { return x * y; });
  if (needs_grad({&a, &b})) {
    auto node = detail::make_node<MulBackward>({&a, &b}, a.shape(), a.dtype(), b.shape(), b.dtype());
    if (b.requires_grad()) node->a_.save(a);
    if (a.requires_grad()) node->b_.save(b);
    set_history(out, node);
  }
  return out;
}

Tensor add_(const Tensor& a, const Tensor& b) {
  if (!(a.shape() == b.shape())) throw Error("add_: shapes " + a.shape().str() + " and " + b.shape().str() + " differ");
  const bool record = needs_grad({&a, &b});
  detail::check_inplace(a, record);
  Tensor out = alias_of(a, a.shape(), a.strides(), a.offset());
  add_into(out, a, b);
  out.bump_version();
  if (record) {
    auto node = detail::make_node<AddBackward>({&a, &b}, a.dtype(), b.dtype());
    detail::rebase_history(out, node);
  }
  return out;
}

Tensor mul_scalar(const Tensor& x, double s) {
  Tensor out = detail::unary(x, [s](auto v) { return v * static_cast<decltype(v)>(s); });
  if (needs_grad({&x})) set_history(out, detail::make_node<MulScalarBackward>({&x}, s));
  return out;
}

Tensor causal_mask(const Tensor& x, double value) {
  if (x.dim() < 2) throw Error("causal_mask: needs [..., T, T], got " + x.shape().str());
  Tensor out = empty(x.runtime(), x.shape(), x.dtype());
  causal_fill(x, out, value);
  if (needs_grad({&x})) set_history(out, detail::make_node<CausalMaskBackward>({&x}));
  return out;
}

Tensor cat(std::span<const Tensor> tensors, std::int64_t dim) {
  if (tensors.empty()) throw Error("cat: no tensors");
  const Tensor& first = tensors.front();
  if (dim < 0) dim += static_cast<std::int64_t>(first.dim());
  Shape shape = first.shape();
  shape[static_cast<std::size_t>(dim)] = 0;
  DType dtype = first.dtype();
  std::vector<std::int64_t> sizes;
  std::vector<DType> dtypes;
  for (const Tensor& t : tensors) {
    shape[static_cast<std::size_t>(dim)] += t.size(dim);
    sizes.push_back(t.size(dim));
    dtypes.push_back(t.dtype());
    dtype = detail::promote(dtype, t.dtype());
  }
  Runtime& rt = first.runtime();
  Tensor out = empty(rt, shape, dtype);
  if (rt.computing()) {
    std::int64_t start = 0;
    for (const Tensor& t : tensors) {
      Shape part = shape;
      part[static_cast<std::size_t>(dim)] = t.size(dim);
      detail::copy_raw(alias_of(out, part, out.strides(), start * out.strides()[static_cast<std::size_t>(dim)]), t);
      start += t.size(dim);
    }
  }
  bool any = false;
  for (const Tensor& t : tensors) any = any || needs_grad({&t});
  if (any) {
    auto node = std::make_shared<CatBackward>(sizes, dtypes, dim);
    init_node(*node);
    for (const Tensor& t : tensors) node->add_input(t);
    set_history(out, node);
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, std::span<const std::int64_t> sizes, std::int64_t dim) {
  if (dim < 0) dim += static_cast<std::int64_t>(x.dim());
  std::int64_t total = 0;
  for (auto s : sizes) total += s;
  if (total != x.size(dim)) throw Error("split: sizes do not add up to " + std::to_string(x.size(dim)));
  std::vector<Tensor> out;
  std::int64_t start = 0;
  for (auto s : sizes) {
    Shape shape = x.shape();
    shape[static_cast<std::size_t>(dim)] = s;
    out.push_back(alias_of(x, shape, x.strides(), x.offset() + start * x.strides()[static_cast<std::size_t>(dim)]));
    start += s;
  }
  if (needs_grad({&x})) {
    auto node = detail::make_node<SplitBackward>({&x}, x.shape(), x.dtype(),
                                                 std::vector<std::int64_t>(sizes.begin(), sizes.end()), dim);
    node->set_num_outputs(static_cast<std::uint32_t>(sizes.size()));
    for (std::size_t i = 0; i < out.size(); ++i) set_history(out[i], node, static_cast<std::uint32_t>(i));
  }
  return out;
}

Tensor clone(const Tensor& x) {
  Tensor out = detail::empty_following(x, x.shape(), x.dtype());
  detail::copy_raw(out, x);
  if (needs_grad({&x})) set_history(out, detail::make_node<detail::PassThroughBackward>({&x}, "CloneBackward0"));
  return out;
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  // .to(dtype) copies with memory_format=preserve_format (aten _to_copy: empty_like of a
  // dense input keeps its strides), so a transposed tensor stays transposed.
  Tensor out = detail::empty_following(x, x.shape(), dtype);
  detail::copy_raw(out, x);
  if (needs_grad({&x})) set_history(out, detail::make_node<ToCopyBackward>({&x}, x.dtype()));
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  if (weight.dim() != 2 || indices.dtype() != DType::I64) {
    throw Error("embedding: weight [V, D] and i64 indices expected");
  }
  const std::int64_t d = weight.size(1);
  Shape shape = indices.shape();
  shape.push_back(d);
  Runtime& rt = weight.runtime();
  Tensor out = empty(rt, shape, weight.dtype());
  if (rt.computing()) {
    detail::dispatch(weight.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> W(weight);
      HostIn<double> I(indices);
      HostOut<T> Y(out);
      for (std::int64_t r = 0, n_ = indices.numel(); r < n_; ++r) {
        const auto row = static_cast<std::int64_t>(I[r]);
        if (row < 0 || row >= weight.size(0)) throw Error("embedding: index out of range");
        for (std::int64_t j = 0; j < d; ++j) Y[r * d + j] = W[row * d + j];
      }
    });
  }
  if (needs_grad({&weight})) {
    auto node = detail::make_node<EmbeddingBackward>({&weight, &indices}, weight.shape(), weight.dtype());
    node->indices_.save(indices);
    set_history(out, node);
  }
  return out;
}

Tensor sum(const Tensor& x) {
  Runtime& rt = x.runtime();
  Tensor out = empty(rt, Shape{}, x.dtype());
  rt.add_flops(static_cast<double>(x.numel()));
  if (rt.computing()) {
    detail::dispatch(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      HostIn<T> X(x);
      HostOut<T> Y(out);
      T acc{0};
      for (std::int64_t i = 0, n_ = x.numel(); i < n_; ++i) acc += X[i];
      Y[0] = acc;
    });
  }
  if (needs_grad({&x})) set_history(out, detail::make_node<SumBackward>({&x}, x.shape()));
  return out;
}

}  // namespace mem::nn
