// plan.cpp — the plan search: a profile, then families of plans, each searched with the
// profile's estimates and decided by dry runs on the device.
#include "vramscope/planner/plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <unordered_map>

#include "vramscope/planner/max_batch.hpp"
#include "vramscope/planner/errors.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/allocator/sim_device.hpp"
#include "vramscope/runtime/checkpoint.hpp"

namespace mem::planner {

std::string_view plan_change_name(PlanChange change) noexcept {
  switch (change) {
    case PlanChange::None: return "as given";
    case PlanChange::Checkpointing: return "checkpointing";
    case PlanChange::Allocator: return "allocator";
    case PlanChange::Loss: return "loss";
    case PlanChange::Compile: return "compile";
    case PlanChange::Accumulation: return "accumulation";
    case PlanChange::Precision: return "precision";
    case PlanChange::Optimizer: return "optimizer";
  }
  return "?";
}

std::string Plan::label() const {
  std::vector<std::string> parts;
  if (checkpoint_modules && !checkpoint_modules->empty()) {
    const std::size_t n = checkpoint_modules->size();
    if (checkpointing == "blocks") {
      parts.push_back(n == blocks_of ? fmt::format("checkpoint every block ({})", n)
                                     : fmt::format("checkpoint {} of {} blocks", n, blocks_of));
    } else {
      parts.push_back(n == 1 ? "checkpoint " + checkpoint_modules->front() : fmt::format("checkpoint {} modules", n));
    }
    if (!selective.empty()) parts.back() += fmt::format(" keeping {}", fmt::join(selective_groups, ", "));
    if (!selective_scopes.empty()) parts.back() += fmt::format(" keeping {} of {} operator calls", kept_calls, calls_of);
  }
  if (segments > 1) parts.push_back(fmt::format("checkpoint_sequential {} segments", segments));
  if (compile) {
    parts.push_back(*compile >= 1 ? std::string("torch.compile")
                                  : fmt::format("torch.compile, activation_memory_budget {:g}", *compile));
  }
  if (change == PlanChange::Allocator) parts.push_back(alloc_conf);
  if (fused_loss) parts.emplace_back("liger-flce loss");
  if (accumulation > 1) parts.push_back(fmt::format("batch {} x {} accumulation steps", batch, accumulation));
  if (precision_changed) parts.emplace_back(nn::precision_name(precision));
  if (change == PlanChange::Optimizer) parts.push_back(nn::optimizer_label(optimizer));
  if (parts.empty()) return change == PlanChange::None ? "as given" : "no checkpointing";
  std::string out = parts.front();
  for (std::size_t i = 1; i < parts.size(); ++i) out += " + " + parts[i];
  return out;
}

int Plan::rank_tier() const noexcept {
  switch (change) {
    case PlanChange::Accumulation: return 1;
    // Mixed precision keeps f32 master weights: a smaller change than half weights.
    case PlanChange::Precision: return precision == nn::Precision::Amp || precision == nn::Precision::AmpBF16 ? 2 : 3;
    case PlanChange::Optimizer: return 4;
    default: return 0;  // as given, checkpointing, the allocator, the fused loss: the same arithmetic
  }
}

const Plan* PlanResult::best() const noexcept {
  if (given.fits()) return &given;
  for (const Plan& p : plans) {
    if (p.fits()) return &p;
  }
  return nullptr;
}

namespace {

/// A selective checkpointing policy the plan tries: the operators it keeps, and what they are.
struct SelectiveCandidate {
  std::vector<std::string> ops;
  std::vector<std::string> groups;
};

/// The policies worth trying on an operator-level model, least recompute first: keep every
/// costly operator (products, attention, convolutions: only the cheap ones are recomputed),
/// then attention and convolutions alone (the products recomputed too). Each names the
/// overloads the model runs; a policy that keeps nothing, or the same as the one before, is
/// not tried.
std::vector<SelectiveCandidate> selective_candidates(const nn::ModelInfo& info) {
  std::vector<SelectiveCandidate> out;
  if (info.operators == 0) return out;
  // Each group's operators the model runs, in the model's order; the groups that have any.
  const auto present = [&](const std::vector<std::string>& groups) {
    SelectiveCandidate c;
    std::vector<nn::SelectivePolicy> policies;
    for (const std::string& g : groups) policies.push_back(nn::SelectivePolicy{nn::SelectivePolicy::group(g), {}});
    std::vector<bool> used(groups.size(), false);
    for (const std::string& op : info.operator_names) {
      bool kept = false;
      for (std::size_t i = 0; i < groups.size(); ++i) {
        if (policies[i].saves(op)) kept = used[i] = true;
      }
      if (kept) c.ops.push_back(op);
    }
    for (std::size_t i = 0; i < groups.size(); ++i) {
      if (used[i]) c.groups.push_back(groups[i]);
    }
    return c;
  };
  for (const auto& groups : {std::vector<std::string>{"matmuls", "attention", "convolutions"},
                             std::vector<std::string>{"attention", "convolutions"}}) {
    SelectiveCandidate c = present(groups);
    if (c.ops.empty() || (!out.empty() && out.back().ops == c.ops)) continue;
    out.push_back(std::move(c));
  }
  return out;
}

/// The training configuration of plan `p` of `base`. The given configuration keeps the
/// model's own marks; every other plan checkpoints exactly its modules (none: no marks).
/// A decoder checkpoints through gradient_checkpointing_enable() (which also makes a PEFT
/// model's inputs require grad), its layers' flags then saying which ones run so.
nn::TrainConfig plan_config(const SweepSpec& base, const Plan& p, bool decoder) {
  SweepRow row;
  row.segments = p.segments;
  row.precision = p.precision;
  row.alloc_conf = p.alloc_conf;
  row.batch = p.batch;
  row.parallel = base.parallels.front();
  nn::TrainConfig cfg = train_config(base, row);
  cfg.optimizer = p.optimizer;
  if (p.fused_loss) cfg.model_options.loss = "liger-flce";
  if (p.accumulation > 1) accumulate(cfg, static_cast<std::size_t>(p.accumulation), 2);
  if (p.change == PlanChange::None) return cfg;
  if (p.compile) {
    // The partitioner decides what the compiled step recomputes: no checkpointing beside it.
    cfg.compile = nn::CompileMode{.memory_budget = *p.compile};
    cfg.checkpoint_modules.reset();
    return cfg;
  }
  if (p.segments > 1) {
    cfg.checkpoint_modules.reset();
    return cfg;
  }
  cfg.checkpoint_modules = p.checkpoint_modules.value_or(std::vector<std::string>{});
  if ((!p.selective.empty() || !p.selective_scopes.empty()) && !cfg.checkpoint_modules->empty()) {
    cfg.selective = nn::SelectivePolicy{p.selective, p.selective_scopes};
  }
  if (decoder) cfg.model_options.checkpoint = cfg.checkpoint_modules->empty() ? "none" : "non-reentrant";
  return cfg;
}

class Planner {
 public:
  Planner(const PlanSpec& spec, const PlanProgress& progress, PlanResult& result)
      : spec_(spec), progress_(progress), result_(result) {}

  void search();
  /// When nothing fits (after the ranking): the least hungry attempt and what would fit.
  void advise();

 private:
  /// A plan with the given configuration's settings and no checkpointing.
  Plan plain() const {
    Plan p;
    p.precision = spec_.base.precisions.front();
    p.optimizer = spec_.base.optimizer;
    p.alloc_conf = spec_.base.alloc_confs.front();
    p.batch = result_.model.batch;
    return p;
  }

  nn::TrainConfig config_of(const Plan& p) const { return plan_config(spec_.base, p, by_layer_); }

  /// A decoder whose causal LM loss Liger's fused linear cross entropy can take (a model that
  /// takes the option, not already given it), on one GPU or a data-parallel engine that leaves
  /// lm_head's weight whole.
  bool fused_loss_applies() const {
    const auto& keys = spec_.base.model->option_keys();
    const nn::ParallelConfig& parallel = spec_.base.parallels.front();
    return result_.model.loss == nn::LossKind::CausalLM && !result_.model.fused_linear_loss &&
           std::find(keys.begin(), keys.end(), "loss") != keys.end() &&
           !parallel.shards_parameters();
  }

  Plan measure(Plan p) {
    if (progress_) progress_(result_.dry_runs, p.label());
    ++result_.dry_runs;
    const nn::TrainConfig cfg = config_of(p);
    try {
      p.figures = run_config(cfg, make_run_device(spec_.base), p.oom, p.error);
    } catch (const mem::Error& e) {
      p.refused = e.what();
    }
    p.recompute_share = p.figures.recompute_share;
    p.over_headroom = !p.oom && !p.error && p.refused.empty() && p.figures.peak_device_used > capacity_;
    return p;
  }

  Plan with_modules(Plan p, std::vector<std::string> modules, const char* kind) const {
    p.checkpointing = kind;
    p.checkpoint_modules = std::move(modules);
    if (p.change == PlanChange::None) p.change = PlanChange::Checkpointing;
    return p;
  }

  /// The smallest n in [1, count] whose plan fits, assuming more checkpointing never needs
  /// more memory: the estimate first, then galloping and bisection. nullopt when `count`
  /// does not fit (then `most` holds its run).
  std::optional<Plan> smallest_fitting(std::size_t count, std::size_t guess, const std::function<Plan(std::size_t)>& plan_of,
                                       std::optional<Plan>* most = nullptr) {
    return smallest_run_fitting(
        count, guess, [&](std::size_t n) { return std::optional<Plan>(measure(plan_of(n))); }, most);
  }

  /// smallest_fitting over runs that may be refused (nullopt: not a fit): `run(n)` gives the
  /// plan of size n, measured.
  std::optional<Plan> smallest_run_fitting(std::size_t count, std::size_t guess,
                                           const std::function<std::optional<Plan>(std::size_t)>& run,
                                           std::optional<Plan>* most) {
    if (count == 0) return std::nullopt;
    std::map<std::size_t, std::optional<Plan>> runs;
    const auto fits = [&](std::size_t n) {
      auto it = runs.find(n);
      if (it == runs.end()) it = runs.emplace(n, run(n)).first;
      return it->second && it->second->fits();
    };
    const bool all_fit = fits(count);
    if (most != nullptr) *most = runs.at(count);  // the run of every module, fitting or not
    if (!all_fit) return std::nullopt;
    std::size_t lo = 0, hi = count;  // lo: the family's empty end, which the caller saw fail; hi fits
    guess = std::clamp<std::size_t>(guess, 1, count);
    if (guess < hi) {
      if (fits(guess)) {
        hi = guess;
        for (std::size_t step = 1; hi - lo > 1;) {  // gallop down
          const std::size_t probe = hi > lo + step ? hi - step : lo + 1;
          if (probe <= lo || probe >= hi) break;
          if (fits(probe)) hi = probe;
          else { lo = probe; break; }
          step *= 2;
        }
      } else {
        lo = guess;
        for (std::size_t step = 1; hi - lo > 1;) {  // gallop up
          const std::size_t probe = std::min(hi - 1, lo + step);
          if (probe <= lo) break;
          if (fits(probe)) { hi = probe; break; }
          lo = probe;
          step *= 2;
        }
      }
    }
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (fits(mid)) hi = mid;
      else lo = mid;
    }
    return runs.at(hi);
  }

  /// The module sets under `base`: the cheap model's sequence (checkpoint_sequence), then
  /// the shortest prefix of it that fits on the device.
  std::optional<Plan> search_modules(const Plan& base, std::int64_t deficit, std::optional<Plan>* most) {
    for (const bool exhaustive : {false, true}) {
      const CheckpointSequence sequence = checkpoint_sequence(result_.profile, deficit, exhaustive);
      const auto& order = sequence.modules;
      auto found = smallest_fitting(
          order.size(), sequence.enough,
          [&](std::size_t n) {
            return with_modules(base,
                                std::vector<std::string>(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n)),
                                "modules");
          },
          most);
      if (found) return found;  // else: every module that helps, once more
    }
    return std::nullopt;
  }

  /// c of the N repeated blocks, evenly spaced: the smallest c that fits.
  std::optional<Plan> search_blocks(const Plan& base, std::int64_t deficit, std::optional<Plan>* every) {
    const auto& blocks = result_.profile.blocks;
    const std::size_t n = blocks.size();
    if (n == 0) return std::nullopt;
    std::int64_t per_block = 0;
    for (const ModuleCost& c : result_.profile.modules) {
      if (c.path == blocks.front()) {
        per_block = std::max<std::int64_t>(static_cast<std::int64_t>(c.saved_bytes) - static_cast<std::int64_t>(c.input_bytes), 1);
      }
    }
    const auto plan_of = [&](std::size_t c) {
      std::vector<std::string> paths;
      for (std::size_t j = 0; j < c; ++j) paths.push_back(blocks[(2 * j + 1) * n / (2 * c)]);
      Plan p = with_modules(base, std::move(paths), "blocks");
      p.blocks_of = n;
      return p;
    };
    std::optional<Plan> all;
    auto found = smallest_fitting(n, per_block > 0 ? static_cast<std::size_t>(div_up(deficit, per_block)) : n, plan_of, &all);
    if (every != nullptr) *every = std::move(all);
    return found;
  }

  static std::int64_t div_up(std::int64_t a, std::int64_t b) { return b <= 0 ? 0 : (a + b - 1) / b; }

  /// The innermost module (a recorded call, so it can be checkpointed) holding every block;
  /// "" when only the model itself does.
  std::string blocks_holder() const {
    const auto& blocks = result_.profile.blocks;
    std::string best;
    if (blocks.empty()) return best;
    for (const ModuleCost& m : result_.profile.modules) {
      const bool holds =
          std::all_of(blocks.begin(), blocks.end(), [&](const std::string& b) { return inside(b, m.path); });
      if (holds && m.saved_bytes > 0 && m.path.size() > best.size()) best = m.path;
    }
    return best;
  }

  /// Regions checkpointed keeping operator calls one by one (what sac_ilp decides per
  /// operator, here decided by the allocator): from every region checkpointed keeping nothing
  /// (`every`, measured), the steps of keep_sequence (keep a call, or stop checkpointing a
  /// region), as many as fit. The dry runs decide where the sequence stops; then what the room
  /// left holds of the later calls, by the same estimate. The regions are the repeated blocks
  /// ("blocks") or the one module holding them all ("modules"). Where `every` does not fit,
  /// prefixes around the estimate are probed (fragmentation can fail it and not them); nullopt
  /// when none fits or the model has no operators.
  std::optional<Plan> search_kept_calls(const Plan& base, const std::vector<std::string>& blocks, const char* kind,
                                        const Plan& every) {
    const StepProfile& profile = result_.profile;
    const std::vector<KeepStep> steps = keep_sequence(profile, blocks);
    if (steps.empty()) return std::nullopt;
    const std::size_t count = steps.size(), calls_of = keepable_calls(profile, blocks);
    const auto plan_of_steps = [&](const std::vector<bool>& taken) {
      std::vector<bool> whole(blocks.size(), false);
      std::vector<std::vector<std::string>> kept(blocks.size());
      for (std::size_t i = 0; i < count; ++i) {
        if (!taken[i]) continue;
        if (steps[i].call.empty()) whole[steps[i].block] = true;
        else kept[steps[i].block].push_back(steps[i].call);
      }
      std::vector<std::string> checkpointed;
      Plan p = base;
      for (std::size_t b = 0; b < blocks.size(); ++b) {
        if (whole[b]) continue;
        checkpointed.push_back(blocks[b]);
        p.kept_calls += kept[b].size();
        if (!kept[b].empty()) p.selective_scopes.push_back({blocks[b], std::move(kept[b])});
      }
      p = with_modules(std::move(p), std::move(checkpointed), kind);
      p.blocks_of = blocks.size();
      p.calls_of = calls_of;
      return p;
    };
    // n steps not taken (the sequence's last n): more of them never needs more memory.
    const auto plan_of = [&](std::size_t n) {
      std::vector<bool> taken(count, false);
      std::fill(taken.begin(), taken.begin() + static_cast<std::ptrdiff_t>(count - n), true);
      return plan_of_steps(taken);
    };
    // The estimate: what every block keeping nothing leaves free, filled in the sequence's order.
    const std::int64_t slack = capacity_ - every.figures.peak_device_used;
    std::size_t guess = 0;
    for (std::int64_t used = 0; guess < count; ++guess) {
      used += steps[guess].bytes;
      if (used > slack) break;
    }
    std::size_t fewest_left = count;  // the smallest n that fit: the plan found
    // Each prefix runs once: the probes below and the bisection share the runs, and the far
    // end (nothing kept) is `every`, measured already.
    std::map<std::size_t, Plan> runs{{count, every}};
    const auto run = [&](std::size_t n) {
      auto it = runs.find(n);
      if (it == runs.end()) it = runs.emplace(n, measure(plan_of(n))).first;
      if (it->second.fits()) fewest_left = std::min(fewest_left, n);
      return std::optional<Plan>(it->second);
    };
    // n that fits, the sequence's far end (every region keeping nothing) when that does. When
    // it does not, the allocator's fragmentation can still let a longer prefix fit (a request
    // that finds its room in a different layout): prefixes around the estimate, outwards.
    std::size_t top = count;
    if (!every.fits()) {
      const std::size_t start = count - std::min(guess, count - 1);
      std::optional<std::size_t> fitting;
      for (std::size_t step = 0; !fitting && step <= count; step = step == 0 ? 1 : step * 2) {
        for (const std::size_t n : {start + step, start > step ? start - step : std::size_t{0}}) {
          if (n < 1 || n > count || fitting) continue;
          if (run(n)->fits()) fitting = n;
        }
        if (step >= 64) break;  // a dozen runs: the layout that fails the far end fails around it too
      }
      if (!fitting) return std::nullopt;
      top = *fitting;
    }
    std::optional<Plan> found = smallest_run_fitting(
        top, std::min(top, count - guess),
        run, nullptr);
    if (!found) return found;
    // The sequence stops at the first step that does not fit, though later, smaller calls
    // may. The room: what the device has beyond the plan's allocated peak (its nvidia-smi
    // peak is often the whole device, the cache grown into it); a share of it filled with the
    // later calls in the sequence's order, a half, then a quarter, an eighth where that does
    // not fit (the cache's layout takes its part), three times at most.
    const std::size_t prefix = count - fewest_left;
    std::vector<bool> taken(count, false);
    std::fill(taken.begin(), taken.begin() + static_cast<std::ptrdiff_t>(prefix), true);
    std::vector<bool> released(blocks.size(), false);
    for (std::size_t i = 0; i < prefix; ++i) released[steps[i].block] = released[steps[i].block] || steps[i].call.empty();
    for (int accepted = 0, runs = 0; accepted < 3 && runs < 6; ++accepted) {
      const std::int64_t room = capacity_ - found->figures.peak_allocated;
      bool improved = false;
      for (const int share : {2, 4, 8}) {
        std::int64_t left = room / share;
        std::vector<bool> more = taken;
        bool added = false;
        for (std::size_t i = prefix; i < count; ++i) {
          if (more[i] || steps[i].call.empty() || released[steps[i].block] || steps[i].bytes > left) continue;
          more[i] = added = true;
          left -= steps[i].bytes;
        }
        if (!added) break;
        Plan filled = measure(plan_of_steps(more));
        ++runs;
        if (filled.fits() && filled.recompute_share < found->recompute_share) {
          found = std::move(filled);
          taken = std::move(more);
          improved = true;
          break;
        }
      }
      if (!improved) break;
    }
    return found;
  }

  /// checkpoint_sequential's counts (auto_segments): the fitting one with least recompute.
  std::optional<Plan> search_segments(const Plan& base) {
    std::optional<Plan> best;
    for (const std::size_t s : auto_segments(result_.model.sequence_length)) {
      if (s <= 1) continue;
      result_.segments_tried.push_back(s);
      Plan p = base;
      p.change = PlanChange::Checkpointing;
      p.checkpointing = "segments";
      p.segments = s;
      p = measure(std::move(p));
      if (!p.fits()) continue;
      if (!best || p.recompute_share < best->recompute_share ||
          (p.recompute_share == best->recompute_share && p.figures.peak_device_used < best->figures.peak_device_used)) {
        best = std::move(p);
      }
    }
    return best;
  }

  /// No micro-batch fits alone (a decoder whose activations outgrow the device at any batch):
  /// micro-batches under the checkpointing search, the fewest of them that fit (more
  /// micro-batches never need more memory): the smallest micro-batch first, then bisection.
  /// nullopt when even that does not fit with every module checkpointed (the attempt kept).
  std::optional<Plan> search_accumulation_with_checkpointing(std::size_t count,
                                                             const std::function<Plan(std::size_t)>& micro,
                                                             Plan most_measured) {
    std::optional<Plan> attempt;
    const auto run = [&](std::size_t i) {
      // The most micro-batches ran alone already (smallest_fitting): not again.
      return i == count ? with_change(micro(i), std::move(most_measured)) : with_change(micro(i));
    };
    std::optional<Plan> found = smallest_run_fitting(count, count, run, &attempt);
    if (!found && attempt) keep(std::move(*attempt));  // the attempt, as the other families show theirs
    return found;
  }

  /// torch.compile's step (the file recorded it): PyTorch's default partition, else the
  /// activation_memory_budget of the least recompute that fits. A budget's peak is not monotonic
  /// (at 0 the backward recomputes the whole forward at once), so the budgets are tried in
  /// tenths; the plan kept is the fitting one that recomputes least, else the least hungry attempt.
  void search_compile(const Plan& base) {
    Plan p = base;
    p.change = PlanChange::Compile;
    p.compile = 1.0;
    Plan full = measure(p);
    if (!full.refused.empty()) return;  // not the recorded dtype or size: no compiled plan
    if (full.fits()) {
      keep(std::move(full));
      return;
    }
    std::optional<Plan> best, least = std::move(full);
    for (int tenth = 9; tenth >= 0; --tenth) {
      p.compile = tenth / 10.0;
      Plan m = measure(p);
      if (m.fits() && (!best || m.recompute_share < best->recompute_share)) best = m;
      if (!m.oom && !m.error && m.refused.empty() && m.figures.peak_device_used < least->figures.peak_device_used) {
        least = std::move(m);
      }
    }
    keep(best ? std::move(*best) : std::move(*least));
  }

  /// A configuration change (precision, optimizer, allocator): as it is, then with the
  /// greedy checkpointing when it alone does not fit; the plan found is kept.
  void search_change(Plan base) {
    if (std::optional<Plan> p = with_change(std::move(base))) keep(std::move(*p));
  }

  /// `base` as it is, then with the greedy checkpointing when it alone does not fit: the
  /// plan that fits, else the attempt with the most checkpointing; nullopt when refused.
  std::optional<Plan> with_change(Plan base, std::optional<Plan> measured = std::nullopt) {
    Plan p = measured ? std::move(*measured) : measure(base);
    if (p.fits() || !p.refused.empty() || p.error) {
      if (p.refused.empty()) return p;
      return std::nullopt;
    }
    const RunFigures needs = needs_of(p);
    std::int64_t short_of = shortfall(needs);
    // The profile's bytes are the given precision's and batch's: a deficit in bf16 bytes is
    // worth twice as much of them when the given run is f32, and a micro-batch's activations
    // are a fraction of the batch's. Scaled by the two runs' activations.
    const std::int64_t act = needs.peak_composition.of(MemoryKind::Activations);
    const std::int64_t given_act =
        result_.given_needs ? result_.given_needs->peak_composition.of(MemoryKind::Activations) : 0;
    if (act > 0 && given_act > 0) {
      short_of = static_cast<std::int64_t>(static_cast<double>(short_of) * static_cast<double>(given_act) /
                                           static_cast<double>(act));
    }
    std::optional<Plan> most;
    if (auto found = search_checkpointing(base, short_of, &most)) return found;
    return most;
  }

  /// The checkpointing search of a model: the greedy module sets, or for a decoder (which
  /// transformers checkpoints by layer) the layers.
  std::optional<Plan> search_checkpointing(const Plan& base, std::int64_t deficit, std::optional<Plan>* most) {
    return by_layer_ ? search_blocks(base, deficit, most) : search_modules(base, deficit, most);
  }

  /// What `p` needs: its run on an unlimited twin of the device (one more dry run), up to a
  /// failure; `ran` says whether it ran to the end (else it needs more than any device holds).
  RunFigures needs_of(const Plan& p, bool* ran = nullptr) {
    if (progress_) progress_(result_.dry_runs, p.label() + " (without the limit)");
    ++result_.dry_runs;
    std::optional<OomFailure> oom;
    std::optional<AutogradFailure> error;
    RunFigures needs = run_config(config_of(p), unlimited_twin(result_.device), oom, error);
    if (ran != nullptr) *ran = !oom && !error;
    return needs;
  }

  /// What must be saved for a run of these needs to fit, which the cheap model turns into
  /// modules to checkpoint.
  std::int64_t shortfall(const RunFigures& needs) const {
    return std::max<std::int64_t>(1, needs.peak_device_used - capacity_);
  }

  void keep(Plan p) { result_.plans.push_back(std::move(p)); }

  const PlanSpec& spec_;
  const PlanProgress& progress_;
  PlanResult& result_;
  /// The model checkpoints by layer (a transformers decoder: gradient_checkpointing_enable and
  /// its layers' flags), not by any module.
  bool by_layer_ = false;
  std::int64_t capacity_ = 0;
};

void Planner::search() {
  const nn::ModelInfo& info = result_.model;
  by_layer_ = info.checkpoints_by_layer;
  capacity_ = static_cast<std::int64_t>(result_.device.total_bytes) - static_cast<std::int64_t>(spec_.headroom);
  result_.given = measure(plain());
  if (!result_.given.refused.empty()) throw UsageError(result_.given.refused);
  if (result_.given.fits()) return;  // nothing to plan: fits as given
  ++result_.dry_runs;
  try {
    result_.profile = profile_step(config_of(plain()));
  } catch (const OutOfMemoryError&) {
    return;  // more than any device holds (a batch of millions): nothing to search, see advise()
  } catch (const RequestTooLargeError&) {
    return;
  }
  result_.given_needs = needs_of(result_.given);
  const std::int64_t short_of = shortfall(*result_.given_needs);
  const Plan base = plain();
  const bool no_segments = spec_.base.parallels.front().hooks_modules();  // FSDP2 or ZeRO-3

  // Checkpointing alone, the arithmetic untouched: the module sets, c of the blocks evenly
  // spaced, and every block (what gradient_checkpointing_enable() does) for comparison.
  std::optional<Plan> most;
  if (!by_layer_) {
    if (auto found = search_modules(base, short_of, &most)) keep(std::move(*found));
    else if (most) keep(*most);
  }
  std::optional<Plan> every;  // every block checkpointed
  {
    if (auto found = search_blocks(base, short_of, &every)) keep(std::move(*found));
    if (every && (by_layer_ || every->fits())) keep(*every);
  }
  if (info.sequential_checkpointing && info.checkpointed_modules == 0 && !no_segments) {
    if (auto found = search_segments(base)) keep(std::move(*found));
  }
  // Operator by operator (an operator-level model): more modules checkpointed, each keeping
  // its costly operators' outputs, recompute only the cheap ones.
  const std::vector<SelectiveCandidate> policies = spec_.search.selective ? selective_candidates(info)
                                                                          : std::vector<SelectiveCandidate>{};
  for (const SelectiveCandidate& c : policies) {
    Plan selective = base;
    selective.selective = c.ops;
    selective.selective_groups = c.groups;
    if (auto found = search_modules(selective, short_of, nullptr)) keep(std::move(*found));
    if (auto found = search_blocks(selective, short_of, nullptr)) keep(std::move(*found));
  }
  if (spec_.search.selective && every && !result_.profile.op_calls.empty()) {
    if (auto found = search_kept_calls(base, result_.profile.blocks, "blocks", *every)) keep(std::move(*found));
    // One region holding every block (a decoder's body, a ViT's encoder): its rerun at the
    // backward's start holds what the blocks keep, but the loss's peak does not.
    if (const std::string holder = blocks_holder(); !holder.empty()) {
      const Plan whole = measure(with_modules(base, {holder}, "modules"));
      if (auto found = search_kept_calls(base, {holder}, "modules", whole)) keep(std::move(*found));
    }
  }
  if (spec_.search.compile && info.compiled && !spec_.base.parallels.front().enabled()) search_compile(base);
  const bool fits_without_change = std::any_of(result_.plans.begin(), result_.plans.end(), [](const Plan& p) {
    return p.fits() && p.recompute_share == 0;
  });
  if (spec_.search.allocator && !fits_without_change) {
    // PyTorch's two settings against fragmentation (its OOM message names both): segments
    // that grow in place, and large blocks never split.
    for (const char* setting : {"expandable_segments:True", "max_split_size_mb:128"}) {
      const std::string key(setting, std::string_view(setting).find(':'));
      if (base.alloc_conf.find(key) != std::string::npos) continue;
      Plan p = base;
      p.change = PlanChange::Allocator;
      p.alloc_conf = base.alloc_conf.empty() ? setting : base.alloc_conf + "," + setting;
      search_change(std::move(p));
    }
  }
  if (spec_.search.loss && fused_loss_applies()) {
    // The causal LM loss without its logits: Liger's fused linear cross entropy, alone and with
    // checkpointing (what the decoder's loss holds at its peak is often the largest block).
    Plan p = base;
    p.change = PlanChange::Loss;
    p.fused_loss = true;
    search_change(std::move(p));
  }
  if (spec_.search.accumulation && info.batch > 1 && !spec_.base.parallels.front().enabled()) {
    constexpr std::int64_t kMaxMicroBatches = 256;
    std::vector<std::int64_t> steps;  // k: the batch splits into k micro-batches
    std::vector<std::int64_t> large;
    for (std::int64_t k = 2; k * k <= info.batch; ++k) {
      if (info.batch % k != 0) continue;
      steps.push_back(k);
      if (k * k != info.batch) large.push_back(info.batch / k);
    }
    steps.insert(steps.end(), large.rbegin(), large.rend());
    steps.push_back(info.batch);
    // A dry run of k micro-batches runs k + 2 steps: beyond kMaxMicroBatches the search would
    // cost minutes (the largest batch of resnet50 at 32 px on 80 GB, 118,688, tried k up to it).
    std::erase_if(steps, [](std::int64_t k) { return k > kMaxMicroBatches; });
    const auto micro = [&](std::size_t i) {  // the i-th split (1-based)
      Plan p = base;
      p.change = PlanChange::Accumulation;
      p.accumulation = steps[i - 1];
      p.batch = info.batch / p.accumulation;
      return p;
    };
    std::optional<Plan> most;  // the run of the most micro-batches
    auto found = steps.empty() ? std::nullopt : smallest_fitting(steps.size(), 1, micro, &most);
    if (!found && most) found = search_accumulation_with_checkpointing(steps.size(), micro, std::move(*most));
    if (found) keep(std::move(*found));
  }
  if (spec_.search.precision) {
    std::vector<nn::Precision> alternatives;
    switch (base.precision) {
      case nn::Precision::F32: alternatives = {nn::Precision::AmpBF16, nn::Precision::BF16}; break;
      case nn::Precision::Amp:
      case nn::Precision::AmpBF16: alternatives = {nn::Precision::BF16}; break;
      default: break;
    }
    for (const nn::Precision precision : alternatives) {
      Plan p = base;
      p.change = PlanChange::Precision;
      p.precision = precision;
      p.precision_changed = true;
      search_change(std::move(p));
    }
  }
  if (spec_.search.optimizer && !spec_.base.parallels.front().enabled()) {
    std::vector<std::string> alternatives;
    if (base.optimizer.kind == nn::OptimizerKind::Adam) alternatives = {"adam8bit", "sgd-momentum", "sgd"};
    else if (base.optimizer.kind == nn::OptimizerKind::Adam8bit) alternatives = {"sgd-momentum", "sgd"};
    else if (base.optimizer.kind == nn::OptimizerKind::SGD && base.optimizer.momentum != 0) alternatives = {"sgd"};
    for (const std::string& name : alternatives) {
      Plan p = base;
      p.change = PlanChange::Optimizer;
      p.optimizer = nn::parse_optimizer_config(name);
      p.optimizer.lr = base.optimizer.lr;
      search_change(std::move(p));
    }
  }
  // Nothing fits one change at a time: the fewest bytes per parameter together.
  const bool any_fits = std::any_of(result_.plans.begin(), result_.plans.end(), [](const Plan& p) { return p.fits(); });
  if (!any_fits && spec_.search.precision && spec_.search.optimizer && !spec_.base.parallels.front().enabled() &&
      base.precision != nn::Precision::BF16 && base.precision != nn::Precision::F16) {
    for (const char* name : {"adam8bit", "sgd"}) {
      Plan p = base;
      p.change = PlanChange::Optimizer;
      p.precision = nn::Precision::BF16;
      p.precision_changed = true;
      p.optimizer = nn::parse_optimizer_config(name);
      p.optimizer.lr = base.optimizer.lr;
      search_change(std::move(p));
    }
  }
}

/// Nothing fits: each attempt (a family's most checkpointed plan, or the given one) run
/// without the device's limit says what it needs; the least hungry is the nearest thing to
/// fitting, and the smallest preset and the largest batch are about it.
void Planner::advise() {
  std::vector<const Plan*> attempts;
  for (const Plan& p : result_.plans) {
    if (p.refused.empty() && !p.error) attempts.push_back(&p);
  }
  if (attempts.empty()) attempts.push_back(&result_.given);
  const Plan* least = nullptr;
  for (const Plan* p : attempts) {
    bool ran = false;
    const RunFigures needs = needs_of(*p, &ran);
    if (!ran) continue;  // more than any device holds
    if (!result_.least_hungry_needs || needs.peak_device_used < result_.least_hungry_needs->peak_device_used) {
      result_.least_hungry_needs = needs;
      least = p;
    }
  }
  if (least == nullptr) least = attempts.front();
  result_.least_hungry = *least;
  if (result_.least_hungry_needs) {
    const std::size_t need = static_cast<std::size_t>(result_.least_hungry_needs->peak_device_used) + spec_.headroom;
    std::uint64_t smallest = 0;
    for (const std::string& name : sim_preset_names()) {
      const SimDeviceConfig c = sim_preset(name);
      if (c.capacity >= need && (smallest == 0 || c.capacity < smallest)) {
        smallest = c.capacity;
        result_.smallest_device = "sim:" + name;
      }
    }
  }
  // The largest batch of that plan, when the batch is what tips it.
  const nn::TrainConfig cfg = config_of(*least);
  SweepSpec spec = spec_.base;
  spec.optimizer = cfg.optimizer;
  spec.model_options = cfg.model_options;
  spec.checkpoint_modules = cfg.checkpoint_modules;
  SweepRow row;
  row.segments = least->segments;
  row.precision = least->precision;
  row.alloc_conf = least->alloc_conf;
  row.parallel = spec_.base.parallels.front();
  spec.headroom = spec_.headroom;  // the batch leaves the headroom free
  const MaxBatchRow m = find_max_batch(spec, row);
  result_.dry_runs += m.probes;
  result_.max_batch = m.max_batch;
}

/// Fits first, then the least change, the least recompute, the least memory.
bool ranks_before(const Plan& a, const Plan& b) {
  if (a.fits() != b.fits()) return a.fits();
  if (a.rank_tier() != b.rank_tier()) return a.rank_tier() < b.rank_tier();
  if (a.recompute_share != b.recompute_share) return a.recompute_share < b.recompute_share;
  // Among equals, the plan that changes one thing less.
  const bool a_alloc = a.change == PlanChange::Allocator, b_alloc = b.change == PlanChange::Allocator;
  if (a_alloc != b_alloc) return b_alloc;
  return a.figures.peak_device_used < b.figures.peak_device_used;
}

}  // namespace

PlanResult run_plan(const PlanSpec& spec_in, const PlanProgress& progress) {
  const auto start = std::chrono::steady_clock::now();
  PlanResult result;
  result.spec = spec_in;
  SweepSpec& base = result.spec.base;
  if (base.precisions.size() != 1) throw UsageError("plan: give one --dtype (the plan tries the others itself)");
  if (base.alloc_confs.size() != 1) throw UsageError("plan: give one --alloc-conf (the plan tries expandable_segments and max_split_size_mb itself)");
  if (base.parallels.size() != 1) throw UsageError("plan: give one --parallel configuration");
  if (!base.batches.empty() || !base.seqs.empty()) throw UsageError("plan: give one --batch and one --seq");
  if (base.mode != nn::ExecMode::DryRun) throw UsageError("plan: runs dry runs only");
  base.segments = {0};
  result.model = validate_sweep(base);
  result.device = make_run_device(base)->info();
  if (result.spec.headroom >= result.device.total_bytes - result.device.context_bytes) {
    throw UsageError(fmt::format("--headroom: {} leaves nothing of the {} {} has after its CUDA context",
                                 format_bytes(result.spec.headroom),
                                 format_bytes(result.device.total_bytes - result.device.context_bytes), result.device.name));
  }

  // The weights alone, in the smallest precision the search may take and sharded as the
  // engine shards them, outgrow the device: no plan can fit, and none is searched (a search
  // walks the model, however large).
  const nn::ParallelConfig& parallel = base.parallels.front();
  const bool sharded = parallel.shards_parameters();
  const nn::DType smallest = result.spec.search.precision ? nn::DType::BF16 : nn::parameter_dtype(base.precisions.front());
  const std::size_t weights =
      result.model.parameter_bytes(smallest) / (sharded ? std::max<std::size_t>(parallel.gpus(), 1) : 1);
  if (weights > result.device.total_bytes) {
    throw RunFailed(fmt::format(
        "no plan fits: the weights alone are {} in {}{}, more than the {} of {} (then gradients and optimizer "
        "state); a smaller model, or more GPUs to shard it over (--parallel fsdp:N)",
        format_bytes(weights), nn::dtype_name(smallest), sharded ? " on each rank" : "",
        format_bytes(result.device.total_bytes), result.device.name));
  }

  Planner planner{result.spec, progress, result};
  planner.search();
  std::stable_sort(result.plans.begin(), result.plans.end(), ranks_before);
  // One row per distinct plan (a family may find what another did: one evenly spaced block is
  // a module set too).
  const auto key = [](const Plan& p) {
    std::vector<std::string> modules = p.checkpoint_modules.value_or(std::vector<std::string>{});
    std::sort(modules.begin(), modules.end());
    std::string k = fmt::format("{}|{}|{}|{}|{}|{}|{}|", p.segments, nn::precision_name(p.precision),
                                nn::optimizer_label(p.optimizer), p.alloc_conf, p.batch, p.accumulation,
                                fmt::join(p.selective, ","));
    k += nn::SelectivePolicy{{}, p.selective_scopes}.str() + "|";
    for (const std::string& m : modules) k += m + ",";
    return k;
  };
  std::vector<Plan> unique;
  for (Plan& p : result.plans) {
    const bool seen = std::any_of(unique.begin(), unique.end(), [&](const Plan& q) { return key(q) == key(p); });
    if (!seen) unique.push_back(std::move(p));
  }
  result.plans = std::move(unique);
  // Once something fits, the table holds what is worth choosing: of each kind of change (the
  // checkpointing alone, an allocator setting, accumulation, each precision, each optimizer),
  // the plans that fit and that no other of the kind beats on recompute and nvidia-smi's peak
  // at once.
  if (std::any_of(result.plans.begin(), result.plans.end(), [](const Plan& p) { return p.fits(); })) {
    const auto kind = [](const Plan& p) {
      return fmt::format("{}|{}|{}", plan_change_name(p.change), p.precision_changed ? nn::precision_name(p.precision) : "",
                         p.change == PlanChange::Optimizer ? nn::optimizer_label(p.optimizer) : "");
    };
    const auto dominates = [&](const Plan& q, const Plan& p) {
      if (kind(q) != kind(p)) return false;
      const bool no_worse = q.recompute_share <= p.recompute_share && q.figures.peak_device_used <= p.figures.peak_device_used;
      const bool better = q.recompute_share < p.recompute_share || q.figures.peak_device_used < p.figures.peak_device_used;
      return no_worse && better;
    };
    // Of two plans of a kind with the same figures, the first in rank stays.
    const auto same = [&](const Plan& q, const Plan& p) {
      return kind(q) == kind(p) && q.recompute_share == p.recompute_share &&
             q.figures.peak_device_used == p.figures.peak_device_used;
    };
    std::vector<Plan> kept;
    for (std::size_t i = 0; i < result.plans.size(); ++i) {
      const Plan& p = result.plans[i];
      if (!p.fits()) continue;
      bool beaten = false;
      for (std::size_t j = 0; j < result.plans.size() && !beaten; ++j) {
        const Plan& q = result.plans[j];
        beaten = q.fits() && (dominates(q, p) || (j < i && same(q, p)));
      }
      if (!beaten) kept.push_back(p);
    }
    result.plans = std::move(kept);
  }

  if (result.best() == nullptr) planner.advise();
  result.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mem::planner
