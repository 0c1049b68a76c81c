#!/usr/bin/env python
"""Probe the CUDA caching-allocator trace of PyTorch context parallel (ring
attention) for ONE simulated rank, using the fake process group.

usage:  python cp_probe.py W RANK OUT.json [--seq S] [--no-warmup] [--device cuda]
                          [--configs allgather:1,allgather:0,alltoall:1,alltoall:0]

For each config (rotate method, load balance on/off) it:
  * builds q,k,v (2, 4, S, 64) bf16 WITHOUT grad (context_parallel() calls
    buffer.resize_(), which raises "cannot resize variables that require grad"),
  * enters context_parallel(mesh, buffers=[q,k,v], buffer_seq_dims=[2,2,2]),
    sets requires_grad inside, runs causal SDPA under sdpa_kernel(FLASH),
    backward of out.sum() (inside the context, so the backward is also routed to
    ring attention), clears grads / requires_grad before exit (else the restoring
    resize_ in __exit__ fails),
  * records torch.cuda.memory history around all of it and dumps every trace
    entry (action, addr, size, stream, top python frames) plus phase markers.
Works with torch >= 2.11 (CP code in _context_parallel/_attention.py or the old
single-file experimental/_attention.py).
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("world_size", type=int)
    p.add_argument("rank", type=int)
    p.add_argument("out")
    p.add_argument("--seq", type=int, default=8192, help="GLOBAL sequence length")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    p.add_argument("--backend", default="flash", help="flash, efficient, cudnn or any (SDPA picks; enable_gqa when kv heads differ)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--max-entries", type=int, default=100000)
    p.add_argument(
        "--configs",
        default="allgather:1,allgather:0,alltoall:1,alltoall:0",
        help="comma list of rotate_method:load_balance(0/1)",
    )
    return p.parse_args()


# ----------------------------------------------------------------- imports ---
def import_cp():
    try:
        from torch.distributed.tensor.experimental._context_parallel import (
            _attention as A,
        )
    except ImportError:
        from torch.distributed.tensor.experimental import _attention as A
    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError:
        context_parallel = A.context_parallel
    return A, context_parallel


def import_fake_store():
    # Importing the module also registers the "fake" backend.
    try:
        import torch.testing._internal.distributed.fake_pg as fake_pg

        return fake_pg.FakeStore
    except (ImportError, AttributeError):
        return torch._C._distributed_c10d.FakeStore


def set_rotate(A, name):
    if hasattr(A, "set_rotate_method"):
        A.set_rotate_method(name)
    else:
        A._cp_options.rotate_method = (
            A._RotateMethod.ALL_GATHER if name == "allgather" else A._RotateMethod.ALL_TO_ALL
        )


def make_mesh(device, W):
    try:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device, (W,), mesh_dim_names=("cp",))
    except Exception:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device, list(range(W)))  # NOTE: arg is the rank list, not a shape


# -------------------------------------------------------- memory recording ---
def rec_start(max_entries):
    mem = torch.cuda.memory
    try:
        mem._record_memory_history(enabled=None)
    except Exception:
        pass
    kw = dict(context="all", stacks="python", max_entries=max_entries)
    try:
        mem._record_memory_history(enabled="all", clear_history=True, **kw)
    except TypeError:
        mem._record_memory_history(enabled="all", **kw)


def rec_stop():
    torch.cuda.memory._record_memory_history(enabled=None)


def trace_len(dev_idx):
    s = torch.cuda.memory._snapshot()
    tr = s.get("device_traces", [])
    return len(tr[dev_idx]) if dev_idx < len(tr) else 0


def short(fn):
    for key in ("site-packages/", "dist-packages/"):
        if key in fn:
            return fn.split(key, 1)[1]
    return os.path.basename(fn) if fn.endswith("cp_probe.py") else fn


def fmt_frame(f):
    return f"{short(f.get('filename', '?'))}:{f.get('line', '?')}:{f.get('name', '?')}"


def pick(frames, pred):
    for f in frames:
        if pred(f.get("filename", "")):
            return fmt_frame(f)
    return None


def dump_trace(dev_idx):
    s = torch.cuda.memory._snapshot()
    tr = s.get("device_traces", [])
    entries = tr[dev_idx] if dev_idx < len(tr) else []
    out = []
    for e in entries:
        frames = e.get("frames", []) or []
        out.append(
            {
                "action": e.get("action"),
                "addr": e.get("addr"),
                "size": e.get("size"),
                "stream": e.get("stream"),
                "top": fmt_frame(frames[0]) if frames else None,
                "cp": pick(frames, lambda fn: "experimental" in fn and "tensor" in fn),
                "user": pick(frames, lambda fn: fn.endswith("cp_probe.py")),
                "frames": [fmt_frame(f) for f in frames[:6]],
            }
        )
    return out


def mem(device):
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
    }


def tmeta(t):
    if t is None:
        return None
    st = t.untyped_storage()
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "data_ptr": t.data_ptr(),
        "storage_ptr": st.data_ptr(),
        "storage_nbytes": st.nbytes(),
    }


# ---------------------------------------------------------------- one run ---
def run_one(args, A, context_parallel, mesh, rotate, lb, record):
    from torch.nn.attention import sdpa_kernel, SDPBackend

    dev = args.device
    cuda = dev == "cuda"
    dev_idx = torch.cuda.current_device() if cuda else 0
    res = {"rotate": rotate, "lb_requested": lb, "phases": {}, "mem": {}}
    A._cp_options.enable_load_balance = lb
    set_rotate(A, rotate)
    res["cp_options_before"] = repr(A._cp_options)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if record:
        rec_start(args.max_entries)

    def phase(name):
        if record:
            res["phases"][name] = trace_len(dev_idx)
        res["mem"][name] = mem(dev)

    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads or args.heads, args.seq, args.head_dim)
    phase("start")
    q = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(kv_shape, device=dev, dtype=torch.bfloat16) for _ in range(2))
    phase("qkv_created")
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            try:
                phase("sharded")
                res["lb_effective"] = bool(A._cp_options.enable_load_balance)
                res["local_q"] = tmeta(q)
                for t in (q, k, v):
                    t.requires_grad_(True)
                kw = {"enable_gqa": True} if kv_shape[1] != shape[1] else {}
                backends = {"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                            "cudnn": [SDPBackend.CUDNN_ATTENTION]}.get(args.backend) or [
                    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
                with sdpa_kernel(backends):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
                phase("after_fwd")
                res["out"] = tmeta(out)
                loss = out.sum()
                loss.backward()
                phase("after_bwd")
                res["grads"] = {n: tmeta(t.grad) for n, t in zip("qkv", (q, k, v))}
                del out, loss
                phase("out_deleted")
            finally:
                for t in (q, k, v):
                    t.grad = None
                    t.requires_grad_(False)
                phase("grads_cleared")
        phase("exited")
        res["restored_q_shape"] = list(q.shape)
    except Exception as e:  # keep going with the other configs
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    del q, k, v
    phase("qkv_deleted")
    if record:
        res["trace"] = dump_trace(dev_idx)
        rec_stop()
    res["cp_options_after"] = repr(A._cp_options)
    return res


def main():
    args = parse()
    W, r = args.world_size, args.rank
    FakeStore = import_fake_store()
    A, context_parallel = import_cp()
    if args.device == "cuda":
        torch.cuda.set_device(0)  # one real GPU simulates rank r
    dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=W)
    mesh = make_mesh(args.device, W)
    record = args.device == "cuda"
    default_opts = repr(A._cp_options)

    result = {
        "torch": torch.__version__,
        "cp_module": A.__name__,
        "cp_file": A.__file__,
        "world_size": W,
        "rank": r,
        "global_shape": [args.batch, args.heads, args.seq, args.head_dim],
        "kv_heads": args.kv_heads or args.heads,
        "backend": args.backend,
        "default_cp_options": default_opts,
        "device_name": torch.cuda.get_device_name() if record else None,
        "configs": [],
    }
    configs = []
    for c in args.configs.split(","):
        rot, lb = c.split(":")
        configs.append((rot, lb == "1"))

    if not args.no_warmup and configs:
        t0 = time.time()
        w = run_one(args, A, context_parallel, mesh, configs[0][0], configs[0][1], False)
        result["warmup"] = {"error": w.get("error"), "s": time.time() - t0}
        if w.get("error"):
            print("warmup error:", w["error"], file=sys.stderr)
            print(w.get("traceback", ""), file=sys.stderr)

    for rot, lb in configs:
        t0 = time.time()
        res = run_one(args, A, context_parallel, mesh, rot, lb, record)
        res["seconds"] = time.time() - t0
        result["configs"].append(res)
        n = len(res.get("trace", []))
        print(
            f"[{rot} lb={lb}] lb_eff={res.get('lb_effective')} entries={n} "
            f"err={res.get('error')} mem={res['mem'].get('after_bwd')}",
            file=sys.stderr,
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print("wrote", args.out, file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
