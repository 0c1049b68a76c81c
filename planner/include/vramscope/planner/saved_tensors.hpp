// saved_tensors.hpp — `vramscope trace --saved`: the bytes each module keeps for backward
// in the first step's forward, as torch.autograd.graph.saved_tensors_hooks measures them
// in PyTorch (each storage once, under the module that saved it first; parameters and
// buffers left out, since they are kept anyway).
#pragma once

#include <cstddef>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vramscope/instrumentation/memory_logger.hpp"
#include "vramscope/runtime/autograd.hpp"
#include "vramscope/runtime/modules.hpp"

namespace mem::planner {

struct SavedByModule {
  std::string module;   ///< full dotted path; "" for code outside any module (the root's)
  std::size_t tensors = 0;
  std::size_t bytes = 0;
};

class SavedTensorLog {
 public:
  /// Leaves out the storages of `model`'s parameters and buffers (materialized).
  explicit SavedTensorLog(const nn::Module& model);
  /// The observer to install (nn::SavedTensorsObserver) around the step.
  nn::SavedTensorsObserver::Fn observer();
  /// Modules in the order of their first save.
  const std::vector<SavedByModule>& rows() const noexcept { return rows_; }
  std::size_t total_bytes() const noexcept;

 private:
  void saved(const nn::Tensor& tensor);

  // By owner, not address: a node whose output nothing reads dies in the forward with what it
  // saved, and a later storage may take the same address (a weak_ptr keeps its control block).
  std::set<std::weak_ptr<const nn::Storage>, std::owner_less<>> seen_;
  std::vector<SavedByModule> rows_;
  std::unordered_map<std::string, std::size_t> row_of_;
};

}  // namespace mem::planner
