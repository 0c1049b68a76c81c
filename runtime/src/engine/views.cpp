// views.cpp — view, reshape, permute, transpose, flatten, contiguous and their
// backward nodes. Views share storage; reshape copies only when PyTorch's stride
// rule (computeStride) cannot express the new shape over the old layout.
#include <optional>
#include <string>

#include "engine/detail.hpp"

namespace mem::nn {
namespace {

/// PyTorch's computeStride: strides for `newshape` viewing (oldshape, oldstride),
/// or nothing when the layout needs a copy. Dimensions are merged or split only
/// inside chunks of memory that are contiguous among themselves.
std::optional<Shape> compute_stride(const Shape& oldshape, const Shape& oldstride, const Shape& newshape) {
  Shape newstride = newshape;
  if (oldshape.numel() == 0) return contiguous_strides(newshape);
  if (oldshape.empty()) {
    for (std::size_t i = 0; i < newshape.size(); ++i) newstride[i] = 1;
    return newstride;
  }
  auto view_d = static_cast<std::ptrdiff_t>(newshape.size()) - 1;
  std::int64_t chunk_base_stride = oldstride.back();
  std::int64_t tensor_numel = 1;
  std::int64_t view_numel = 1;
  for (auto tensor_d = static_cast<std::ptrdiff_t>(oldshape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= oldshape[static_cast<std::size_t>(tensor_d)];
    const bool chunk_ends =
        tensor_d == 0 ||
        (oldshape[static_cast<std::size_t>(tensor_d - 1)] != 1 &&
         oldstride[static_cast<std::size_t>(tensor_d - 1)] != tensor_numel * chunk_base_stride);
    if (chunk_ends) {
      while (view_d >= 0 && (view_numel < tensor_numel || newshape[static_cast<std::size_t>(view_d)] == 1)) {
        newstride[static_cast<std::size_t>(view_d)] = view_numel * chunk_base_stride;
        view_numel *= newshape[static_cast<std::size_t>(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = oldstride[static_cast<std::size_t>(tensor_d - 1)];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return newstride;
}

/// Resolves one -1 extent and checks the element count.
Shape infer_shape(const Shape& requested, std::int64_t numel) {
  Shape shape = requested;
  std::ptrdiff_t infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) throw Error("view: only one dimension can be -1 in " + requested.str());
      infer = static_cast<std::ptrdiff_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) throw Error("view: cannot infer -1 in " + requested.str());
    shape[static_cast<std::size_t>(infer)] = numel / known;
  }
  if (shape.numel() != numel) {
    throw Error("shape " + requested.str() + " is invalid for a tensor of " + std::to_string(numel) + " elements");
  }
  return shape;
}

Tensor alias(const Tensor& base, const Shape& shape, const Shape& strides, std::int64_t offset) {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = base.storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

/// ViewBackward0 / UnsafeViewBackward0: the gradient reshaped to the input's shape
/// (a copy when the incoming gradient's layout does not allow a view).
class ViewBackward final : public Node {
 public:
  explicit ViewBackward(Shape in_shape, bool copy) : in_shape_(in_shape), copy_(copy) {}
  TensorList apply(TensorList& grads) override { return {grads[0].reshape(in_shape_)}; }
  std::string_view name() const noexcept override { return copy_ ? "UnsafeViewBackward0" : "ViewBackward0"; }

 private:
  Shape in_shape_;
  bool copy_;
};

class PermuteBackward final : public Node {
 public:
  explicit PermuteBackward(Shape inverse) : inverse_(inverse) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    Shape shape, strides;
    for (std::size_t i = 0; i < inverse_.size(); ++i) {
      shape.push_back(g.shape()[static_cast<std::size_t>(inverse_[i])]);
      strides.push_stride(g.strides()[static_cast<std::size_t>(inverse_[i])]);
    }
    return {alias(g, shape, strides, g.offset())};
  }
  std::string_view name() const noexcept override { return "PermuteBackward0"; }

 private:
  Shape inverse_;
};

/// SliceBackward0: zeros of the input's shape with the gradient copied into the slice
/// (slice_backward in FunctionsManual.cpp: at::zeros, then copy_): one allocation.
class NarrowBackward final : public Node {
 public:
  NarrowBackward(Shape in_shape, DType dtype, std::int64_t dim, std::int64_t start)
      : in_shape_(in_shape), dtype_(dtype), dim_(dim), start_(start) {}
  TensorList apply(TensorList& grads) override {
    const Tensor& g = grads[0];
    Tensor gx = empty(g.runtime(), in_shape_, dtype_);
    if (g.runtime().computing()) {
      detail::fill_raw(gx, 0.0);
      detail::copy_raw(alias(gx, g.shape(), gx.strides(), start_ * gx.strides()[static_cast<std::size_t>(dim_)]), g);
    }
    return {gx};
  }
  std::string_view name() const noexcept override { return "SliceBackward0"; }

 private:
  Shape in_shape_;
  DType dtype_;
  std::int64_t dim_, start_;
};

/// ExpandBackward0: at::sum_to(grad, self.sizes()), an allocation of the input's shape.
class ExpandBackward final : public Node {
 public:
  explicit ExpandBackward(Shape in_shape) : in_shape_(in_shape) {}
  TensorList apply(TensorList& grads) override { return {detail::sum_to(grads[0], in_shape_)}; }
  std::string_view name() const noexcept override { return "ExpandBackward0"; }

 private:
  Shape in_shape_;
};

Tensor with_history(Tensor out, const Tensor& input, std::shared_ptr<Node> node) {
  node->add_input(input);
  set_history(out, node);
  return out;
}

}  // namespace

Tensor Tensor::view(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel());
  auto strides = compute_stride(this->shape(), this->strides(), shape);
  if (!strides) {
    throw Error("view " + shape.str() + " of a " + this->shape().str() +
                " tensor is not compatible with its strides; use reshape()");
  }
  Tensor out = alias(*this, shape, *strides, offset());
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<ViewBackward>(this->shape(), false);
  init_node(*node);
  return with_history(out, *this, node);
}

Tensor Tensor::reshape(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel());
  if (compute_stride(this->shape(), this->strides(), shape)) return view(shape);
  // clone(contiguous) + _unsafe_view: one allocation.
  Tensor copy = empty(runtime(), this->shape(), dtype());
  detail::copy_raw(copy, *this);
  Tensor out = alias(copy, shape, contiguous_strides(shape), 0);
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<ViewBackward>(this->shape(), true);
  init_node(*node);
  return with_history(out, *this, node);
}

Tensor Tensor::permute(std::initializer_list<std::int64_t> dims) const {
  return permute(std::span<const std::int64_t>(dims.begin(), dims.size()));
}

Tensor Tensor::permute(std::span<const std::int64_t> dims) const {
  std::vector<bool> seen(dim(), false);
  for (std::int64_t d : dims) {
    const std::int64_t k = d < 0 ? d + static_cast<std::int64_t>(dim()) : d;
    if (k < 0 || k >= static_cast<std::int64_t>(dim()) || seen[static_cast<std::size_t>(k)]) {
      throw Error("permute: dims are not a permutation of " + std::to_string(dim()) + " dimensions");
    }
    seen[static_cast<std::size_t>(k)] = true;
  }
  if (dims.size() != dim()) throw Error("permute: " + std::to_string(dims.size()) + " dims for " + shape().str());
  Shape shape, strides, inverse = this->shape();
  std::size_t i = 0;
  for (std::int64_t d : dims) {
    if (d < 0) d += static_cast<std::int64_t>(dim());
    shape.push_back(this->shape()[static_cast<std::size_t>(d)]);
    strides.push_stride(this->strides()[static_cast<std::size_t>(d)]);
    inverse[static_cast<std::size_t>(d)] = static_cast<std::int64_t>(i++);
  }
  Tensor out = alias(*this, shape, strides, offset());
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<PermuteBackward>(inverse);
  init_node(*node);
  return with_history(out, *this, node);
}

Tensor Tensor::transpose(std::int64_t a, std::int64_t b) const {
  const auto n = static_cast<std::int64_t>(dim());
  if (a < 0) a += n;
  if (b < 0) b += n;
  std::array<std::int64_t, kMaxDims> order{};
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::swap(order[static_cast<std::size_t>(a)], order[static_cast<std::size_t>(b)]);
  switch (n) {
    case 2: return permute({order[0], order[1]});
    case 3: return permute({order[0], order[1], order[2]});
    case 4: return permute({order[0], order[1], order[2], order[3]});
    case 5: return permute({order[0], order[1], order[2], order[3], order[4]});
    default: throw Error("transpose: needs 2 to 5 dimensions, got " + shape().str());
  }
}

Tensor Tensor::narrow(std::int64_t d, std::int64_t start, std::int64_t length) const {
  const auto n = static_cast<std::int64_t>(dim());
  if (d < 0) d += n;
  if (d < 0 || d >= n || start < 0 || length < 0 || start > size(d) - length) {
    throw Error("narrow: [" + std::to_string(start) + ", +" + std::to_string(length) + ") of dimension " +
                std::to_string(d) + " is outside " + shape().str());
  }
  Shape shape = this->shape();
  shape[static_cast<std::size_t>(d)] = length;
  Tensor out = alias(*this, shape, strides(), offset() + start * strides()[static_cast<std::size_t>(d)]);
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<NarrowBackward>(this->shape(), dtype(), d, start);
  init_node(*node);
  return with_history(out, *this, node);
}

Tensor Tensor::expand(const Shape& requested) const {
  if (requested.size() != dim()) throw Error("expand: " + requested.str() + " for " + shape().str());
  Shape strides = this->strides();
  for (std::size_t i = 0; i < dim(); ++i) {
    if (shape()[i] == requested[i]) continue;
    if (shape()[i] != 1 || requested[i] < 0) {
      throw Error("expand: " + shape().str() + " cannot be expanded to " + requested.str());
    }
    strides[i] = 0;
  }
  if (requested == shape()) return *this;
  Tensor out = alias(*this, requested, strides, offset());
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<ExpandBackward>(this->shape());
  init_node(*node);
  return with_history(out, *this, node);
}

Tensor Tensor::unsqueeze(std::int64_t d) const {
  const auto n = static_cast<std::int64_t>(dim());
  if (d < 0) d += n + 1;
  if (d < 0 || d > n) throw Error("unsqueeze: dimension out of range for " + shape().str());
  Shape shape;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i == d) shape.push_back(1);
    shape.push_back(size(i));
  }
  if (d == n) shape.push_back(1);
  return view(shape);
}

Tensor Tensor::flatten(std::int64_t start, std::int64_t end) const {
  const auto n = static_cast<std::int64_t>(dim());
  if (start < 0) start += n;
  if (end < 0) end += n;
  Shape shape;
  std::int64_t merged = 1;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e = this->shape()[static_cast<std::size_t>(i)];
    if (i < start || i > end) {
      shape.push_back(e);
    } else {
      merged *= e;
      if (i == end) shape.push_back(merged);
    }
  }
  return reshape(shape);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = empty(runtime(), shape(), dtype());
  detail::copy_raw(out, *this);
  if (!needs_grad({this})) return out;
  auto node = std::make_shared<detail::PassThroughBackward>("CloneBackward0");
  init_node(*node);
  return with_history(out, *this, node);
}

}  // namespace mem::nn
