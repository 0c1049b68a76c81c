// modules.cpp — the module tree (paths, scopes, parameters) and the basic layers.
#include "vramscope/runtime/modules.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <string_view>

#include "engine/detail.hpp"
#include "parallel/tensor_parallel.hpp"
#include "vramscope/runtime/checkpoint.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace mem::nn {

namespace {

/// checkpoint()'s options for a module's mark (checkpoint_wrapper's use_reentrant).
CheckpointOptions options_for(CheckpointMark mark) {
  CheckpointOptions options;
  options.mode = mark == CheckpointMark::Reentrant ? CheckpointMode::Reentrant : CheckpointMode::NonReentrant;
  return options;
}

}  // namespace

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}
Module::~Module() = default;

Tensor Module::operator()(const Tensor& input) {
  if (hooks_ == nullptr) return call(input);
  const Tensor in = hooks_->pre_forward(*this, input);
  return hooks_->post_forward(*this, call(in));
}

Tensor Module::call(const Tensor& input) {
  if (checkpoint_ != CheckpointMark::None && grad_enabled()) {
    // checkpoint_wrapper: the wrapped forward, rerun in backward (in the module's own
    // scopes then, too), keeps only its input.
    CheckpointOptions options = options_for(checkpoint_);
    options.policy = selective_;
    struct Flag {
      bool& on;
      explicit Flag(bool& f) : on(f) { on = true; }
      ~Flag() { on = false; }
    } first_forward(checkpointed_call_);
    TensorList inputs = checkpoint_inputs();
    if (!checkpoint_saves_input()) {
      if (input.defined()) options.runtime = &input.runtime();
      return checkpoint(
          [this, input](const TensorList& in) {
            take_checkpoint_inputs(in);
            return TensorList{run_in_scope(input)};
          },
          inputs, options)[0];
    }
    inputs.insert(inputs.begin(), input);
    return checkpoint(
        [this](const TensorList& in) {
          take_checkpoint_inputs(std::span<const Tensor>(in).subspan(1));
          return TensorList{run_in_scope(in[0])};
        },
        inputs, options)[0];
  }
  return run_in_scope(input);
}

Tensor Module::run_in_scope(const Tensor& input) {
  // A root or inline code: the children (or the enclosing module) carry the scopes.
  if (path_.empty() || inline_) return forward(input);
  const Phase phase = current_phase();
  ModuleScope scope(context(phase == Phase::Backward ? Phase::Recompute : phase));
  BackwardContextGuard backward_scope(context(Phase::Backward));
  return forward(input);
}

std::size_t Module::checkpoint_marks() const {
  std::size_t n = checkpoint_ != CheckpointMark::None ? 1 : 0;
  for (const auto& [name, child] : children_) n += child->checkpoint_marks();
  return n;
}

void Module::set_path(const std::string& path) {
  path_ = path;
  contexts_ready_ = false;
  for (auto& [name, child] : children_) {
    child->set_path(child->inline_ ? path : path.empty() ? name : path + "." + name);
  }
}

ContextId Module::context(Phase phase) {
  if (!contexts_ready_) {
    for (std::size_t i = 0; i < kNumPhases; ++i) {
      contexts_[i] = path_.empty() ? kNoContext : intern_context(path_, static_cast<Phase>(i));
    }
    contexts_ready_ = true;
  }
  return contexts_[static_cast<std::size_t>(phase)];
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (const ParamSlot& slot : slots_) {
    if (!slot.is_buffer) out.push_back(slot.tensor);
  }
  for (const auto& [name, child] : children_) {
    auto sub = child->parameters();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::vector<Tensor> Module::buffers() const {
  std::vector<Tensor> out;
  for (const ParamSlot& slot : slots_) {
    if (slot.is_buffer) out.push_back(slot.tensor);
  }
  for (const auto& [name, child] : children_) {
    auto sub = child->buffers();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::vector<Tensor> Module::trainable_parameters() const {
  std::vector<Tensor> out;
  for (const ParamSlot& slot : slots_) {
    if (!slot.is_buffer && !slot.frozen) out.push_back(slot.tensor);
  }
  for (const auto& [name, child] : children_) {
    auto sub = child->trainable_parameters();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

void Module::freeze() {
  for (ParamSlot& slot : slots_) slot.frozen = !slot.is_buffer;
  for (auto& [name, child] : children_) child->freeze();
}

void Module::keep_f32() {
  for (ParamSlot& slot : slots_) {
    if (slot.is_buffer) continue;
    slot.keeps_dtype = true;
    slot.fixed_dtype = DType::F32;
  }
  for (auto& [name, child] : children_) child->keep_f32();
}

std::int64_t Module::parameter_count() const {
  std::int64_t n = 0;
  const auto add = [&](std::int64_t more) {
    if (__builtin_add_overflow(n, more, &n)) {
      throw Error("module '" + path_ + "' has more than 2^63 parameters; no device holds them "
                  "(check the sizes given)");
    }
  };
  for (const ParamSlot& slot : slots_) {
    if (!slot.is_buffer) add(slot.logical_numel >= 0 ? slot.logical_numel : slot.shape.numel());
  }
  for (const auto& [name, child] : children_) add(child->parameter_count());
  return n;
}

std::int64_t Module::parameter_tensors() const {
  std::int64_t n = 0;
  for (const ParamSlot& slot : slots_) n += slot.is_buffer ? 0 : 1;
  for (const auto& [name, child] : children_) n += child->parameter_tensors();
  return n;
}

std::size_t Module::buffer_bytes(DType dtype) const {
  std::size_t n = 0;
  for (const ParamSlot& slot : slots_) {
    if (slot.is_buffer) {
      n += static_cast<std::size_t>(slot.shape.numel()) * dtype_size(slot.keeps_dtype ? slot.fixed_dtype : dtype);
    }
  }
  for (const auto& [name, child] : children_) n += child->buffer_bytes(dtype);
  return n;
}

namespace {
thread_local bool tls_meta_parameters = false;
}

MetaParameters::MetaParameters() noexcept : previous_(tls_meta_parameters) { tls_meta_parameters = true; }
MetaParameters::~MetaParameters() { tls_meta_parameters = previous_; }
bool MetaParameters::active() noexcept { return tls_meta_parameters; }

void Module::materialize(Runtime& runtime, DType dtype) {
  // Module._apply order: children first, then own parameters, then own buffers.
  for (auto& [name, child] : children_) child->materialize(runtime, dtype);
  ModuleScope scope(context(Phase::None));
  for (int pass = 0; pass < 2; ++pass) {
    for (ParamSlot& slot : slots_) {
      if (slot.is_buffer != (pass == 1)) continue;
      const DType dt = slot.keeps_dtype ? slot.fixed_dtype : dtype;
      {
        std::optional<MetaDevice> meta;
        if (!slot.is_buffer && tls_meta_parameters) meta.emplace();
        slot.tensor = empty(runtime, slot.shape, dt);
      }
      const std::uint64_t seed = runtime.init_seed() + 0x51ed27ull * (runtime.next_init_stream() + 1);
      if (slot.init_low == slot.init_high) {
        fill_(slot.tensor, slot.init_low);
      } else {
        uniform_(slot.tensor, slot.init_low, slot.init_high, seed);
      }
      slot.tensor.set_name(path_.empty() ? slot.name : path_ + "." + slot.name);
      if (!slot.is_buffer && !slot.frozen) {
        slot.tensor.set_requires_grad(true);
        slot.tensor.impl()->grad_context = context(Phase::Backward);
        // Snapshots label the gradient by its parameter, as memory_viz users name it.
        slot.tensor.impl()->grad_label = intern_context(slot.tensor.name() + ".grad", Phase::Backward);
      }
    }
  }
  materialized(runtime, dtype);
}

void Module::release() noexcept {
  for (ParamSlot& slot : slots_) slot.tensor = Tensor{};
  for (auto& [name, child] : children_) child->release();
}

std::size_t Module::add_parameter(std::string name, Shape shape, double low, double high) {
  slots_.push_back(ParamSlot{std::move(name), shape, false, DType::F32, false, low, high, {}});
  return slots_.size() - 1;
}

std::size_t Module::add_buffer(std::string name, Shape shape, double fill, bool keep_i64) {
  slots_.push_back(ParamSlot{std::move(name), shape, true, DType::I64, keep_i64, fill, fill, {}});
  return slots_.size() - 1;
}

void Module::configure_slot(std::size_t slot, bool fixed_dtype, DType dtype, bool frozen) {
  ParamSlot& s = slots_.at(slot);
  if (fixed_dtype) {
    s.keeps_dtype = true;
    s.fixed_dtype = dtype;
  }
  s.frozen = s.frozen || frozen;
}

std::size_t Module::add_typed_buffer(std::string name, Shape shape, DType dtype) {
  slots_.push_back(ParamSlot{std::move(name), shape, true, dtype, true, 0, 0, {}});
  return slots_.size() - 1;
}

std::size_t Module::add_packed_parameter(std::string name, std::int64_t bytes, std::int64_t elements) {
  ParamSlot slot{std::move(name), Shape{bytes}, false, DType::U8, true, 0, 0, {}};
  slot.frozen = true;
  slot.logical_numel = elements;
  slots_.push_back(std::move(slot));
  return slots_.size() - 1;
}

// --- Sequential ---------------------------------------------------------------------------

Sequential::Sequential() : Module("Sequential") {}

void Sequential::retain(const std::vector<std::string>& names) { remove_children_except(names); }

void Module::remove_children_except(const std::vector<std::string>& keep) {
  std::erase_if(children_, [&](const auto& child) {
    return std::find(keep.begin(), keep.end(), child.first) == keep.end();
  });
}

Module& Sequential::append(std::string name, std::unique_ptr<Module> module) {
  return add_module(std::move(name), std::move(module));
}

Module& Sequential::append(std::unique_ptr<Module> module) {
  return append(std::to_string(children().size()), std::move(module));
}

std::string_view Sequential::group_of(std::string_view name) const {
  const auto dot = name.rfind('.');
  if (dot == std::string_view::npos) return {};
  const std::string_view prefix = name.substr(0, dot);
  for (const auto& [other, child] : children()) {
    if (other == prefix) return {};  // a module of its own ("transformer" for "transformer.ln_f")
  }
  return prefix;
}

std::vector<std::string> Sequential::groups() const {
  std::vector<std::string> out;
  for (const auto& [name, child] : children()) {
    const std::string_view g = group_of(name);
    if (!g.empty() && (out.empty() || out.back() != g)) out.emplace_back(g);
  }
  return out;
}

bool Sequential::set_group_checkpoint(std::string_view group, CheckpointMark mark) {
  const std::vector<std::string> known = groups();
  if (std::find(known.begin(), known.end(), group) == known.end()) return false;
  std::erase_if(group_marks_, [&](const auto& m) { return m.first == group; });
  if (mark != CheckpointMark::None) group_marks_.emplace_back(std::string(group), mark);
  return true;
}

Tensor Sequential::run_group_checkpointed(std::size_t first, std::size_t last, std::string_view group,
                                          CheckpointMark mark, const Tensor& input) {
  // checkpoint(self.layer1, x): the stretch keeps only its input and reruns in backward, in
  // its scope (the rerun's phase) as the first run.
  const std::string scope_path = group_path(group);
  return checkpoint(
      [this, first, last, scope_path](const TensorList& in) {
        const Phase phase = current_phase() == Phase::Backward ? Phase::Recompute : current_phase();
        ModuleScope scope(scope_path, phase);
        Tensor y = in[0];
        for (std::size_t i = first; i < last; ++i) y = at(i)(y);
        return TensorList{y};
      },
      {input}, options_for(mark))[0];
}

std::string Sequential::group_path(std::string_view group) const {
  return path().empty() ? std::string(group) : path() + "." + std::string(group);
}

Tensor Sequential::forward(const Tensor& input) { return run_children(input, {}); }

Tensor Sequential::forward_part(const Tensor& input, const std::vector<bool>& part) {
  if (part.size() != children().size()) {
    throw Error("a part of " + (path().empty() ? std::string("the model") : path()) + " names " +
                std::to_string(part.size()) + " children of " + std::to_string(children().size()));
  }
  if (!group_marks_.empty()) throw Error("a part of a Sequential runs without checkpoint_sequential's segments");
  return run_children(input, part);
}

Tensor Sequential::run_children(const Tensor& input, const std::vector<bool>& part) {
  // Flattened children ("layer1.0", "layer1.1": resnet's blocks sit in one
  // Sequential so checkpoint_sequential can split between them) run inside a
  // scope for their container ("layer1"), as nested Sequentials would in PyTorch,
  // so hooks and logs see the tree. Only a scope: it allocates nothing and sets
  // no backward context (autograd nodes keep their own module's).
  const Phase phase = current_phase() == Phase::Backward ? Phase::Recompute : current_phase();
  Tensor x = input;
  std::optional<ModuleScope> group;
  std::string_view group_name;
  const auto& list = children();
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (!part.empty() && !part[i]) continue;
    const std::string_view g = group_of(list[i].first);
    if (g != group_name) {
      group.reset();
      group_name = g;
      const auto marked = std::find_if(group_marks_.begin(), group_marks_.end(), [&](const auto& m) { return m.first == g; });
      if (!g.empty() && marked != group_marks_.end() && grad_enabled()) {
        std::size_t last = i;
        while (last < list.size() && group_of(list[last].first) == g) ++last;
        x = run_group_checkpointed(i, last, g, marked->second, x);
        i = last - 1;
        group_name = {};
        continue;
      }
      if (!g.empty()) group.emplace(group_path(g), phase);
    }
    x = (*list[i].second)(x);
  }
  return x;
}

// --- Residual, Parallel, Identity ------------------------------------------------------------

namespace {

/// Runs `modules` one after another on `x`, as a list of statements `x = m(x)` does.
Tensor run_in_order(const std::vector<Module*>& modules, Tensor x) {
  for (Module* m : modules) x = (*m)(x);
  return x;
}

}  // namespace

Residual::Residual(std::string class_name, bool inplace_add)
    : Module(std::move(class_name)), inplace_add_(inplace_add) {}

Module& Residual::add(Part part, std::string name, std::unique_ptr<Module> module) {
  Module& child = add_module(std::move(name), std::move(module));
  reuse(part, child);
  return child;
}

void Residual::reuse(Part part, Module& child) { parts_[static_cast<std::size_t>(part)].push_back(&child); }

Tensor Residual::forward(const Tensor& input) {
  Tensor out = run_in_order(parts_[0], input);
  const Tensor identity = run_in_order(parts_[1], input);
  out = inplace_add_ ? add_(out, identity) : nn::add(out, identity);
  return run_in_order(parts_[2], out);
}

Parallel::Parallel(std::string class_name, Join join, std::int64_t dim)
    : Module(std::move(class_name)), join_(join), dim_(dim) {}

void Parallel::branch() { branches_.emplace_back(); }

Module& Parallel::add(std::string name, std::unique_ptr<Module> module) {
  Module& child = add_module(std::move(name), std::move(module));
  reuse(child);
  return child;
}

void Parallel::reuse(Module& child) {
  if (branches_.empty()) branch();
  branches_.back().push_back(&child);
}

Tensor Parallel::forward(const Tensor& input) {
  std::vector<Tensor> outs;
  outs.reserve(branches_.size());
  for (const auto& modules : branches_) outs.push_back(run_in_order(modules, input));
  if (join_ == Join::Concat) return cat(outs, dim_);
  if (join_ == Join::Mul) return nn::mul(outs.at(0), outs.at(1));
  if (join_ == Join::Matmul) {
    const Tensor& a = outs.at(0);
    const Tensor& b = outs.at(1);
    if (a.dim() >= 3) return nn::matmul(a, b);
    // torch.mm saves the same operands as bmm; the [1, M, K] views allocate nothing.
    const Tensor out = bmm(a.view(Shape{1, a.size(0), a.size(1)}), b.view(Shape{1, b.size(0), b.size(1)}));
    return out.view(Shape{a.size(0), b.size(1)});
  }
  Tensor sum = outs.at(0);
  for (std::size_t i = 1; i < outs.size(); ++i) sum = nn::add(sum, outs[i]);
  return sum;
}

Identity::Identity() : Module("Identity") {}

std::vector<Module*> Sequential::modules() const {
  std::vector<Module*> out;
  for (const auto& [name, child] : children()) out.push_back(child.get());
  return out;
}

// --- layers ---------------------------------------------------------------------------------

Linear::Linear(std::int64_t in, std::int64_t out, bool bias, bool kn_layout)
    : Module("Linear"), has_bias_(bias), kn_layout_(kn_layout) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));  // kaiming_uniform(a=sqrt(5))
  weight_ = add_parameter("weight", kn_layout ? Shape{in, out} : Shape{out, in}, -bound, bound);
  bias_ = bias ? add_parameter("bias", Shape{out}, -bound, bound) : 0;
}

Tensor Linear::forward(const Tensor& input) {
  if (in_loss_) return input;
  const Tensor b = has_bias_ ? param(bias_) : Tensor{};
  return kn_layout_ ? linear_kn(input, param(weight_), b) : linear(input, param(weight_), b);
}

const Tensor& Linear::weight() const noexcept { return slots()[weight_].tensor; }

void Linear::shard_columns(std::size_t ranks, std::size_t rank) {
  if (kn_layout_) throw Error("tensor parallel of a Conv1D (k x n) projection is not modelled");
  Shape w = slots()[weight_].shape;
  w[0] = chunk_size(w[0], ranks, rank);
  set_slot_shape(weight_, w);
  if (has_bias_) set_slot_shape(bias_, Shape{w[0]});
}

void Linear::shard_inputs(std::size_t ranks, std::size_t rank) {
  if (kn_layout_) throw Error("tensor parallel of a Conv1D (k x n) projection is not modelled");
  Shape w = slots()[weight_].shape;
  w[1] = chunk_size(w[1], ranks, rank);
  set_slot_shape(weight_, w);
}

Conv2d::Conv2d(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
               bool bias, std::int64_t dilation, std::int64_t groups)
    : Module("Conv2d"), stride_(stride), padding_(padding), dilation_(dilation), groups_(groups), has_bias_(bias) {
  if (groups < 1 || in % groups != 0 || out % groups != 0) {
    throw Error("Conv2d: in_channels " + std::to_string(in) + " and out_channels " + std::to_string(out) +
                " must be multiples of groups " + std::to_string(groups));
  }
  // kaiming_uniform(a=sqrt(5)) over fan_in = in / groups * k * k; in double, as the product
  // may exceed int64 before the weight's shape is checked.
  const double fan_in = static_cast<double>(in / groups) * static_cast<double>(kernel) * static_cast<double>(kernel);
  const double bound = 1.0 / std::sqrt(fan_in);
  weight_ = add_parameter("weight", Shape{out, in / groups, kernel, kernel}, -bound, bound);
  bias_ = bias ? add_parameter("bias", Shape{out}, -bound, bound) : 0;
}

Tensor Conv2d::forward(const Tensor& input) {
  return conv2d(input, param(weight_), has_bias_ ? param(bias_) : Tensor{}, stride_, padding_, dilation_, groups_);
}

Conv1d::Conv1d(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
               bool bias, std::int64_t dilation, std::int64_t groups)
    : Module("Conv1d"), stride_(stride), padding_(padding), dilation_(dilation), groups_(groups), has_bias_(bias) {
  if (groups < 1 || in % groups != 0 || out % groups != 0) {
    throw Error("Conv1d: in_channels " + std::to_string(in) + " and out_channels " + std::to_string(out) +
                " must be multiples of groups " + std::to_string(groups));
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(in / groups) * static_cast<double>(kernel));
  weight_ = add_parameter("weight", Shape{out, in / groups, kernel}, -bound, bound);
  bias_ = bias ? add_parameter("bias", Shape{out}, -bound, bound) : 0;
}

Tensor Conv1d::forward(const Tensor& input) {
  return conv1d(input, param(weight_), has_bias_ ? param(bias_) : Tensor{}, stride_, padding_, dilation_, groups_);
}

ConvTranspose2d::ConvTranspose2d(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride,
                                 std::int64_t padding, std::int64_t output_padding, bool bias, std::int64_t dilation)
    : Module("ConvTranspose2d"),
      stride_(stride),
      padding_(padding),
      output_padding_(output_padding),
      dilation_(dilation),
      has_bias_(bias) {
  // kaiming_uniform(a=sqrt(5)) over the weight's fan_in, its dim 1 x k x k (= out k k here).
  const double bound = 1.0 / std::sqrt(static_cast<double>(out) * static_cast<double>(kernel) * static_cast<double>(kernel));
  weight_ = add_parameter("weight", Shape{in, out, kernel, kernel}, -bound, bound);
  bias_ = bias ? add_parameter("bias", Shape{out}, -bound, bound) : 0;
}

Tensor ConvTranspose2d::forward(const Tensor& input) {
  return conv_transpose2d(input, param(weight_), has_bias_ ? param(bias_) : Tensor{}, stride_, padding_, output_padding_,
                          dilation_);
}

Reshape::Reshape(std::vector<std::int64_t> shape) : Module("Reshape"), shape_(std::move(shape)) {}
Tensor Reshape::forward(const Tensor& input) { return input.reshape(Shape(shape_)); }

Permute::Permute(std::vector<std::int64_t> dims) : Module("Permute"), dims_(std::move(dims)) {}
Tensor Permute::forward(const Tensor& input) { return input.permute(std::span<const std::int64_t>(dims_)); }

Transpose::Transpose(std::int64_t dim0, std::int64_t dim1) : Module("Transpose"), dim0_(dim0), dim1_(dim1) {}
Tensor Transpose::forward(const Tensor& input) { return input.transpose(dim0_, dim1_); }

Contiguous::Contiguous() : Module("Contiguous") {}

GroupNorm::GroupNorm(std::int64_t groups, std::int64_t channels, double eps, bool affine)
    : Module("GroupNorm"), groups_(groups), eps_(eps), affine_(affine) {
  if (affine) {
    weight_ = add_parameter("weight", Shape{channels}, 1.0, 1.0);
    bias_ = add_parameter("bias", Shape{channels}, 0.0, 0.0);
  }
}
Tensor GroupNorm::forward(const Tensor& input) {
  return group_norm(input, affine_ ? param(weight_) : Tensor{}, affine_ ? param(bias_) : Tensor{}, groups_, eps_);
}

LeakyReLU::LeakyReLU(double slope, bool inplace) : Module("LeakyReLU"), slope_(slope), inplace_(inplace) {}
Tensor LeakyReLU::forward(const Tensor& input) {
  return inplace_ ? leaky_relu_(input, slope_) : leaky_relu(input, slope_);
}

Hardtanh::Hardtanh(double lo, double hi, bool inplace, std::string type)
    : Module(std::move(type)), lo_(lo), hi_(hi), inplace_(inplace) {}
Tensor Hardtanh::forward(const Tensor& input) { return inplace_ ? hardtanh_(input, lo_, hi_) : hardtanh(input, lo_, hi_); }

SiLU::SiLU(bool inplace) : Module("SiLU"), inplace_(inplace) {}
Tensor SiLU::forward(const Tensor& input) { return inplace_ ? silu_(input) : silu(input); }

Softmax::Softmax() : Module("Softmax") {}
Tensor Softmax::forward(const Tensor& input) { return softmax(input); }

ReLU::ReLU(bool inplace) : Module("ReLU"), inplace_(inplace) {}
Tensor ReLU::forward(const Tensor& input) { return inplace_ ? relu_(input) : relu(input); }

Sigmoid::Sigmoid() : Module("Sigmoid") {}
Tensor Sigmoid::forward(const Tensor& input) { return sigmoid(input); }

Tanh::Tanh() : Module("Tanh") {}
Tensor Tanh::forward(const Tensor& input) { return tanh(input); }

Scale::Scale(double factor) : Module("Scale"), factor_(factor) {}
Tensor Scale::forward(const Tensor& input) { return mul_scalar(input, factor_); }

GELU::GELU(bool tanh_approx, std::string type) : Module(std::move(type)), tanh_approx_(tanh_approx) {}
Tensor GELU::forward(const Tensor& input) { return gelu(input, tanh_approx_); }

NewGELU::NewGELU() : Module("NewGELUActivation") {}
Tensor NewGELU::forward(const Tensor& x) {
  // transformers/activations.py; Python evaluates 0.5 * x first, and frees each temporary of
  // the right operand once the next one exists (the reassignments below).
  const Tensor half = mul_scalar(x, 0.5);
  Tensor inner = pow_scalar(x, 3.0);
  inner = mul_scalar(inner, 0.044715);
  inner = add(x, inner);
  inner = mul_scalar(inner, std::sqrt(2.0 / std::numbers::pi));
  inner = tanh(inner);
  inner = add_scalar(inner, 1.0);
  return mul(half, inner);
}

BatchNorm2d::BatchNorm2d(std::int64_t channels, double eps, double momentum, std::string type)
    : Module(std::move(type)), eps_(eps), momentum_(momentum) {
  weight_ = add_parameter("weight", Shape{channels}, 1.0, 1.0);
  bias_ = add_parameter("bias", Shape{channels}, 0.0, 0.0);
  mean_ = add_buffer("running_mean", Shape{channels}, 0.0);
  var_ = add_buffer("running_var", Shape{channels}, 1.0);
  batches_ = add_buffer("num_batches_tracked", Shape{}, 0.0, true);
}

Tensor BatchNorm2d::forward(const Tensor& input) {
  if (training()) {
    // num_batches_tracked.add_(1) (torch/nn/modules/batchnorm.py, _BatchNorm.forward): in place on
    // a 0-d tensor, no allocation; again in a checkpoint's recompute, as PyTorch's rerun does.
    const Tensor& counter = param(batches_);
    counter.bump_version();
    if (counter.runtime().computing()) ++*counter.data<std::int64_t>();
  }
  return batch_norm(input, param(weight_), param(bias_), param(mean_), param(var_), training(), momentum_, eps_);
}

const Tensor& BatchNorm2d::running_mean() const noexcept { return slots()[mean_].tensor; }
const Tensor& BatchNorm2d::running_var() const noexcept { return slots()[var_].tensor; }

LayerNorm::LayerNorm(std::int64_t features, double eps) : Module("LayerNorm"), eps_(eps) {
  weight_ = add_parameter("weight", Shape{features}, 1.0, 1.0);
  bias_ = add_parameter("bias", Shape{features}, 0.0, 0.0);
}

Tensor LayerNorm::forward(const Tensor& input) { return layer_norm(input, param(weight_), param(bias_), eps_); }

MaxPool2d::MaxPool2d(std::int64_t kernel, std::int64_t stride, std::int64_t padding)
    : Module("MaxPool2d"), kernel_(kernel), stride_(stride), padding_(padding) {}
Tensor MaxPool2d::forward(const Tensor& input) { return max_pool2d(input, kernel_, stride_, padding_); }

AvgPool2d::AvgPool2d(std::int64_t kernel, std::int64_t stride, std::int64_t padding, bool count_include_pad)
    : Module("AvgPool2d"), kernel_(kernel), stride_(stride), padding_(padding), count_include_pad_(count_include_pad) {}
Tensor AvgPool2d::forward(const Tensor& input) {
  return avg_pool2d(input, kernel_, stride_, padding_, count_include_pad_);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::int64_t out_h, std::int64_t out_w)
    : Module("AdaptiveAvgPool2d"), out_h_(out_h), out_w_(out_w) {}
Tensor AdaptiveAvgPool2d::forward(const Tensor& input) { return adaptive_avg_pool2d(input, out_h_, out_w_); }

Flatten::Flatten(std::int64_t start_dim) : Module("Flatten"), start_dim_(start_dim) {}
Tensor Flatten::forward(const Tensor& input) { return input.flatten(start_dim_); }

Mean::Mean(std::int64_t first_dim, bool keepdim) : Module("Mean"), first_dim_(first_dim), keepdim_(keepdim) {}
Tensor Mean::forward(const Tensor& input) {
  if (first_dim_ < 1 || first_dim_ >= static_cast<std::int64_t>(input.dim())) {
    throw Error("Mean: dimension " + std::to_string(first_dim_) + " of a " + std::to_string(input.dim()) +
                "-dimensional input");
  }
  Shape shape = input.shape();
  for (std::size_t d = static_cast<std::size_t>(first_dim_); d < shape.size(); ++d) shape[d] = 1;
  Tensor out = detail::mean_trailing(input, shape);  // one output, [N, C, 1, 1] as [N, C]
  if (keepdim_) return out;
  return out.view(Shape(std::span<const std::int64_t>(shape.begin(), static_cast<std::size_t>(first_dim_))));
}

Dropout::Dropout(double p) : Module("Dropout"), p_(p) {}
Tensor Dropout::forward(const Tensor& input) { return dropout(input, p_, training()); }

Embedding::Embedding(std::int64_t num_embeddings, std::int64_t dim, double init_bound) : Module("Embedding") {
  weight_ = add_parameter("weight", Shape{num_embeddings, dim}, -init_bound, init_bound);
}
void Embedding::shard_vocab(std::int64_t rows) {
  full_rows_ = weight_rows();
  set_slot_shape(weight_, Shape{rows, slots()[weight_].shape[1]});
}

Tensor Embedding::forward(const Tensor& input) {
  Tensor out = full_rows_ > 0 ? detail::vocab_parallel_embedding(param(weight_), input, full_rows_)
                              : embedding(param(weight_), input);
  if (output_requires_grad_ && !out.requires_grad()) out.set_requires_grad(true);  // output.requires_grad_(True)
  return out;
}
const Tensor& Embedding::weight() const noexcept { return slots()[weight_].tensor; }

Tensor TiedLinear::forward(const Tensor& input) { return in_loss_ ? input : linear(input, embedding_->weight()); }

void TiedLinear::materialized(Runtime& runtime, DType dtype) {
  // nn.Linear(hidden, vocab) in LlamaForCausalLM.__init__, then tie_weights() in post_init
  // (transformers modeling_utils.py) replaces it by the embedding's: allocated, then freed.
  if (untied_first_) const Tensor own = empty(runtime, embedding_->weight().shape(), dtype);
}

}  // namespace mem::nn
