#!/usr/bin/env python3
"""korthikanti_table.py: docs/PARALLEL.md's table of one decoder layer's activations under
tensor + sequence parallel against Korthikanti et al.'s per-layer formula.

    korthikanti_table.py update VRAMSCOPE [DOC]   # rewrite the table between the markers
    korthikanti_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

The layer is GPT-3 175B's shape in the Llama layout (tests/data/gpt3-layout-llama.json: h =
12288, 96 heads, an MLP of 4h, two layers), at s = 2048, b = 1, bf16, SDPA. For each degree t,
`vramscope trace --parallel tp:t --saved` gives what the first layer's modules keep for backward
(model.layers.0.*, each storage once); the table states it per s*b*h bytes beside Korthikanti
et al. (arXiv 2205.05198, Table 2) for TP + SP: 34/t with selective recomputation (the
attention's 5as/h term recomputed, as flash attention never stores it), 34/t + 5as/(ht) without.
"""
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_tables

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "data" / "gpt3-layout-llama.json"
S, B, H, HEADS = 2048, 1, 12288, 96
DEGREES = (1, 2, 4, 8)


def layer_bytes(exe, t):
    """Bytes the first decoder layer saves for backward at tensor-parallel degree t."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved.csv"
        parallel = ["--parallel", f"tp:{t}"] if t > 1 else []
        subprocess.run([exe, "trace", "--hf-config", str(CONFIG), "--batch", str(B), "--seq", str(S), "--dtype",
                        "bf16", "--attn", "sdpa", "--device", "sim:capacity=4TiB", "--steps", "1", *parallel,
                        "--saved", str(saved)], check=True, capture_output=True, text=True, timeout=600)
        with saved.open() as f:
            return sum(int(r["bytes"]) for r in csv.DictReader(f) if r["module"].startswith("model.layers.0"))


def tables(exe):
    sbh = S * B * H
    rows = ["| t | vramscope, bytes | per s·b·h | Korthikanti, selective: 34/t | without: 34/t + 5as/(ht) |",
            "|---:|---:|---:|---:|---:|"]
    for t in DEGREES:
        got = layer_bytes(exe, t)
        rows.append(f"| {t} | {got:,} | {got / sbh:.2f} | {34 / t:.2f} | {34 / t + 5 * HEADS * S / (H * t):.2f} |")
    return {"korthikanti": "\n".join(rows) + "\n"}


if __name__ == "__main__":
    sys.exit(doc_tables.main("korthikanti_table", __doc__, ROOT / "docs" / "PARALLEL.md", tables))
