// tensor.hpp — tensors whose storage is a block of the caching allocator.
//
// A Tensor is a handle (shared_ptr) to an impl holding shape, strides, dtype and
// a reference-counted Storage; the Storage owns one allocator block and gives it
// back when the last tensor or view using it dies. Views (view, reshape when
// possible, permute, transpose, narrow, detach) share storage and allocate
// nothing; memory is therefore counted by storage, exactly as on a GPU.
//
// The Storage also carries PyTorch's version counter (VariableVersion), which
// PyTorch shares between a tensor, its views and its detach()es: every in-place
// op bumps it (relu_, add_, the optimizer's updates, gradient accumulation,
// fill_ / copy_ / uniform_ on an existing tensor; also under no_grad), and a
// tensor saved for backward is checked against it when unpacked (SavedTensor).
//
//   mem::nn::Runtime rt{alloc, mem::nn::ExecMode::Compute};
//   auto a = mem::nn::from_values(rt, {2, 2}, {1, 2, 3, 4});
//   auto b = a.view({4});          // same block
//   mem::nn::to_values(b);          // {1, 2, 3, 4}
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "vramscope/runtime/dtype.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::nn {

class Node;

inline constexpr std::size_t kMaxDims = 6;

/// A small fixed-capacity list of extents or strides (no heap allocation).
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::span<const std::int64_t> dims);

  std::size_t size() const noexcept { return n_; }
  bool empty() const noexcept { return n_ == 0; }
  std::int64_t operator[](std::size_t i) const noexcept { return d_[i]; }
  std::int64_t& operator[](std::size_t i) noexcept { return d_[i]; }
  std::int64_t back() const noexcept { return d_[n_ - 1]; }
  const std::int64_t* begin() const noexcept { return d_.data(); }
  const std::int64_t* end() const noexcept { return d_.data() + n_; }
  void push_back(std::int64_t v);
  /// Appends to a stride vector (a Shape serves as one): strides multiply to no element count,
  /// so only the number of dimensions is checked (a transposed key's strides may
  /// multiply past 2^63 where its shape does not).
  void push_stride(std::int64_t v);
  /// Product of the extents (1 for a scalar).
  std::int64_t numel() const noexcept;
  /// "[256, 3, 224, 224]".
  std::string str() const;
  bool operator==(const Shape& other) const noexcept;
  std::vector<std::int64_t> to_vector() const { return {begin(), end()}; }

 private:
  std::array<std::int64_t, kMaxDims> d_{};
  std::uint8_t n_ = 0;
};

/// Row-major strides of a contiguous tensor of `shape`.
Shape contiguous_strides(const Shape& shape) noexcept;

/// One allocator block (or none for 0 bytes). Not copyable; shared by tensors.
class Storage {
 public:
  /// Allocates `nbytes` on the runtime's allocator and stream (none under a MetaDevice).
  Storage(Runtime& runtime, std::size_t nbytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t nbytes() const noexcept { return nbytes_; }
  /// Whether a block backs it: false on the meta device and while freed (below).
  bool allocated() const noexcept { return data_ != nullptr || nbytes_ == 0; }
  /// storage.resize_(0): its block goes back to the allocator; views keep their shapes
  /// (FSDP frees unsharded parameters so). No-op when not allocated.
  void free() noexcept;
  /// storage.resize_(nbytes): a new block on the runtime's current stream; no-op when
  /// allocated. Throws the allocator's OutOfMemory like any allocation.
  void allocate();
  /// storage.resize_(nbytes) from freed: the storage takes a new size (DeepSpeed's gathered
  /// parameter is a view of an all-gather buffer larger than the parameter). Throws when
  /// allocated.
  void allocate(std::size_t nbytes);
  Runtime& runtime() const noexcept { return *runtime_; }

  /// PyTorch's tensor._version, shared by every tensor viewing this storage.
  std::uint32_t version() const noexcept { return version_; }
  /// What an in-place op does to its output (torch.autograd.graph.increment_version).
  void bump_version() noexcept { ++version_; }
  /// Autograd's record of the last in-place op that recorded history here: PyTorch
  /// rebases the modified tensor onto that op's node (its grad_fn becomes, say,
  /// ReluBackward0), which is the node its version-mismatch message names.
  void set_inplace_fn(const std::shared_ptr<Node>& fn) noexcept {
    inplace_fn_ = fn;
    inplace_version_ = version_;
  }
  /// The node of the last in-place op recorded at a version above `version` (null if
  /// none, or if that node is gone).
  std::shared_ptr<Node> inplace_fn_since(std::uint32_t version) const noexcept {
    return inplace_version_ > version ? inplace_fn_.lock() : nullptr;
  }

 private:
  Runtime* runtime_;
  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  std::uint32_t version_ = 0;
  std::uint32_t inplace_version_ = 0;
  std::weak_ptr<Node> inplace_fn_;  ///< weak: the node keeps this storage alive when it saves it
};

/// `with torch.device("meta")`: tensors made while one lives get no block (shapes and dtypes
/// only) until Storage::allocate(), as module.to_empty() does. Per thread.
class MetaDevice {
 public:
  MetaDevice() noexcept;
  ~MetaDevice();
  MetaDevice(const MetaDevice&) = delete;
  MetaDevice& operator=(const MetaDevice&) = delete;
  static bool active() noexcept;

 private:
  bool previous_;
};

namespace detail {
/// What a Tensor handle points at. Invariant: offset + extent of (shape, strides)
/// stays within storage->nbytes() / dtype_size(dtype).
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;
  std::int64_t offset = 0;  ///< in elements
  DType dtype = DType::F32;
  // Autograd metadata.
  bool requires_grad = false;
  std::uint32_t output_nr = 0;
  std::shared_ptr<Node> grad_fn;             ///< null for leaves
  std::shared_ptr<TensorImpl> grad;          ///< leaves: accumulated gradient
  std::weak_ptr<Node> grad_accumulator;      ///< leaves: their AccumulateGrad node
  std::string name;                          ///< parameters: full dotted name
  std::uint32_t grad_context = 0;            ///< leaves: module scope of AccumulateGrad
  /// Leaves: the owner context of their .grad ("fc.weight.grad", backward), which
  /// AccumulateGrad gives the gradient's block when it becomes the .grad (0: none).
  std::uint32_t grad_label = 0;
  /// Leaves: a DTensor whose gradient's placement differs from its own (a vocabulary-sharded
  /// embedding's whole-table Replicate gradient, a sequence-parallel norm's Partial one):
  /// .grad keeps the shape it arrives in, and each optimizer op that reads it redistributes
  /// it first, a copy of the parameter's size.
  bool redistributed_grad = false;
  /// Leaves: Tensor.grad_dtype (PyTorch 2.10+): AccumulateGrad makes a new .grad in this dtype
  /// (FSDP2's unsharded parameters, whose gradients accumulate wider than they compute).
  std::optional<DType> grad_dtype;
};
}  // namespace detail

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<detail::TensorImpl> impl) noexcept : impl_(std::move(impl)) {}

  bool defined() const noexcept { return impl_ != nullptr; }
  const Shape& shape() const noexcept { return impl_->shape; }
  const Shape& strides() const noexcept { return impl_->strides; }
  std::int64_t offset() const noexcept { return impl_->offset; }
  std::size_t dim() const noexcept { return impl_->shape.size(); }
  /// Extent of dimension `d`; negative counts from the end.
  std::int64_t size(std::int64_t d) const;
  DType dtype() const noexcept { return impl_->dtype; }
  std::int64_t numel() const noexcept { return impl_->shape.numel(); }
  /// Bytes of the elements this tensor spans (not of its storage).
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  bool is_contiguous() const noexcept;
  const std::shared_ptr<Storage>& storage() const noexcept { return impl_->storage; }
  Runtime& runtime() const noexcept { return impl_->storage->runtime(); }
  /// PyTorch's tensor._version: how many in-place ops wrote into this tensor or a
  /// view of its storage. Fresh tensors are at 0.
  std::uint32_t version() const noexcept { return impl_->storage->version(); }
  /// Bumps the version counter, as every in-place op does (also under no_grad).
  void bump_version() const noexcept { impl_->storage->bump_version(); }

  /// Pointer to the first element. Compute mode only (throws mem::Error in a dry run,
  /// where device addresses have no memory behind them).
  void* raw_data() const;
  template <class T>
  T* data() const {
    return static_cast<T*>(raw_data());
  }

  // --- autograd ---------------------------------------------------------------------
  bool requires_grad() const noexcept { return impl_->requires_grad; }
  /// Only on leaves (tensors without grad_fn); throws mem::Error otherwise.
  Tensor& set_requires_grad(bool value);
  bool is_leaf() const noexcept { return impl_->grad_fn == nullptr; }
  const std::shared_ptr<Node>& grad_fn() const noexcept { return impl_->grad_fn; }
  std::uint32_t output_nr() const noexcept { return impl_->output_nr; }
  /// The accumulated gradient of a leaf (undefined until backward reaches it).
  Tensor grad() const { return Tensor(impl_->grad); }
  void set_grad(const Tensor& grad) { impl_->grad = grad.impl_; }
  /// zero_grad(set_to_none=True): frees the gradient block.
  void reset_grad() noexcept { impl_->grad.reset(); }
  /// Same storage and layout, no history, requires_grad false.
  Tensor detach() const;
  const std::string& name() const noexcept { return impl_->name; }
  void set_name(std::string name) { impl_->name = std::move(name); }

  /// Handles sharing this impl (AccumulateGrad steals a gradient used nowhere else).
  long use_count() const noexcept { return impl_.use_count(); }
  detail::TensorImpl* impl() const noexcept { return impl_.get(); }
  const std::shared_ptr<detail::TensorImpl>& impl_ptr() const noexcept { return impl_; }
  bool is_same(const Tensor& other) const noexcept { return impl_ == other.impl_; }

  // --- views (no allocation, no copy; recorded by autograd) -------------------------
  /// Throws mem::Error when the strides do not allow it (use reshape()).
  Tensor view(const Shape& shape) const;
  /// A view when the layout allows it, else a contiguous copy (PyTorch's reshape).
  Tensor reshape(const Shape& shape) const;
  Tensor permute(std::initializer_list<std::int64_t> dims) const;
  Tensor permute(std::span<const std::int64_t> dims) const;
  Tensor transpose(std::int64_t a, std::int64_t b) const;
  /// x.narrow(dim, start, length) (x[..., start:start+length]). Backward (SliceBackward0)
  /// allocates a zero gradient of the whole input and copies into it.
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  /// Size-1 dimensions repeated as stride-0 views (x.expand(shape)); backward sums the
  /// gradient back to this shape (allocates).
  Tensor expand(const Shape& shape) const;
  /// A new size-1 dimension at `dim`.
  Tensor unsqueeze(std::int64_t dim) const;
  /// Merges dimensions start..end (inclusive) into one.
  Tensor flatten(std::int64_t start = 0, std::int64_t end = -1) const;
  /// This tensor if contiguous, else a contiguous copy (allocates).
  Tensor contiguous() const;

 private:
  std::shared_ptr<detail::TensorImpl> impl_;
};

/// True when both use the same allocator block.
inline bool same_storage(const Tensor& a, const Tensor& b) noexcept {
  return a.defined() && b.defined() && a.storage() == b.storage();
}

// --- factories -------------------------------------------------------------------------
/// Uninitialised contiguous tensor (one allocation of numel * dtype_size bytes).
Tensor empty(Runtime& runtime, const Shape& shape, DType dtype = DType::F32);
Tensor empty_like(const Tensor& like);
Tensor zeros(Runtime& runtime, const Shape& shape, DType dtype = DType::F32);
Tensor full(Runtime& runtime, const Shape& shape, double value, DType dtype = DType::F32);
/// Uniform in [low, high) from a seeded generator (compute mode; a dry run only allocates).
Tensor uniform(Runtime& runtime, const Shape& shape, double low, double high,
               DType dtype = DType::F32, std::uint64_t seed = 0);
/// torch.arange(n): [n] holding 0, 1, ..., n - 1 (position ids); in a dry run only allocates.
Tensor arange(Runtime& runtime, std::int64_t n, DType dtype = DType::I64);
/// Tensor holding `values` (row-major) converted to `dtype`; in a dry run only allocates.
Tensor from_values(Runtime& runtime, const Shape& shape, std::span<const double> values,
                   DType dtype = DType::F32);
inline Tensor from_values(Runtime& runtime, const Shape& shape,
                          std::initializer_list<double> values, DType dtype = DType::F32) {
  return from_values(runtime, shape, std::span<const double>(values.begin(), values.size()), dtype);
}
/// Elements in row-major order as doubles. Compute mode only.
std::vector<double> to_values(const Tensor& tensor);
/// Fills in place (compute mode; no-op in a dry run). Not recorded by autograd, but
/// bumps the version counter as PyTorch's fill_ does (in a dry run too).
void fill_(const Tensor& tensor, double value);
void uniform_(const Tensor& tensor, double low, double high, std::uint64_t seed);
/// Copies src into dst elementwise with conversion (compute mode). Not recorded;
/// bumps dst's version counter.
void copy_(const Tensor& dst, const Tensor& src);

}  // namespace mem::nn
