#!/usr/bin/env python3
r"""zero_reference.py: the buffers DeepSpeed's ZeRO stage 1 and 2 allocate on one rank, on the CPU.

The reference for `vramscope --parallel zero1:N|zero2:N` (issue 32). Each configuration runs in a
fresh process: rank r of world size 8 on PyTorch's fake process group (no other process, the
collectives do nothing), DeepSpeed on its CPU accelerator (DS_ACCELERATOR=cpu), bf16, the
optimizer from the config (AdamW -> DeepSpeed's FusedAdam), three steps of
`loss = engine(x).float().pow(2).mean(); engine.backward(loss); engine.step()` on
Sequential(Linear(40, 64), ReLU, Linear(64, 48), ReLU, Linear(48, 3)): 5,891 parameters, which
do not split evenly over 8 ranks (groups_padding on the last) and straddle the partitions.

A TorchDispatchMode records every storage the ops create and a weakref finalizer its free; the
allocations made in DeepSpeed's ZeRO code (stage_1_and_2.py, fused_adam.py, the flattening in
runtime/utils.py) are kept, named by their call site, with the phase they were made in
(construction, step N backward, step N optimizer) and when they were freed. The CPU has no
streams: what overlap_comm moves to the reduction stream shows here on the one timeline.

    DS_ACCELERATOR=cpu python3 scripts/zero_reference.py --json zero_reference.json

needs torch and deepspeed importable (pip install deepspeed, or its sources on PYTHONPATH).
"""
import argparse
import json
import os
import subprocess
import sys
import traceback
import weakref

WORLD = 8
STEPS = 3
CONFIGS = {  # name -> (stage, rank, reduce_bucket_size, overlap_comm)
    "zero1-r0": (1, 0, 5e8, None), "zero1-r3-b4000": (1, 3, 4000, None), "zero1-r7": (1, 7, 5e8, None),
    "zero2-r0": (2, 0, 5e8, None), "zero2-r3-b4000": (2, 3, 4000, None), "zero2-r7": (2, 7, 5e8, None),
}
# DeepSpeed call sites (file:function) -> the name vramscope's buffer log gives the tensor.
SITES = [
    ("fused_adam.py", "__init__", "FusedAdam overflow flag"),
    ("utils.py", "align_dense_tensors", "flat padding"),
    ("stage_1_and_2.py", "flatten_dense_tensors_aligned", None),  # the flat parameters, or step's flat gradient
    ("stage_1_and_2.py", "setup_buckets", "gradient bucket (IPG buffer)"),
    ("stage_1_and_2.py", "allreduce_bucket", "bucket all-reduce copy (torch.cat of its slices)"),
    ("stage_1_and_2.py", "copy_grads_in_partition", "grads_in_partition"),
    ("stage_1_and_2.py", "get_flat_partition", "gradient padding zeros"),
    ("fused_adam.py", "step", None),  # exp_avg, exp_avg_sq
]


def one(name):
    stage, rank, bucket, overlap = CONFIGS[name]
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29511")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    import deepspeed

    phase = ["construction"]
    events = []  # [name, bytes, allocated phase, freed phase, site]
    live = set()

    def site(stack):
        """The DeepSpeed statement that made a tensor: (file, line, name) or None."""
        for frame in reversed(stack):
            base = os.path.basename(frame.filename)
            if "deepspeed" not in frame.filename:
                continue
            for file, function, label in SITES:
                if base == file and frame.name == function:
                    if function == "flatten_dense_tensors_aligned":
                        label = ("bit16 flat parameters (bit16_groups_flat)" if phase[0] == "construction"
                                 else "flat gradient partition")
                    if file == "fused_adam.py" and function == "step":
                        label = "exp_avg" if "exp_avg_sq" not in (frame.line or "") else "exp_avg_sq"
                    return base, frame.lineno, label
            # Statements of DeepSpeedZeroOptimizer's own methods: the master weights'
            # .clone().to(fp32) in __init__, the step's flatten and .to(fp32).
            text = frame.line or ""
            if base == "stage_1_and_2.py" and frame.name == "__init__" and ".clone()" in text:
                return base, frame.lineno, "master"
            if base == "stage_1_and_2.py" and frame.name == "step" and "flatten" in text:
                return base, frame.lineno, "flat gradient partition"
            if base == "stage_1_and_2.py" and frame.name == "step" and ".to(" in text:
                return base, frame.lineno, "fp32 gradient partition"
        return None

    def freed(index):
        events[index][3] = phase[0]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # A view's storage is its input's: only storages this op created count.
            # (lift_fresh moves a constant made outside the mode, IntTensor([0]): a new tensor.)
            inputs = set() if func is torch.ops.aten.lift_fresh.default else {
                a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)}
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in live or key in inputs:
                    continue
                where = site(traceback.extract_stack()[:-1])
                if where is None:
                    continue
                base, line, label = where
                live.add(key)
                events.append([label, storage.nbytes(), phase[0], "", f"{base}:{line}"])
                weakref.finalize(storage, lambda i=len(events) - 1, k=key: (freed(i), live.discard(k)))
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 3))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    if overlap is not None:
        cfg["zero_optimization"]["overlap_comm"] = overlap
    mode = Track()
    mode.__enter__()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    info = {"partition_size": int(engine.optimizer.partition_size[0]),
            "groups_padding": int(engine.optimizer.groups_padding[0]),
            "flat_numel": int(engine.optimizer.bit16_groups_flat[0].numel()),
            "optimizer": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
            "deepspeed": deepspeed.__version__}
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 40, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        phase[0] = f"step {step} backward"
        engine.backward(loss)
        phase[0] = f"step {step} optimizer"
        engine.step()
    mode.__exit__(None, None, None)
    # The master clone is recognised by its statement: relabel the pair made at __init__.
    for e in events:
        if e[0] == "master":
            e[0] = "master weights' bit16 clone" if e[1] == info["partition_size"] * 2 else "fp32 master partition"
    return {"stage": stage, "rank": rank, "world_size": WORLD, "reduce_bucket_size": bucket, "overlap_comm": overlap,
            **info, "buffers": [{"buffer": e[0], "bytes": e[1], "allocated": e[2], "freed": e[3], "site": e[4]}
                                for e in events]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated configuration names")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    names = args.only.split(",") if args.only else list(CONFIGS)
    out = {"world_size": WORLD, "steps": STEPS, "configs": {}}
    for name in names:
        run = subprocess.run([sys.executable, __file__, "--json", "-", "--one", name], capture_output=True, text=True,
                             env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=600)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        out["configs"][name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {
            "error": (run.stderr or run.stdout)[-2000:]}
    import torch
    out["versions"] = {"torch": torch.__version__.split("+")[0]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
