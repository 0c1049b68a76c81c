#!/usr/bin/env python3
"""sac_ilp_table.py: docs/PLAN.md's table of PyTorch's own planner (sac_ilp) beside `vramscope plan`.

    sac_ilp_table.py update VRAMSCOPE [DOC] [--only 0,2]   # rewrite the table between the markers
    sac_ilp_table.py check VRAMSCOPE [DOC] [--only 0,2]    # exit 1 when the document differs

--only runs those cases (0-based) and keeps the document's other rows: CI runs the ViT (a
minute), the coverage label all four (eight minutes: the Llama's sac_ilp solves take most).

For each case, recorded at the operator level by the exporter (as plan_ops_table.py does):
- sac_ilp (torch.distributed._tools.sac_ilp, scripts/sac_ilp_plan.py) is given the device's
  memory as its budget, as a user would, and its plan (modules and the operator calls each
  keeps) runs under vramscope's allocator on that device;
- then the largest budget, to a quarter GiB, whose plan does fit there: found by bisection,
  each sac_ilp plan run by `vramscope sweep`;
- `vramscope plan --search selective --headroom 0` on the same device: checkpointing alone,
  whole modules, operator groups or operator calls, up to the last byte of the device as
  sac_ilp's budget is.
Every figure is a vramscope dry run of the plan; recompute is the recomputed forward FLOPs
over the step's, for both. Exit 77 (skipped) without the stack, unless
VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_tables
from plan_ops_table import gib, stack_python

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "models" / "zoo" / "hf"
# label, exporter arguments, sac_ilp_plan.py's model arguments, plan and sweep arguments. The
# roofline's datasheet: the device's, the L4 (Ada, as the RTX 4090) where PyTorch has none.
CASES = [
    ("torchvision vit_b_16, batch 256, f32", ["torchvision.models:vit_b_16", "--input", "256,3,224,224"],
     ["torchvision.models:vit_b_16", "--input", "256,3,224,224", "--gpu-type", "NVIDIA A100"],
     ["--device", "sim:a100-40g"]),
    ("torchvision resnet50, batch 320, f32", ["torchvision.models:resnet50", "--input", "320,3,224,224"],
     ["torchvision.models:resnet50", "--input", "320,3,224,224", "--gpu-type", "NVIDIA L4"],
     ["--device", "sim:rtx4090"]),
    ("torchvision convnext_tiny, batch 256, f32", ["torchvision.models:convnext_tiny", "--input", "256,3,224,224"],
     ["torchvision.models:convnext_tiny", "--input", "256,3,224,224", "--gpu-type", "NVIDIA L4"],
     ["--device", "sim:rtx4090"]),
    ("llama-3.2-1b, batch 8 x 4096, bf16",
     ["--hf-config", str(HF / "llama-3.2-1b.json"), "--batch", "8", "--seq", "4096"],
     ["--hf-config", str(HF / "llama-3.2-1b.json"), "--batch", "8", "--seq", "4096", "--dtype", "bf16",
      "--gpu-type", "NVIDIA H100"],
     ["--dtype", "bf16", "--device", "sim:h100-80g"]),
]
STEP = 0.25  # GiB: the budget's resolution


MUTATED = "has been mutated"  # PyTorch's and vramscope's error for a kept output changed in place


def run_json(command):
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if out.returncode == 1 and MUTATED in out.stderr:
        return {"mutated": True}
    if out.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command[:3])} ...: exit {out.returncode}\n{out.stderr[-2000:]}")
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise SystemExit(f"{' '.join(command)[:3000]}: exit {out.returncode}, no JSON\n{out.stderr[-2000:]}") from None


def sweep(exe, model, args, plan):
    """The sac_ilp plan run by vramscope: its first row (fits, peak, recompute)."""
    command = [exe, "sweep", "--model-file", str(model), *args, "--format", "json"]
    if plan["modules"]:
        command += ["--checkpoint-modules", ",".join(plan["modules"])]
        if plan["selective"]:
            command += ["--selective", plan["selective"]]
    result = run_json(command)
    # A plan keeping an output that an in-place operator then changes (a batch norm's, before
    # ReLU(inplace=True)): PyTorch's selective checkpoint raises in backward, as vramscope does.
    return {"fits": False, "mutated": True} if result.get("mutated") else result["rows"][0]


def sac_label(plan):
    n = len(plan["modules"])
    if n == 0:
        return "no checkpointing"
    what = plan["modules"][0] if n == 1 else f"{n} modules"
    return f"checkpoint {what} keeping {plan['kept_calls']} operator calls"


def share(x):
    """The recomputed share to three digits: the two plans are often near."""
    return "0" if x == 0 else f"{100 * x:.3g}%"


def smi(row):
    if row.get("mutated"):
        return "fails: a kept output is changed in place"
    return gib(row["max_nvidia_smi"]) + ("" if row["fits"] else " (OOM)")


class SacIlp:
    """sac_ilp_plan.py on one model: budgets in, plans out (one estimation, many solves)."""

    def __init__(self, python, model_args, env):
        self.proc = subprocess.Popen([python, str(ROOT / "scripts" / "sac_ilp_plan.py"), *model_args, "--budgets", "-"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.plans = {}

    def plan(self, budget):
        if budget not in self.plans:
            self.proc.stdin.write(f"{budget}\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"sac_ilp_plan.py ended at budget {budget} GiB (run it alone to see why)")
            self.plans[budget] = json.loads(line)
        return self.plans[budget]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def tables(exe, chosen=None):
    """The table's rows; `chosen` (CASES with None for a case not run) leaves a placeholder row."""
    python = stack_python()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), TQDM_DISABLE="1")
    rows = ["| case | device | sac_ilp, budget the device's GiB | max nvidia-smi | largest budget that fits | "
            "its plan | recompute | max nvidia-smi | vramscope plan | recompute | max nvidia-smi |",
            "|---|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(chosen or CASES):
            if case is None:
                rows.append("|")
                continue
            label, export, model_args, args = case
            path = Path(tmp) / f"case{i}.json"
            run = subprocess.run([python, "-m", "vramscope.export", *export, "--level", "ops", "-o", str(path)],
                                 capture_output=True, text=True, env=env, timeout=900)
            if run.returncode != 0:
                raise SystemExit(f"export of {label} failed:\n{run.stderr}")
            result = run_json([exe, "plan", "--model-file", str(path), *args, "--search", "selective",
                               "--headroom", "0", "--format", "json"])
            if result.get("best") == -1:
                raise SystemExit(f"{label}: fits as given on {args}; the case needs a plan")
            ours = result["plans"][result["best"]] if isinstance(result.get("best"), int) else None
            device = args[args.index("--device") + 1]
            capacity = result["device"]["total_bytes"] / (1 << 30)
            sac = SacIlp(python, model_args, env)
            try:
                naive_budget = int(capacity / STEP) * STEP
                naive = sac.plan(naive_budget)
                naive_row = sweep(exe, path, args, naive) if naive["solved"] else None
                # The largest budget whose plan fits. Below some budget sac_milp finds no
                # solution; above it, its plans need more as the budget grows. So: the smallest
                # budget it solves (bisection), then the largest that fits above it.
                top = int(capacity / STEP)
                least = None  # the plan of the least budget sac_milp solves, when none fits
                fit = (naive, naive_row) if naive_row is not None and naive_row["fits"] else None
                if fit is None and naive["solved"]:
                    unsolved, solved = 0, top
                    while solved - unsolved > 1:
                        mid = (unsolved + solved) // 2
                        if sac.plan(mid * STEP)["solved"]:
                            solved = mid
                        else:
                            unsolved = mid
                    lo, hi = solved, top  # fits at lo once checked, not at hi
                    plan = sac.plan(lo * STEP)
                    row = sweep(exe, path, args, plan)
                    least = (plan, row)
                    if row["fits"]:
                        fit = (plan, row)
                        while hi - lo > 1:
                            mid = (lo + hi) // 2
                            plan = sac.plan(mid * STEP)
                            row = sweep(exe, path, args, plan)
                            if row["fits"]:
                                lo, fit = mid, (plan, row)
                            else:
                                hi = mid
            finally:
                sac.close()
            cells = [label, f"`{device}`", sac_label(naive) if naive["solved"] else "no solution",
                     smi(naive_row) if naive_row else ""]
            if fit:
                plan, row = fit
                cells += [f"{plan['budget_gib']:g} GiB", sac_label(plan), share(row["recompute_share"] or 0), smi(row)]
            elif least:
                plan, row = least
                cells += ["none", f"at {plan['budget_gib']:g} GiB, the least it solves: {sac_label(plan)}", "", smi(row)]
            else:
                cells += ["none", "", "", ""]
            cells += [ours["plan"], share(ours["recompute_share"]), gib(ours["max_nvidia_smi"])] if ours else \
                ["none fits", "", ""]
            rows.append("| " + " | ".join(cells) + " |")
    text = "\n".join(rows) + "\n"
    return text if chosen is not None else {"sac_ilp": text}


def only_some(cases_text):
    """`--only 0,2`: those cases run; the document's other rows stay as they are (CI runs the
    fast one; the coverage label all)."""
    wanted = {int(i) for i in cases_text.split(",")}
    full = tables

    def some(exe):
        doc = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / "docs" / "PLAN.md"
        old = doc_tables.section(doc.read_text(), "sac_ilp").splitlines()
        chosen = [c if i in wanted else None for i, c in enumerate(CASES)]
        rows = full(exe, chosen).splitlines()
        for i, case in enumerate(chosen):
            if case is None:
                rows[2 + i] = next((r for r in old if r.startswith(f"| {CASES[i][0]} |")), rows[2 + i])
        return {"sac_ilp": "\n".join(rows) + "\n"}
    return some


if __name__ == "__main__":
    generate = tables
    if "--only" in sys.argv:
        at = sys.argv.index("--only")
        generate = only_some(sys.argv[at + 1])
        del sys.argv[at:at + 2]
    sys.exit(doc_tables.main("sac_ilp_table", __doc__, ROOT / "docs" / "PLAN.md", generate))
