#!/usr/bin/env python3
"""transformers_table.py: the fine-tuning tables of docs/TRANSFORMERS.md, from the command.

    transformers_table.py update VRAMSCOPE [DOC]   # rewrite the tables between the markers
    transformers_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

For llama-3.2-1b and llama-3.1-8b at batch 1, sequence 2048, it runs `vramscope sweep
--format json` for a full fine-tune (bf16 weights and AdamW), LoRA and QLoRA (rank 16 on
every projection), each without and with gradient checkpointing, on three simulated GPUs,
and writes what fits and what the peak is made of. Every figure comes from the dry run.
"""
import json
import subprocess
import sys
from pathlib import Path

import doc_tables

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["llama-3.2-1b", "llama-3.1-8b"]
SETUPS = [
    ("full fine-tune", []),
    ("LoRA r=16", ["--lora", "16", "--lora-targets", "all"]),
    ("QLoRA r=16", ["--lora", "16", "--lora-targets", "all", "--quant", "nf4"]),
]
CHECKPOINTING = [("none", []), ("per layer", ["--gradient-checkpointing", "reentrant"])]
DEVICES = ["sim:a100-80g", "sim:rtx4090", "sim:t4"]
KINDS = [("weights", "peak_weights"), ("gradients", "peak_gradients"),
         ("optimizer state", "peak_optimizer_state"), ("optimizer temporaries", "peak_optimizer_temporaries"),
         ("activations", "peak_activations"), ("workspaces", "peak_workspaces"),
         ("logits and loss", "peak_logits")]


def gib(n):
    return f"{n / (1 << 30):.2f} GiB"


def sweep(exe, model, device, extra):
    args = [exe, "sweep", "--model", model, "--seq", "2048", "--dtype", "bf16", "--attn", "sdpa",
            "--device", device, "--format", "json", *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {out.returncode}\n{out.stderr}")
    return json.loads(out.stdout)["rows"][0]


def tables(exe):
    composition = ["| model | fine-tune | checkpointing | max allocated | " +
                   " | ".join(k for k, _ in KINDS) + " |",
                   "|---|---|---|---:|" + "---:|" * len(KINDS)]
    fits = ["| model | fine-tune | checkpointing | " + " | ".join(d for d in DEVICES) + " |",
            "|---|---|---|" + ":---|" * len(DEVICES)]
    for model in MODELS:
        for setup, setup_args in SETUPS:
            for ckpt, ckpt_args in CHECKPOINTING:
                rows = {d: sweep(exe, model, d, setup_args + ckpt_args) for d in DEVICES}
                # What the peak holds does not depend on the device; an OOM row carries the
                # run without the limit.
                r = next((x for x in rows.values() if x["fits"]), rows[DEVICES[0]])
                peak = r["max_allocated"] if r["fits"] else r["needs_max_allocated"]
                composition.append(f"| {model} | {setup} | {ckpt} | {gib(peak)} | " +
                                   " | ".join(gib(r[key] or 0) for _, key in KINDS) + " |")
                cells = []
                for d in DEVICES:
                    x = rows[d]
                    if x["fits"]:
                        cells.append(f"fits ({gib(x['max_nvidia_smi'])} in nvidia-smi)")
                    else:
                        cells.append(f"**OOM** (needs {gib(x['needs_max_nvidia_smi'])})")
                fits.append(f"| {model} | {setup} | {ckpt} | " + " | ".join(cells) + " |")
    return {"composition": "\n".join(composition) + "\n", "fits": "\n".join(fits) + "\n"}


if __name__ == "__main__":
    sys.exit(doc_tables.main("transformers_table", __doc__, ROOT / "docs" / "TRANSFORMERS.md", tables))
