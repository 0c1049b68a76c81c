#!/usr/bin/env python3
"""gpu_reference_table.py: docs/VALIDATION.md's table of the H100 reference, from the command.

    gpu_reference_table.py update VRAMSCOPE [DOC]   # rewrite the table between the markers
    gpu_reference_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

For every row of ../shared/gpu-reference/h100-2026-11-26-training-steps.csv (what PyTorch
2.11 measured on an H100, each row run as that directory's README says) it runs
`vramscope sweep --format json` on sim:h100-80g under the stack the reference ran
(torch=2.11,transformers=5.17,peft=0.21) and under transformers 4.50 (the stack vramscope
modelled before), and tabulates max allocated, allocated after the step and max reserved,
measured against predicted. tests/models/gpu_reference_test.cpp asserts the tolerances; this
keeps the document's figures equal to the command's. Exit 77 without the reference files.
"""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import doc_tables

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path(os.environ.get("VRAMSCOPE_GPU_REFERENCE", ROOT.parent / "shared" / "gpu-reference"))
STEPS = REFERENCE / "h100-2026-11-26-training-steps.csv"
STACKS = [("2.11 / 5.17", "torch=2.11,transformers=5.17,peft=0.21"), ("2.11 / 4.50", "torch=2.11,transformers=4.50")]


def args_of(row):
    """The sweep arguments of one reference row."""
    model = row["model"]
    out = ["--batch", row["batch"], "--dtype", {"amp": "amp"}.get(row["dtype"], row["dtype"])]
    if model.startswith(("llama", "qwen")):
        out += ["--hf-config", str(ROOT / "models" / "zoo" / "hf" / f"{model}.json"), "--seq", row["seq"],
                "--attn", row["attn"]]
        if row["gradient_checkpointing"] != "none":
            out += ["--gradient-checkpointing", row["gradient_checkpointing"]]
        if row["lora"] != "0":
            out += ["--lora", row["lora"], "--lora-targets", row["lora_targets"]]
        if row["built_on"] == "gpu":
            out += ["--model-options", "built_on=gpu"]
    else:
        out += ["--model", model]
    if row["alloc_conf"]:
        out += ["--alloc-conf", row["alloc_conf"]]
    return out


def sweep(exe, row, stack):
    args = [exe, "sweep", *args_of(row), "--segments", "0", "--device", "sim:h100-80g", "--stack", stack,
            "--format", "json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return json.loads(done.stdout)["rows"][0]


def mib(n):
    return f"{n / (1 << 20):,.0f}"


def off(predicted, measured):
    return f"{100.0 * (predicted - measured) / measured:+.1f}%"


def describe(row):
    what = f"{row['model']} {row['dtype']}"
    if row["model"].startswith(("llama", "qwen")):
        what += f" b{row['batch']} s{row['seq']}"
        if row["attn"] != "sdpa":
            what += f" {row['attn']}"
        if row["lora"] != "0":
            what += f" LoRA r={row['lora']} {row['lora_targets']}"
        if row["gradient_checkpointing"] != "none":
            what += f", {row['gradient_checkpointing']} checkpointing"
    else:
        what += f" b{row['batch']}"
    if row["alloc_conf"]:
        what += f" [{row['alloc_conf']}]"
    if row["built_on"] == "gpu":
        what += ", built on the GPU"
    return what


def table(exe):
    lines = ["| row | configuration | max allocated: H100 | " +
             " | ".join(f"vramscope {name}" for name, _ in STACKS) +
             " | after the step: H100 / vramscope | max reserved: H100 / vramscope |",
             "|---|---|---:|" + "---:|" * len(STACKS) + "---:|---:|"]
    for row in csv.DictReader(STEPS.open()):
        measured = int(row["max_allocated"])
        predicted = [sweep(exe, row, stack) for _, stack in STACKS]
        cells = [f"{mib(p['max_allocated'])} ({off(p['max_allocated'], measured)})" for p in predicted]
        now = predicted[0]
        lines.append(f"| {row['id']} | {describe(row)} | {mib(measured)} | " + " | ".join(cells) +
                     f" | {int(row['allocated_after_step']) / (1 << 20):,.1f} / "
                     f"{now['allocated_after_step'] / (1 << 20):,.1f} | {mib(int(row['max_reserved']))} / "
                     f"{mib(now['max_reserved'])} ({off(now['max_reserved'], int(row['max_reserved']))}) |")
    return "\n".join(lines) + "\n"


def main():
    if not STEPS.exists() and sys.argv[1:2] in (["update"], ["check"]):
        print(f"gpu_reference_table: skipped, {STEPS} is absent")
        return 77
    return doc_tables.main("gpu_reference_table", __doc__, ROOT / "docs" / "VALIDATION.md",
                           lambda exe: {"h100-reference": table(exe)})


if __name__ == "__main__":
    sys.exit(main())
