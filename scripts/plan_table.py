#!/usr/bin/env python3
"""plan_table.py: the zoo table of docs/PLAN.md, from `vramscope plan`.

    plan_table.py update VRAMSCOPE [DOC]   # rewrite the table between the markers
    plan_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

For each case it runs `vramscope plan --search none --format json` (checkpointing alone, the
step's arithmetic untouched) and sets the best plan beside the best uniform checkpointing
that fits: checkpoint_sequential's best segment count, or every repeated block (what
gradient_checkpointing_enable() does for a decoder). Every figure is a dry run's. The
"code" block is what `--code` writes for the last case.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_tables

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # label, arguments
    ("resnet152, batch 256, f32", ["--model", "resnet152", "--batch", "256", "--device", "sim:a100-40g"]),
    ("vit_l_16, batch 64, f32", ["--model", "vit_l_16", "--batch", "64", "--device", "sim:rtx4090"]),
    ("gpt2-xl, batch 4 x 1024, bf16", ["--model", "gpt2-xl", "--batch", "4", "--seq", "1024", "--dtype", "bf16",
                                       "--device", "sim:rtx4090"]),
    ("llama-3.1-8b LoRA r=16, batch 1 x 2048, bf16", ["--model", "llama-3.1-8b", "--lora", "16", "--batch", "1",
                                                     "--seq", "2048", "--attn", "sdpa", "--dtype", "bf16",
                                                     "--device", "sim:rtx4090"]),
]


def gib(n):
    return f"{n / (1 << 30):.2f} GiB"


def pct(share):
    return f"{100 * share:.1f}%"


def plan(exe, args):
    command = [exe, "plan", *args, "--search", "none", "--format", "json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {out.returncode}\n{out.stderr}")
    return json.loads(out.stdout)


def tables(exe):
    rows = ["| case | device | best plan | recompute | max nvidia-smi | best uniform | recompute | max nvidia-smi |",
            "|---|---|---|---:|---:|---|---:|---:|"]
    for label, args in CASES:
        r = plan(exe, args)
        device = args[args.index("--device") + 1]
        best = r["plans"][r["best"]] if r["best"] is not None and r["best"] >= 0 else None
        uniform = [p for p in r["plans"] if p["fits"] and (p["segments"] > 1 or p["checkpointing"] == "blocks"
                                                           and p["plan"].startswith("checkpoint every block"))]
        uniform.sort(key=lambda p: (p["recompute_share"], p["max_nvidia_smi"]))
        u = uniform[0] if uniform else None
        cells = [label, f"`{device}`"]
        cells += [best["plan"], pct(best["recompute_share"]), gib(best["max_nvidia_smi"])] if best else ["none fits", "", ""]
        cells += [u["plan"], pct(u["recompute_share"]), gib(u["max_nvidia_smi"])] if u else ["none fits", "", ""]
        rows.append("| " + " | ".join(cells) + " |")
    with tempfile.TemporaryDirectory() as tmp:  # the code of the llama case's best plan
        code = Path(tmp) / "plan.py"
        plan(exe, CASES[-1][1] + ["--code", str(code)])
        block = "```python\n" + code.read_text() + "```\n"
    return {"zoo": "\n".join(rows) + "\n", "code": block}


if __name__ == "__main__":
    sys.exit(doc_tables.main("plan_table", __doc__, ROOT / "docs" / "PLAN.md", tables))
