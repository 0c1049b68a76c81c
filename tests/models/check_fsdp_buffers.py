#!/usr/bin/env python3
"""check_fsdp_buffers.py VRAMSCOPE: FSDP2's all-gather inputs and outputs and its post-forward
shards under today's PyTorch against `vramscope trace --parallel fsdp:8 --buffers`, step by
step, group by group, to the byte and in order.

The cases are reshard_after_forward True, False and an integer (2, 4: the backward gathers over
that many ranks from the 1/k slices kept after forward), each with and without a
MixedPrecisionPolicy (bf16 parameters, f32 reduction). With a param_dtype every all-gather
copies its inputs into a new flat buffer (_get_param_all_gather_inputs), cast from the shards
or copied from the post-forward slices; without one the inputs are the shards themselves.

PyTorch runs on the CPU, rank 0 of world size 8 on its fake process group, the residual MLP of
tests/data/h100-parallel-2026-11-26 (ref-resmlp.json is the same model for vramscope), two
steps. Each case runs in a process of its own (`--case K mp|nomp` prints the engine's events).

Exit 77 (skipped) without torch, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from parallel_reference import build_mlp  # noqa: E402
MODEL = ROOT / "tests" / "data" / "h100-parallel-2026-11-26" / "ref-resmlp.json"
WORLD = 8
CASES = [("true", "mp"), ("false", "mp"), ("2", "mp"), ("4", "mp"), ("true", "nomp"), ("2", "nomp")]
KINDS = ("all-gather input (param_dtype)", "all-gather output", "post-forward shards")


def engine_events(reshard, mixed):
    """(stage, buffer, bytes) of every all-gather input and output and post-forward shard that
    FSDP2 allocates, in order, as vramscope's --buffers names them."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    torch.manual_seed(0)

    model, blocks, batch, loss_of = build_mlp(torch, nn)  # the model of ref-resmlp.json
    stage = ["construction"]
    names = {}
    events = []

    def nbytes(t):
        return t.numel() * t.element_size()

    original_gather = collectives.foreach_all_gather
    original_inputs = collectives._get_param_all_gather_inputs

    def gather(fsdp_params, group, *args, **kwargs):
        name = names[id(fsdp_params[0])]

        def inputs(params):
            result = original_inputs(params)
            sources = [p._sharded_post_forward_param_data if getattr(p, "_sharded_post_forward_param_data", None) is not None
                       else p._sharded_param_data for p in params]
            # A new buffer: the inputs' storage is none of the shards' (the foreach copy).
            copied = [r[0] for r, s in zip(result, sources)
                      if r[0].untyped_storage().data_ptr() != s.untyped_storage().data_ptr()]
            if copied:
                events.append([stage[0], f"{name} all-gather input (param_dtype)", sum(map(nbytes, copied))])
            return result

        collectives._get_param_all_gather_inputs = inputs
        try:
            result = original_gather(fsdp_params, group, *args, **kwargs)
        finally:
            collectives._get_param_all_gather_inputs = original_inputs
        events.append([stage[0], f"{name} all-gather output", nbytes(result.all_gather_output)])
        return result

    collectives.foreach_all_gather = gather
    param_group.foreach_all_gather = gather
    original_post_forward = param_group.FSDPParamGroup._to_sharded_post_forward

    def post_forward(self):
        original_post_forward(self)
        shards = sum(nbytes(p._sharded_post_forward_param_data) for p in self.fsdp_params)
        events.append([stage[0], f"{names[id(self.fsdp_params[0])]} post-forward shards", shards])

    param_group.FSDPParamGroup._to_sharded_post_forward = post_forward

    mesh = init_device_mesh("cpu", (WORLD,))
    options = {"reshard_after_forward": {"true": True, "false": False}.get(reshard) if reshard in ("true", "false")
               else int(reshard)}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    for module, name in [(model, "root")] + [(b, f"blocks.{i}") for i, b in enumerate(model.blocks)]:
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            names[id(group.fsdp_params[0])] = name
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in (1, 2):
        optimizer.zero_grad(set_to_none=True)
        example = batch("cpu")
        stage[0] = f"step {step} forward"
        loss = loss_of(model, example)
        stage[0] = f"step {step} backward"
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    return events


def ours(exe, stack, reshard, mixed, tmp):
    options = f"reshard_after_forward={reshard}" + (",param_dtype=bf16,reduce_dtype=f32" if mixed else "")
    buffers = Path(tmp) / f"{reshard}-{mixed}.json"
    subprocess.run([exe, "trace", "--model-file", str(MODEL), "--dtype", "f32", "--device", "sim:h100-80g",
                    "--steps", "2", "--parallel", f"fsdp:{WORLD}", "--parallel-options", options, "--stack", stack,
                    "--buffers", str(buffers)], check=True, capture_output=True, text=True, timeout=300)
    rows = json.loads(buffers.read_text())
    return [[r["allocated"], r["buffer"], r["bytes"]] for r in rows if r["buffer"].endswith(KINDS)]


def main() -> int:
    reexec_on_stack("check_fsdp_buffers")
    if sys.argv[1] == "--case":
        print(json.dumps(engine_events(sys.argv[2], sys.argv[3] == "mp")))
        return 0
    import torch
    exe = sys.argv[1]
    stack = f"torch={'.'.join(torch.__version__.split('+')[0].split('.')[:2])},transformers=5.24"
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for reshard, mp in CASES:
            run = subprocess.run([sys.executable, __file__, "--case", reshard, mp], check=True, capture_output=True,
                                 text=True, timeout=300)
            theirs = json.loads(run.stdout.strip().splitlines()[-1])
            mine = ours(exe, stack, reshard, mp == "mp", tmp)
            verdict = "ok" if mine == theirs else "DIFFERS"
            print(f"  reshard_after_forward={reshard} {mp}: {len(theirs)} buffers in PyTorch, {len(mine)} in vramscope: "
                  f"{verdict}")
            if mine != theirs:
                failures.append(f"reshard_after_forward={reshard} {mp}")
                missing = [e for e in theirs if e not in mine][:4]
                extra = [e for e in mine if e not in theirs][:4]
                print(f"    only in PyTorch: {missing}\n    only in vramscope: {extra}")
    print(f"check_fsdp_buffers: torch {torch.__version__}: "
          f"{'every all-gather input, output and post-forward shard equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
