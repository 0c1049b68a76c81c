#!/usr/bin/env python3
r"""parallel_reference.py: what real PyTorch allocates per rank under DDP and FSDP2, on ONE GPU.

The reference for the "several GPUs: per-rank memory under DDP, FSDP2" issue. Every rank is
simulated alone on one device with PyTorch's fake process group at world size 8
(`dist.init_process_group("fake", rank=r, world_size=8, store=FakeStore())`,
torch/testing/_internal/distributed/fake_pg.py). The collectives are no-ops, but rank r's
sharded/bucketed tensors are real, so the caching allocator sees exactly the allocations of rank r
(fact sheet /work/shared/multigpu-memory-facts.md §7 "One H100"). Stream timing is not that of
real NCCL, and NCCL/context memory outside the caching allocator is not measured (fact sheet §4).

Configurations: models {mlp, cnn, llama} x engines {ddp, fsdp2} x ranks {0, 7} = 12, each in a
fresh process (the script re-invokes itself with --one), so each starts from an empty allocator.
  mlp   residual MLP 1000 -> 1337 (3 blocks Linear-ReLU-Linear + skip) -> 10, batch 64, f32;
        1337 is odd so FSDP2 dim-0 padding shows (ceil(1337/8)=168 rows, the last rank holds 161).
  cnn   3 x (conv3x3 + BN + ReLU, 29/61/127 channels) with max pools, global avg pool, linear 10,
        on 3x64x64 images, batch 32, f32. BN buffers exercise DDP's per-forward buffer broadcast.
  llama transformers LlamaForCausalLM from a LlamaConfig (hidden 512, intermediate 1376, 8 heads,
        4 kv heads, vocab 32000, 2 layers, bf16 weights, sdpa), batch 2, seq 256,
        loss = model(input_ids=x, labels=x).loss.
Engines, at their defaults:
  ddp   DistributedDataParallel (bucket_cap_mb default 25 MiB, first bucket 1 MiB after the rebuild,
        gradient_as_bucket_view=False). On the fake PG the built-in allreduce hook fails
        ("expected the hook result is either a Tensor or a TensorList found None", comm.cpp), so a
        Python comm hook returns bucket.buffer() in a completed Future (fact sheet §7); memory is
        the same except that there is no pre-divide. The hook also records each bucket's index
        and bytes per step: step 1 has one giant bucket, the forward of step 2 rebuilds them
        (fact sheet §1).
  fsdp2 torch.distributed.fsdp.fully_shard on each block / decoder layer, then on the root, defaults
        (reshard_after_forward=None -> True for non-root, False for the root; fact sheet §2).
Training: torch.optim.AdamW(lr=1e-3), foreach left at its default, for every model; 3 steps of
zero_grad(set_to_none=True), fresh random batch, forward, loss, backward, step, with the peak stats
reset before each step.

Per (config, rank, step) the CSV holds max_memory_allocated / max_memory_reserved of the step,
memory_allocated / reserved after it, and allocated / reserved after building and after wrapping
(before step 1). The JSON holds the DDP bucket calls and DDP logging data, or each FSDPParam's
original, sharded and padded sharded size (from FSDPState's param groups; private API, skipped if
absent). With --history DIR, rank 0 configs also dump torch.cuda.memory._record_memory_history
snapshots (whole run, from before the model is built) to DIR/<config>.pickle.

    python3 scripts/parallel_reference.py --csv $OUT/parallel.csv --json $OUT/parallel.json \
        --history $OUT/parallel_history
    python3 scripts/parallel_reference.py --device cpu --csv /tmp/pr.csv --json /tmp/pr.json

On --device cpu the memory figures are written as 0 (no allocator stats) but everything else runs,
so the script can be tested without a GPU. If a configuration fails or times out, its rows carry the
error and the others still run (the GPU run is done once).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

WORLD = 8
STEPS = 3
MODELS = ("mlp", "cnn", "llama")
ENGINES = ("ddp", "fsdp2")
# --variants: the engines' options that change memory, rank 0 only (identical ranks under DDP):
# gradient_as_bucket_view=True, static_graph=True, find_unused_parameters=True; FSDP2 with a
# MixedPrecisionPolicy (bf16 parameters, f32 reduction) and with reshard_after_forward=False.
VARIANTS = ("ddp-gabv", "ddp-static", "ddp-unused", "fsdp2-mp", "fsdp2-keep")
RANKS = (0, 7)
COLUMNS = ["config", "model", "engine", "rank", "world_size", "step", "device", "optimizer",
           "param_numel", "local_param_bytes",
           "allocated_after_build", "reserved_after_build",
           "allocated_after_wrap", "reserved_after_wrap",
           "max_allocated", "max_reserved", "allocated_after_step", "reserved_after_step",
           "num_alloc_retries", "loss", "step_ms", "wall_s",
           "torch", "transformers", "cuda", "gpu", "error"]


def config_name(model, engine, rank):
    return f"{model}-{engine}-r{rank}"


# --- models --------------------------------------------------------------------------------------

def build_mlp(torch, nn):
    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    class ResMLP(nn.Module):
        def __init__(self, d_in=1000, d=1337, blocks=3, classes=10):
            super().__init__()
            self.stem = nn.Linear(d_in, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model = ResMLP()

    def batch(dev):
        return torch.randn(64, 1000, device=dev), torch.randint(0, 10, (64,), device=dev)

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    return model, list(model.blocks), batch, loss


def build_cnn(torch, nn):
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([block(3, 29), block(29, 61), block(61, 127)])
            self.pool = nn.MaxPool2d(2)
            self.head = nn.Linear(127, 10)

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                x = b(x)
                if i + 1 < len(self.blocks):
                    x = self.pool(x)
            return self.head(x.mean(dim=(2, 3)))

    model = CNN()

    def batch(dev):
        return torch.randn(32, 3, 64, 64, device=dev), torch.randint(0, 10, (32,), device=dev)

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    return model, list(model.blocks), batch, loss


def build_llama(torch, nn):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000, num_hidden_layers=2,
                      max_position_embeddings=1024, use_cache=False, attn_implementation="sdpa")
    # bf16 weights built directly (no f32 copy first): the default dtype is what nn.Linear /
    # nn.Embedding use; rotary inv_freq is computed in f32 explicitly by transformers.
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)

    def batch(dev):
        return (torch.randint(0, 32000, (2, 256), device=dev),)

    def loss(m, b):
        return m(input_ids=b[0], labels=b[0]).loss

    return model, list(model.model.layers), batch, loss


# --- one configuration (child process) ---------------------------------------------------------

def fsdp_shard_info(model):
    """Each FSDPParam's sizes, from the private FSDPState (torch/distributed/fsdp/
    _fully_shard/_fsdp_state.py and _fsdp_param.py: sharded_size, padded_sharded_param_size,
    _sharded_param_data). Private API: the caller catches any failure."""
    groups = []
    for name, mod in model.named_modules():
        get = getattr(mod, "_get_fsdp_state", None)
        if get is None:
            continue
        state = get()
        pgs = getattr(state, "_fsdp_param_groups", None)  # newer torch: a list
        if pgs is None:
            pg = getattr(state, "_fsdp_param_group", None)
            pgs = [pg] if pg is not None else []
        for pg in pgs:
            params = []
            for fp in pg.fsdp_params:
                data = fp._sharded_param_data
                params.append({
                    "fqn": getattr(fp, "_param_fqn", None) or fp._module_info.param_name,
                    "orig_size": list(fp._orig_size),
                    "sharded_size": list(fp.sharded_size),
                    "padded_sharded_size": list(fp.padded_sharded_param_size),
                    "dtype": str(data.dtype),
                    "sharded_storage_bytes": data.numel() * data.element_size(),
                })
            padded = sum(p["sharded_storage_bytes"] for p in params)
            groups.append({"module": name or "<root>", "params": params,
                           "padded_shard_bytes": padded,
                           # the all-gather output is padded shards x world (fact sheet §2)
                           "all_gather_output_bytes": padded * WORLD})
    return groups


def run_one(model_name, engine, rank, device, history_dir):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cuda = device == "cuda"
    name = config_name(model_name, engine, rank)
    out = {"config": name, "rows": [], "details": {}, "error": ""}
    if cuda:
        # set before any mesh is made, so DeviceMesh does not pick rank % device_count itself
        # (torch/distributed/device_mesh.py, "auto set the cuda/cuda-like device only if ...")
        torch.cuda.set_device(0)
        if history_dir and rank == 0:
            try:
                # Python stacks only: C++ frames are symbolized at dump time, which can take long
                # and the GPU run has a hard time limit.
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            except Exception as e:
                out["details"]["history_error"] = repr(e)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def mem():
        if not cuda:
            return 0, 0
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    base = {}
    t0 = time.perf_counter()
    try:
        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
        torch.manual_seed(0)
        builder = {"mlp": build_mlp, "cnn": build_cnn, "llama": build_llama}[model_name]
        with dev:
            model, blocks, make_batch, loss_fn = builder(torch, nn)
        base["param_numel"] = sum(p.numel() for p in model.parameters())
        base["allocated_after_build"], base["reserved_after_build"] = mem()
        if model_name == "llama":
            out["details"]["attn_implementation"] = model.config._attn_implementation

        if engine.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            ddp_kwargs = {"ddp-gabv": {"gradient_as_bucket_view": True}, "ddp-static": {"static_graph": True},
                          "ddp-unused": {"find_unused_parameters": True}}.get(engine, {})
            model = DDP(model, device_ids=[0] if cuda else None, **ddp_kwargs)
            hook_state = {"step": 0, "calls": []}

            def hook(state, bucket):
                # The fake PG's allreduce returns no tensor, which breaks the built-in hook
                # (comm.cpp:114; fact sheet §7); returning the bucket unchanged keeps memory
                # the same.
                buf = bucket.buffer()
                state["calls"].append({"step": state["step"], "index": bucket.index(),
                                       "numel": buf.numel(), "dtype": str(buf.dtype),
                                       "bytes": buf.numel() * buf.element_size(),
                                       "num_params": len(bucket.parameters())})
                fut = torch.futures.Future()
                fut.set_result(buf)
                return fut

            model.register_comm_hook(hook_state, hook)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(dev.type, (WORLD,))
            fsdp_kwargs = {}
            if engine == "fsdp2-mp":
                from torch.distributed.fsdp import MixedPrecisionPolicy
                fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if engine == "fsdp2-keep":
                fsdp_kwargs["reshard_after_forward"] = False
            for b in blocks:
                fully_shard(b, mesh=mesh, **fsdp_kwargs)
            fully_shard(model, mesh=mesh, **fsdp_kwargs)
        base["local_param_bytes"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
            for p in model.parameters())
        base["allocated_after_wrap"], base["reserved_after_wrap"] = mem()

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, STEPS + 1):
            if engine.startswith("ddp"):
                hook_state["step"] = step
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ts = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            batch = make_batch(dev)
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            row = dict(base, step=step, loss=round(float(loss), 5),
                       step_ms=round((time.perf_counter() - ts) * 1e3, 2))
            if cuda:
                st = torch.cuda.memory_stats()
                row.update(max_allocated=torch.cuda.max_memory_allocated(),
                           max_reserved=torch.cuda.max_memory_reserved(),
                           allocated_after_step=torch.cuda.memory_allocated(),
                           reserved_after_step=torch.cuda.memory_reserved(),
                           num_alloc_retries=st.get("num_alloc_retries", 0))
            else:
                row.update(max_allocated=0, max_reserved=0, allocated_after_step=0,
                           reserved_after_step=0, num_alloc_retries=0)
            out["rows"].append(row)

        # details are best effort: a failure here must not lose the measured rows
        try:
            if engine.startswith("ddp"):
                out["details"]["bucket_calls"] = hook_state["calls"]
                try:
                    ld = model._get_ddp_logging_data()
                    out["details"]["ddp_logging"] = {
                        k: ld[k] for k in ("bucket_sizes", "rebuilt_bucket_sizes",
                                           "bucket_cap_bytes", "num_buckets_reduced",
                                           "has_rebuilt_buckets", "gradient_as_bucket_view")
                        if k in ld}
                except Exception as e:  # private API
                    out["details"]["ddp_logging_error"] = repr(e)
            else:
                out["details"]["fsdp_groups"] = fsdp_shard_info(model)
        except Exception as e:
            out["details"]["error"] = repr(e)
    except Exception as e:
        import traceback
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["traceback"] = traceback.format_exc()[-3000:]
        if not out["rows"]:
            out["rows"].append(dict(base, step=0))
    finally:
        if cuda and history_dir and rank == 0:
            try:
                os.makedirs(history_dir, exist_ok=True)
                torch.cuda.memory._dump_snapshot(os.path.join(history_dir, name + ".pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as e:
                out["details"]["history_error"] = repr(e)
        if dist.is_initialized():
            dist.destroy_process_group()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda or ""
    out["gpu"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    out["optimizer"] = "AdamW(lr=1e-3, foreach default)"
    return out


# --- driver (parent process) -------------------------------------------------------------------

def pkg_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--csv", default="parallel_reference.csv")
    ap.add_argument("--json", default="parallel_reference.json")
    ap.add_argument("--history", default="", help="dump memory-history snapshots (rank 0) here")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per configuration")
    ap.add_argument("--budget", type=float, default=225.0,
                    help="seconds for the whole run; configurations left when it is spent are "
                         "recorded as skipped")
    ap.add_argument("--only", default="", help="comma-separated config names (default: all 12)")
    ap.add_argument("--variants", action="store_true",
                    help="instead: rank 0 of each model under the engines' options (" + ", ".join(VARIANTS) + ")")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "ENGINE", "RANK"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        out = run_one(args.one[0], args.one[1], int(args.one[2]), args.device, args.history)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return

    start = time.perf_counter()
    configs = ([(m, e, 0) for m in MODELS for e in VARIANTS] if args.variants
               else [(m, e, r) for m in MODELS for e in ENGINES for r in RANKS])
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if config_name(*c) in keep]
    versions = {"torch": pkg_version("torch"), "transformers": pkg_version("transformers")}
    rows, details = [], {}
    tmpdir = tempfile.mkdtemp(prefix="parallel_reference.")
    for model, engine, rank in configs:
        name = config_name(model, engine, rank)
        left = args.budget - (time.perf_counter() - start)
        common = dict(versions, config=name, model=model, engine=engine, rank=rank,
                      world_size=WORLD, device=args.device)
        if left < 5:
            rows.append(dict(common, step=0, error="skipped: --budget spent"))
            print(f"{name}: skipped (budget)", flush=True)
            continue
        result = os.path.join(tmpdir, name + ".json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", model, engine, str(rank),
               "--device", args.device, "--result", result]
        if args.history:
            cmd += ["--history", args.history]
        t0 = time.perf_counter()
        err, out = "", None
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(args.timeout, left))
            if os.path.exists(result):
                with open(result) as f:
                    out = json.load(f)
            else:
                err = f"exit {p.returncode}: " + (p.stderr or p.stdout)[-400:].replace("\n", " | ")
        except subprocess.TimeoutExpired:
            err = f"timeout after {min(args.timeout, left):.0f} s"
        wall = round(time.perf_counter() - t0, 2)
        if out is None:
            rows.append(dict(common, step=0, wall_s=wall, error=err))
            details[name] = {"error": err}
        else:
            for r in out["rows"]:
                rows.append(dict(common, **r, wall_s=wall, optimizer=out["optimizer"],
                                 torch=out["torch"], cuda=out["cuda"], gpu=out["gpu"],
                                 error=out["error"]))
            details[name] = dict(out["details"], error=out["error"],
                                 traceback=out.get("traceback", ""))
        status = err or out["error"] or "ok"
        print(f"{name}: {status} ({wall:.1f} s)", flush=True)

    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    with open(args.json, "w") as f:
        json.dump({"world_size": WORLD, "steps": STEPS, "device": args.device,
                   "versions": versions, "configs": details}, f, indent=1)

    mib = 1 << 20
    print(f"\n{'config':<18}{'step':>5}{'shard MiB':>10}{'wrap MiB':>10}{'peak MiB':>10}"
          f"{'resv MiB':>10}{'after MiB':>10}  error")
    for r in rows:
        def m(k):
            v = r.get(k)
            return f"{v / mib:10.2f}" if isinstance(v, (int, float)) else f"{'-':>10}"
        print(f"{r['config']:<18}{r.get('step', 0):>5}{m('local_param_bytes')}"
              f"{m('allocated_after_wrap')}{m('max_allocated')}{m('max_reserved')}"
              f"{m('allocated_after_step')}  {r.get('error', '')[:60]}")
    print(f"\n{len(configs)} configs in {time.perf_counter() - start:.1f} s; "
          f"csv {args.csv}, json {args.json}")


if __name__ == "__main__":
    main()
