#!/usr/bin/env python3
"""check_parallel.py VRAMSCOPE: DistributedDataParallel's gradient buckets and FSDP2's shards
and all-gather outputs under today's PyTorch against `vramscope trace --parallel ddp:8|fsdp:8
--buffers`, to the byte and in order.

Runs scripts/parallel_reference.py on the CPU with the current-stack environment
(scripts/stack_env.sh; its python in VRAMSCOPE_STACK_PYTHON, or this interpreter if it has
torch and transformers): rank 0 of world size 8 on PyTorch's fake process group, a comm hook
recording every bucket DDP reduces (fact sheet: the fake group needs one that returns the
bucket). Models: a residual MLP of odd width, a CNN with batch norms and a two-layer bf16 Llama
(tests/data/h100-parallel-2026-11-26 holds them as vramscope reads them). The first
backward's buckets (one of every gradient per dtype) and the rebuilt ones of the second must
equal vramscope's, size for size, in the order DDP reduces them. Under FSDP2 (fully_shard on each
block, then the root), each group's padded shards and all-gather output (FSDPState's own
parameters, sharded and padded sizes) must equal vramscope's group by group.

Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "h100-parallel-2026-11-26"
MODELS = {  # parallel_reference.py's model -> the same model and step for vramscope
    "mlp": ["--model-file", str(DATA / "ref-resmlp.json"), "--dtype", "f32"],
    "cnn": ["--model-file", str(DATA / "ref-cnn.json"), "--dtype", "f32"],
    "llama": ["--hf-config", str(DATA / "ref-llama-2layer.json"), "--batch", "2", "--seq", "256",
              "--attn", "sdpa", "--dtype", "bf16"],
}
CASES = {f"{model}-{engine}-r0": (engine, args) for model, args in MODELS.items() for engine in ("ddp", "fsdp2")}


def check_ddp(config, got, rows, failures):
    torch_steps = {1: [], 2: []}
    for call in got["bucket_calls"]:
        if call["step"] in torch_steps:
            torch_steps[call["step"]].append(call["bytes"])
    ours = {1: [r["bytes"] for r in rows if r["buffer"].startswith("gradient bucket") and "rebuilt" not in r["buffer"]],
            2: [r["bytes"] for r in rows if r["buffer"].startswith("gradient bucket") and "rebuilt" in r["buffer"]]}
    for step in (1, 2):
        verdict = "ok" if ours[step] == torch_steps[step] else "DIFFERS"
        print(f"  {config} step {step}: PyTorch {torch_steps[step]}, vramscope {ours[step]}: {verdict}")
        if ours[step] != torch_steps[step]:
            failures.append(f"{config} step {step}")


def check_fsdp(config, got, rows, failures):
    groups = got["fsdp_groups"]  # the root first, then the blocks, as FSDPState lists them
    torch_shards = [g["padded_shard_bytes"] for g in groups]
    torch_gathered = [g["all_gather_output_bytes"] for g in groups]
    shards = {r["buffer"][:-len(" shards")]: r["bytes"] for r in rows if r["buffer"].endswith(" shards")
              and not r["buffer"].endswith("post-forward shards")}
    ours_shards = [shards.get(g["module"].replace("<root>", "root")) for g in groups]
    ours_gathered = [r["bytes"] for r in rows
                     if r["buffer"].endswith("all-gather output") and r["allocated"] == "step 1 forward"]
    for what, theirs, ours in (("shards", torch_shards, ours_shards), ("all-gather outputs", torch_gathered, ours_gathered)):
        verdict = "ok" if ours == theirs else "DIFFERS"
        print(f"  {config} {what}: PyTorch {theirs}, vramscope {ours}: {verdict}")
        if ours != theirs:
            failures.append(f"{config} {what}")


def main() -> int:
    reexec_on_stack("check_parallel")
    import torch
    import transformers
    exe = sys.argv[1]
    stack = (f"torch={'.'.join(torch.__version__.split('+')[0].split('.')[:2])},"
             f"transformers={'.'.join(transformers.__version__.split('.')[:2])}")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_json = Path(tmp) / "ref.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "parallel_reference.py"), "--device", "cpu",
                        "--only", ",".join(CASES), "--timeout", "300", "--csv", str(Path(tmp) / "ref.csv"), "--json", str(ref_json)],
                       check=True, capture_output=True, text=True, timeout=600)
        configs = json.loads(ref_json.read_text())["configs"]
        for config, (engine, args) in CASES.items():
            got = configs[config]
            if got.get("error"):
                failures.append(f"{config}: PyTorch's run failed: {got['error']}")
                continue
            buffers = Path(tmp) / f"{config}.json"
            parallel = ["--parallel", "ddp:8"] if engine == "ddp" else ["--parallel", "fsdp:8"]
            subprocess.run([exe, "trace", *args, "--device", "sim:h100-80g", "--steps", "2", *parallel,
                            "--stack", stack, "--buffers", str(buffers)], check=True, capture_output=True, text=True)
            rows = json.loads(buffers.read_text())
            (check_ddp if engine == "ddp" else check_fsdp)(config, got, rows, failures)
    print(f"check_parallel: torch {torch.__version__}, transformers {transformers.__version__}: "
          f"{'all buckets, shards and all-gathers equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
