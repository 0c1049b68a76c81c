#!/usr/bin/env python3
"""korthikanti_table.py: docs/PARALLEL.md's tables of one transformer layer's activations against
Korthikanti et al.'s per-layer formula: a Llama-layout layer under tensor + sequence parallel,
and GPT-3's own layer term by term.

    korthikanti_table.py update VRAMSCOPE [DOC]   # rewrite the table between the markers
    korthikanti_table.py check VRAMSCOPE [DOC]    # exit 1 when the document differs

The layer is GPT-3 175B's shape in the Llama layout (tests/data/gpt3-layout-llama.json: h =
12288, 96 heads, an MLP of 4h, two layers), at s = 2048, b = 1, bf16, SDPA. For each degree t,
`vramscope trace --parallel tp:t --saved` gives what the first layer's modules keep for backward
(model.layers.0.*, each storage once); the table states it per s*b*h bytes beside Korthikanti
et al. (arXiv 2205.05198, Table 2) for TP + SP: 34/t with selective recomputation (the
attention's 5as/h term recomputed, as flash attention never stores it), 34/t + 5as/(ht) without.

GPT-3's own layer (tests/data/gpt3-175b-layer.json: GPT-2's layout, which GPT-3 keeps, at GPT-3
175B's size, GELU, dropout 0.1; t = 1, as vramscope's tensor parallel plan is torchtitan's Llama
one) is the formula's own case: each module's bytes with transformers' eager attention beside
the terms of the paper's section 4.1 that it accounts for, and with SDPA (flash, which keeps
no scores: the formula's selective recomputation) beside 34 per s*b*h.
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


GPT3 = ROOT / "tests" / "data" / "gpt3-175b-layer.json"
# Korthikanti et al. section 4.1, per module of GPT-2's layer: the terms in units of s*b*h,
# and those of a*s*s*b (the attention's softmax output 2, dropout mask 1, dropout output 2).
GPT3_TERMS = (
    ("ln_1", "its input (and f32 mean, rstd per token)", "LayerNorm's input", 2, 0),
    ("attn.c_attn", "its input (ln_1's output)", "QKV's input", 2, 0),
    ("attn", "q, k, v (c_attn's output), softmax's output, dropout's output", "Q, K 4; V 2; softmax 2as/h; "
     "dropout output 2as/h", 6, 4),
    ("attn.attn_dropout", "its mask (bool)", "dropout mask as/h", 0, 1),
    ("attn.c_proj", "its input (the heads merged)", "projection's input", 2, 0),
    ("attn.resid_dropout", "its mask", "dropout mask", 1, 0),
    ("ln_2", "its input (and f32 mean, rstd per token)", "LayerNorm's input", 2, 0),
    ("mlp.c_fc", "its input (ln_2's output)", "first linear's input", 2, 0),
    ("mlp.act", "its input", "GeLU's input", 8, 0),
    ("mlp.c_proj", "its input (GELU's output)", "second linear's input", 8, 0),
    ("mlp.dropout", "its mask", "dropout mask", 1, 0),
)


def saved_rows(exe, config, prefix, *options):
    """What the first layer's modules save for backward: {module without `prefix`: bytes}."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved.csv"
        subprocess.run([exe, "trace", "--hf-config", str(config), "--batch", str(B), "--seq", str(S), "--dtype",
                        "bf16", "--device", "sim:capacity=4TiB", "--steps", "1", *options, "--saved", str(saved)],
                       check=True, capture_output=True, text=True, timeout=600)
        with saved.open() as f:
            return {r["module"].removeprefix(prefix): int(r["bytes"]) for r in csv.DictReader(f)
                    if r["module"].startswith(prefix)}


def layer_bytes(exe, t):
    """Bytes the first decoder layer saves for backward at tensor-parallel degree t."""
    parallel = ["--parallel", f"tp:{t}"] if t > 1 else []
    return sum(saved_rows(exe, CONFIG, "model.layers.0", "--attn", "sdpa", *parallel).values())


def gpt3_table(exe):
    """GPT-3's layer module by module against the formula's terms (s*b*h and a*s*s*b bytes),
    with eager attention, and beside it with SDPA's flash kernel (the formula's selective case)."""
    sbh, as2b = S * B * H, HEADS * S * S * B
    got = saved_rows(exe, GPT3, "transformer.h.0.", "--attn", "eager")
    flash = saved_rows(exe, GPT3, "transformer.h.0.", "--attn", "sdpa")
    unknown = (set(got) | set(flash)) - {m for m, *_ in GPT3_TERMS}
    if unknown:
        sys.exit(f"korthikanti_table: modules of GPT-2's layer without a term here: {sorted(unknown)}")
    rows = ["| module | keeps (eager) | eager, bytes | Korthikanti's terms | their bytes | difference "
            "| SDPA, bytes |",
            "|:---|:---|---:|:---|---:|---:|---:|"]
    total = formula = 0
    for module, keeps, terms, per_sbh, per_as2b in GPT3_TERMS:
        theirs = per_sbh * sbh + per_as2b * as2b
        mine = got.get(module, 0)
        total, formula = total + mine, formula + theirs
        rows.append(f"| {module} | {keeps} | {mine:,} | {terms} | {theirs:,} | {mine - theirs:+,} "
                    f"| {flash.get(module, 0):,} |")
    rows.append(f"| **layer** | | **{total:,}** | **34 + 5as/h = {34 + 5 * HEADS * S / H:.0f} per s·b·h** "
                f"| **{formula:,}** | **{total - formula:+,}** | |")
    selective = sum(flash.values())
    rows.append(f"| **layer, selective** | | | **34 per s·b·h** | **{34 * sbh:,}** | **{selective - 34 * sbh:+,}** "
                f"| **{selective:,}** |")
    return "\n".join(rows) + "\n"


def tables(exe):
    sbh = S * B * H
    rows = ["| t | vramscope, bytes | per s·b·h | Korthikanti, selective: 34/t | without: 34/t + 5as/(ht) |",
            "|---:|---:|---:|---:|---:|"]
    for t in DEGREES:
        got = layer_bytes(exe, t)
        rows.append(f"| {t} | {got:,} | {got / sbh:.2f} | {34 / t:.2f} | {34 / t + 5 * HEADS * S / (H * t):.2f} |")
    return {"korthikanti": "\n".join(rows) + "\n", "korthikanti-gpt3": gpt3_table(exe)}


if __name__ == "__main__":
    sys.exit(doc_tables.main("korthikanti_table", __doc__, ROOT / "docs" / "PARALLEL.md", tables))
