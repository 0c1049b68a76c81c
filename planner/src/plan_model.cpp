// plan_model.cpp — the profile run and the backward replayed on its figures.
#include "vramscope/planner/plan_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <queue>
#include <unordered_map>

#include "vramscope/instrumentation/module_scope.hpp"
#include "vramscope/planner/saved_tensors.hpp"
#include "vramscope/planner/sweep.hpp"
#include "vramscope/runtime/checkpoint_modules.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace mem::planner {

bool inside(const std::string& path, const std::string& outer) {
  return path.size() > outer.size() && path.compare(0, outer.size(), outer) == 0 && path[outer.size()] == '.';
}

namespace {

/// Adds up each named module's inputs over its calls (a checkpoint of it keeps each one; a
/// ReLU module a block calls three times keeps three).
class InputBytes final : public nn::ForwardHooks {
 public:
  nn::Tensor pre_forward(nn::Module& module, const nn::Tensor& input) override {
    // The storage, as the saved bytes count it: a view's checkpoint keeps its whole base.
    if (input.defined()) bytes[&module] += input.storage() ? input.storage()->nbytes() : input.nbytes();
    return input;
  }
  nn::Tensor post_forward(nn::Module& module, const nn::Tensor& output) override {
    (void)module;
    return output;
  }
  std::unordered_map<const nn::Module*, std::size_t> bytes;
};

/// What keeping an operator's outputs holds: the storages its outputs made (each once), not
/// those of outputs that view an input.
std::size_t new_storage_bytes(const nn::TensorList& in, const nn::TensorList& out) {
  std::size_t bytes = 0;
  for (std::size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined() || out[k].storage() == nullptr) continue;
    const auto same = [&](const nn::Tensor& t) { return nn::same_storage(t, out[k]); };
    if (std::any_of(in.begin(), in.end(), same) ||
        std::any_of(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(k), same)) {
      continue;
    }
    bytes += out[k].storage()->nbytes();
  }
  return bytes;
}

}  // namespace

StepProfile profile_step(nn::TrainConfig cfg) {
  cfg.steps = 1;
  cfg.segments = 1;
  cfg.checkpoint_modules = std::vector<std::string>{};
  cfg.parallel = nn::ParallelConfig{};  // what a module keeps is the same on every rank
  const auto device = make_device(nn::device_spec_for(cfg));
  CachingAllocator allocator{unlimited_twin(device->info()), AllocatorConfig::parse(cfg.alloc_conf)};
  nn::Trainer trainer{cfg, allocator};
  nn::Module& root = trainer.model().body();
  const std::vector<nn::Module*> named = nn::named_modules(root);
  InputBytes inputs;
  for (nn::Module* m : named) m->set_forward_hooks(&inputs);
  SavedTensorLog saved{root};
  std::vector<double> flops_by_context;
  trainer.runtime().set_forward_flops_by_context(&flops_by_context);
  StepProfile profile;
  // Each call's output storages, watched (not kept: the profile must not change what is
  // alive), so that an in-place write into one marks the call whose output it was.
  std::vector<std::pair<std::weak_ptr<nn::Storage>, std::size_t>> outputs;
  const nn::Runtime::OpObserver ops = [&](std::string_view op, const nn::TensorList& in, const nn::TensorList& out,
                                         bool inplace, double flops) {
    if (inplace) {
      for (const nn::Tensor& t : out) {
        if (!t.defined() || t.storage() == nullptr) continue;
        for (const auto& [storage, call] : outputs) {
          if (storage.lock() == t.storage()) profile.op_calls[call].mutated_later = true;
        }
      }
    }
    const std::size_t call = profile.op_calls.size();
    profile.op_calls.push_back({context_info(current_context()).path, std::string(op), new_storage_bytes(in, out), flops});
    for (const nn::Tensor& t : out) {
      if (t.defined() && t.storage() != nullptr) outputs.emplace_back(t.storage(), call);
    }
    std::erase_if(outputs, [](const auto& o) { return o.first.expired(); });
  };
  trainer.runtime().set_op_observer(&ops);
  nn::StepStats stats;
  {
    nn::SavedTensorsObserver observe{saved.observer()};
    stats = trainer.step();
  }
  trainer.runtime().set_op_observer(nullptr);
  trainer.runtime().set_forward_flops_by_context(nullptr);
  for (nn::Module* m : named) m->set_forward_hooks(nullptr);

  profile.flops = stats.flops;
  std::unordered_map<std::string, std::size_t> index;
  for (nn::Module* m : named) {
    if (index.contains(m->path())) continue;
    index.emplace(m->path(), profile.modules.size());
    ModuleCost cost;
    cost.path = m->path();
    const auto it = inputs.bytes.find(m);
    cost.input_bytes = it == inputs.bytes.end() ? 0 : it->second;
    cost.first_save = SIZE_MAX;
    profile.modules.push_back(std::move(cost));
  }
  // Each figure counts for its module and every module above it.
  const auto add_up = [&](const std::string& path, auto&& add) {
    std::string p = path;
    while (!p.empty()) {
      if (const auto it = index.find(p); it != index.end()) add(profile.modules[it->second]);
      const std::size_t dot = p.rfind('.');
      p = dot == std::string::npos ? "" : p.substr(0, dot);
    }
  };
  for (const SavedByModule& row : saved.rows()) {
    const std::size_t at = profile.saves.size();
    profile.saves.push_back({row.module, row.bytes});
    add_up(row.module, [&](ModuleCost& c) {
      c.saved_bytes += row.bytes;
      c.first_save = std::min(c.first_save, at);
      c.end_save = std::max(c.end_save, at + 1);
    });
  }
  for (ModuleCost& c : profile.modules) {
    if (c.first_save == SIZE_MAX) c.first_save = c.end_save = 0;
  }
  for (std::size_t id = 0; id < flops_by_context.size(); ++id) {
    if (flops_by_context[id] == 0) continue;
    const double f = flops_by_context[id];
    add_up(context_info(static_cast<ContextId>(id)).path, [&](ModuleCost& c) { c.forward_flops += f; });
  }
  for (const nn::Module* block : nn::repeated_blocks(root)) profile.blocks.push_back(block->path());
  return profile;
}

std::int64_t estimated_peak(const StepProfile& profile, const std::vector<std::size_t>& checkpointed) {
  const std::size_t n = profile.saves.size();
  // Where each checkpointed module's saves begin (its input goes there) and end (its
  // recompute comes there, the backward walking the saves from the last).
  std::vector<std::int64_t> recompute_at(n + 1, 0), input_at(n + 1, 0);
  std::vector<bool> covered(n, false);
  std::int64_t live = 0;
  for (const std::size_t i : checkpointed) {
    const ModuleCost& m = profile.modules[i];
    if (m.end_save <= m.first_save) continue;
    recompute_at[m.end_save - 1] += static_cast<std::int64_t>(m.saved_bytes);
    input_at[m.first_save] += static_cast<std::int64_t>(m.input_bytes);
    live += static_cast<std::int64_t>(m.input_bytes);
    for (std::size_t k = m.first_save; k < m.end_save; ++k) covered[k] = true;
  }
  for (std::size_t k = 0; k < n; ++k) {
    if (!covered[k]) live += static_cast<std::int64_t>(profile.saves[k].bytes);
  }
  std::int64_t peak = live;
  for (std::size_t k = n; k-- > 0;) {
    live += recompute_at[k];
    peak = std::max(peak, live);
    live -= static_cast<std::int64_t>(profile.saves[k].bytes);
    live -= input_at[k];
  }
  return peak;
}

CheckpointSequence checkpoint_sequence(const StepProfile& profile, std::int64_t deficit, bool exhaustive,
                                       std::size_t candidates) {
  // The candidates: modules keeping more than their inputs, the most per FLOP first.
  // A module whose saves are not one run of the forward (one called again after others ran)
  // does not fit the replay's model: left out.
  std::vector<std::size_t> prefix(profile.saves.size() + 1, 0);
  for (std::size_t k = 0; k < profile.saves.size(); ++k) prefix[k + 1] = prefix[k] + profile.saves[k].bytes;
  std::vector<std::size_t> pool;
  for (std::size_t i = 0; i < profile.modules.size(); ++i) {
    const ModuleCost& m = profile.modules[i];
    const bool contiguous = m.end_save > m.first_save && prefix[m.end_save] - prefix[m.first_save] == m.saved_bytes;
    if (m.saved_bytes > m.input_bytes && contiguous) pool.push_back(i);
  }
  const auto density = [&](std::size_t i) {
    const ModuleCost& m = profile.modules[i];
    return static_cast<double>(m.saved_bytes - m.input_bytes) / std::max(m.forward_flops, 1.0);
  };
  std::stable_sort(pool.begin(), pool.end(), [&](std::size_t a, std::size_t b) { return density(a) > density(b); });
  // Each pass replays the backward once per candidate: keep candidates^2 x saves near 2e8.
  const double saves = std::max<double>(1, static_cast<double>(profile.saves.size()));
  const auto affordable = static_cast<std::size_t>(std::sqrt(2e8 / saves));
  pool.resize(std::min({pool.size(), candidates, std::max<std::size_t>(affordable, 8)}));

  CheckpointSequence out;
  std::vector<std::size_t> taken;
  const std::int64_t start = estimated_peak(profile, taken);
  std::int64_t peak = start;
  for (;;) {
    std::size_t best = SIZE_MAX;
    double best_gain = 0;
    std::int64_t best_peak = peak;
    for (const std::size_t i : pool) {
      const std::string& path = profile.modules[i].path;
      const bool clash = std::any_of(taken.begin(), taken.end(), [&](std::size_t t) {
        const std::string& other = profile.modules[t].path;
        return t == i || inside(path, other) || inside(other, path);
      });
      if (clash) continue;
      taken.push_back(i);
      const std::int64_t with = estimated_peak(profile, taken);
      taken.pop_back();
      if (with >= peak) continue;
      const double gain = static_cast<double>(peak - with) / std::max(profile.modules[i].forward_flops, 1.0);
      if (best == SIZE_MAX || gain > best_gain || (gain == best_gain && with < best_peak)) {
        best = i;
        best_gain = gain;
        best_peak = with;
      }
    }
    if (best == SIZE_MAX) break;
    taken.push_back(best);
    peak = best_peak;
    out.modules.push_back(profile.modules[best].path);
    if (out.enough == 0 && start - peak >= deficit) out.enough = out.modules.size();
    // Past the model's answer, a few more for the dry runs to fall back on (all that help when
    // `exhaustive`).
    if (!exhaustive && out.enough != 0 && out.modules.size() >= std::max<std::size_t>(2 * out.enough, out.enough + 8)) {
      break;
    }
  }
  if (out.enough == 0) out.enough = out.modules.size();
  return out;
}

}  // namespace mem::planner

namespace mem::planner {

namespace {

struct BlockCalls {
  std::vector<KeepStep> calls;  ///< the calls worth keeping, in the block's forward order
  std::int64_t extra_saved = 0; ///< saved beyond its input: what it keeps unless checkpointed
  double flops = 0;             ///< its forward
};

/// Each region's calls (counted per operator in its forward, as a region's policy counts them).
std::vector<BlockCalls> block_calls(const StepProfile& profile, const std::vector<std::string>& regions) {
  std::vector<BlockCalls> out(regions.size());
  std::unordered_map<std::string, std::size_t> block_of;
  for (std::size_t b = 0; b < regions.size(); ++b) block_of.emplace(regions[b], b);
  for (const ModuleCost& m : profile.modules) {
    if (const auto it = block_of.find(m.path); it != block_of.end()) {
      out[it->second].extra_saved = static_cast<std::int64_t>(m.saved_bytes) - static_cast<std::int64_t>(m.input_bytes);
      out[it->second].flops = m.forward_flops;
    }
  }
  std::vector<std::unordered_map<std::string, std::size_t>> counts(regions.size());
  for (const OpCallCost& c : profile.op_calls) {
    std::string path = c.module;
    auto it = block_of.end();
    while (!path.empty() && (it = block_of.find(path)) == block_of.end()) {
      const std::size_t dot = path.rfind('.');
      path = dot == std::string::npos ? "" : path.substr(0, dot);
    }
    if (it == block_of.end()) continue;
    const std::size_t call = counts[it->second][c.op]++;
    if (c.bytes > 0 && c.flops > 0 && !c.mutated_later) {
      out[it->second].calls.push_back({it->second, c.op + "@" + std::to_string(call), static_cast<std::int64_t>(c.bytes), c.flops});
    }
  }
  return out;
}

}  // namespace

std::size_t keepable_calls(const StepProfile& profile, const std::vector<std::string>& regions) {
  std::size_t n = 0;
  for (const BlockCalls& b : block_calls(profile, regions)) n += b.calls.size();
  return n;
}

std::vector<KeepStep> keep_sequence(const StepProfile& profile, const std::vector<std::string>& regions) {
  std::vector<KeepStep> sequence;
  if (profile.op_calls.empty() || regions.empty()) return sequence;
  const std::vector<BlockCalls> blocks = block_calls(profile, regions);
  struct Candidate {
    double rate;
    std::size_t block;
    std::size_t call;       ///< index into the block's calls; SIZE_MAX: the whole block
    std::uint64_t version;  ///< a whole block's figures change as its calls are kept
    std::int64_t bytes;
    bool operator<(const Candidate& o) const {
      if (rate != o.rate) return rate < o.rate;
      if (bytes != o.bytes) return bytes > o.bytes;  // ties: the smaller first (packs closer)
      if (block != o.block) return block > o.block;  // then the earlier block, the earlier call
      return call > o.call;
    }
  };
  const auto rate = [](double flops, std::int64_t bytes) {
    return bytes <= 0 ? std::numeric_limits<double>::infinity() : flops / static_cast<double>(bytes);
  };
  std::vector<std::int64_t> kept_bytes(blocks.size(), 0);
  std::vector<double> kept_flops(blocks.size(), 0);
  std::vector<std::uint64_t> version(blocks.size(), 0);
  std::vector<bool> whole(blocks.size(), false);
  std::priority_queue<Candidate> queue;
  const auto push_whole = [&](std::size_t b) {
    const double flops = blocks[b].flops - kept_flops[b];
    if (flops > 0) {
      const std::int64_t bytes = blocks[b].extra_saved - kept_bytes[b];
      queue.push({rate(flops, bytes), b, SIZE_MAX, version[b], bytes});
    }
  };
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    for (std::size_t i = 0; i < blocks[b].calls.size(); ++i) {
      queue.push({rate(blocks[b].calls[i].flops, blocks[b].calls[i].bytes), b, i, 0, blocks[b].calls[i].bytes});
    }
    push_whole(b);
  }
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    if (whole[c.block]) continue;
    if (c.call == SIZE_MAX) {
      if (c.version != version[c.block]) continue;  // stale figures
      whole[c.block] = true;
      sequence.push_back({c.block, "", blocks[c.block].extra_saved - kept_bytes[c.block],
                          blocks[c.block].flops - kept_flops[c.block]});
      continue;
    }
    const KeepStep& call = blocks[c.block].calls[c.call];
    sequence.push_back(call);
    kept_bytes[c.block] += call.bytes;
    kept_flops[c.block] += call.flops;
    ++version[c.block];
    push_whole(c.block);
  }
  return sequence;
}

}  // namespace mem::planner
