#!/usr/bin/env python3
"""plan_ops_table.py: docs/PLAN.md's table of operator-level plans against whole-module plans.

    plan_ops_table.py update VRAMSCOPE [DOC]   # rewrite the table between the markers
    plan_ops_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

Each case is recorded at the operator level by `python3 -m vramscope.export` (on the current
stack's Python, VRAMSCOPE_STACK_PYTHON: the exporter needs PyTorch), then planned twice with
`vramscope plan --format json`: `--search none` (whole modules: checkpointing alone) and
`--search selective` (the same, and the checkpointed modules may keep their costly operators'
outputs). The table sets the two best plans side by side; every figure is a dry run's.
Exit 77 (skipped) without the stack, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_tables

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "models" / "zoo" / "hf"
CASES = [  # label, exporter arguments, plan arguments
    ("llama-3.1-8b LoRA r=16, batch 4 x 4096, bf16",
     ["--hf-config", str(HF / "llama-3.1-8b.json"), "--batch", "4", "--seq", "4096", "--lora", "16"],
     ["--dtype", "bf16", "--device", "sim:h100-80g"]),
    ("torchvision vit_b_16, batch 256, f32", ["torchvision.models:vit_b_16", "--input", "256,3,224,224"],
     ["--device", "sim:a100-40g"]),
    ("torchvision resnet50, batch 256, f32", ["torchvision.models:resnet50", "--input", "256,3,224,224"],
     ["--device", "sim:rtx4090"]),
]


def stack_python() -> str:
    python = os.environ.get("VRAMSCOPE_STACK_PYTHON", "")
    if not python:
        if os.environ.get("VRAMSCOPE_REQUIRE_STACK") == "1":
            sys.exit("FAIL plan_ops_table: VRAMSCOPE_STACK_PYTHON is not set")
        print("plan_ops_table: skipped, no current-stack Python (VRAMSCOPE_STACK_PYTHON)")
        sys.exit(77)
    return python


def gib(n):
    return f"{n / (1 << 30):.2f} GiB"


def pct(share):
    return "0" if share == 0 else f"{100 * share:.2g}%" if share < 0.001 else f"{100 * share:.1f}%"


def plan(exe, args, search):
    command = [exe, "plan", *args, "--search", search, "--format", "json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)}: exit {out.returncode}\n{out.stderr}")
    r = json.loads(out.stdout)
    index = r.get("best")
    return r["plans"][index] if isinstance(index, int) and 0 <= index < len(r["plans"]) else None


def tables(exe):
    python = stack_python()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), TQDM_DISABLE="1")
    rows = ["| case (recorded at the operator level) | device | best plan | recompute | max nvidia-smi | "
            "best by whole modules | recompute | max nvidia-smi |", "|---|---|---|---:|---:|---|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, export, args) in enumerate(CASES):
            path = Path(tmp) / f"case{i}.json"
            run = subprocess.run([python, "-m", "vramscope.export", *export, "--level", "ops", "-o", str(path)],
                                 capture_output=True, text=True, env=env, timeout=600)
            if run.returncode != 0:
                raise SystemExit(f"export of {label} failed:\n{run.stderr}")
            ops, modules = plan(exe, ["--model-file", str(path), *args], "selective"), \
                plan(exe, ["--model-file", str(path), *args], "none")
            device = args[args.index("--device") + 1]
            cells = [label, f"`{device}`"]
            for p in (ops, modules):
                cells += [p["plan"], pct(p["recompute_share"]), gib(p["max_nvidia_smi"])] if p else ["none fits", "", ""]
            rows.append("| " + " | ".join(cells) + " |")
    return {"ops": "\n".join(rows) + "\n"}


if __name__ == "__main__":
    sys.exit(doc_tables.main("plan_ops_table", __doc__, ROOT / "docs" / "PLAN.md", tables))
