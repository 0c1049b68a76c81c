#!/usr/bin/env python3
"""check_compiled.py VRAMSCOPE [--all]: the torch.compile'd step's saved values, vramscope's
partitioner against PyTorch's own.

For each model below (transformers decoders with odd sizes, torchvision CNNs and a ViT), on the
current stack, on fake CPU tensors:
1. `vramscope.export --compile` records the joint graph AOTAutograd's partitioner sees;
2. `vramscope sweep --compile on,B...` chooses the saved values itself (runtime/src/compiled/
   min_cut_partition.cpp) under each activation_memory_budget B;
3. PyTorch compiles the same step with torch._functorch.config.activation_memory_budget = B and
   its min_cut_rematerialization_partition chooses them (read where choose_saved_values_set
   returns, the forward graph's saved outputs);
4. both lists of node names are equal, in order, for every budget;
5. at another size (the batch + 3, the sequence + 5), the file's formulas give the joint graph
   PyTorch compiles there: the saved values are equal again (default and 0.5).

By default a representative part runs (CI); --all runs every model (ctest -L coverage).
Exit 77 (skipped) without torch and the current stack.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

BUDGETS = [1.0, 0.5, 0.1, 0.0]
# Odd sizes, so that no two tensors share a size by chance and a wrong choice shows.
DECODER = {"hidden_size": 96, "intermediate_size": 250, "num_hidden_layers": 2, "num_attention_heads": 6,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "max_position_embeddings": 512,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CASES = [
    # name, kind, in CI
    ("llama", "hf", True),
    ("llama+lora", "hf", False),  # PEFT's LoRA r=8 on PEFT's default targets, the base frozen
    ("qwen3", "hf", False),
    ("gemma3_text", "hf", False),
    ("qwen3_moe", "hf", False),  # a mixture of experts, grouped_mm over the routed rows
    ("resnet18", "torchvision", True),
    ("convnext_tiny", "torchvision", False),
    ("vit_b_32", "torchvision", False),
]


def skip(why: str) -> None:
    if os.environ.get("VRAMSCOPE_REQUIRE_STACK") == "1":
        sys.exit(f"FAIL check_compiled: {why}")
    print(f"check_compiled: skipped, {why}")
    sys.exit(77)


def hf_case(name: str, folder: Path):
    """(doc, meta model, make_inputs, batch, seq, step) of a transformers decoder ("+lora": with
    PEFT's LoRA of rank 8)."""
    import torch
    import transformers
    from vramscope.export import export_hf_config, with_lora
    name, _, variant = name.partition("+")
    lora = 8 if variant == "lora" else 0
    values = dict(DECODER, model_type=name)
    if name == "gemma3_text":
        values["sliding_window"] = 128
    if name == "qwen3_moe":
        values.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    path = folder / f"{name}{variant}.json"
    path.write_text(json.dumps(values))
    doc = export_hf_config(str(path), batch=2, seq=64, compile=True, lora=lora)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.bfloat16).train()
    if lora:
        model = with_lora(model, lora)

    def make_inputs(b: int, s: int):
        ids = torch.empty((b, s), dtype=torch.int64, device="meta")
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}

    return doc, model, make_inputs, 2, 64, lambda m, *a, **k: m(*a, **k).loss


def torchvision_case(name: str):
    import torch
    import torchvision
    from vramscope.export import InputSpec, export_ops, _on_meta
    from vramscope.export._compiled import step_with_loss
    from vramscope.export._opfile import _pick
    built = torchvision.models.get_model(name, weights=None)
    doc = export_ops(built, [InputSpec([2, 3, 224, 224])], name=name, compile=True)
    model = _on_meta(built)

    def make_inputs(b: int, s: int):
        return (torch.empty((b, 3, 224, 224), dtype=torch.bfloat16, device="meta"),), {}

    graph = doc["graph"]
    step, with_target = step_with_loss(make_inputs, doc["loss"], _pick(None),
                                       graph["tensors"][graph["output"]]["shape"])
    return doc, model, with_target, 2, None, step


def vramscope_saved(binary: str, doc: dict, folder: Path, name: str, budgets=BUDGETS, size=()) -> dict:
    path = folder / f"{name}-model.json"
    path.write_text(json.dumps(doc))
    listed = ",".join("on" if b == 1 else f"{b:g}" for b in budgets)
    run = subprocess.run([binary, "sweep", "--model-file", str(path), "--dtype", "bf16", "--segments", "0",
                          "--compile", listed, "--device", "sim:h100-80g", "--steps", "1", "--format", "json",
                          *size], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"vramscope sweep failed: {run.stderr.strip()}")
    out = {}
    for row in json.loads(run.stdout)["rows"]:
        if row["compile"] is not None:
            out[row["compile"]] = row["compiled"]["saved_values"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vramscope")
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        skip(f"needs torch, torchvision and transformers ({e})")
    from vramscope.export._compiled import record_compiled
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, kind, ci in CASES:
            if not (ci or args.all):
                continue
            start = time.time()
            doc, model, make_inputs, batch, seq, step = (hf_case(name, folder) if kind == "hf"
                                                         else torchvision_case(name))
            ours = vramscope_saved(args.vramscope, doc, folder, name)
            nodes = len(doc["compiled"]["graph"]["nodes"])
            for budget in BUDGETS:
                record, _ = record_compiled(model, make_inputs, batch, seq, step, budget=budget)
                theirs = record["saved"]
                mine = ours.get(budget)
                status = "equal" if mine == theirs else "DIFFERENT"
                print(f"{name:14s} budget {budget:<4g} {nodes:5d} nodes: PyTorch saves {len(theirs):4d} values, "
                      f"vramscope {len(mine or []):4d}: {status}")
                if mine != theirs:
                    only_theirs = [v for v in theirs if v not in (mine or [])]
                    only_mine = [v for v in (mine or []) if v not in theirs]
                    failures.append(f"{name} budget {budget}: only PyTorch's {only_theirs[:12]}, only vramscope's "
                                    f"{only_mine[:12]}")
            # Another size, from the file's formulas.
            if "fixed" in doc["compiled"]:
                failures.append(f"{name}: the file's sizes are fixed ({doc['compiled']['fixed']})")
                continue
            other_batch, other_seq = batch + 3, (seq + 5 if seq else None)
            size = ["--batch", str(other_batch)] + (["--seq", str(other_seq)] if other_seq else [])
            ours = vramscope_saved(args.vramscope, doc, folder, name, [1.0, 0.5], size)
            for budget in (1.0, 0.5):
                record, _ = record_compiled(model, make_inputs, other_batch, other_seq, step, budget=budget)
                theirs, mine = record["saved"], ours.get(budget)
                status = "equal" if mine == theirs else "DIFFERENT"
                print(f"{name:14s} budget {budget:<4g} at {' '.join(size)}: PyTorch saves {len(theirs):4d} values, "
                      f"vramscope {len(mine or []):4d}: {status}")
                if mine != theirs:
                    failures.append(f"{name} budget {budget} at {' '.join(size)}: differ")
            print(f"  ({time.time() - start:.1f} s)")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
