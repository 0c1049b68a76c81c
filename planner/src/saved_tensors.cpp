// saved_tensors.cpp — per-module saved-for-backward bytes (see saved_tensors.hpp).
#include "vramscope/planner/saved_tensors.hpp"

#include <fmt/format.h>

#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/runtime/runtime.hpp"

namespace mem::planner {

namespace {

void add_slots(const nn::Module& m, std::set<std::weak_ptr<const nn::Storage>, std::owner_less<>>& out) {
  for (const nn::ParamSlot& slot : m.slots()) {
    if (slot.tensor.defined()) out.insert(slot.tensor.storage());
  }
  for (const auto& [name, child] : m.children()) add_slots(*child, out);
}

}  // namespace

SavedTensorLog::SavedTensorLog(const nn::Module& model) { add_slots(model, seen_); }

nn::SavedTensorsObserver::Fn SavedTensorLog::observer() {
  return [this](const nn::Tensor& t) { saved(t); };
}

void SavedTensorLog::saved(const nn::Tensor& tensor) {
  // The forward only: a checkpoint's rerun in backward saves again what it frees again.
  if (nn::current_phase() != Phase::Forward || !tensor.storage()) return;
  if (!seen_.insert(tensor.storage()).second) return;
  const std::string& module = context_info(current_context()).path;
  const auto [at, fresh] = row_of_.emplace(module, rows_.size());
  if (fresh) rows_.push_back({module, 0, 0});
  SavedByModule& row = rows_[at->second];
  ++row.tensors;
  row.bytes += tensor.storage()->nbytes();
}

std::size_t SavedTensorLog::total_bytes() const noexcept {
  std::size_t total = 0;
  for (const SavedByModule& r : rows_) total += r.bytes;
  return total;
}

}  // namespace mem::planner
