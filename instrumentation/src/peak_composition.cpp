// peak_composition.cpp — live bytes by kind, and their composition at the peak.
#include "vramscope/instrumentation/peak_composition.hpp"

#include <numeric>

namespace mem {

std::string_view memory_kind_name(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::Weights: return "weights";
    case MemoryKind::Gradients: return "gradients";
    case MemoryKind::OptimizerState: return "optimizer state";
    case MemoryKind::OptimizerTemporaries: return "optimizer temporaries";
    case MemoryKind::Workspaces: return "workspaces";
    case MemoryKind::Activations: return "activations";
    case MemoryKind::Logits: return "logits and loss";
    case MemoryKind::Communication: return "communication buffers";
    case MemoryKind::Other: return "other";
  }
  return "?";
}

std::string_view memory_kind_key(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::OptimizerState: return "optimizer_state";
    case MemoryKind::OptimizerTemporaries: return "optimizer_temporaries";
    case MemoryKind::Logits: return "logits";
    case MemoryKind::Communication: return "communication";
    default: return memory_kind_name(kind);
  }
}

MemoryKind memory_kind(ContextId context) noexcept {
  const ContextInfo& info = context_info(context);
  const std::string_view path = info.path;
  if (path.empty() || path == "input") return MemoryKind::Other;
  if (path.ends_with(".grad")) return MemoryKind::Gradients;
  if (path.starts_with("DistributedDataParallel") || path.starts_with("FullyShardedDataParallel") ||
      path.starts_with("DeepSpeed") || path.starts_with("DTensor ") || path.starts_with("PipelineStage ")) {
    return MemoryKind::Communication;
  }
  if (path.starts_with("DataParallel ")) {
    // nn.DataParallel: a replica's parameters, GPU 0's reduced gradients, the copies it moves.
    if (path.ends_with("(parameters)")) return MemoryKind::Weights;
    if (path.ends_with("(gradients)")) return MemoryKind::Gradients;
    if (path.ends_with("(output)")) return MemoryKind::Logits;  // the gathered output
    return MemoryKind::Communication;
  }
  if (path.ends_with("(cuBLAS workspace)") || path.ends_with("(cublasLt workspace)")) return MemoryKind::Workspaces;
  switch (info.phase) {
    case Phase::None: return MemoryKind::Weights;
    case Phase::Optimizer:
      return path.ends_with("(optimizer temporaries)") ? MemoryKind::OptimizerTemporaries : MemoryKind::OptimizerState;
    default: break;
  }
  if (path == "lm_head" || path.starts_with("lm_head.") || path == "loss") return MemoryKind::Logits;
  return MemoryKind::Activations;
}

std::int64_t MemoryComposition::total() const noexcept {
  return std::accumulate(bytes.begin(), bytes.end(), std::int64_t{0});
}

std::int64_t MemoryComposition::model_states() const noexcept {
  return of(MemoryKind::Weights) + of(MemoryKind::Gradients) + of(MemoryKind::OptimizerState) +
         of(MemoryKind::OptimizerTemporaries);
}

void PeakComposition::on_event(const TraceEvent& e) noexcept {
  switch (e.action) {
    case TraceAction::Alloc: {
      const MemoryKind kind =
          e.context == kNoContext && unscoped_ != MemoryKind::Other ? unscoped_ : memory_kind(e.context);
      try {
        live_[e.address] = Live{static_cast<std::int64_t>(e.size), kind};
      } catch (...) {
        return;  // out of host memory: this block goes uncounted
      }
      add(kind, static_cast<std::int64_t>(e.size));
      now_.context = e.context;
      if (now_.total() > peak_.total()) peak_ = now_;
      break;
    }
    case TraceAction::FreeRequested:
    case TraceAction::FreeCompleted: {
      // A deferred free is counted when requested, as allocated_bytes is.
      if (e.action == TraceAction::FreeCompleted) break;
      const auto it = live_.find(e.address);
      if (it == live_.end()) break;
      add(it->second.kind, -it->second.size);
      live_.erase(it);
      break;
    }
    case TraceAction::Relabel: {
      const auto it = live_.find(e.address);
      if (it == live_.end()) break;
      add(it->second.kind, -it->second.size);
      it->second.kind = memory_kind(e.context);
      add(it->second.kind, it->second.size);
      break;
    }
    default: break;
  }
}

}  // namespace mem
