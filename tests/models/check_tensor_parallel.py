#!/usr/bin/env python3
"""check_tensor_parallel.py VRAMSCOPE: tensor + sequence parallel under today's PyTorch against
`vramscope trace --parallel tp:N --buffers`, buffer for buffer and in order.

PyTorch runs on the CPU, rank 0 of world size N on its fake process group: the two-layer bf16
Llama of tests/data/h100-parallel-2026-11-26 (transformers' LlamaForCausalLM, SDPA) under
torchtitan's plan (torch.distributed.tensor.parallel.parallelize_module: the embedding
row-wise with a Shard(1) output, sequence-parallel norms, PrepareModuleInput Shard(1) ->
Replicate before the attention and the MLP, q/k/v/gate/up column-wise, o/down row-wise with a
Shard(1) output, lm_head column-wise from Shard(1) to Replicate), position_ids passed (the
local hidden states would give transformers the local length), one step of AdamW (foreach).
The CPU profiler's allocations (profile_memory) inside DTensor's redistributions are the
buffers: all_gather_into_tensor's and reduce_scatter_tensor's outputs, the torch.cat that
rearranges a gather on dim != 0 or stages a reduce-scatter's input, and the clone of a
Replicate gradient's chunk. They must equal vramscope's, kind and bytes, in order, forward and
backward. The embedding's gradient is the whole table (Replicate), the norms' stay Partial:
the optimizer's foreach ops copy each such gradient per operand (one for lerp_, two for
addcmul_) before _foreach_sqrt's temporaries; vramscope's optimizer temporaries (its snapshot)
must be those, in order.

Each world size runs in a process of its own (`--world N` prints PyTorch's side as JSON).
Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "data" / "h100-parallel-2026-11-26" / "ref-llama-2layer.json"
BATCH, SEQ = 2, 256
WORLDS = (2, 4)


def kind_of(chain):
    """The buffer a profiled allocation inside a redistribution is, or None."""
    if "all_gather_into_tensor" in chain:
        return "all-gather output"
    if "reduce_scatter_tensor" in chain:
        return "reduce-scatter output"
    if "Redistribute" in chain and chain.endswith("cat"):
        return "cat"
    if "Redistribute" in chain and "clone" in chain:
        return "chunk"
    return None


def torch_side(world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    cfg = LlamaConfig.from_dict({**json.loads(CONFIG.read_text()), "use_cache": False})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    parallelize_module(model.model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel()})
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    positions = torch.arange(SEQ)[None]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()
        grads = {n: local(p.grad).untyped_storage().nbytes() for n, p in model.named_parameters()}
        opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    step_span = [o for o in ops if o["name"].startswith("Optimizer.step")]
    opt_start = min(o["ts"] for o in step_span)

    def chain(ts, tid):
        around = sorted((o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"] and o["tid"] == tid),
                        key=lambda o: -o["dur"])
        return " > ".join(o["name"] for o in around)

    buffers, optimizer_copies = [], []
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        size = e["args"]["Bytes"]
        if size <= 0:
            continue
        where = chain(e["ts"], e["tid"])
        if e["ts"] >= opt_start:
            copies = ("_foreach_lerp_" in where or "_foreach_addcmul_" in where) and "clone" in where
            if copies or "_foreach_sqrt" in where:
                optimizer_copies.append(size)
            continue
        kind = kind_of(where)
        if kind:
            buffers.append([kind, size])
    return {"buffers": buffers, "embedding_grad": grads["model.embed_tokens.weight"],
            "optimizer_copies": optimizer_copies}


def ours(exe, world, tmp):
    common = ["--hf-config", str(CONFIG), "--batch", str(BATCH), "--seq", str(SEQ), "--attn", "sdpa",
              "--dtype", "bf16", "--device", "sim:h100-80g", "--steps", "1", "--parallel", f"tp:{world}"]
    out = Path(tmp) / f"tp{world}.json"
    subprocess.run([exe, "trace", *common, "--buffers", str(out)], check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())

    def kind(name):
        for suffix, k in (("all-gather output", "all-gather output"), ("reduce-scatter output", "reduce-scatter output"),
                          ("all-gather cat", "cat"), ("reduce-scatter input", "cat"), ("chunk", "chunk")):
            if name.endswith(suffix):
                return k
        raise ValueError(name)

    # The optimizer's temporaries, as the snapshot names them: the redistributed gradients'
    # copies, then _foreach_sqrt's outputs.
    snapshot = Path(tmp) / f"tp{world}.pickle"
    subprocess.run([exe, "trace", *common, "--snapshot", str(snapshot)], check=True, capture_output=True, text=True)
    with snapshot.open("rb") as f:
        events = pickle.load(f)["device_traces"][0]
    temporaries = [e["size"] for e in events if e["action"] == "alloc" and e["frames"]
                   and e["frames"][0]["filename"].endswith("(optimizer temporaries)")]
    embedding_grad = max(e["size"] for e in events if e["action"] == "alloc" and e["frames"]
                         and e["frames"][0]["filename"] == "model.embed_tokens.weight.grad")
    return [[kind(r["buffer"]), r["bytes"]] for r in rows], temporaries, embedding_grad


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--world":
        print(json.dumps(torch_side(int(sys.argv[2]))))
        return 0
    reexec_on_stack("check_tensor_parallel")
    import torch
    exe = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in WORLDS:
            run = subprocess.run([sys.executable, __file__, "--world", str(world)], capture_output=True, text=True,
                                 timeout=600)
            if run.returncode != 0:
                failures.append(f"tp:{world}: PyTorch's run failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            theirs = json.loads(run.stdout.strip().splitlines()[-1])
            buffers, temporaries, embedding_grad = ours(exe, world, tmp)
            same = buffers == theirs["buffers"]
            print(f"  tp:{world}: {len(theirs['buffers'])} redistribution buffers in PyTorch, {len(buffers)} in "
                  f"vramscope: {'equal, in order' if same else 'DIFFER'}")
            if not same:
                for i, (a, b) in enumerate(zip(theirs["buffers"] + [None] * len(buffers), buffers + [None] * len(theirs["buffers"]))):
                    if a != b:
                        print(f"    first difference at {i}: PyTorch {a}, vramscope {b}")
                        break
                failures.append(f"tp:{world} buffers")
            checks = [("embedding gradient (the whole table)", theirs["embedding_grad"], embedding_grad),
                      ("optimizer's temporaries (copies of redistributed gradients, then sqrt's)",
                       theirs["optimizer_copies"], temporaries)]
            for what, a, b in checks:
                print(f"  tp:{world} {what}: PyTorch {a}, vramscope {b}: {'ok' if a == b else 'DIFFERS'}")
                if a != b:
                    failures.append(f"tp:{world} {what}")
    print(f"check_tensor_parallel: torch {torch.__version__}: "
          f"{'every buffer equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
