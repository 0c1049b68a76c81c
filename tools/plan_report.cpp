// plan_report.cpp — the plan table, its notes and the PyTorch code of the best plan.
#include "plan_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "model_args.hpp"
#include "sweep_export.hpp"
#include "sweep_report.hpp"
#include "table.hpp"

namespace mem::tools {

namespace {

std::string percent(double share) { return human_share(share); }

std::string smi_cell(const planner::Plan& p) {
  if (p.fits()) return human_bytes(p.figures.peak_device_used);
  if (p.over_headroom) return human_bytes(p.figures.peak_device_used) + " (headroom)";
  if (!p.refused.empty()) return "refused";
  if (p.error) return "error";
  return "OOM";
}

std::string allocated_cell(const planner::Plan& p) {
  if (p.fits() || p.figures.peak_allocated > 0) return human_bytes(p.figures.peak_allocated) + (p.fits() ? "" : "+");
  return "-";
}

std::string python_set(const std::vector<std::string>& items) {
  std::string out = "{";
  for (std::size_t i = 0; i < items.size(); ++i) {
    out += fmt::format("{}\"{}\"", i == 0 ? "" : (i % 4 == 0 ? ",\n    " : ", "), items[i]);
  }
  return out + "}";
}

/// `text` wrapped, its continuation lines starting with `rest`, ending in one newline.
std::string wrapped_line(const std::string& text, const std::string& rest) {
  std::string out = wrap(text, "", rest);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out + "\n";
}

/// A call-by-call plan's policy: KEEP maps each checkpointed module to the calls it keeps, per
/// operator overload ("aten.mm.default": {0, 3}: its first and fourth call in the module's
/// forward), and keeping_calls makes one region's policy, counting the forward's calls and the
/// recompute's apart (ctx.is_recompute) as vramscope's policy counts them. The attention
/// kernels count as one name: a GPU may pick another than the recorded one.
std::string kept_calls_code(const planner::Plan& p) {
  const std::vector<std::string> attention = nn::SelectivePolicy::group("attention");
  std::string out = "from collections import Counter\n";
  out += "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n\n";
  out += fmt::format("# each checkpointed module keeps these operator calls ({} of the {} worth keeping) and\n"
                     "# recomputes the rest: the K-th call of an operator in its forward, counted from 0\n",
                     p.kept_calls, p.calls_of);
  out += "KEEP = {\n";
  for (const auto& scope : p.selective_scopes) {
    std::vector<std::pair<std::string, std::vector<std::string>>> by_op;
    for (const std::string& entry : scope.save) {
      const std::size_t at = entry.find('@');
      std::string op = entry.substr(0, at);
      const std::string packet = op.substr(0, op.rfind('.'));
      if (std::find(attention.begin(), attention.end(), packet) != attention.end()) op = "attention";
      auto it = std::find_if(by_op.begin(), by_op.end(), [&](const auto& e) { return e.first == op; });
      if (it == by_op.end()) it = by_op.insert(by_op.end(), {op, {}});
      it->second.push_back(entry.substr(at + 1));
    }
    for (auto& [op, indices] : by_op) {
      std::sort(indices.begin(), indices.end(), [](const std::string& a, const std::string& b) {
        return a.size() != b.size() ? a.size() < b.size() : a < b;  // numbers, in order
      });
    }
    std::string calls;
    for (const auto& [op, indices] : by_op) {
      calls += fmt::format("{}\"{}\": {{{}}}", calls.empty() ? "" : ", ", op, fmt::join(indices, ", "));
    }
    out += wrapped_line(fmt::format("    \"{}\": {{{}}},", scope.modules, calls), "        ");
  }
  out += "}\n";
  std::vector<std::string> quoted;
  for (const std::string& a : attention) quoted.push_back(fmt::format("\"{}\"", a));
  out += wrapped_line(fmt::format("ATTENTION = {{{}}}", fmt::join(quoted, ", ")), "    ") + "\n";
  out += "def keeping_calls(keep):\n";
  out += "    calls = {False: Counter(), True: Counter()}  # the forward's, the recompute's\n\n";
  out += "    def policy(ctx, op, *args, **kwargs):\n";
  out += "        name = \"attention\" if str(getattr(op, \"overloadpacket\", op)) in ATTENTION else str(op)\n";
  out += "        call = calls[ctx.is_recompute][name]\n";
  out += "        calls[ctx.is_recompute][name] += 1\n";
  out += "        kept = call in keep.get(name, ())\n";
  out += "        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE\n";
  out += "    return create_selective_checkpoint_contexts(policy)\n\n";
  return out;
}

/// How the failure of the given configuration reads: "out of memory in step 1, backward of layer3.2".
std::string given_failure(const planner::Plan& p) {
  if (p.oom) {
    return fmt::format("out of memory in step {}, {} of {} (asked {} with {} allocated)", p.oom->step,
                       phase_name(p.oom->phase), p.oom->module.empty() ? "the model" : p.oom->module,
                       human_bytes(static_cast<std::int64_t>(p.oom->figures.requested)),
                       human_bytes(static_cast<std::int64_t>(p.oom->figures.allocated)));
  }
  if (p.error) return describe_place(*p.error) + ": " + p.error->message;
  if (p.over_headroom) {
    return fmt::format("it runs, peaking at {} in nvidia-smi's view, which leaves less than the headroom asked",
                       human_bytes(p.figures.peak_device_used));
  }
  return p.refused;
}

}  // namespace

std::string plan_report(const planner::PlanResult& r, std::size_t top, bool how_to_read) {
  std::string out;
  const planner::Plan& g = r.given;
  out += fmt::format("plan for {} ({}, {}{}) on {}{} ({} total{})\n", model_title(r.model, r.spec.base.model_options),
                     nn::precision_name(g.precision), nn::optimizer_label(g.optimizer),
                     g.alloc_conf.empty() ? "" : ", " + g.alloc_conf, r.device.name, per_gpu(r.spec.base.parallels),
                     human_bytes(static_cast<std::int64_t>(r.device.total_bytes)),
                     r.spec.headroom == 0 ? ", none kept free"
                                          : ", " + human_bytes(static_cast<std::int64_t>(r.spec.headroom)) +
                                                " kept free: --headroom");
  if (g.fits()) {
    out += fmt::format("\nIt fits as given: max allocated {}, {} in nvidia-smi's view of {}; nothing to change.\n",
                       human_bytes(g.figures.peak_allocated), human_bytes(g.figures.peak_device_used),
                       human_bytes(static_cast<std::int64_t>(r.device.total_bytes)));
    if (g.figures.peak_composition.total() > 0) {
      out += wrap(fmt::format("It peaks at {}{}: {}.", human_bytes(g.figures.peak_allocated),
                              describe_peak_moment(g.figures.peak_composition),
                              describe_composition(g.figures.peak_composition)),
                  "", "  ");
    }
    for (const std::string& w : g.figures.warnings) out += wrap("Note: " + w + ".", "  ", "    ");
    out += fmt::format("({} dry runs, {:.0f} ms)\n", r.dry_runs, r.wall_ms);
    return out;
  }
  out += wrap("As given: " + given_failure(g) + ".", "", "  ");
  out += "\n";

  Table t{{{"#", Align::Right},
           {"plan", Align::Left},
           {"changes", Align::Left},
           {"max allocated", Align::Right},
           {"max nvidia-smi", Align::Right},
           {"recompute", Align::Right},
           {"fits", Align::Left}}};
  t.add_row({"-", "as given", "-", allocated_cell(g), smi_cell(g), "0", "no"});
  const planner::Plan* best = r.best();
  std::size_t shown = 0;
  for (const planner::Plan& p : r.plans) {
    if (shown == top) break;
    ++shown;
    t.add_row({std::to_string(shown), p.label(), std::string(planner::plan_change_name(p.change)), allocated_cell(p), smi_cell(p),
               percent(p.recompute_share), p.fits() ? (&p == best ? "yes *" : "yes") : "no"});
  }
  out += t.render("  ");
  if (r.plans.size() > shown) out += fmt::format("  ({} more plans; --top {} shows them)\n", r.plans.size() - shown, r.plans.size());
  const bool segments_fit = std::any_of(r.plans.begin(), r.plans.end(), [](const planner::Plan& p) { return p.segments > 1 && p.fits(); });
  if (!r.segments_tried.empty() && !segments_fit) {
    std::string counts;
    for (const std::size_t s : r.segments_tried) counts += (counts.empty() ? "" : ", ") + std::to_string(s);
    out += wrap(fmt::format("No checkpoint_sequential segment count fits ({} tried).", counts), "  ", "  ");
  }

  // Why checkpointing alone is not the answer, when no plan that keeps the arithmetic fits.
  const bool same_math_fits = std::any_of(r.plans.begin(), r.plans.end(), [](const planner::Plan& p) {
    return p.fits() && p.rank_tier() == 0;
  });
  if (!same_math_fits && r.given_needs && r.given_needs->peak_composition.total() > 0) {
    const MemoryComposition& c = r.given_needs->peak_composition;
    const std::int64_t states = c.model_states();
    const auto usable = static_cast<std::int64_t>(r.device.total_bytes - r.device.context_bytes);
    out += "\n";
    out += wrap(fmt::format("As given it needs {} in nvidia-smi's view and peaks at {}{}: {}.",
                            human_bytes(r.given_needs->peak_device_used), human_bytes(r.given_needs->peak_allocated),
                            describe_peak_moment(c), describe_composition(c)),
                "", "  ");
    if (states >= usable) {
      out += wrap(fmt::format("Checkpointing cannot fit it: the weights, gradients and the optimizer's state and "
                              "temporaries alone hold {} of the {} the device has after its CUDA context; "
                              "checkpointing only cuts activations ({} here). What can is fewer bytes per "
                              "parameter.",
                              human_bytes(states), human_bytes(usable), human_bytes(c.of(MemoryKind::Activations))),
                  "", "  ");
    } else {
      out += wrap("No checkpointing of its modules fits it, even of all of them: what stays (the weights, "
                  "gradients, optimizer state, the loss and what checkpointed modules keep) is more than the "
                  "device holds.",
                  "", "  ");
    }
  }
  if (best != nullptr) {
    out += "\n";
    out += wrap(fmt::format("* {}: {} in nvidia-smi's view of {}, {} recomputed. It peaks at {}{}: {}.", best->label(),
                            human_bytes(best->figures.peak_device_used),
                            human_bytes(static_cast<std::int64_t>(r.device.total_bytes)),
                            percent(best->recompute_share) == "0" ? "nothing" : percent(best->recompute_share) + " of the step",
                            human_bytes(best->figures.peak_allocated), describe_peak_moment(best->figures.peak_composition),
                            describe_composition(best->figures.peak_composition)),
                "", "  ");
    if (best->checkpoint_modules && !best->checkpoint_modules->empty()) {
      std::string all;
      for (const std::string& m : *best->checkpoint_modules) all += (all.empty() ? "" : ", ") + m;
      out += wrap("Checkpointed: " + all + ".", "  ", "  ");
    }
    for (const std::string& w : best->figures.warnings) out += wrap("Note: " + w + ".", "  ", "    ");
  } else {
    out += "\nNothing tried fits.";
    if (r.least_hungry_needs) {
      const MemoryComposition& c = r.least_hungry_needs->peak_composition;
      out += "\n";
      out += wrap(fmt::format("The least hungry plan ({}) needs {} in nvidia-smi's view; it peaks at {}{}: {}.",
                              r.least_hungry->label(), human_bytes(r.least_hungry_needs->peak_device_used),
                              human_bytes(r.least_hungry_needs->peak_allocated),
                              describe_peak_moment(c), describe_composition(c)),
                  "", "  ");
    }
    out += "\nWhat would fit:\n";
    if (!r.smallest_device.empty()) {
      out += fmt::format("  - a larger GPU: {} is the smallest preset that holds {}\n", r.smallest_device,
                         r.least_hungry->label());
    }
    if (r.max_batch && *r.max_batch > 0) {
      out += fmt::format("  - a smaller batch: at most {} with that plan (then accumulate gradients to keep the "
                         "effective batch)\n",
                         *r.max_batch);
    } else if (r.max_batch) {
      out += "  - no batch size: even batch 1 does not fit\n";
    }
    out += r.model.sequential_checkpointing
               ? "  - several GPUs: --parallel fsdp:N or zero3:N shard the weights, gradients and optimizer state "
                 "(zero2:N the last two)\n"
               : "  - fewer trained parameters (--lora), or several GPUs (--parallel fsdp:N, zero3:N or zero2:N)\n";
  }
  if (how_to_read) {
    out += "\n";
    out += wrap("How to read this: every row is a full dry run through the caching allocator on the device "
                "(two training steps). Plans are ranked by what they change (first those that keep the step's "
                "arithmetic: checkpointing, the allocator setting, a decoder's loss by Liger's fused linear cross "
                "entropy, torch.compile's step (a file recorded with --compile) under the activation_memory_budget "
                "that recomputes least; then gradient accumulation, precision, the optimizer), then by recompute (the forward "
                "FLOPs checkpointing reruns, as a share of the step's forward, backward and optimizer FLOPs), then "
                "by nvidia-smi's peak. OOM rows show "
                "max allocated up to the failure (+). --code writes the PyTorch code of the * plan.",
                "", "");
  }
  out += fmt::format("({} dry runs, {:.0f} ms; device: {})\n", r.dry_runs, r.wall_ms, r.device.name);
  out += assumptions_note(r.model.assumed);
  return out;
}

std::string plan_code(const planner::PlanResult& r, const planner::Plan& p) {
  std::string out;
  const bool decoder = r.model.checkpoints_by_layer;
  out += fmt::format("# vramscope plan: {} on {} -> {}\n", model_title(r.model, r.spec.base.model_options), r.device.name,
                     p.label());
  out += fmt::format("# predicted: max allocated {}, {} in nvidia-smi's view, {} of the step recomputed\n",
                     human_bytes(p.figures.peak_allocated), human_bytes(p.figures.peak_device_used),
                     percent(p.recompute_share));
  for (const std::string& w : p.figures.warnings) out += wrap("# note: " + w + ".", "", "#   ");
  out += "# `model` is your model (built); `optimizer` below replaces yours.\n";
  if (p.alloc_conf != r.given.alloc_conf && !p.alloc_conf.empty()) {
    out += "import os\n";
    out += fmt::format("os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"] = \"{}\"  # before CUDA starts: at the top of the script\n",
                       p.alloc_conf);
  }
  out += "import torch\n";
  if (p.checkpoint_modules && !p.checkpoint_modules->empty()) {
    // GradientCheckpointingLayer and its per-layer flag came with transformers 4.52 (unsloth
    // #2674 tracks the move); before it, the layers are wrapped by name like any module.
    const bool layer_flags = r.spec.base.stack.transformers >= nn::Version{4, 52};
    if (decoder && layer_flags) {
      out += "from transformers.modeling_layers import GradientCheckpointingLayer\n\n";
      out += fmt::format("CHECKPOINTED = {}\n", python_set(*p.checkpoint_modules));
      out += "# (newer transformers name it activation_checkpointing_enable)\n";
      out += "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})\n";
      if (r.spec.base.model_options.lora > 0) {
        // decoder.cpp models it: the frozen embedding's output requires grad, as TRL and PEFT's
        // prepare_model_for_kbit_training make it for checkpointed adapters.
        out += "model.enable_input_require_grads()  # as TRL does for a PEFT model with checkpointing\n";
      }
      out += "for name, module in model.named_modules():  # then only the planned layers keep it\n";
      out += "    if isinstance(module, GradientCheckpointingLayer):\n";
      out += "        module.gradient_checkpointing = name.removeprefix(\"base_model.model.\") in CHECKPOINTED\n";
    } else {
      out += "import functools\n";
      out += "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n";
      out += "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)\n\n";
      out += fmt::format("CHECKPOINTED = {}\n", python_set(*p.checkpoint_modules));
      out += decoder ? "names = {module: name.removeprefix(\"base_model.model.\") for name, module in model.named_modules()}\n"
                     : "names = {module: name for name, module in model.named_modules()}\n";
      if (!p.selective.empty()) {
        // Selective checkpointing: checkpoint_wrapper hands context_fn on to checkpoint(). The
        // policy names operators by packet (every overload), the groups' whole lists: the
        // attention kernel a GPU picks (flash, cuDNN) need not be the one recorded.
        std::vector<std::string> ops;
        for (const std::string& g : p.selective_groups) {
          for (const std::string& op : nn::SelectivePolicy::group(g)) ops.push_back(fmt::format("\"{}\"", op));
        }
        out += "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n\n";
        out += fmt::format("# the checkpointed modules keep these operators' outputs ({}) and recompute the rest\n",
                           fmt::join(p.selective_groups, ", "));
        out += wrap(fmt::format("OPS_TO_SAVE = {{{}}}", fmt::join(ops, ", ")), "", "    ") + "\n";
        out += "def keep_costly(ctx, op, *args, **kwargs):\n";
        out += "    saved = str(getattr(op, \"overloadpacket\", op)) in OPS_TO_SAVE\n";
        out += "    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE\n\n";
      }
      if (!p.selective_scopes.empty()) out += kept_calls_code(p);
      out += "apply_activation_checkpointing(\n";
      out += "    model,\n";
      if (!p.selective_scopes.empty()) {
        out += "    checkpoint_wrapper_fn=lambda module: checkpoint_wrapper(\n";
        out += "        module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,\n";
        out += "        context_fn=functools.partial(keeping_calls, KEEP.get(names[module], {}))),\n";
      } else if (p.selective.empty()) {
        out += "    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),\n";
      } else {
        out += "    checkpoint_wrapper_fn=functools.partial(\n";
        out += "        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,\n";
        out += "        context_fn=functools.partial(create_selective_checkpoint_contexts, keep_costly)),\n";
      }
      out += "    check_fn=lambda module: names.get(module) in CHECKPOINTED)\n";
    }
  } else if (p.segments > 1) {
    out += "from torch.utils.checkpoint import checkpoint_sequential\n\n";
    out += fmt::format("# in the training step, for `output = model(x)` (the model as one nn.Sequential of its "
                       "{} top-level modules):\n",
                       r.model.sequence_length);
    out += fmt::format("# output = checkpoint_sequential(model, {}, x, use_reentrant=False)\n", p.segments);
  }
  if (p.compile) {
    // torch._functorch.config: the partitioner's budget, read when the step compiles.
    out += "# the step as torch.compile partitions it (the model's first call compiles forward and backward)\n";
    if (*p.compile < 1) {
      out += "import torch._functorch.config\n";
      out += fmt::format("torch._functorch.config.activation_memory_budget = {:g}\n", *p.compile);
    }
    if (r.model.loss == nn::LossKind::None || r.model.loss == nn::LossKind::CausalLM) {
      out += "model = torch.compile(model)  # its loss is inside it, as recorded\n";
    } else {
      // The recording compiled the forward and the loss as one region (vramscope.export --compile).
      out += "step = torch.compile(lambda x, y: loss_fn(model(x), y))  # forward and loss, one region as recorded\n";
      out += "# in the training loop: loss = step(x, y); loss.backward()\n";
    }
  }
  if (p.fused_loss) {
    // liger-kernel transformers/monkey_patch.py: the model's forward replaced by lce_forward,
    // whose training loss is LigerForCausalLMLoss; the other kernels (RoPE, RMSNorm, SwiGLU)
    // change what the layers keep, so they stay off.
    const std::string& type = r.model.model_type;
    out += "# the loss without its logits: Liger's fused linear cross entropy (pip install liger-kernel)\n";
    out += fmt::format("from liger_kernel.transformers import apply_liger_kernel_to_{}\n", type);
    out += fmt::format("apply_liger_kernel_to_{}(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,\n", type);
    out += "    fused_linear_cross_entropy=True,\n";
    out += "    model=model.get_base_model() if hasattr(model, \"get_base_model\") else model)\n";
  }
  if (p.precision != r.given.precision) {  // the plan changes it
    switch (p.precision) {
      case nn::Precision::BF16: out += "model = model.to(torch.bfloat16)  # bf16 weights, gradients and state\n"; break;
      case nn::Precision::F16: out += "model = model.half()\n"; break;
      case nn::Precision::AmpBF16: out += "autocast = torch.autocast(\"cuda\", dtype=torch.bfloat16)  # with autocast: output = model(x); loss = ...\n"; break;
      case nn::Precision::Amp: out += "autocast = torch.autocast(\"cuda\", dtype=torch.float16)  # with a GradScaler\n"; break;
      default: break;
    }
  }
  const std::string lr = fmt::format("{:g}", p.optimizer.lr);
  if (p.optimizer.kind != nn::OptimizerKind::None) out += "params = [p for p in model.parameters() if p.requires_grad]\n";
  switch (p.optimizer.kind) {
    case nn::OptimizerKind::Adam:
      out += fmt::format("optimizer = torch.optim.Adam(params, lr={})\n", lr);
      break;
    case nn::OptimizerKind::Adam8bit:
      out += "import bitsandbytes as bnb\n";
      out += fmt::format("optimizer = bnb.optim.Adam8bit(params, lr={})\n", lr);
      break;
    case nn::OptimizerKind::SGD:
      out += p.optimizer.momentum != 0
                 ? fmt::format("optimizer = torch.optim.SGD(params, lr={}, momentum={:g})\n", lr, p.optimizer.momentum)
                 : fmt::format("optimizer = torch.optim.SGD(params, lr={})\n", lr);
      break;
    case nn::OptimizerKind::None: break;
  }
  if (p.accumulation > 1) {
    out += fmt::format("\n# gradient accumulation: {} micro-batches of {} per optimizer step (the effective batch {})\n",
                       p.accumulation, p.batch, p.batch * p.accumulation);
    out += fmt::format("# for x, y in batches:  # each of {}\n", p.batch * p.accumulation);
    out += fmt::format("#     for xs, ys in zip(x.chunk({0}), y.chunk({0})):\n", p.accumulation);
    out += fmt::format("#         (loss_fn(model(xs), ys) / {}).backward()\n", p.accumulation);
    out += "#     optimizer.step(); optimizer.zero_grad()\n";
  }
  return out;
}

nlohmann::json plan_json(const planner::PlanResult& r) {
  const auto plan_of = [&](const planner::Plan& p) {
    nlohmann::json j;
    j["plan"] = p.label();
    j["change"] = std::string(planner::plan_change_name(p.change));
    j["checkpointing"] = p.checkpointing;
    j["checkpoint_modules"] = p.checkpoint_modules.value_or(std::vector<std::string>{});
    j["segments"] = p.segments;
    j["dtype"] = std::string(nn::precision_name(p.precision));
    j["optimizer"] = nn::optimizer_label(p.optimizer);
    j["alloc_conf"] = p.alloc_conf;
    j["batch"] = p.batch;
    j["accumulation"] = p.accumulation;
    j["fused_loss"] = p.fused_loss;
    j["compile"] = p.compile ? nlohmann::json(*p.compile) : nlohmann::json(nullptr);
    j["selective"] = p.selective;
    j["selective_groups"] = p.selective_groups;
    // Call by call: each checkpointed module's kept calls ("aten.mm.default@2"), as --selective takes them.
    j["selective_scopes"] = nlohmann::json::array();
    for (const auto& scope : p.selective_scopes) j["selective_scopes"].push_back({{"modules", scope.modules}, {"save", scope.save}});
    if (!p.selective_scopes.empty()) {
      j["selective_policy"] = nn::SelectivePolicy{{}, p.selective_scopes}.str();
      j["kept_calls"] = p.kept_calls;
      j["calls_of"] = p.calls_of;
    }
    j["fits"] = p.fits();
    j["max_allocated"] = p.figures.peak_allocated;
    j["max_reserved"] = p.figures.peak_reserved;
    j["max_nvidia_smi"] = p.figures.peak_device_used;
    j["recompute_share"] = p.recompute_share;
    j["recompute_ratio"] = p.figures.recompute_ratio;
    j["over_headroom"] = p.over_headroom;
    j["warnings"] = p.figures.warnings;
    if (p.oom) j["oom"] = p.oom->message;
    if (p.error) j["error"] = p.error->message;
    if (!p.refused.empty()) j["refused"] = p.refused;
    return j;
  };
  nlohmann::json j;
  j["model"] = r.model.name;
  j["model_options"] = r.spec.base.model_options.to_string();
  j["device"] = device_json(r.device);
  j["given"] = plan_of(r.given);
  j["plans"] = nlohmann::json::array();
  for (const planner::Plan& p : r.plans) j["plans"].push_back(plan_of(p));
  const planner::Plan* best = r.best();
  j["best"] = best == nullptr ? nlohmann::json(nullptr) : nlohmann::json(best == &r.given ? -1 : best - r.plans.data());
  if (r.least_hungry_needs) j["least_hungry_needs"] = r.least_hungry_needs->peak_device_used;
  j["smallest_device"] = r.smallest_device;
  if (r.max_batch) j["max_batch"] = *r.max_batch;
  j["headroom"] = r.spec.headroom;
  j["segments_tried"] = r.segments_tried;
  j["profile"] = {{"forward_flops", r.profile.flops.forward},
                  {"backward_flops", r.profile.flops.backward},
                  {"optimizer_flops", r.profile.flops.optimizer}};
  j["dry_runs"] = r.dry_runs;
  return j;
}

}  // namespace mem::tools
