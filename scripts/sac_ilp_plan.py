#!/usr/bin/env python3
"""sac_ilp_plan.py: PyTorch's own selective-checkpointing planner, for comparison with vramscope's.

    sac_ilp_plan.py torchvision.models:vit_b_16 --input 256,3,224,224 --gpu-type "NVIDIA A100" --budgets 30,20
    sac_ilp_plan.py --hf-config models/zoo/hf/llama-3.2-1b.json --batch 8 --seq 4096 --dtype bf16 --budgets 70

Runs torch.distributed._tools' pipeline as its tests do (MemTracker, RuntimeEstimator and
SACEstimator over one training step, aggregate_stats, sac_milp), on fake tensors on the CPU,
then for each budget (GiB) solves sac_milp and each chosen module's operators with
get_optimal_checkpointing_policy_per_module. It prints one JSON object per budget: the modules
checkpointed (vramscope's paths) and the plan as vramscope's --selective scopes, each kept
operator call written "aten.NAME@K" (the K-th call of that operator in the module's forward,
as a policy function that counts applies sac_ilp's list), sac_ilp's own peak and recompute time.

Needs the current stack (VRAMSCOPE_STACK_PYTHON) with pulp and pwlf (sac_ilp's solver and
curve fit). pwlf's fits are randomized (differential evolution): numpy's seed is fixed, so the
plans repeat; CBC stops at sac_ilp's time limits (10 s a module, 180 s the whole), which a slow
machine can reach on a large module, and then answers with what it has. No LoRA: MemTracker
hooks every parameter's gradient, and PyTorch raises on a frozen one. What it works around to run without a GPU, each PyTorch's
limitation, not a choice:
- the roofline cost model asserts torch.accelerator.is_available() even when pinned to a
  datasheet (gpu_type): the check is answered yes while the estimators run;
- the roofline asserts one floating output dtype per operator, and a half-precision attention
  kernel returns its output in bf16 with an f32 logsumexp: such an operator is costed in its
  first output's dtype (the attention's);
- a module outside the backward (a rotary embedding computing cos and sin from the positions)
  has no backward snapshot, which aggregate_stats reads: it is given its post-forward one (no
  gradient and no activation gradient of its own: it is never where the step peaks);
- a module called several times in a forward (a ResNet Bottleneck's one ReLU, called three
  times) is listed once per call in the module orders, which parse_module_info asserts against:
  its first call stands for it (such modules are leaves, never checkpointed);
- an operator with neither memory nor runtime (a view the roofline ignores) is in no constraint
  of get_optimal_checkpointing_policy_per_module, and CBC gives its variable no value, which
  sac_ilp then rounds: it is read as recomputed (either way costs nothing);
- a trade-off curve of too few points leaves pwlf's fit NaN, which pulp refuses: the straight
  line (recompute share equal to the discarded share) stands for it;
- a module whose operators keep nothing (a classifier head whose output only the loss reads)
  divides by zero in the trade-off curve fit and in sac_milp: it is given a flat curve and
  treated as a leaf (nothing to discard, so never checkpointed, as sac_milp would decide).
"""
import argparse
import contextlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

# The attention kernel: the CPU's in this run, the GPU's in the operator-level file.
CPU_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
GPU_ATTENTION = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention")


def build_torchvision(target: str, dtype):
    module, name = target.split(":")
    import importlib
    with torch.device("meta"):
        return getattr(importlib.import_module(module), name)().to(dtype)


def build_hf(config_path: str, dtype):
    import transformers
    values = json.loads(Path(config_path).read_text())
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    return model.train()


def estimate(model, make_batch, loss_of, gpu_type: str):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator, SACTradeOffStats

    fit = SACEstimator._get_sac_tradeoff_pwlf_stats

    def flat_when_empty(self, sac_stats, greedy_order_meta, **kwargs):
        if sum(sac_stats.memory) == 0:
            return SACTradeOffStats(n_segments=1, slopes=[0.0], intercepts=[0.0], fit_breaks=[0.0, 1.0],
                                    tradeoff_curve={}, sac_memory=0, sac_runtime=sum(sac_stats.runtimes))
        stats = fit(self, sac_stats, greedy_order_meta, **kwargs)
        values = list(stats.slopes) + list(stats.intercepts)
        if all(math.isfinite(v) for v in values):
            return stats
        # A curve of one or two points leaves pwlf's two-segment fit undefined (NaN): the line
        # recompute share = discarded share stands for it.
        return SACTradeOffStats(n_segments=1, slopes=[1.0], intercepts=[0.0], fit_breaks=[0.0, 1.0],
                                tradeoff_curve=stats.tradeoff_curve, sac_memory=stats.sac_memory,
                                sac_runtime=stats.sac_runtime)

    from torch.distributed._tools import runtime_estimator as roofline
    compute_time = roofline.get_compute_time

    def in_first_dtype(func_packet, args, kwargs, out, out_dtypes, *rest, **named):
        if len(out_dtypes) > 1:
            first = next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            out_dtypes = {first.dtype}
        return compute_time(func_packet, args, kwargs, out, out_dtypes, *rest, **named)

    available = torch.accelerator.is_available
    torch.accelerator.is_available = lambda: True
    SACEstimator._get_sac_tradeoff_pwlf_stats = flat_when_empty
    roofline.get_compute_time = in_first_dtype
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model.to_empty(device="cpu")
            trained = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(trained)
            batch = make_batch()

            def step():
                loss_of(model, batch).backward()
                optimizer.step()
                optimizer.zero_grad()

            memory = MemTracker()
            memory.track_external(model, optimizer)
            with memory:
                step()
            runtime = RuntimeEstimator(gpu_type=gpu_type)
            with runtime("operator-level-cost-model"):
                step()
            sac = SACEstimator(gpu_type=gpu_type)
            with sac("operator-level-cost-model"):
                step()
        from torch.distributed._tools.mem_tracker import _ModState
        for stats in memory.memory_tracking.values():
            for state in (_ModState.PRE_BW, _ModState.PEAK_BW):
                if not stats.snapshots.get(state):
                    stats.snapshots[state] = [stats.snapshots[_ModState.POST_FW][-1]]
        import numpy
        numpy.random.seed(0)  # pwlf's fits are differential evolution's, from numpy's global state
        info = aggregate_stats(model, memory, runtime, sac, torch.device("cpu"))
        for order in info["mod_order"].values():
            order[:] = list(dict.fromkeys(order))  # a module called several times: its first call
        graph = parse_module_info(info)
    finally:
        torch.accelerator.is_available = available
        SACEstimator._get_sac_tradeoff_pwlf_stats = fit
        roofline.get_compute_time = compute_time
    for node in graph.nodes:
        if node["sac_memory"] == 0:
            node["is_leaf"] = True  # nothing to discard (see the docstring)
    return graph, sac


def vramscope_path(fqn: str) -> str:
    """'VisionTransformer.encoder.layers.encoder_layer_0' -> 'encoder.layers.encoder_layer_0'."""
    return fqn.split(".", 1)[1] if "." in fqn else ""


def kept_calls(stats, decisions) -> list:
    """The operator calls sac_ilp keeps, counted per operator as a counting policy applies them."""
    seen, kept = Counter(), []
    for i, (name, save) in enumerate(zip(stats.func_names, decisions)):
        call = seen[name]
        seen[name] += 1
        if not save or i in stats.view_like_ops:
            continue
        names = GPU_ATTENTION if name == CPU_ATTENTION else (name,)
        kept += [f"aten.{n}@{call}" for n in names]
    return kept


def plan(graph, sac, budget: float, ac_units):
    import builtins
    from torch.distributed._tools import sac_ilp
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module, sac_milp
    # An operator of no memory and no runtime is in no constraint, and CBC leaves its variable
    # without a value, which sac_ilp rounds: it is recomputed (0), which costs nothing.
    sac_ilp.round = lambda value, *digits: 0 if value is None else builtins.round(value, *digits)
    decisions, recompute_ms, peak = sac_milp(graph, memory_budget=budget, ac_units=ac_units)
    out = {"budget_gib": budget, "solved": peak != -1, "modules": [], "selective": "", "recompute_ms": recompute_ms,
           "peak_bytes": peak}
    scopes, kept = [], 0
    for fqn, discard in decisions.items():
        stats = sac.sac_mod_stats[fqn]
        ops = get_optimal_checkpointing_policy_per_module(stats, memory_budget=max(0.0, 1.0 - discard))
        path = vramscope_path(fqn)
        out["modules"].append(path)
        calls = kept_calls(stats, ops)
        kept += sum(1 for c in calls if not any(c.startswith(f"aten.{n}@") for n in GPU_ATTENTION[1:]))
        if calls:
            scopes.append(f"{path}={','.join(calls)}")
    out["selective"] = ";".join(scopes)
    out["kept_calls"] = kept
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="module:FUNCTION building the nn.Module (torchvision.models:vit_b_16)")
    parser.add_argument("--input", help="its input's shape, batch first (a float image batch, cross entropy on 1000 classes)")
    parser.add_argument("--hf-config", help="a transformers config.json (its causal LM loss on labels)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--gpu-type", default="NVIDIA H100", help="the roofline's datasheet (PyTorch's names)")
    parser.add_argument("--budgets", required=True, help="GiB, comma-separated; - reads one per line from standard "
                                                         "input and answers each at once (for a caller's bisection)")
    parser.add_argument("--ac-units", help="a regular expression: only modules whose path matches may be checkpointed")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    if args.hf_config:
        model = build_hf(args.hf_config, dtype)
        make_batch = lambda: torch.randint(0, model.config.vocab_size, (args.batch, args.seq))  # noqa: E731
        loss_of = lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
    else:
        model = build_torchvision(args.model, dtype)
        shape = [int(v) for v in args.input.split(",")]
        make_batch = lambda: (torch.randn(shape, dtype=dtype), torch.randint(0, 1000, (shape[0],)))  # noqa: E731
        loss_of = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with contextlib.redirect_stdout(sys.stderr):  # RuntimeEstimator prints its total
        graph, sac = estimate(model, make_batch, loss_of, args.gpu_type)
    ac_units = None
    if args.ac_units:
        import re
        ac_units = [n["fqn"] for n in graph.nodes if re.fullmatch(args.ac_units, vramscope_path(n["fqn"]))]
    budgets = (line.strip() for line in sys.stdin) if args.budgets == "-" else iter(args.budgets.split(","))
    for text in budgets:
        if not text:
            continue
        budget = float(text)
        if not math.isfinite(budget) or budget <= 0:
            raise SystemExit(f"--budgets: {text} is no budget in GiB")
        with contextlib.redirect_stdout(sys.stderr):  # pulp's and sac_milp's messages
            answer = plan(graph, sac, budget, ac_units)
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
