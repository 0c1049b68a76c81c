// sweep_report.cpp — the sweep's table, footnotes and reading notes.
#include "sweep_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>
#include <vector>

#include "vramscope/runtime/compiled.hpp"
#include "vramscope/planner/accepted_segments.hpp"
#include "model_args.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::tools {

namespace {

constexpr const char* kNone = "—";

std::string segments_cell(std::size_t k) { return k <= 1 ? fmt::format("{} (none)", k) : std::to_string(k); }

template <class Failure>
std::string where(const Failure& failure) {
  std::string out = failure.step == 0 ? std::string("while allocating the parameters")
                                      : fmt::format("in step {}", failure.step);
  if (failure.phase != Phase::None || !failure.module.empty()) {
    out += fmt::format(", {}", phase_name(failure.phase));
    if (!failure.module.empty()) out += fmt::format(" of module {}", failure.module);
  }
  return out;
}

}  // namespace

std::string describe_peak_moment(const MemoryComposition& c) {
  const ContextInfo& where = context_info(c.context);
  if (c.context == kNoContext || where.path.empty()) return "";
  const char* phase = where.phase == Phase::Forward     ? "the forward"
                      : where.phase == Phase::Backward  ? "the backward"
                      : where.phase == Phase::Recompute ? "a recomputed forward"
                      : where.phase == Phase::Optimizer ? "the optimizer step"
                                                        : "the model's construction";
  return fmt::format(" in {} ({})", phase, where.path);
}

std::string describe_composition(const MemoryComposition& c) {
  std::string out;
  for (std::size_t k = 0; k < kNumMemoryKinds; ++k) {
    if (c.bytes[k] == 0) continue;
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", memory_kind_name(static_cast<MemoryKind>(k)),
                       human_bytes(c.bytes[k]));
  }
  return out;
}

std::string model_title(const nn::ModelInfo& info, const nn::ModelOptions& options,
                        const std::vector<std::int64_t>& batches, const std::vector<std::int64_t>& seqs,
                        const std::vector<std::string>& checkpoints) {
  nn::ModelOptions shown = options;
  if (!batches.empty()) shown.batch = 0;  // the lists are written below
  if (!seqs.empty()) shown.seq = 0;
  if (checkpoints.size() > 1) shown.checkpoint = fmt::format("{}", fmt::join(checkpoints, "/"));
  std::string sizes = shown.to_string();
  for (char& ch : sizes) {
    if (ch == ',') ch = ' ';
  }
  std::string out = info.name;
  if (!sizes.empty()) out += " " + sizes;
  if (!batches.empty()) {
    out += fmt::format(" batch={}", fmt::join(batches, ","));
  } else if (sizes.find("batch=") == std::string::npos) {
    out += fmt::format(" batch={}", info.batch);
  }
  if (!seqs.empty()) out += fmt::format(" seq={}", fmt::join(seqs, ","));
  return out;
}

namespace {

/// When no row of a dtype fits: what the step's peak was made of without the capacity limit
/// (its most checkpointed row's), and so what can act. Weights, gradients and optimizer state
/// alone beyond the device: no checkpointing or batch can fit it. Else the activations are
/// what to cut.
std::string out_of_memory_advice(const planner::SweepResult& result) {
  std::string out;
  const auto capacity = static_cast<std::int64_t>(result.device.total_bytes - result.device.context_bytes);
  for (const nn::Precision precision : result.spec.precisions) {
    const planner::SweepRow* least = nullptr;  // the OOM row that needed the least
    bool any_fits = false, all_known = true;
    for (const planner::SweepRow& row : result.rows) {
      if (row.precision != precision) continue;
      any_fits = any_fits || row.fits();
      if (!row.oom) continue;
      if (!row.unlimited || row.unlimited->peak_composition.total() == 0) {
        all_known = false;
        continue;
      }
      if (least == nullptr || row.unlimited->peak_allocated < least->unlimited->peak_allocated) least = &row;
    }
    if (any_fits || least == nullptr || !all_known) continue;
    const MemoryComposition& c = least->unlimited->peak_composition;
    const std::int64_t optimizer = c.of(MemoryKind::OptimizerState) + c.of(MemoryKind::OptimizerTemporaries);
    const std::int64_t states = c.model_states();
    const std::string name(nn::precision_name(precision));
    if (states >= capacity) {
      out += wrap(fmt::format(
                      "No {} row can fit, whatever the segments or the batch: at the peak the weights ({}), "
                      "gradients ({}) and the optimizer's state and temporaries ({}) alone hold {} of the {} the "
                      "device has after its CUDA context; the activations are {}. What can act: fewer bytes per "
                      "parameter ({}--optimizer sgd or adam8bit for Adam's state, LoRA for a transformer), several "
                      "GPUs (--parallel fsdp:N or zero2:N), or a device with at least {} in nvidia-smi's view.",
                      name, human_bytes(c.of(MemoryKind::Weights)), human_bytes(c.of(MemoryKind::Gradients)),
                      human_bytes(optimizer), human_bytes(states), human_bytes(capacity),
                      human_bytes(c.of(MemoryKind::Activations)),
                      precision == nn::Precision::F32 ? "--dtype bf16 weights, " : "",
                      human_bytes(least->unlimited->peak_device_used)),
                  "  ", "  ");
    } else {
      out += wrap(fmt::format(
                      "No {} row fits: at the least hungry row's peak ({}, {}) the activations hold {} and the "
                      "weights, gradients and optimizer state {}; the activations are what to cut: more "
                      "--segments, a smaller --batch, or bf16.",
                      name, least->label(), human_bytes(least->unlimited->peak_allocated),
                      human_bytes(c.of(MemoryKind::Activations)), human_bytes(states)),
                  "  ", "  ");
    }
  }
  return out;
}

}  // namespace

std::string wrap(const std::string& text, const std::string& first, const std::string& rest,
                 std::size_t width) {
  std::string out, line = first;
  std::size_t pos = 0;
  bool line_empty = true;
  while (pos < text.size()) {
    std::size_t end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(pos, end - pos);
    if (!line_empty && display_width(line) + 1 + display_width(word) > width) {
      out += line + "\n";
      line = rest;
      line_empty = true;
    }
    if (!line_empty) line += ' ';
    line += word;
    line_empty = false;
    pos = end + 1;
  }
  return out + line + "\n";
}

std::string describe_oom(const planner::SweepRow& row) {
  if (!row.oom) return {};
  const planner::OomFailure& o = *row.oom;
  const auto& f = o.figures;
  std::string out = fmt::format(
      "{}: out of memory {} asking for {}, with {} allocated, {} reserved, {} in use as nvidia-smi "
      "shows it of {} ({} free)",
      row.label(), where(o), format_bytes(f.requested), format_bytes(f.allocated),
      format_bytes(f.reserved), format_bytes(f.process_used), format_bytes(f.device_total),
      format_bytes(f.device_free));
  if (f.allowed != 0) out += fmt::format(", memory fraction allows {}", format_bytes(f.allowed));
  if (f.requested > f.device_total) out += "; that one tensor is larger than the whole device (lower --batch or --seq)";
  if (row.unlimited) {
    out += fmt::format(". Without the capacity limit it needs {} max allocated, {} in nvidia-smi's view",
                       human_bytes(row.unlimited->peak_allocated),
                       human_bytes(row.unlimited->peak_device_used));
  }
  if (row.weights_alone > 0 && !row.unlimited && row.parallel.shards_parameters()) {
    out += fmt::format(". Each GPU's share of the weights alone is at least {} in {}, more than the whole device: "
                       "more GPUs, or a smaller model",
                       human_bytes(row.weights_alone), nn::precision_name(row.precision));
  } else if (row.weights_alone > 0 && !row.unlimited) {
    out += fmt::format(". The weights alone are {} in {}, more than the whole device (then gradients and "
                       "optimizer state): a smaller model, or sharding it over GPUs (--parallel fsdp:N)",
                       human_bytes(row.weights_alone), nn::precision_name(row.precision));
  }
  out += ".";
  if (row.error) {
    out += fmt::format(" Without the capacity limit PyTorch refuses it anyway, {}: {}", where(*row.error),
                       row.error->message);
  }
  return out;
}

std::string describe_place(const planner::AutogradFailure& failure) { return where(failure); }

std::string describe_error(const planner::SweepRow& row) {
  if (!row.error) return {};
  const planner::AutogradFailure& e = *row.error;
  return fmt::format("{}: fails as on PyTorch, {}: {}", row.label(), where(e), e.message);
}

std::string describe_failure(const planner::SweepRow& row) {
  if (row.oom) return describe_oom(row);
  return describe_error(row);
}

Table sweep_table(const planner::SweepResult& result, const ReportOptions& options) {
  const bool show_conf = result.spec.alloc_confs.size() > 1 ||
                         (result.spec.alloc_confs.size() == 1 && !result.spec.alloc_confs[0].empty());
  const bool show_batch = result.spec.batches.size() > 1;
  const bool show_seq = result.spec.seqs.size() > 1;
  const bool show_parallel = result.spec.parallels.size() > 1;
  const bool show_checkpoint = result.spec.checkpoints.size() > 1;
  const bool show_compile = !result.spec.compiles.empty();
  std::vector<Column> cols{{"dtype", Align::Left}};
  if (show_batch) cols.push_back({"batch", Align::Right});
  if (show_seq) cols.push_back({"seq", Align::Right});
  if (show_parallel) cols.push_back({"parallel", Align::Left});
  if (show_checkpoint) cols.push_back({"checkpointing", Align::Left});
  if (show_compile) cols.push_back({"step", Align::Left});
  cols.push_back({"segments", Align::Right});
  if (show_conf) cols.push_back({"alloc conf", Align::Left});
  for (const char* h : {"after step", "max alloc", "max reserved", "max nvidia-smi",
                        "unalloc@peak", "saving", "recompute"}) {
    cols.push_back({h, Align::Right});
  }
  if (options.show_time) cols.push_back({"time/step", Align::Right});
  cols.push_back({"fits", Align::Left});
  Table table{cols};

  std::size_t footnote = 0;
  std::string previous_group;
  for (const planner::SweepRow& row : result.rows) {
    const std::string group = fmt::format("{}|{}|{}|{}|{}|{}|{}", nn::precision_name(row.precision), row.batch,
                                          row.seq, row.alloc_conf, nn::parallel_label(row.parallel), row.checkpoint,
                                          planner::compile_label(row.compile));
    if (!previous_group.empty() && group != previous_group) table.add_separator();
    previous_group = group;

    std::vector<std::string> cells{std::string(nn::precision_name(row.precision))};
    if (show_batch) cells.push_back(std::to_string(row.batch));
    if (show_seq) cells.push_back(std::to_string(row.seq));
    if (show_parallel) cells.push_back(row.parallel.enabled() ? nn::parallel_label(row.parallel) : "1 GPU");
    if (show_checkpoint) cells.push_back(row.checkpoint);
    if (show_compile) cells.push_back(planner::compile_label(row.compile));
    const auto& modules = result.spec.checkpoint_modules;
    std::string checkpointed = modules && !modules->empty()
                                   ? fmt::format("{} module{}", modules->size(), modules->size() == 1 ? "" : "s")
                                   : segments_cell(row.segments);
    if (result.spec.selective && row.segments <= 1 && !row.unmarked) checkpointed += ", selective";
    cells.push_back(checkpointed);
    if (show_conf) cells.push_back(row.alloc_conf.empty() ? "default" : row.alloc_conf);
    const planner::RunFigures& f = row.figures;
    if (row.fits()) {
      cells.push_back(human_bytes(f.allocated_end));
      cells.push_back(human_bytes(f.peak_allocated));
      cells.push_back(human_bytes(f.peak_reserved));
      cells.push_back(human_bytes(f.peak_device_used));
      cells.push_back(human_bytes(f.unallocated_at_peak));
      cells.push_back(row.saving ? human_saving(*row.saving, row.saving_fraction) : kNone);
      cells.push_back(human_share(f.recompute_share));
      if (options.show_time) cells.push_back(human_ms(f.step_ms));
      std::string fits = "yes";
      if (f.gradients_missing) fits += " (grads missing!)";
      if (row.best) fits += " *";
      cells.push_back(fits);
    } else if (!row.oom) {
      // Autograd refused it (PyTorch does too): no memory figure means anything.
      for (int i = 0; i < 7; ++i) cells.push_back(kNone);
      if (options.show_time) cells.push_back(kNone);
      cells.push_back(fmt::format("error [{}]", ++footnote));
    } else {
      // The allocator's figures at the failure, as in PyTorch's OOM message.
      const auto& o = row.oom->figures;
      cells.push_back(kNone);
      cells.push_back(format_bytes(o.allocated));
      cells.push_back(format_bytes(o.reserved));
      cells.push_back(format_bytes(o.process_used));
      cells.push_back(format_bytes(o.reserved - std::min(o.reserved, o.allocated)));
      cells.push_back(kNone);
      cells.push_back(kNone);
      if (options.show_time) cells.push_back(kNone);
      cells.push_back(fmt::format("OOM [{}]", ++footnote));
    }
    table.add_row(std::move(cells));
  }
  return table;
}

std::string sweep_report(const planner::SweepResult& result, const ReportOptions& options) {
  const nn::ModelInfo& m = result.model;
  const planner::SweepSpec& spec = result.spec;
  std::string out;
  out += fmt::format("vramscope sweep: {}, {}{}, {} parameters{} ({} in f32)\n",
                     model_title(m, spec.model_options, spec.batches, spec.seqs, spec.checkpoints),
                     m.operators > 0 ? fmt::format("{} operators in {} module calls (recorded with {})", m.operators,
                                                   m.module_calls, m.recorded_with)
                                     : fmt::format("{} sequential modules", m.sequence_length),
                     m.checkpointed_modules > 0 && spec.checkpoints.empty()
                         ? fmt::format(" ({} checkpointed {})", m.checkpointed_modules,
                                       m.sequential_checkpointing ? "by the file's marks"
                                       : m.operators > 0          ? "by its recorded forward"
                                                                  : "per decoder layer")
                         : std::string(),
                     human_count(m.parameters),
                     m.expert_parallel > 1
                         ? fmt::format(" on each GPU (a recording of one GPU under expert parallel over {}: 1/{} of "
                                       "the experts)", m.expert_parallel, m.expert_parallel)
                         : std::string(),
                     format_bytes(m.parameter_bytes(nn::DType::F32)));
  const std::string steps =
      spec.accumulation > 1
          ? fmt::format("{} micro-batches per optimizer step (gradient accumulation), then {} more", spec.accumulation,
                        spec.steps)
          : fmt::format("{} step{} per configuration{}", spec.steps, spec.steps == 1 ? "" : "s",
                        spec.steps < nn::kCudaGraphSteps && planner::any_cudagraphs(spec.compiles)
                            ? fmt::format(" ({} with CUDA graphs: warmup, recording, replay)", nn::kCudaGraphSteps)
                            : std::string());
  out += fmt::format("on {} ({} total){}, optimizer {}, {}, {}\n\n",
                     result.device.name, format_bytes(result.device.total_bytes), per_gpu(spec.parallels),
                     nn::optimizer_label(spec.optimizer), steps,
                     spec.mode == nn::ExecMode::DryRun
                         ? "dry run (every allocation and free of the step, no arithmetic)"
                         : "compute (real arithmetic on the CPU)");
  out += sweep_table(result, options).render("  ");

  std::size_t footnote = 0;
  bool any_best = false;
  bool any_oom_needs = false;
  bool any_error = false;
  for (const planner::SweepRow& row : result.rows) {
    any_best = any_best || row.best;
    if (row.fits()) continue;
    any_oom_needs = any_oom_needs || row.unlimited.has_value();
    any_error = any_error || row.error.has_value();
    out += wrap(fmt::format("[{}] {}", ++footnote, describe_failure(row)), "  ", "      ");
  }
  if (std::any_of(result.rows.begin(), result.rows.end(),
                  [](const planner::SweepRow& r) { return r.fits() && r.figures.gradients_missing; })) {
    // What "(grads missing!)" means, under the table as the other marks are.
    out += wrap("(grads missing!) reentrant checkpointing whose input needs no grad: the first segment's "
                "parameters got no gradient (PyTorch warns \"None of the inputs have requires_grad=True. "
                "Gradients will be None\"), so its lower memory is missing work, not a saving; give "
                "--input-requires-grad (x.requires_grad_()) or --checkpoint non-reentrant.",
                "  ", "  ");
  }
  out += out_of_memory_advice(result);
  for (const planner::SweepRow& row : result.baselines) {
    const std::string what = std::string(nn::precision_name(row.precision)) +
                             (row.shape.empty() ? "" : " " + row.shape);
    if (row.fits()) {
      out += fmt::format("  saving is against {} without checkpointing (not in the list): {} max allocated\n",
                         what, human_bytes(row.figures.peak_allocated));
    } else if (row.unlimited) {
      out += fmt::format("  saving is against {} without checkpointing (not in the list; OOM here, "
                         "needs {} max allocated)\n",
                         what, human_bytes(row.unlimited->peak_allocated));
    }
  }
  // What the runs warned of (a checkpointed BatchNorm's statistics), once each.
  std::vector<std::string> notes;
  for (const planner::SweepRow& row : result.rows) {
    for (const std::string& w : row.figures.warnings) {
      if (std::find(notes.begin(), notes.end(), w) == notes.end()) notes.push_back(w);
    }
  }
  for (const std::string& w : notes) out += wrap("note: " + w + ".", "  ", "    ");
  if (result.accepted_segments) {
    out += wrap(fmt::format("Segment counts PyTorch accepts for {}: {}.", m.name,
                            planner::describe_segment_counts(*result.accepted_segments)),
                "  ", "  ");
  }
  if (any_best) {
    const bool shapes = spec.batches.size() > 1 || spec.seqs.size() > 1, parallels = spec.parallels.size() > 1,
               modes = spec.checkpoints.size() > 1;
    std::vector<std::string> by{"dtype"};
    if (shapes) by.push_back("shape");
    if (parallels) by.push_back("GPUs");
    if (modes) by.push_back("checkpointing");
    std::string group = by.front();
    for (std::size_t i = 1; i < by.size(); ++i) group += (i + 1 == by.size() ? " and " : ", ") + by[i];
    out += fmt::format("  * least memory in nvidia-smi's view among the configurations of its {} that fit; among "
                       "equals, the least recomputation\n",
                       group);
    for (const planner::SweepRow& row : result.rows) {
      if (row.best && row.figures.peak_composition.total() > 0) {
        out += wrap(fmt::format("* {} peaks at {}{}: {}.", row.label(), human_bytes(row.figures.peak_allocated),
                                describe_peak_moment(row.figures.peak_composition),
                                describe_composition(row.figures.peak_composition)),
                    "  ", "    ");
      }
    }
  }

  if (m.compiled && !spec.compiles.empty()) {
    // What the compiled rows assume: the partition is PyTorch's decision, the buffers a model of inductor's.
    out += wrap(fmt::format("torch.compile's step: the joint graph recorded with torch {} on {} tensors (batch {}{}); "
                            "vramscope chooses the saved values as AOTAutograd's min-cut partitioner does, under "
                            "each activation_memory_budget. Inductor's buffers as modelled: a value is a buffer when "
                            "a reader cannot fuse it (matrix products, attention, convolutions), when it is a "
                            "reduction's or leaves its graph; fused pointwise values never exist; each buffer is "
                            "freed after its last reader (docs/OPERATORS.md, \"Compiled steps\").",
                            m.compiled->graph.torch, m.compiled->graph.traced_on, m.compiled->batch,
                            m.compiled->seq > 0 ? fmt::format(", sequence {}", m.compiled->seq) : std::string()),
                "  ", "  ");
    if (planner::any_cudagraphs(spec.compiles)) {
      out += wrap(fmt::format("CUDA graphs (mode=\"reduce-overhead\", inductor's CUDA graph trees): both graphs "
                              "take their blocks from one private pool on a side stream, which no other allocation "
                              "shares and empty_cache keeps; their rows run {} steps (warmup, recording with the cache "
                              "emptied first, then replay), the batch and the loss's gradient copied into the pool "
                              "from the recording on, the saved values and gradients living there, cuBLAS's "
                              "workspaces cleared around each warmup and recording. The graphs' own device memory "
                              "(cudaGraphInstantiate) is outside the allocator and not counted.",
                              std::max(spec.steps, nn::kCudaGraphSteps)),
                  "  ", "  ");
    }
    for (const planner::SweepRow& row : result.rows) {
      if (const auto& c = row.figures.compiled) {
        out += wrap(fmt::format("{}: the partitioner keeps {} values, {} of them activations, and the backward "
                                "recomputes {} forward nodes{}.",
                                row.label(), c->saved_values.size(), human_bytes(c->saved_bytes), c->recomputed_nodes,
                                row.compile && row.compile->cudagraphs
                                    ? fmt::format("; the CUDA graphs' pool holds {} of the reserved memory at the end",
                                                  human_bytes(c->graph_pool_reserved))
                                    : std::string()),
                    "  ", "    ");
      }
    }
  }

  if (options.how_to_read) {
    const double root = std::sqrt(static_cast<double>(m.sequence_length));
    out += "\nHow to read this:\n";
    out += spec.stack.cublas_workspace_per_operation()
               ? "  after step      memory_allocated() after the optimizer step: weights, gradients, optimizer state\n"
                 "                  (PyTorch 2.15 frees each matmul's cuBLAS workspace when it returns).\n"
               : "  after step      memory_allocated() after the optimizer step: weights, gradients, optimizer state,\n"
                 "                  and the cuBLAS workspaces PyTorch keeps (one per thread that ran a matmul).\n";
    out += "  max alloc       max_memory_allocated(): the peak of live tensors.\n";
    out += "  max reserved    max_memory_reserved(): segments the caching allocator held from the driver.\n";
    out += "                  Freed blocks stay cached for reuse, and blocks are rounded up, so reserved > allocated.\n";
    out += fmt::format(
        "  max nvidia-smi  what nvidia-smi shows: the CUDA context ({}), the kernels of cuBLAS and cuDNN\n"
        "                  once the step runs them, plus every reserved segment at the driver's\n"
        "                  granularity. That is why it is higher than max alloc.\n",
        format_bytes(result.device.context_bytes));
    out += "  unalloc@peak    reserved but unallocated when live tensors peaked (cache and fragmentation).\n";
    if (options.show_time) {
      out += "  time/step       host time of a computed step on this machine's CPU: the mean of the steps after\n"
             "                  the first (its warm-up); with --steps 1, that one step. A row that does not fit\n"
             "                  is found by a dry run first and never computed.\n";
    }
    out += "  saving          max alloc saved against no checkpointing (0 segments) with the same dtype.\n";
    out += "  recompute       the forward FLOPs checkpointing reruns, as a share of the step's work (forward,\n"
           "                  backward and optimizer), as `plan` reports it.\n";
    out += fmt::format(
        "  segments        checkpoint_sequential(model, k): k-1 segments keep only their input and rerun\n"
        "                  in backward, one at a time. Peak ~ k kept inputs + one segment of n/k modules\n"
        "                  rerun, lowest around k = sqrt(n) (n = {} modules: {:.1f}). Past it, more\n"
        "                  segments keep more inputs alive and cost more memory, not less.\n",
        m.sequence_length, root);
    if (any_oom_needs) {
      out += "  OOM [n]         the allocator's figures at the failure; 'needs' is the same run on this device\n"
             "                  without its capacity limit.\n";
    }
    if (any_error) {
      out += "  error [n]       autograd refused the step, with the error PyTorch raises for the same program\n"
             "                  (a tensor saved for backward was modified in place): it fails at any size.\n";
    }
  }
  // Pinned host memory beside the device's figures: activation offloading's, FSDP2's
  // CPUOffloadPolicy's, DeepSpeed's offload_optimizer's, or several.
  std::vector<std::string> on_host;
  if (result.spec.offload_activations) on_host.push_back("activations offloaded (--offload activations: save_on_cpu, pin_memory=True)");
  bool fsdp_host = false, zero_host = false, zero3_host = false, zero3_params_host = false;
  for (const nn::ParallelConfig& c : result.spec.parallels) {
    zero3_params_host = zero3_params_host || (c.offload_param && c.engine == nn::ParallelEngine::Zero3);
    fsdp_host = fsdp_host || (c.cpu_offload && c.engine == nn::ParallelEngine::Fsdp);
    zero_host = zero_host || (c.cpu_offload && (c.engine == nn::ParallelEngine::Zero1 || c.engine == nn::ParallelEngine::Zero2));
    zero3_host = zero3_host || (c.cpu_offload && c.engine == nn::ParallelEngine::Zero3);
  }
  if (fsdp_host) on_host.push_back("FSDP2's shards and gradients on the host (offload_policy=cpu)");
  if (zero_host) on_host.push_back("ZeRO's fp32 master partition and its gradients on the host (offload_optimizer=cpu)");
  if (zero3_host) {
    on_host.push_back("ZeRO-3's gradient partitions and fp32 gradients on the host (offload_optimizer=cpu; the "
                      "fp32 master there is pageable)");
  }
  if (zero3_params_host) {
    on_host.push_back("ZeRO-3's parameter partitions and their flat buffer on the host (offload_param=cpu; each "
                      "gather copies a partition to the GPU first)");
  }
  if (!on_host.empty()) {
    std::int64_t pinned = 0;
    for (const planner::SweepRow& row : result.rows) pinned = std::max(pinned, row.figures.pinned_host_bytes);
    std::string what;
    for (std::size_t i = 0; i < on_host.size(); ++i) {
      what += (i == 0 ? "" : i + 1 == on_host.size() ? " and " : ", ") + on_host[i];
    }
    what[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(what[0])));
    out += wrap(fmt::format("{}: up to {} of pinned host memory per row, beside the device's figures (PyTorch's "
                            "caching host allocator: each tensor pinned alone, in a power-of-two block, kept for "
                            "reuse){}.",
                            what, human_bytes(pinned),
                            fsdp_host || zero_host || zero3_host
                                ? "; the optimizer's state is on the host too, in pageable memory"
                                                   : ""),
                "", "  ");
  }
  out += fmt::format("\ndevice: {}\nstack: {} (--stack)\n", result.device.assumptions, result.spec.stack.to_string());
  out += assumptions_note(result.model.assumed);
  out += parallel_note(result.spec.parallels, result.device);
  return out;
}

}  // namespace mem::tools
