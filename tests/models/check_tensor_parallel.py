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
import contextlib
import json
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "data" / "h100-parallel-2026-11-26" / "ref-llama-2layer.json"
BATCH, SEQ = 2, 256
# (fsdp, tp, loss_parallel): tensor parallel alone, with torchtitan's default loss_parallel and
# with the logits gathered, and FSDP2 over it (torchtitan's 2-D mesh, tp innermost).
MESHES = ((1, 2, True), (1, 4, True), (1, 2, False), (2, 2, True))


def kind_of(chain):
    """The buffer a profiled allocation inside a redistribution is, or None (FSDP's own are
    fsdp_kind_of's)."""
    if "FSDP::" in chain:
        return None
    if "all_gather_into_tensor" in chain:
        return "all-gather output"
    if "reduce_scatter_tensor" in chain:
        return "reduce-scatter output"
    if "Redistribute" in chain and chain.endswith("cat"):
        return "cat"
    if "Redistribute" in chain and "clone" in chain:
        return "chunk"
    return None


def fsdp_kind_of(chain, last):
    """FSDP2's buffer a profiled allocation is, or None: the all-gather output, the
    reduce-scatter input and output (post_backward_reduce makes them in that order), and a
    gradient redistributed to the tensor-parallel placement before it (post_backward_reshard)."""
    ops = [op.split(" (")[0] for op in chain.split(" > ")]
    if "FSDP::all_gather" in ops:
        return "all-gather output"
    if "FSDP::post_backward_reduce" in ops and ops[-1].endswith("empty"):
        return "reduce-scatter output" if last == "reduce-scatter input" else "reduce-scatter input"
    if "FSDP::post_backward_reshard" in ops and ("clone" in chain or "all_reduce" in chain):
        return "gradient redistributed"
    return None


def layer_plan():
    """torchtitan's plan for one decoder layer: sequence-parallel norms, the sequence gathered
    before the attention and the MLP, q/k/v/gate/up column-wise, o/down row-wise to Shard(1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return {
        "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}


def torch_side(dp, world, parallel_loss):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                                   parallelize_module)
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("fake", rank=0, world_size=dp * world, store=FakeStore())
    mesh2d = init_device_mesh("cpu", (dp, world), mesh_dim_names=("dp", "tp"))
    mesh = mesh2d["tp"]
    cfg = LlamaConfig.from_dict({**json.loads(CONFIG.read_text()), "use_cache": False})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    parallelize_module(model.model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel()})
    head = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) if parallel_loss
            else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    parallelize_module(model, mesh, {"lm_head": head})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan())

    if dp > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh2d["dp"])
        fully_shard(model, mesh=mesh2d["dp"])

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    positions = torch.arange(SEQ)[None]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with loss_parallel() if parallel_loss else contextlib.nullcontext():
            model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()
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

    buffers, optimizer_copies, fsdp, whole_table, loss = [], [], [], 0, []
    loss_size = BATCH * SEQ * (cfg.vocab_size // world) * 4  # the loss's f32 [tokens, V / N] tensors
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
        if size == loss_size:
            loss.append(size)
        if "embedding_dense_backward" in where:
            whole_table = max(whole_table, size)
        kind = kind_of(where)
        if kind:
            buffers.append([kind, size])
        kind = fsdp_kind_of(where, fsdp[-1][0] if fsdp else None)
        if kind:
            fsdp.append([kind, size])
    return {"buffers": buffers, "fsdp": fsdp, "embedding_grad": whole_table, "loss": loss,
            "optimizer_copies": optimizer_copies}


def ours(exe, dp, world, parallel_loss, tmp):
    mesh = f"fsdp:{dp}xtp:{world}" if dp > 1 else f"tp:{world}"
    common = ["--hf-config", str(CONFIG), "--batch", str(BATCH), "--seq", str(SEQ), "--attn", "sdpa",
              "--dtype", "bf16", "--device", "sim:h100-80g", "--steps", "1", "--parallel", mesh,
              "--parallel-options", f"loss_parallel={str(parallel_loss).lower()}"]
    out = Path(tmp) / f"{mesh}-{parallel_loss}.json"
    subprocess.run([exe, "trace", *common, "--buffers", str(out)], check=True, capture_output=True, text=True)
    everything = json.loads(out.read_text())
    # Tensor parallel's buffers name the module's input or output they redistribute; FSDP's
    # name the group (its shards and unsharded parameters are not collectives' buffers).
    tensor_parallel = re.compile(r" (input|output)( \(backward\))? (all-gather|reduce-scatter|chunk)")
    rows = [r for r in everything if tensor_parallel.search(r["buffer"])]
    fsdp = []
    for r in everything:
        if tensor_parallel.search(r["buffer"]):
            continue
        for k in ("all-gather output", "reduce-scatter input", "reduce-scatter output", "gradient redistributed"):
            if r["buffer"].endswith(k) or r["buffer"].endswith(k + " (sharded gradients)"):
                fsdp.append([k, r["bytes"]])
    def kind(name):
        for suffix, k in (("all-gather output", "all-gather output"), ("reduce-scatter output", "reduce-scatter output"),
                          ("all-gather cat", "cat"), ("reduce-scatter input", "cat"), ("chunk", "chunk")):
            if name.endswith(suffix):
                return k
        raise ValueError(name)

    # The optimizer's temporaries, as the snapshot names them: the redistributed gradients'
    # copies, then _foreach_sqrt's outputs.
    snapshot = Path(tmp) / f"{mesh}-{parallel_loss}.pickle"
    subprocess.run([exe, "trace", *common, "--snapshot", str(snapshot)], check=True, capture_output=True, text=True)
    with snapshot.open("rb") as f:
        events = pickle.load(f)["device_traces"][0]
    temporaries = [e["size"] for e in events if e["action"] == "alloc" and e["frames"]
                   and e["frames"][0]["filename"].endswith("(optimizer temporaries)")]
    embedding_grad = max(e["size"] for e in events if e["action"] == "alloc" and e["frames"]
                         and e["frames"][0]["filename"] == "model.embed_tokens.weight.grad")
    loss_size = BATCH * SEQ * (json.loads(CONFIG.read_text())["vocab_size"] // world) * 4
    loss = [e["size"] for e in events if e["action"] == "alloc" and e["size"] == loss_size]
    return [[kind(r["buffer"]), r["bytes"]] for r in rows], fsdp, temporaries, embedding_grad, loss


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--mesh":
        print(json.dumps(torch_side(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "True")))
        return 0
    reexec_on_stack("check_tensor_parallel")
    import torch
    exe = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp, world, parallel_loss in MESHES:
            mesh = (f"fsdp:{dp}xtp:{world}" if dp > 1 else f"tp:{world}") + ("" if parallel_loss else " loss_parallel=false")
            run = subprocess.run([sys.executable, __file__, "--mesh", str(dp), str(world), str(parallel_loss)],
                                 capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                failures.append(f"{mesh}: PyTorch's run failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            theirs = json.loads(run.stdout.strip().splitlines()[-1])
            buffers, fsdp, temporaries, embedding_grad, loss = ours(exe, dp, world, parallel_loss, tmp)
            for what, a, b in (("redistribution buffers", theirs["buffers"], buffers),
                               ("FSDP buffers", theirs["fsdp"], fsdp)):
                same = a == b
                print(f"  {mesh}: {len(a)} {what} in PyTorch, {len(b)} in vramscope: "
                      f"{'equal, in order' if same else 'DIFFER'}")
                if not same:
                    for i, (x, y) in enumerate(zip(a + [None] * len(b), b + [None] * len(a))):
                        if x != y:
                            print(f"    first difference at {i}: PyTorch {x}, vramscope {y}")
                            break
                    failures.append(f"{mesh} {what}")
            checks = [("embedding gradient (the whole table)", theirs["embedding_grad"], embedding_grad),
                      ("the loss's f32 [tokens x V/N] tensors", theirs["loss"], loss),
                      ("optimizer's temporaries (copies of redistributed gradients, then sqrt's)",
                       theirs["optimizer_copies"], temporaries)]
            for what, a, b in checks:
                print(f"  {mesh} {what}: PyTorch {a}, vramscope {b}: {'ok' if a == b else 'DIFFERS'}")
                if a != b:
                    failures.append(f"{mesh} {what}")
    print(f"check_tensor_parallel: torch {torch.__version__}: "
          f"{'every buffer equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
