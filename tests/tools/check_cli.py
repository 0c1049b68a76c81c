#!/usr/bin/env python3
"""check_cli.py — end-to-end checks of the built `vramscope` command.

Usage: check_cli.py VRAMSCOPE CHECK WORKDIR

Each check runs the command as a user would and reads what it wrote with
python's own csv, json, pickle and xml.etree modules. Exit status 0 = pass.
"""
import csv
import io
import json
import shlex
import os
import pickle
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30


def run(exe, *args, expect=0):
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=110)
    if expect is not None and proc.returncode != expect:
        raise AssertionError(
            f"{' '.join(args)}: exit {proc.returncode}, expected {expect}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# A small model on a small simulated device: mlp depth 4 (8 sequential modules).
SMALL = ["--model", "mlp", "--depth", "4", "--width", "1024", "--batch", "1024",
         "--device", "sim:capacity=1GiB,context=100MiB"]


# Exact rows, derived by hand: mlp depth 1 (Linear(256, 256) + Sigmoid), batch 1024, f32,
# no optimizer, one step, on a 64 MiB simulated GPU with an 8 MiB context.
#   A = 1024*256*4 = 1 MiB an activation, W = 256*256*4 = 256 KiB, K = 256*4 = 1 KiB (bias),
#   P = W + K = 263168 B the parameters, s = 512 B a scalar (the implicit ones gradient).
# Every block is <= 1 MiB: small pool, 2 MiB segments, blocks = requests rounded to 512 B.
# Forward: x, t, z = Linear(x), y = Sigmoid(z) (z dies: Linear keeps x, Sigmoid keeps y);
#   mse_loss allocates its output at the input's full size A and resizes it to a scalar
#   without shrinking the storage (PyTorch's structured op, pytorch/pytorch#185647), plus a
#   squared-difference temporary A while it runs: the loss holds A until the step ends.
# Backward: ones s, alive until backward returns (torch.autograd.backward holds it in
#   grad_tensors_); MseBackward gx (A); SigmoidBackward gz (A) while gx lives, beside x, t,
#   y and the loss: 5A + s, the step's peak with the gradients and workspaces.
#   LinearBackward: no grad for x (not requiring grad), gw + gb = P while gz lives.
# After the step x, t, y and the loss die; the gradients and the cuBLAS workspaces stay.
# Two segments (the Linear checkpointed, the Sigmoid the tail) save nothing: the Linear's
#   input x is kept anyway — "I checkpointed every layer and memory did not go down". The
#   recompute is one Linear forward: (2w + 1) of the (2w + 1) + 4 + 3 FLOPs per element of
#   one forward (multiply-add and bias; sigmoid 4; mse 3, as the runtime counts them).
EXACT_ARGS = ["sweep", "--model", "mlp", "--depth", "1", "--width", "256", "--batch", "1024",
              "--optimizer", "none", "--steps", "1", "--segments", "0,2", "--dtype", "f32",
              "--device", "sim:capacity=64MiB,context=8MiB,cublas=0,cudnn=0"]
# One Linear(256, 256) + Sigmoid, batch 1024 (an activation A = 1 MiB), no optimizer. The
# cuBLAS workspaces PyTorch takes on a GPU of unknown generation: W = 8 MiB + 128 KiB per
# thread (forward; backward), Lt = 1 MiB for addmm with a bias, and a second Lt when the
# checkpointed Linear reruns in the backward thread.
W, LT = 4096 * 1024 * 2 + 16 * 1024 * 8, MiB
PARAMS = 256 * 256 * 4 + 256 * 4
# After the step: parameters, their gradients, the workspaces.
AFTER = 2 * PARAMS + 2 * W + LT
# Peak once the Linear's gradients exist: parameters and their gradients, x, target,
# sigmoid output and the gradient reaching the Linear (4 A), the loss: a scalar whose
# storage is a full A, as PyTorch's structured mse_loss leaves it (pytorch/pytorch#185647),
# and the seed s.
PEAK = 2 * PARAMS + 5 * MiB + 512 + 2 * W + LT
EXACT_ROWS = {0: dict(fits=True, max_reserved=28 * MiB, max_nvidia_smi=36 * MiB,
                      allocated_after_step=AFTER, max_allocated=PEAK,
                      unallocated_at_peak=28 * MiB - PEAK, saving=0, recompute_ratio=0.0,
                      recompute_share=0.0, saving_fraction=0.0),
              # Checkpointing the only Linear saves nothing and costs the rerun's Lt and
              # its output, alive beside the sigmoid's gradient: the saving is negative,
              # and the rerun's blocks take one more 2 MiB segment.
              2: dict(fits=True, max_reserved=30 * MiB, max_nvidia_smi=38 * MiB,
                      allocated_after_step=AFTER + LT, max_allocated=25691648,
                      unallocated_at_peak=30 * MiB - 25691648, saving=PEAK - 25691648,
                      recompute_ratio=513 / 520)}


def check_exact(exe, work):
    out = json.loads(run(exe, *EXACT_ARGS, "--format", "json").stdout)
    check(len(out["rows"]) == 2, out["rows"])
    rows = {r["segments"]: r for r in out["rows"]}
    for k, expected in EXACT_ROWS.items():
        r = rows[k]
        for key, value in expected.items():
            ok = abs(r[key] - value) < 1e-12 if isinstance(value, float) else r[key] == value
            check(ok, f"segments {k}: {key} = {r[key]}, expected {value}")
    # The rerun as a share of the step's work (forward, backward, optimizer): less than the
    # fraction of one forward it is, as plan reports it.
    check(0 < rows[2]["recompute_share"] < rows[2]["recompute_ratio"], rows[2])
    # The table prints the same figures in human units.
    text = run(exe, *EXACT_ARGS).stdout
    line = next(l for l in text.splitlines() if l.strip().startswith("f32") and "(none)" in l)
    check(line.split() == ["f32", "0", "(none)", "17.75", "MiB", "22.75", "MiB", "28.00", "MiB",
                           "36.00", "MiB", "5.25", "MiB", "0", "B", "0", "yes", "*"], line)
    check("device: simulated capacity=64MiB,context=8MiB,cublas=0,cudnn=0: 64.00 MiB total, CUDA context 8.00 MiB"
          in text, text)


def check_csv(exe, work):
    text = run(exe, "sweep", *SMALL, "--segments", "0,2,4", "--dtype", "f32,f16",
               "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    check(len(rows) == 6, f"{len(rows)} rows, expected 6")
    for r in rows:
        check(r["model"] == "mlp", r)
        check(r["fits"] == "true", r)
        for key in ("max_allocated", "max_reserved", "max_nvidia_smi", "allocated_after_step",
                    "unallocated_at_peak"):
            int(r[key])
        check(int(r["max_reserved"]) >= int(r["max_allocated"]), r)
        check(int(r["max_nvidia_smi"]) >= int(r["max_reserved"]) + 100 * MiB, r)
        float(r["recompute_ratio"])
    check(sum(r["best"] == "true" for r in rows) == 2, "one best per dtype")
    # A setting with commas in it survives the quoting.
    text = run(exe, "sweep", *SMALL, "--segments", "2", "--dtype", "f32", "--alloc-conf",
               "roundup_power2_divisions:[256:1,>:8]", "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    check(rows[0]["alloc_conf"] == "roundup_power2_divisions:[256:1,>:8]", rows[0])


def check_json(exe, work):
    out = json.loads(run(exe, "sweep", *SMALL, "--segments", "0,2", "--dtype", "f32",
                         "-a", "", "-a", "max_split_size_mb:128", "--format", "json").stdout)
    check(out["schema_version"] == 2, out.keys())
    check(out["model"]["name"] == "mlp" and out["model"]["sequential_modules"] == 8, out["model"])
    check(out["device"]["total_bytes"] == GiB and out["device"]["context_bytes"] == 100 * MiB,
          out["device"])
    check("assumptions" in out["device"] and out["device"]["simulated"], out["device"])
    check(len(out["rows"]) == 4, len(out["rows"]))
    check({r["alloc_conf"] for r in out["rows"]} == {"", "max_split_size_mb:128"}, out["rows"])
    for r in out["rows"]:
        check(r["steps"] == 2 and r["fits"], r)
        check(r["saving"] is not None, r)
        if r["segments"] == 0:
            check(r["saving"] == 0 and r["recompute_ratio"] == 0, r)
        else:
            check(r["recompute_ratio"] > 0, r)
    # --accumulation 4: four micro-batches make the first optimizer step, two more follow with the
    # accumulating gradients alive in their forward (Trainer's gradient_accumulation_steps).
    acc = json.loads(run(exe, "sweep", *SMALL, "--segments", "0", "--dtype", "f32", "--accumulation", "4",
                         "--format", "json").stdout)
    one = [r for r in out["rows"] if r["segments"] == 0 and r["alloc_conf"] == ""][0]
    check(acc["accumulation"] == 4 and out["accumulation"] == 1 and acc["rows"][0]["steps"] == 6, acc)
    check(acc["rows"][0]["max_allocated"] >= one["max_allocated"], (acc["rows"][0], one))
    err = run(exe, "sweep", *SMALL, "--accumulation", "0", expect=2).stderr
    check("--accumulation" in err and err.count("\n") == 1, err)
    # The star: least nvidia-smi, then among equals the least recompute (issue 33: gpt2's 14 and
    # 15 segments need the same nvidia-smi; 14 recomputes less and gets the star).
    rows = json.loads(run(exe, "sweep", "--model", "gpt2", "--device", "sim:a100-40g", "--segments", "14,15", "--dtype", "f32",
                          "--format", "json").stdout)["rows"]
    check([r["best"] for r in rows] == [True, False] and rows[0]["max_nvidia_smi"] == rows[1]["max_nvidia_smi"]
          and rows[0]["recompute_ratio"] < rows[1]["recompute_ratio"]
          and rows[0]["max_allocated"] > rows[1]["max_allocated"], rows)


def oom_sweep(exe, fmt):
    return run(exe, "sweep", "--model", "mlp", "--depth", "16", "--width", "1024", "--batch", "4096",
               "--device", "sim:capacity=824MiB,context=100MiB", "--segments", "0,4",
               "--dtype", "f32", "--format", fmt)


def check_model_states_oom(exe):
    """Issue 33: forum-cnn-full on an RTX 2080 SUPER runs out of memory in every row, and its
    peak is weights, gradients and Adam's state: the sweep says no segments or batch can help,
    and what can."""
    out = run(exe, "sweep", "--model", "forum-cnn-full", "--device", "sim:rtx2080s", "--segments", "0,2",
              "--dtype", "f32", "--brief").stdout
    text = " ".join(out.split())
    check("No f32 row can fit, whatever the segments or the batch" in text and "optimizer's state and temporaries (19.41 GiB)" in text
          and "--optimizer sgd or adam8bit" in text and "--dtype bf16 weights" in text, out)
    fits = run(exe, "sweep", *SMALL, "--segments", "0,2", "--dtype", "f32", "--brief").stdout
    check("can fit" not in fits and "No f32 row" not in fits, fits)


def check_weights_alone(exe, work):
    """Issue 47: a 1 KB model file that repeats a 4096-wide Linear 100,000 times (1.7 T
    parameters) is answered from its size: the weights alone outgrow the device, said at once,
    with no run of the whole model without the capacity limit (sweep) and no search (plan)."""
    os.makedirs(work, exist_ok=True)
    huge = Path(work) / "huge.json"
    huge.write_text(json.dumps({
        "format": "vramscope-model", "version": 1, "name": "huge", "options": {"batch": 8},
        "input": {"shape": ["batch", 4096]}, "loss": {"type": "mse"},
        "layers": [{"repeat": 100000, "layers": [{"type": "Linear", "in_features": 4096, "out_features": 4096}]}]}))
    out = run(exe, "sweep", "--model-file", str(huge), "--segments", "0", "--dtype", "f32").stdout
    text = " ".join(out.split())
    check("The weights alone are 6.11 TiB in f32, more than the whole device" in text, out[-600:])
    check("Without the capacity limit" not in text, out[-600:])
    p = run(exe, "plan", "--model-file", str(huge), expect=1)
    check("no plan fits: the weights alone are 3.05 TiB in bf16" in p.stderr and p.stderr.count("\n") == 1, p.stderr)


def check_oom(exe, work):
    check_model_states_oom(exe)
    check_weights_alone(exe, work)
    # A batch whose first activation is over 1 PiB is an OOM row, as PyTorch's cudaMalloc failure
    # is, with the module that asked, never the end of the sweep (issue 36); the other batch runs.
    for model in ("resnet50", "mlp"):
        out = json.loads(run(exe, "sweep", "--model", model, "--batch", "8,1099511627776", "--segments", "0",
                             "--dtype", "f32", "--format", "json").stdout)
        big = [r for r in out["rows"] if r["batch"] == 1099511627776][0]
        small = [r for r in out["rows"] if r["batch"] == 8][0]
        check(small["fits"] and not big["fits"] and big["oom_requested"] > (1 << 50), big)
        check(big["oom_allocated"] > 0 and "larger than 1 PiB" in big["oom_message"], big)
    # A transposed key at sequence 65536 has strides that multiply past 2^63 (its shape does not):
    # the eager attention's 256 GiB scores are the OOM row, not an element-count error (issue 47).
    out = json.loads(run(exe, "sweep", "--model", "llama-3.2-1b", "--seq", "65536", "--attn", "eager", "--dtype", "bf16",
                         "--segments", "0", "--device", "sim:b200", "--format", "json").stdout)
    row = out["rows"][0]
    check(not row["fits"] and row["oom_requested"] == 256 << 30 and row["oom_module"] == "model.layers.0.self_attn", row)
    # plan's runs without the capacity limit map hundreds of TiB under expandable segments: a
    # run of pages is one entry and one call on the simulated device, not one per 20 MiB page
    # (issue 47: 42 s and 2.6 GB before). An address-space limit holds it to what it needs.
    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    # Not under a sanitizer: its shadow memory alone is terabytes of addresses.
    sanitized = bool(os.environ.get("VRAMSCOPE_SANITIZE"))
    for args in (["--model", "resnet50"], ["--model", "gpt2", "--seq", "32"]):
        p = subprocess.run([exe, "plan", *args, "--batch", "10000000"], capture_output=True, text=True,
                           timeout=120 if sanitized else 60, preexec_fn=None if sanitized else limited)
        check(p.returncode in (0, 1) and "As given: out of memory in step 1" in p.stdout and "TiB" in p.stdout,
              p.stdout[-800:] + p.stderr[-800:])
    p = run(exe, "trace", "--model", "resnet50", "--batch", "1099511627776", expect=1)
    check("input, forward: asked for 588.00 PiB, more than any GPU holds" in p.stdout, p.stdout)
    out = json.loads(oom_sweep(exe, "json").stdout)
    rows = {r["segments"]: r for r in out["rows"]}
    r = rows[0]
    check(not r["fits"] and not r["best"], r)
    check(r["oom_requested"] > 0 and r["oom_allocated"] > 0, r)
    check(r["oom_nvidia_smi"] <= 824 * MiB, r)
    check(r["oom_reserved"] >= r["oom_allocated"], r)
    check(r["oom_nvidia_smi"] >= r["oom_reserved"] + 100 * MiB, r)
    check(r["oom_device_free"] + r["oom_nvidia_smi"] == 824 * MiB, r)
    check(r["oom_requested"] > r["oom_device_free"], r)
    check(r["needs_max_allocated"] > r["oom_allocated"], r)
    check(r["needs_max_nvidia_smi"] > 824 * MiB, r)
    check("out of memory" in r["oom_message"].lower(), r["oom_message"])
    # The sweep goes on after the OOM row.
    check(rows[4]["fits"] and rows[4]["best"], rows[4])
    text = oom_sweep(exe, "table").stdout
    check("OOM [1]" in text and "[1] f32 seg 0: out of memory" in text, text)
    check("needs" in text, text)


BAD = [
    (["sweep", "--parallel", "fsdp1:8"], ["--parallel", "fsdp1 is not modelled yet", "fsdp:N", "zero3:N"]),
    (["sweep", "--parallel", "zero3:8", "--parallel-options", "stage3_max_reuse_distance=far"],
     ["--parallel-options", "stage3_max_reuse_distance=far: expected elements"]),
    (["sweep", "--parallel", "ddp:8", "--topology", "infiniband"], ["--topology", "unknown topology 'infiniband'"]),
    (["sweep", "--stray-contexts"], ["--stray-contexts: applies to several GPUs"]),
    (["sweep", "--parallel", "zero2:8", "--parallel-options", "reduce_bucket_size=-1"],
     ["--parallel-options", "reduce_bucket_size=-1: expected elements"]),
    (["sweep", "--parallel", "fsdp:8", "--parallel-options", "bucket_cap_mb=50"],
     ["--parallel-options", "not an option of fsdp"]),
    (["sweep", "--parallel", "ddp:0"], ["--parallel", "whole number from 1"]),
    (["trace", "--parallel", "ddp"], ["--parallel", "whole number from 1"]),
    (["sweep", "--parallel-options", "bucket_cap_mb=50"], ["--parallel-options", "give one, e.g. ddp:8"]),
    (["sweep", "--parallel", "ddp:8", "--parallel-options", "bucket_cap_mb=abc"], ["--parallel-options", "bucket_cap_mb=abc"]),
    (["sweep", "--parallel", "ddp:8", "--parallel-options", "reshard_after_forward=false"],
     ["'reshard_after_forward' is not an option of ddp", "bucket_cap_mb"]),
    (["sweep", "--parallel", ""], ["--parallel"]),
    (["trace", "--buffers", "/tmp/vramscope-never-written.csv"], ["--buffers", "give --parallel ddp:N"]),
    (["sweep", "--model", "nosuchnet"], ["mlp", "resnet18"]),
    (["sweep", "--device", "sim:nosuchgpu"], ["rtx2080s", "a100-80g"]),
    (["sweep", "--device", "tpu:0"], ["sim:", "cuda"]),
    (["sweep", "--dtype", "f32,f8"], ["f16", "bf16"]),
    (["sweep", "--device", "sim:capacity=8XB"], ["8XB", "MiB"]),
    (["sweep", "--alloc-conf", "max_split_size_mb:abc"], ["max_split_size_mb"]),
    (["sweep", "--alloc-conf", "nosuchkey:1"], ["max_split_size_mb"]),
    (["sweep", "--model", "mlp", "--depth", "4", "--segments", "9"], ["8", "auto"]),
    (["sweep", "--segments", "two"], ["0,2,4,8", "auto"]),
    (["sweep", "--format", "xml"], ["table", "csv", "json"]),
    (["sweep", "--steps", "0"], ["--steps", "from 1 to 1000"]),
    (["sweep", "--batch", "-3"], ["--batch", "out of range"]),
    # Sizes are whole numbers in range, never wrapped, clamped or taken as "the default"
    # (issue 22, items 1, 2 and 11).
    (["sweep", "--steps", "-1"], ["--steps", "out of range"]),
    (["sweep", "--batch", "99999999999999999999"], ["--batch", "out of range"]),
    (["sweep", "--batch", "1e3"], ["--batch", "not a whole number"]),
    (["sweep", "--depth", "0"], ["--depth", "from 1 to 10000"]),
    (["trace", "--max-depth", "-1"], ["--max-depth", "out of range"]),
    (["models", "--model", "mlp", "--depth", "1000000000000"], ["--depth", "out of range"]),
    (["models", "--model", "mlp", "--model-options", "depth=1000000000000"], ["depth", "1 to 10000"]),
    (["sweep", "--model", "mlp", "--batch", "4611686018427387904"], ["--batch", "out of range"]),
    (["sweep", "--model", "mlp", "--batch", "1099511627776", "--width", "2147483648"],
     ["than 2^63"]),
    (["sweep", "--model", "resnet18", "--image", "1048576", "--batch", "1099511627776"],
     ["than 2^63"]),
    (["models", "--model", "mlp", "--width", "2147483648", "--depth", "3"], ["2^63"]),
    # Options that do not apply, empty list items and names (issue 22, item 2).
    (["sweep", "--model", "gpt2", "--depth", "12", "--width", "1024"], ["gpt2 has no depth", "seq"]),
    (["sweep", "--model", "mlp", "--seq", "77"], ["mlp has no seq", "width"]),
    (["trace", "--model", "resnet18", "--model-options", "dropout=0"], ["resnet18 has no dropout"]),
    (["sweep", "--dtype", "f32,,f16"], ["--dtype", "empty item"]),
    (["sweep", "--segments", "0,2,"], ["--segments", "empty item"]),
    (["sweep", "--model", ""], ["empty model name", "resnet18"]),
    (["sweep", "--optimizer", "lion"], ["adam", "sgd", "sgd-momentum"]),
    (["trace", "--optimizer", "lion"], ["adam8bit", "sgd-momentum"]),
    (["sweep", "--nosuchflag"], ["--nosuchflag"]),
    (["trace", "--model", "nosuchnet"], ["resnet18"]),
    (["trace", "--model", "mlp", "--depth", "2", "--segments", "5"], ["4"]),
    (["trace", "--dtype", "f32,f16"], ["one"]),
    (["nosuchcommand"], []),
    # Outputs are checked before any work (issue 22, item 13).
    (["trace", "--model", "mlp", "--depth", "2", "--plot", "/nonexistent-dir/x.svg"],
     ["--plot", "/nonexistent-dir", "does not exist"]),
    (["trace", "--model", "mlp", "--depth", "2", "--snapshot", "same.out", "--timeline",
      "./same.out"], ["--timeline", "also the file of --snapshot"]),
    (["sweep", "--model", "mlp", "--depth", "2", "--plot", "/"], ["--plot", "is a directory"]),
    # What the command line alone decides is exit 2 (issue 47).
    (["sweep", "--model", "mlp", "--compute", "--parallel", "fsdp:8"], ["--compute with --parallel fsdp:8", "dry run"]),
    (["trace", "--model", "mlp", "--parallel", "zero3:8", "--optimizer", "adam8bit"],
     ["--optimizer adam8bit with --parallel zero3:8", "FusedAdam"]),
    (["sweep", "--model", "mlp", "--batch", "4", "--batch", "5"], ["--batch given 2 times; give it once", "--batch 8,16"]),
    (["plan", "--model", "mlp", "--search", ""], ["--search", "empty value"]),
    (["replay", "--trace-device", "0x1", "x.pickle"], ["--trace-device", "not a whole number"]),
]


# An empty value is refused, never silently the default (issue 36).
BAD += [(["sweep", option, ""], [option, "an empty value"])
        for option in ("--batch", "--seq", "--attn", "--gradient-checkpointing", "--lora-targets", "--quant",
                       "--stack", "--model-options", "--model-file", "--hf-config")]
BAD += [(["trace", option, " "], [option, "an empty value"]) for option in ("--snapshot", "--timeline", "--plot",
                                                                           "--saved")]
BAD += [(["sweep", "--stack", "torch=3.0"], ["--stack", "torch 3.0 is not a version vramscope models", "2.11"]),
        (["sweep", "--model-options", "depth=4,depth=8"], ["depth is given twice"]),
        (["replay", "x.pickle", "--trace-device", "-1"], ["--trace-device"]),
        (["sweep", "--model-options", ","], ["empty item"]),
        (["sweep", "--model", "mlp", "--plot", ""], ["--plot", "an empty value"]),
        (["trace", "--model", "mlp", "--segments", ""], ["--segments", "an empty value"]),
        (["sweep", "--model", "mlp", "--max-batch", "--device", "sim:capacity=4096PiB"],
         ["capacity", "more than a simulated device models"]),
        (["trace", "--model", "mlp", "--checkpoint-modules", "0", "--selective", "matmuls"],
         ["--selective", "mlp is a model of modules", "python3 -m vramscope.export"]),
        (["trace", "--model", "mlp", "--selective", "aten mm"], ["--selective", "'aten mm' is no operator name"]),
        (["trace", "--model", "mlp", "--selective", "mm,,bmm"], ["--selective", "an empty operator name"])]


def check_bad_input(exe, work):
    for args, words in BAD:
        p = run(exe, *args, expect=2)
        err = p.stderr.strip()
        check(err.count("\n") == 0 and err.startswith("vramscope: error:"),
              f"{args}: not one error line: {p.stderr!r}")
        for w in words:
            check(w in err, f"{args}: {w!r} not in {err!r}")
        check(p.stdout == "", f"{args}: printed on stdout: {p.stdout!r}")


def check_trace_files(exe, work):
    os.makedirs(work, exist_ok=True)
    pk, tl, svg = (os.path.join(work, n) for n in ("step.pickle", "step.json", "step.svg"))
    p = run(exe, "trace", "--model", "forum-cnn", "--device", "sim:rtx2080s", "--snapshot", pk,
            "--timeline", tl, "--plot", svg, "--summary")
    text = p.stdout
    for word in ("pre-forward", "forward", "backward", "optimizer", "(Conv2d)", "per phase",
                 "device: simulated rtx2080s"):
        check(word in text, f"{word!r} not in the trace output")
    with open(pk, "rb") as f:
        snap = pickle.load(f)
    check(set(snap) >= {"segments", "device_traces", "allocator_settings"}, snap.keys())
    check(len(snap["segments"]) > 0, "no segments")
    check(len(snap["device_traces"]) == 1 and len(snap["device_traces"][0]) > 0, "no trace")
    actions = {e["action"] for e in snap["device_traces"][0]}
    check({"alloc", "free_requested", "segment_alloc"} <= actions, actions)
    # memory_viz shows "filename:line:name": module (class):0:phase; the parameters, made
    # before the step outside any module, say so instead of "(none)" (issue 22, item 9).
    frames = [f for seg in snap["segments"] for b in seg["blocks"] for f in b["frames"]]
    check(any(f["filename"].endswith("(Conv2d)") for f in frames), frames[:5])
    check(any(f["name"] == "parameters and buffers" for f in frames), sorted({f["name"] for f in frames}))
    check(all(f["name"] != "none" for f in frames), "a frame still says none")
    with open(tl) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    check(any(e.get("ph") == "C" for e in events), "no counter events")
    check(any(e.get("ph") in ("X", "B") for e in events), "no slices")
    root = ET.parse(svg).getroot()
    check(root.tag.endswith("svg"), root.tag)


def check_files(exe, work):
    """Hostile paths (issue 36), in a scratch folder, never the machine's own /dev: an output
    that is a symbolic link writes its target and the link stays; a device is written through,
    never replaced by a regular file, and a write error (a full device) is an error; an output
    that is the model file is a usage error that changes nothing; a FIFO given as an input is
    refused at once instead of waiting for a writer; a malformed trace is bad input (exit 2)."""
    import shutil
    import stat
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    w = Path(work)
    (w / "real.svg").write_text("old")
    os.symlink("real.svg", w / "link.svg")
    run(exe, "trace", *SMALL, "--plot", str(w / "link.svg"))
    check(os.path.islink(w / "link.svg"), "the symbolic link was replaced")
    check("<svg" in (w / "real.svg").read_text()[:400], "the link's target was not written")
    run(exe, "sweep", "--model", "mlp", "--depth", "2", "--segments", "0", "--plot", str(w / "link.svg"))
    check(os.path.islink(w / "link.svg") and "<svg" in (w / "real.svg").read_text()[:400], "sweep --plot link")

    # A dangling link: its target is created, the link stays.
    os.symlink("made.svg", w / "dangling.svg")
    run(exe, "trace", *SMALL, "--plot", str(w / "dangling.svg"))
    check(os.path.islink(w / "dangling.svg") and "<svg" in (w / "made.svg").read_text()[:400], "dangling link")
    # A link to the process's stdout, redirected to a file: the printed log stays, the plot
    # follows it; to a pipe, the plot goes down the pipe (never a rename over the file).
    os.symlink("/proc/self/fd/1", w / "out1")
    with open(w / "captured.txt", "w") as captured:
        done = subprocess.run([exe, "trace", *SMALL, "--plot", str(w / "out1")], stdout=captured, timeout=110)
    check(done.returncode == 0, done)
    text = (w / "captured.txt").read_text()
    check("totals:" in text and "<svg" in text, text[-300:])
    p = run(exe, "trace", *SMALL, "--plot", str(w / "out1"))
    check("totals:" in p.stdout and "<svg" in p.stdout, p.stdout[-300:])
    # A loop of links is a usage error before the run.
    os.symlink("loop-b", w / "loop-a")
    os.symlink("loop-a", w / "loop-b")
    p = run(exe, "trace", *SMALL, "--plot", str(w / "loop-a"), expect=2)
    check("loop of symbolic links" in p.stderr, p.stderr)

    # Devices made here (as root; elsewhere the device part is skipped): null (1, 3), full (1, 7).
    try:
        os.mknod(w / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(w / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        devices = True
    except PermissionError:
        devices = False
    if devices:
        for option in ("--snapshot", "--timeline", "--plot", "--saved"):
            run(exe, "trace", *SMALL, option, str(w / "null"))
            check(stat.S_ISCHR(os.stat(w / "null").st_mode), f"{option}: the device was replaced by a file")
        # Two outputs may share a device.
        run(exe, "trace", *SMALL, "--snapshot", str(w / "null"), "--timeline", str(w / "null"))
        p = run(exe, "trace", *SMALL, "--snapshot", str(w / "full"), expect=1)
        check("No space left on device" in p.stderr and "--snapshot" in p.stderr, p.stderr)
        check(stat.S_ISCHR(os.stat(w / "full").st_mode), "the full device was replaced")
        p = run(exe, "sweep", "--model", "mlp", "--depth", "2", "--segments", "0", "--plot", str(w / "full"),
                expect=1)
        check("No space left on device" in p.stderr, p.stderr)

    # An output that is an input: refused before any work, the model file untouched.
    net = w / "net.json"
    net.write_text(json.dumps({"format": "vramscope-model", "version": 1, "name": "tiny",
                               "options": {"batch": 8}, "input": {"shape": ["batch", 8]},
                               "loss": {"type": "mse"},
                               "layers": [{"type": "Linear", "in_features": 8, "out_features": 4}]}))
    before = net.read_bytes()
    os.symlink("net.json", w / "net-link.json")
    for option in ("--snapshot", "--timeline", "--plot", "--saved"):
        for target in (net, w / "net-link.json"):
            p = run(exe, "trace", "--model-file", str(net), option, str(target), expect=2)
            check("--model-file reads" in p.stderr and p.stdout == "", p.stderr)
    p = run(exe, "sweep", "--model-file", str(net), "--plot", str(net), expect=2)
    check("--model-file reads" in p.stderr, p.stderr)
    check(net.read_bytes() == before, "the model file changed")

    # A FIFO as an input: refused at once (the timeout in run() catches a wait).
    os.mkfifo(w / "fifo")
    for args in (["models", "--model-file"], ["sweep", "--hf-config"], ["replay"]):
        p = run(exe, *args, str(w / "fifo"), expect=2)
        check("FIFO" in p.stderr and p.stderr.count("\n") == 1, p.stderr)
    # A hostile file's bytes never reach the terminal raw: NUL, escape sequences and bytes that
    # are not UTF-8 come out as \xNN, and the message is whole (issue 36).
    hostile = w / "hostile.json"
    hostile.write_bytes(b'{"format": "vramscope-model", "version": 1, "name": "x\\u0000\\u001b[31mred", '
                        b'"options": {"batch": 8}, "input": {"shape": ["batch", 8]}, "loss": {"type": "nosuch\\u001b]0;t\\u0007"},'
                        b' "layers": [{"type": "Linear", "in_features": 8, "out_features": 4}]}')
    p = run(exe, "models", "--model-file", str(hostile), expect=2)
    check("\x1b" not in p.stderr and "\x07" not in p.stderr and "\\x1B]0;t\\x07" in p.stderr, repr(p.stderr))
    # A name with control characters is printed escaped in every table and header.
    named = w / "named.json"
    named.write_text(json.dumps({"format": "vramscope-model", "version": 1, "name": "evil\u001b]0;owned\u0007x",
                                 "options": {"batch": 8}, "input": {"shape": ["batch", 8]}, "loss": {"type": "mse"},
                                 "layers": [{"type": "Linear", "in_features": 8,
                                             "out_features": 4}]}))
    for args in (["models"], ["trace"], ["sweep", "--segments", "0"]):
        p = run(exe, *args, "--model-file", str(named))
        check("\x1b" not in p.stdout and "\x07" not in p.stdout and "evil\\x1B]0;owned\\x07x" in p.stdout,
              (args, repr(p.stdout[:300])))
    raw = w / "raw.json"
    raw.write_bytes(b'{"format": "vramscope-model\xff\x00\x1b[2J"}')
    p = run(exe, "models", "--model-file", str(raw), expect=2)
    check("\x1b" not in p.stderr and "\x00" not in p.stderr and p.stderr.endswith("\n"), repr(p.stderr))
    # A malformed trace is bad input, as a malformed model file is.
    (w / "bad.pickle").write_bytes(b"\x80\x04garbage")
    p = run(exe, "replay", str(w / "bad.pickle"), expect=2)
    check(p.stderr.startswith("vramscope: error:"), p.stderr)


def check_trace_log(exe, work):
    """trace --log: the per-module log as CSV and as JSON, one row per printed line, bytes
    exact (the printed MiB are the same figures, rounded); the trace and the sweep default
    to the same device, so one model gives one figure (issue 36)."""
    os.makedirs(work, exist_ok=True)
    csv_path, json_path = os.path.join(work, "log.csv"), os.path.join(work, "log.json")
    p = run(exe, "trace", "--model", "mlp", "--depth", "2", "--log", csv_path)
    printed = [l for l in p.stdout.splitlines() if l.split(" ")[0] in
               ("pre-forward", "forward", "pre-backward", "backward", "pre-optimizer", "optimizer",
                "pre-recompute", "recompute")]
    rows = list(csv.DictReader(open(csv_path)))
    check(len(rows) == len(printed) > 10, (len(rows), len(printed)))
    for row, line in zip(rows, printed):
        check(line.startswith(row["hook"] + " "), (row, line))
        check(f"{int(row['allocated']) / MiB:.2f} MiB" in line, (row, line))
    check("Adam's foreach step" in p.stdout, "no word on the optimizer's passes")
    run(exe, "trace", "--model", "mlp", "--depth", "2", "--log", json_path)
    doc = json.load(open(json_path))
    check(doc["model"] == "mlp" and doc["device"] == "sim:rtx2080s" and doc["segments"] == 0, doc)
    check([l["allocated"] for l in doc["lines"]] == [int(r["allocated"]) for r in rows], "csv and json differ")
    p = run(exe, "trace", "--model", "mlp", "--depth", "2", "--log", os.path.join(work, "log.txt"), expect=2)
    check("--log" in p.stderr and ".csv or .json" in p.stderr, p.stderr)
    # A stream has no extension: CSV, after what was printed (a link in the scratch folder to
    # this process's stdout, a pipe here; never the machine's own /dev entries).
    stream = os.path.join(work, "stream")
    if os.path.lexists(stream):
        os.remove(stream)
    os.symlink("/proc/self/fd/1", stream)
    p = run(exe, "trace", "--model", "mlp", "--depth", "2", "--log", stream)
    check("\nline,hook,module,type,depth," in p.stdout and p.stdout.count("\n1,pre-forward,input,") == 1, p.stdout[-400:])
    # One default device: the sweep's max allocated equals the trace's peak.
    trace_peak = json.load(open(json_path))
    sweep = json.loads(run(exe, "sweep", "--model", "mlp", "--depth", "2", "--segments", "0", "--dtype", "f32",
                           "--steps", "1", "--format", "json").stdout)
    check(sweep["device"]["name"] == trace_peak["device"], (sweep["device"], trace_peak["device"]))
    check(sweep["rows"][0]["max_allocated"] == max(l["peak_between"] for l in trace_peak["lines"]),
          (sweep["rows"][0]["max_allocated"], max(l["peak_between"] for l in trace_peak["lines"])))


def check_trace_saved(exe, work):
    """--saved: forum-cnn's saved-for-backward bytes per module, derived by hand (batch 100,
    f32): conv1 keeps the input, each ReLU its output (which the next conv and the Linear
    keep too: one storage, counted under the first saver), MSE its input and target."""
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "saved.csv")
    p = run(exe, "trace", "--model", "forum-cnn", "--saved", out, "--no-pre")
    with open(out, newline="") as f:
        rows = {r["module"]: (r["type"], int(r["tensors"]), int(r["bytes"])) for r in csv.DictReader(f)}
    pixels = 100 * 19 * 22 * 4
    expected = {
        "0": ("Conv2d", 1, 20 * pixels),   # the batch
        "1": ("ReLU", 1, 50 * pixels),
        "3": ("ReLU", 1, 25 * pixels),
        "5": ("ReLU", 1, 10 * pixels),
        "loss": ("", 2, 2 * 100 * 3258 * 4),  # mse_loss: output and target
    }
    check(rows == expected, f"{rows} != {expected}")
    total = sum(b for _, _, b in expected.values())
    check(f"{total / MiB:.2f} MiB saved for backward in step 1's forward, in 5 modules" in p.stdout, p.stdout[-600:])
    # Checkpointing keeps only each segment's input: fewer bytes, fewer modules.
    run(exe, "trace", "--model", "forum-cnn", "--saved", out, "--segments", "2", "--no-pre")
    with open(out, newline="") as f:
        kept = sum(int(r["bytes"]) for r in csv.DictReader(f))
    check(kept < total, f"checkpointed {kept} >= {total}")


def check_trace_oom(exe, work):
    os.makedirs(work, exist_ok=True)
    pk = os.path.join(work, "oom.pickle")
    p = run(exe, "trace", "--model", "mlp", "--depth", "16", "--width", "1024", "--batch", "8192",
            "--device", "sim:capacity=600MiB,context=100MiB", "--snapshot", pk, expect=1)
    check("out of memory" in p.stdout.lower(), p.stdout)
    check("pre-forward" in p.stdout, "the log before the failure is missing")
    check(p.stderr.strip().count("\n") == 0, p.stderr)
    with open(pk, "rb") as f:
        snap = pickle.load(f)
    check(any(e["action"] == "oom" for e in snap["device_traces"][0]), "no oom entry")


def check_inplace(exe, work):
    # resnet18's stem ReLU(inplace=True) begins a checkpointed segment from 6 segments on:
    # PyTorch refuses the step, so does vramscope (exit 1, PyTorch's message, the counts that run).
    os.makedirs(work, exist_ok=True)
    p = run(exe, "trace", "--model", "resnet18", "--batch", "2", "--image", "32", "--segments", "6",
            "--no-pre", expect=1)
    check("has been modified by an inplace operation" in p.stdout, p.stdout)
    check("ReluBackward0, is at version 1; expected version 0 instead." in p.stdout, p.stdout)
    check(p.stderr.strip().endswith("--segments that resnet18 accepts: 0 (none), 2-5"), p.stderr)
    js = os.path.join(work, "sweep.json")
    p = run(exe, "sweep", "--model", "resnet18", "--batch", "2", "--image", "32", "--segments", "0,5,6",
            "--dtype", "f32", "--format", "json")
    j = json.loads(p.stdout)
    rows = {r["segments"]: r for r in j["rows"]}
    check(rows[6]["fits"] is False and rows[6]["best"] is False, rows[6])
    check(rows[6]["error_phase"] == "backward" and "ReluBackward0" in rows[6]["error"], rows[6])
    check(rows[5]["error"] is None and rows[5]["fits"] is True, rows[5])
    check(j["accepted_segments"] == [1, 2, 3, 4, 5], j["accepted_segments"])
    # Another refusal says what it is, not the in-place advice (issue 36): a model whose every
    # parameter is frozen and whose input needs no grad has nothing to differentiate.
    frozen = os.path.join(work, "frozen.json")
    with open(frozen, "w") as f:
        json.dump({"format": "vramscope-model", "version": 1, "name": "frozen", "options": {"batch": 4},
                   "input": {"shape": ["batch", 8]}, "loss": {"type": "mse"},
                   "layers": [{"name": "fc", "type": "Linear", "in_features": 8, "out_features": 8,
                               "frozen": True}]}, f)
    p = run(exe, "trace", "--model-file", frozen, "--no-pre", expect=1)
    check("element 0 of tensors does not require grad" in p.stderr, p.stderr)
    check("in-place" not in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr)


def check_demo(exe, work):
    start = time.monotonic()
    text = run(exe, "sweep").stdout
    took = time.monotonic() - start
    check(took < 30, f"the default sweep took {took:.1f} s")
    lines = text.splitlines()
    f32_none = [l for l in lines if l.strip().startswith("f32") and "0 (none)" in l]
    check(f32_none and "OOM" in f32_none[0], f"f32 without checkpointing should not fit:\n{text}")
    check(any(l.strip().startswith("f16") for l in lines), "no f16 rows")
    best = [l for l in lines if l.rstrip().endswith("*")]
    check(len(best) == 2, f"one best per dtype:\n{text}")
    for word in ("How to read this", "nvidia-smi", "sqrt", "device: simulated rtx2080s"):
        check(word in text, f"{word!r} missing")
    # The U: max allocated falls from few to some segments and rises again after.
    out = json.loads(run(exe, "sweep", "--dtype", "f32", "--format", "json").stdout)
    fit = [r for r in out["rows"] if r["fits"]]
    peaks = [r["max_allocated"] for r in sorted(fit, key=lambda r: r["segments"])]
    low = peaks.index(min(peaks))
    check(0 < low < len(peaks) - 1, f"no U shape: {peaks}")
    best_row = next(r for r in out["rows"] if r["best"])
    n = out["model"]["sequential_modules"]
    check(n ** 0.5 / 4 <= best_row["segments"] <= 4 * n ** 0.5,
          f"best at {best_row['segments']} segments, sqrt(n) = {n ** 0.5:.1f}")


def check_help(exe, work):
    for cmd in ([], ["sweep"], ["trace"], ["devices"], ["models"]):
        p = run(exe, *cmd, "--help")
        check("Examples" in p.stdout, f"{cmd}: no examples in --help")


def check_devices(exe, work):
    text = run(exe, "devices").stdout
    for word in ("sim:rtx2080s", "sim:a100-80g", "CUDA context", "assumed", "Real GPUs"):
        check(word in text, f"{word!r} missing")


def check_models(exe, work):
    text = run(exe, "models").stdout
    for word in ("mlp", "forum-cnn", "forum-cnn-full", "resnet18", "resnet50", "gpt2"):
        check(word in text, f"{word!r} missing")
    text = run(exe, "models", "--model", "mlp", "--depth", "4", "--width", "1024").stdout
    # 4 x (1024 x 1024 weights + 1024 biases)
    check("4,198,400" in text, text)


def check_plot(exe, work):
    os.makedirs(work, exist_ok=True)
    svg = os.path.join(work, "sweep.svg")
    run(exe, "sweep", *SMALL, "--segments", "0,2,4", "--plot", svg, "--format", "csv")
    root = ET.parse(svg).getroot()
    check(root.tag.endswith("svg"), root.tag)
    ns = "{http://www.w3.org/2000/svg}"
    check(len(root.findall(f"{ns}polyline")) == 4, "two curves per dtype")
    # A step's plot and timeline are the same picture every time: their x axis counts
    # allocator events, not host time (issue 22, item 8); an OOM is marked in both.
    outs = []
    for n in (1, 2):
        plot, timeline = os.path.join(work, f"step{n}.svg"), os.path.join(work, f"step{n}.json")
        run(exe, "trace", "--model", "forum-cnn-full", "--device", "sim:rtx2080s", "--plot", plot,
            "--timeline", timeline, expect=1)
        outs.append((open(plot).read(), open(timeline).read()))
    check(outs[0] == outs[1], "the same command drew two different pictures")
    svg_text, trace_text = outs[0]
    check('id="oom"' in svg_text and "out of memory: asked" in svg_text, "no OOM mark in the plot")
    check("allocator events since recording started" in svg_text, "x axis")
    check("1 training step" in svg_text, "the title says the steps")
    events = json.loads(trace_text)["traceEvents"]
    check(any(e["ph"] == "i" and e["name"].startswith("out of memory") for e in events),
          "no OOM mark in the timeline")
    check(all(e["name"] for e in events if e["ph"] == "X"), "an unnamed slice")


def check_replay(exe, work):
    """A step's snapshot replayed under two settings; -a is --alloc-conf here as in sweep."""
    os.makedirs(work, exist_ok=True)
    pk = os.path.join(work, "step.pickle")
    run(exe, "trace", *SMALL, "--snapshot", pk)
    p = run(exe, "replay", pk, "--device", "sim:capacity=1GiB,context=100MiB",
            "-a", "", "-a", "max_split_size_mb:128")
    check("max_split_size_mb:128" in p.stdout, p.stdout)
    # The what-if: every run starts from the recorded state and is compared with the recorded
    # setting's run (inserted first when not asked for); a setting that cannot act changes
    # nothing at all; one line of advice.
    out = json.loads(run(exe, "replay", pk, "--device", "sim:capacity=1GiB,context=100MiB",
                         "-a", "garbage_collection_threshold:0.6", "-a", "max_split_size_mb:128",
                         "--format", "json").stdout)
    runs = out["runs"]
    check([r["config"] for r in runs] == ["", "garbage_collection_threshold:0.6", "max_split_size_mb:128"],
          [r["config"] for r in runs])
    check(runs[0].get("baseline") == "recorded", runs[0])
    check(runs[1]["vs_baseline"] == {"peak_reserved_bytes": 0, "peak_nvidia_smi_bytes": 0, "device_allocs": 0,
                                     "oom": ""}, runs[1]["vs_baseline"])
    check(runs[2]["vs_baseline"]["peak_reserved_bytes"] == runs[2]["peak_reserved_bytes"] - runs[0]["peak_reserved_bytes"],
          runs[2])
    check(out["advice"] and "recorded" in out["advice"], out.get("advice"))
    check(all(0 <= r["fragmentation"] < 0.5 for r in runs), [r["fragmentation"] for r in runs])
    table = run(exe, "replay", pk, "-a", "garbage_collection_threshold:0.6").stdout
    check("vs recorded" in table and "advice: " in table and "  same" in table, table)
    # --min-capacity: the smallest GPU for each setting, at most the device's own view of it.
    out = json.loads(run(exe, "replay", pk, "--device", "sim:capacity=1GiB,context=100MiB", "-a", "",
                         "--min-capacity", "--format", "json").stdout)
    mc = out["runs"][0]["min_capacity"]
    check(100 * MiB < mc["capacity_bytes"] <= GiB and mc["capacity_bytes"] % (2 * MiB) == 0, mc)
    check(mc["capacity_bytes"] <= mc["unlimited_nvidia_smi_bytes"] + 2 * MiB, mc)
    table = run(exe, "replay", pk, "--min-capacity").stdout
    check("smallest GPU" in table, table)
    err = run(exe, "replay", pk, "--min-capacity", "--device", "cuda:0", expect=2).stderr
    check(err.count("\n") == 1, err)
    # garbage_collection_threshold acts only under a memory fraction: said when none is given.
    gc = ["-a", "garbage_collection_threshold:0.6", "--device", "sim:capacity=1GiB,context=100MiB"]
    check("acts only under a memory fraction" in run(exe, "replay", pk, *gc).stdout, "gc note")
    check("acts only under a memory fraction" not in
          run(exe, "replay", pk, *gc, "--memory-fraction", "0.9").stdout, "gc note with a fraction")
    for bad in ("0", "1.5", "abc", "nan"):
        err = run(exe, "replay", pk, "--memory-fraction", bad, expect=2).stderr
        check(err.count("\n") == 1 and "--memory-fraction" in err, err)
    # Every segment on GPU 1, one trace entry on each GPU: the default is GPU 1, the one with
    # the segments, not the first with a trace entry; a GPU with nothing is a usage error
    # naming those with something (issue 34).
    with open(pk, "rb") as f:
        snap = pickle.load(f)
    for seg in snap["segments"]:
        seg["device"] = 1
    first = snap["device_traces"][0][0]
    snap["device_traces"] = [[first], [first]]
    moved = os.path.join(work, "on-gpu1.pickle")
    with open(moved, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    out = json.loads(run(exe, "replay", moved, "--format", "json").stdout)
    check(out["trace_device"] == 1 and out["runs"][0]["peak_reserved_bytes"] > 0, (out["trace_device"], out["runs"][0]))
    # The answer comes first: the advice line before the divergences (here every recorded
    # address is off by 512 B, so every allocation diverges), and with --min-capacity the
    # advice ranks by the smallest-GPU column and the sizes name presets that have them.
    with open(pk, "rb") as f:
        snap = pickle.load(f)
    for e in snap["device_traces"][0]:
        if e["action"] in ("alloc", "free_requested", "free_completed"):
            e["addr"] += 512
    shifted = os.path.join(work, "shifted.pickle")
    with open(shifted, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    text = run(exe, "replay", shifted, "-a", "max_split_size_mb:128").stdout
    lines = text.splitlines()
    advice_at = [i for i, l in enumerate(lines) if "advice:" in l]
    diverge_at = [i for i, l in enumerate(lines) if "divergences in all" in l or ": event " in l]
    check(advice_at and diverge_at and advice_at[0] < min(diverge_at), text)
    text = run(exe, "replay", pk, "--min-capacity", "-a", "", "-a", "max_split_size_mb:128").stdout
    check("GPUs of that size or more: " in text and ("smaller GPU" in text or "runs on a GPU of" in text), text)
    err = run(exe, "replay", moved, "--trace-device", "3", expect=2).stderr
    check("device 3 has no segments and no trace events;" in err and
          "device 1 (" in err and "have them" in err and err.count("\n") == 1, err)


def check_reentrant(exe, work):
    """Reentrant checkpointing of every segment with an input that needs no grad: PyTorch's
    RuntimeError, shown as an error row (issue 22, item 6), not the end of the sweep."""
    base = ["sweep", "--model", "mlp", "--depth", "4", "--checkpoint", "reentrant",
            "--segments", "0,2,8", "--dtype", "f32", "--brief", "--format", "csv"]
    rows = list(csv.DictReader(io.StringIO(run(exe, *base).stdout)))
    by_k = {int(r["segments"]): r for r in rows}
    check("does not require grad" in by_k[8]["error"], by_k[8])
    check(by_k[0]["fits"] in ("1", "true", "True") and not by_k[0]["error"], by_k[0])
    rows = list(csv.DictReader(io.StringIO(run(exe, *base, "--input-requires-grad").stdout)))
    check(all(not r["error"] for r in rows), rows)
    # The 2-segment row fits without its first segment's gradients: marked, and the mark explained.
    table = run(exe, *base[:-2]).stdout
    check("yes (grads missing!)" in table and "(grads missing!) reentrant checkpointing whose input needs no grad"
          in table and "--input-requires-grad" in table, table)


def check_auto_segments(exe, work):
    """--segments auto finds the minimum the sampled counts only bracket (issue 22, item 3):
    gpt2 under amp on a T4 is lowest at 15 segments, which 0, 2, 4, 8 would never show."""
    out = run(exe, "sweep", "--model", "gpt2", "--batch", "8", "--dtype", "amp", "--device",
              "sim:t4", "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    best = [r for r in rows if r["best"] == "true"]
    check(len(best) == 1, rows)
    fits = [r for r in rows if r["fits"] == "true"]
    lowest = min(int(r["max_nvidia_smi"]) for r in fits)
    check(int(best[0]["max_nvidia_smi"]) == lowest, best)
    check(int(best[0]["segments"]) >= 14, best[0])
    ks = sorted(int(r["segments"]) for r in rows)
    k = int(best[0]["segments"])
    # Its neighbours in the table are adjacent counts (or the ends of the range).
    i = ks.index(k)
    check(i == 0 or ks[i - 1] >= k - 1 or ks[i - 1] < 2, ks)
    check(i + 1 == len(ks) or ks[i + 1] == k + 1, ks)


def check_compute_host_memory(exe, work):
    """--compute backs the simulated GPU with host memory: a run that cannot fit in what the
    machine has stops before any arithmetic, saying what it needs (issue 22, item 11)."""
    env = dict(os.environ, VRAMSCOPE_HOST_MEMORY="100MiB")
    for args in (["sweep", "--model", "forum-cnn", "--compute", "--segments", "0", "--dtype", "f32"],
                 ["trace", "--model", "forum-cnn", "--compute"]):
        start = time.time()
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=110, env=env)
        check(p.returncode == 1, f"{args}: exit {p.returncode}: {p.stderr}")
        err = p.stderr.strip()
        check(err.count("\n") == 0 and "MiB of host memory" in err and "100.00 MiB available" in err,
              err)
        check(time.time() - start < 20, "the check must come before the arithmetic")
    # A model that cannot fit on the device is found by the dry run, reported as its OOM row,
    # and never computed: no host memory asked for, no minutes of arithmetic (issue 36).
    p = subprocess.run([exe, "sweep", "--model", "llama-3.1-70b", "--compute", "--segments", "0",
                        "--dtype", "bf16"], capture_output=True, text=True, timeout=110, env=env)
    check(p.returncode == 0 and "OOM [1]" in p.stdout, f"exit {p.returncode}: {p.stdout} {p.stderr}")


def check_batch_lists(exe, work):
    """--batch and --seq lists: one group of rows per value, each equal to a run of that
    value alone; a list where one value is expected (trace) is a usage error."""
    small = ["--model", "mlp", "--depth", "4", "--width", "1024",
             "--device", "sim:capacity=1GiB,context=100MiB", "--dtype", "f32", "--format", "csv"]
    rows = list(csv.DictReader(io.StringIO(
        run(exe, "sweep", *small, "--batch", "512,2048", "--segments", "0,2").stdout)))
    check([(r["batch"], r["segments"]) for r in rows] ==
          [("512", "0"), ("512", "2"), ("2048", "0"), ("2048", "2")], rows)
    for batch in ("512", "2048"):
        alone = list(csv.DictReader(io.StringIO(
            run(exe, "sweep", *small, "--batch", batch, "--segments", "0,2").stdout)))
        got = [r for r in rows if r["batch"] == batch]
        check([r["max_allocated"] for r in got] == [r["max_allocated"] for r in alone], (got, alone))
    gpt2 = list(csv.DictReader(io.StringIO(run(
        exe, "sweep", "--model", "gpt2", "--batch", "1", "--seq", "64,128", "--segments", "0",
        "--dtype", "amp", "--steps", "1", "--format", "csv").stdout)))
    check([r["seq"] for r in gpt2] == ["64", "128"], gpt2)
    table = run(exe, "sweep", "--model", "mlp", "--depth", "4", "--batch", "64,128", "--segments",
                "0", "--dtype", "f32", "--brief").stdout
    check("batch=64,128" in table and "  batch  " in table, table)
    err = run(exe, "trace", "--model", "mlp", "--batch", "64,128", expect=2).stderr
    check("--batch: 2 values given" in err, err)
    err = run(exe, "sweep", "--model", "mlp", "--seq", "64,128", expect=2).stderr
    check("seq" in err and err.count("\n") == 1, err)
    err = run(exe, "sweep", "--model", "mlp", "--batch", "64,,128", expect=2).stderr
    check("--batch" in err, err)


def check_max_batch(exe, work):
    """--max-batch: the batch it prints fits, as a sweep at that batch shows, and one more
    sample is out of memory, as a sweep at batch + 1 shows."""
    small = ["--model", "mlp", "--depth", "4", "--width", "1024",
             "--device", "sim:capacity=1GiB,context=100MiB"]
    out = json.loads(run(exe, "sweep", *small, "--max-batch", "--segments", "0,4", "--dtype", "f32,f16",
                         "--format", "json").stdout)
    check(out["schema_version"] == 1 and len(out["rows"]) == 4, out)
    for r in out["rows"]:
        b = r["max_batch"]
        check(b > 1 and r["max_allocated"] <= GiB, r)
        for batch, fits in ((b, "true"), (b + 1, "false")):
            row = list(csv.DictReader(io.StringIO(run(
                exe, "sweep", *small, "--batch", str(batch), "--segments", str(r["segments"]),
                "--dtype", r["dtype"], "--format", "csv").stdout)))[0]
            check(row["fits"] == fits, (batch, r, row))
            if fits == "true":
                check(int(row["max_allocated"]) == r["max_allocated"], (r, row))
            else:
                check(int(row["oom_requested"]) == r["next_oom_requested"], (r, row))
    table = run(exe, "sweep", *small, "--max-batch", "--segments", "0", "--dtype", "f32").stdout
    check("max batch" in table and "batch+1 runs out in" in table, table)
    for bad in (["--batch", "8"], ["--compute"], ["--plot", os.path.join(work, "p.svg")]):
        err = run(exe, "sweep", *small, "--max-batch", *bad, expect=2).stderr
        check(err.count("\n") == 1, err)
    # A model whose structure follows the batch (a repeat count "batch") has one module at
    # batch 1, where the search starts: a usage error naming that, not the runtime's (issue 36).
    os.makedirs(work, exist_ok=True)
    rb = os.path.join(work, "rb.json")
    with open(rb, "w") as f:
        json.dump({"format": "vramscope-model", "version": 1, "name": "rb", "options": {"batch": 8},
                   "input": {"shape": ["batch", 8]}, "loss": {"type": "mse"},
                   "layers": [{"repeat": "batch", "layers": [{"type": "Linear", "in_features": 8,
                                                               "out_features": 8}]}]}, f)
    p = run(exe, "sweep", "--model-file", rb, "--max-batch", "--segments", "4", expect=2)
    check("starts at batch 1, where rb has 1 sequential module" in p.stderr, p.stderr)


# A small llama config.json, as a user's file (issue 19).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 512,
    "model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 1000}



def check_hf_model(exe, work, expected):
    """--hf-model NAME reads config.json from the local Hugging Face cache (huggingface_hub's
    layout: models--org--name/refs/main naming the snapshot), never downloading (issue 48):
    the same rows as --hf-config on that file, and one line saying what to do when it is missing."""
    home = Path(work) / "hf-home"
    snapshot = home / "hub" / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(TINY_LLAMA))
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env["HF_HOME"] = str(home)

    def sweep(*args, expect=0):
        p = subprocess.run([exe, "sweep", *args], capture_output=True, text=True, timeout=110, env=env)
        check(p.returncode == expect, f"{args}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        return p
    common = ["--dtype", "bf16,amp-bf16", "--seq", "128,512", "--attn", "eager", "--format", "json"]
    for name in ("acme/tiny-llama", str(snapshot)):
        doc = json.loads(sweep("--hf-model", name, *common).stdout)
        check([r["max_allocated"] for r in doc["rows"]] == [r["max_allocated"] for r in expected["rows"]], doc["rows"])
        check(doc["model"]["name"] == "tiny-llama", doc["model"]["name"])  # the cache names it, not the commit
    err = sweep("--hf-model", "acme/missing", expect=2).stderr
    check("not in the Hugging Face cache" in err and "huggingface-cli download acme/missing config.json" in err
          and err.count("\n") == 1, err)
    for bad, says in (("a/b/c", "not a Hub model name"), (str(home), "the folder has no config.json"),
                      (str(snapshot / "config.json"), "give its folder")):
        err = sweep("--hf-model", bad, expect=2).stderr
        check(says in err and err.count("\n") == 1, err)
    err = sweep("--hf-model", str(snapshot), "--hf-config", str(snapshot / "config.json"), expect=2).stderr
    check("--hf-config" in err and err.count("\n") == 1, err)


def check_hf_config(exe, work):
    Path(work).mkdir(parents=True, exist_ok=True)
    cfg = Path(work) / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    # 2 x 1000 x 256 embeddings, 4 layers of 256x256 + 2 x 256x64 + 256x256 + 3 x 256x512
    # + 2 x 256, and the final norm.
    params = 2 * 1000 * 256 + 4 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 512 + 2 * 256) + 256
    p = run(exe, "sweep", "--hf-config", str(cfg), "--dtype", "bf16,amp-bf16", "--seq", "128,512",
            "--attn", "eager", "--format", "json")
    doc = json.loads(p.stdout)
    check(doc["model"]["parameters"] == params, f"parameters {doc['model']['parameters']} != {params}")
    # --gradient-checkpointing takes a list (issue 33): a group per mode, "none" first, and each
    # checkpointed mode's saving measured against it (not against itself: 0 B).
    modes = json.loads(run(exe, "sweep", "--hf-config", str(cfg), "--dtype", "bf16", "--seq", "512",
                           "--gradient-checkpointing", "non-reentrant,none", "--format", "json").stdout)["rows"]
    check([r["label"] for r in modes] == ["bf16 checkpoint none seg 0", "bf16 checkpoint non-reentrant seg 0"], modes)
    check(modes[1]["saving"] == modes[0]["max_allocated"] - modes[1]["max_allocated"] and modes[1]["saving"] > 0
          and modes[1]["recompute_ratio"] > 0 and all(r["best"] for r in modes), modes)
    alone = json.loads(run(exe, "sweep", "--hf-config", str(cfg), "--dtype", "bf16", "--seq", "512",
                           "--gradient-checkpointing", "non-reentrant", "--format", "json").stdout)["rows"]
    check(alone[0]["saving"] == modes[1]["saving"], (alone, modes))
    check_hf_model(exe, work, doc)
    err = run(exe, "sweep", "--hf-config", str(cfg), "--gradient-checkpointing", "none,sideways", expect=2).stderr
    check("--gradient-checkpointing" in err and "sideways" in err, err)
    rows = doc["rows"]
    check(len(rows) == 4, f"{len(rows)} rows")
    # Longer sequences peak higher (eager keeps B x H x S x S probabilities).
    by = {(r["dtype"], r["seq"]): r["max_allocated"] for r in rows}
    check(by[("bf16", 512)] > by[("bf16", 128)], f"seq 512 not above seq 128: {by}")
    # LoRA and per-layer checkpointing each lower the peak of the same run.
    def peak(*extra):
        out = run(exe, "sweep", "--hf-config", str(cfg), "--dtype", "bf16", "--seq", "512", "--format",
                  "json", *extra)
        return json.loads(out.stdout)["rows"][0]["max_allocated"]
    full = peak()
    check(peak("--lora", "8") < full, "LoRA does not lower the peak")
    check(peak("--gradient-checkpointing", "non-reentrant") < full, "checkpointing does not lower the peak")
    # Errors: one line, exit 2, the key or option named.
    bad = Path(work) / "bad.json"
    for patch, words in [({"num_key_value_heads": 3}, ["num_key_value_heads", "does not divide"]),
                         # Not a built-in decoder: recorded through the exporter, which needs
                         # a Python with torch (none here: the message says what to install).
                         ({"model_type": "t5"}, ["not one of the built-in decoders"]),
                         ({"moe_experts": 4}, ["moe_experts", "not modelled"]),
                         # transformers refuses layer_types of another length (issue 47).
                         ({"layer_types": ["full_attention"] * 3},
                          ["--hf-config", "layer_types: 3 entries for num_hidden_layers", "one per layer"])]:
        bad.write_text(json.dumps({**TINY_LLAMA, **patch}))
        p = run(exe, "sweep", "--hf-config", str(bad), expect=2)
        err = p.stderr.strip()
        check(err.count("\n") == 0 and all(w in err for w in words), f"{patch}: {err!r}")
    # A number no double holds is named by its key, not by the JSON library's words (issue 47).
    bad.write_text(json.dumps(TINY_LLAMA)[:-1] + ', "rope_theta": 1e400}')
    err = run(exe, "sweep", "--hf-config", str(bad), expect=2).stderr
    check('"rope_theta": a number too large' in err and "json.exception" not in err, err)
    # A recorded model_type runs under one autocast: mixing amp and plain is refused before recording.
    bad.write_text(json.dumps({**TINY_LLAMA, "model_type": "qwen3"}))
    err = run(exe, "sweep", "--hf-config", str(bad), "--dtype", "bf16,amp-bf16", expect=2).stderr
    check("--dtype: an --hf-config that the exporter records runs under one autocast" in err, err)
    err = run(exe, "sweep", "--hf-config", str(bad), "--quant", "nf4", "--lora", "8", expect=2).stderr
    check("--quant: bitsandbytes' 4-bit layers run on a GPU only" in err, err)
    err = run(exe, "sweep", "--hf-config", str(bad), "--gradient-checkpointing", "none,on", expect=2).stderr
    check("takes one mode per run" in err, err)
    for args, words in [(["--seq", "1024"], ["exceeds max_position_embeddings 512"]),
                        (["--segments", "4"], ["checkpoints per decoder layer"]),
                        (["--model", "mlp"], ["give one"]),
                        (["--lora-targets", "q_proj"], ["needs lora=RANK"]),
                        (["--attn", "flash9"], ["unknown attention"])]:
        p = run(exe, "sweep", "--hf-config", str(cfg), *args, expect=2)
        check(all(w in p.stderr for w in words), f"{args}: {p.stderr!r}")
    p = run(exe, "sweep", "--hf-config", str(Path(work) / "missing.json"), expect=2)
    check("does not exist" in p.stderr, p.stderr)


def check_parallel(exe, work):
    """--parallel ddp:8: each row is one rank's step, as the H100 recorded it
    (tests/data/h100-parallel-2026-11-26): the residual mlp's max allocated over three steps
    equals PyTorch's plus the [64, 10] output vramscope's step keeps (the recording's loss_fn
    drops it), its buckets are the communication buffers of the peak, and the table, CSV,
    JSON, trace and --max-batch say which engine they are one GPU of."""
    data = Path(__file__).resolve().parents[1] / "data" / "h100-parallel-2026-11-26"
    ref = [r for r in csv.DictReader(open(data / "parallel_reference.csv")) if r["config"] == "mlp-ddp-r0"]
    model = ["--model-file", str(data / "ref-resmlp.json"), "--device", "sim:h100-80g", "--dtype", "f32",
             "--steps", "3"]
    one = json.loads(run(exe, "sweep", *model, "--segments", "0", "--format", "json").stdout)
    out = json.loads(run(exe, "sweep", *model, "--segments", "0", "--parallel", "ddp:8", "--format", "json").stdout)
    row = out["rows"][0]
    check(row["parallel"] == "ddp:8" and one["rows"][0]["parallel"] == "none", (row, one["rows"][0]))
    check(row["max_allocated"] == max(int(r["max_allocated"]) for r in ref) + 2560, (row["max_allocated"], ref))
    check(row["max_reserved"] == max(int(r["max_reserved"]) for r in ref), row["max_reserved"])
    buckets = sum((b + 511) // 512 * 512 for b in (7209144, 28622496, 12508972))  # the rebuilt buckets
    check(row["peak_communication"] == buckets and one["rows"][0]["peak_communication"] == 0, row)
    # Each step all-reduces every bucket: a ring sends 2 (n - 1) / n of it.
    sent = 2 * 7 / 8 * (7209144 + 28622496 + 12508972)
    check(row["communication_bytes_per_step"] == sent and one["rows"][0]["communication_bytes_per_step"] == 0, row)
    check(sum(row[k] for k in row if k.startswith("peak_") and k != "peak_reserved") == row["max_allocated"], row)
    table = run(exe, "sweep", *model, "--segments", "0", "--parallel", "ddp:8", "--brief").stdout
    check("each GPU of ddp:8" in table and "communication buffers 46.10 MiB" in " ".join(table.split()), table)
    check("parallel: ddp:8: every figure is one GPU's" in table, table)
    # A list gives each configuration its rows (and its star), side by side.
    both = json.loads(run(exe, "sweep", *model, "--segments", "0", "--parallel", "none,ddp:8", "--format",
                          "json").stdout)["rows"]
    check([r["parallel"] for r in both] == ["none", "ddp:8"] and all(r["best"] for r in both), both)
    check(both[0]["max_allocated"] == one["rows"][0]["max_allocated"] and both[1]["max_allocated"] == row["max_allocated"],
          both)
    err = run(exe, "sweep", *model, "--max-batch", "--parallel", "none,ddp:8", expect=2).stderr
    check("--max-batch: searches one --parallel configuration" in err, err)
    err = run(exe, "trace", *model, "--parallel", "none,ddp:8", expect=2).stderr
    check("trace runs one configuration" in err, err)
    rows = list(csv.DictReader(io.StringIO(run(exe, "sweep", *model, "--segments", "0", "--parallel", "ddp:8",
                                               "--parallel-options", "gradient_as_bucket_view=true",
                                               "--format", "csv").stdout)))
    check(rows[0]["parallel"] == "ddp:8 gradient_as_bucket_view=true", rows[0])
    check(int(rows[0]["allocated_after_step"]) < row["allocated_after_step"], (rows[0], row))
    Path(work).mkdir(parents=True, exist_ok=True)
    buffers = os.path.join(work, "buffers.csv")
    trace = run(exe, "trace", *model, "--parallel", "ddp:8", "--buffers", buffers).stdout
    check("each GPU of ddp:8" in trace and "DDP's gradient buckets" in trace, trace)
    rows = list(csv.DictReader(open(buffers)))
    buckets = [(r["buffer"], int(r["bytes"]), r["allocated"], r["freed"]) for r in rows if r["buffer"].startswith("gradient bucket")]
    check(buckets == [("gradient bucket 0 (every gradient of its dtype, until the rebuild)", 48340612, "construction",
                       "step 2 forward"),
                      ("gradient bucket 0 (rebuilt)", 7209144, "step 2 forward", ""),
                      ("gradient bucket 1 (rebuilt)", 28622496, "step 2 forward", ""),
                      ("gradient bucket 2 (rebuilt)", 12508972, "step 2 forward", "")], buckets)
    check(not os.path.exists("/tmp/vramscope-never-written.csv"), "a refused --buffers wrote its file")
    mb = json.loads(run(exe, "sweep", "--model-file", str(data / "ref-resmlp.json"), "--device",
                        "sim:capacity=2GiB,context=100MiB", "--dtype", "f32", "--segments", "0", "--max-batch",
                        "--parallel", "ddp:8", "--format", "json").stdout)
    single = json.loads(run(exe, "sweep", "--model-file", str(data / "ref-resmlp.json"), "--device",
                            "sim:capacity=2GiB,context=100MiB", "--dtype", "f32", "--segments", "0", "--max-batch",
                            "--format", "json").stdout)
    # The buckets (46 MiB) come on top of the step: the largest batch is no larger, and at the
    # same batch the peak is higher by about them.
    m, s1 = mb["rows"][0], single["rows"][0]
    check(mb["parallel"] == "ddp:8" and m["max_batch"] <= s1["max_batch"], (m, s1))
    check(m["max_batch"] != s1["max_batch"] or m["max_allocated"] - s1["max_allocated"] >= 48_000_000, (m, s1))


def check_fsdp(exe, work):
    """--parallel fsdp:8: rank 0's and rank 7's rows (1337 rows do not split evenly over 8),
    each peak equal to PyTorch's on the H100 plus the output vramscope's step keeps, whatever
    the segments asked (FSDP's rows run without them); the buffers listing has each group's
    shards and all-gather output with its stream."""
    data = Path(__file__).resolve().parents[1] / "data" / "h100-parallel-2026-11-26"
    model = ["--model-file", str(data / "ref-resmlp.json"), "--device", "sim:h100-80g", "--dtype", "f32",
             "--steps", "3"]
    ref = {r: [x for x in csv.DictReader(open(data / "parallel_reference.csv")) if x["config"] == f"mlp-fsdp2-r{r}"]
           for r in (0, 7)}
    out = json.loads(run(exe, "sweep", *model, "--segments", "0,2", "--parallel", "fsdp:8", "--parallel-options",
                         "init=cuda", "--format", "json").stdout)["rows"]
    check([r["parallel"] for r in out] == ["fsdp:8 init=cuda", "fsdp:8 init=cuda,rank=7"], out)
    check([r["segments"] for r in out] == [0, 0], out)
    for row, rank in zip(out, (0, 7)):
        check(row["max_allocated"] == max(int(r["max_allocated"]) for r in ref[rank]) + 2560, (row, rank))
        check(row["max_reserved"] == max(int(r["max_reserved"]) for r in ref[rank]), (row, rank))
        check(row["peak_communication"] > 0, row)
    given = json.loads(run(exe, "sweep", *model, "--segments", "0", "--parallel", "fsdp:8", "--parallel-options",
                           "rank=3", "--format", "json").stdout)["rows"]
    check([r["parallel"] for r in given] == ["fsdp:8 rank=3"], given)
    table = run(exe, "sweep", *model, "--segments", "0", "--parallel", "fsdp:8", "--brief").stdout
    check("each GPU of fsdp:8" not in table and "parallel: fsdp:8: every figure is one GPU's, rank 0's" in table,
          table)
    Path(work).mkdir(parents=True, exist_ok=True)
    buffers = os.path.join(work, "fsdp-buffers.json")
    trace = run(exe, "trace", *model, "--parallel", "fsdp:8", "--buffers", buffers).stdout
    check("each GPU of fsdp:8" in trace and "FSDP's shards" in trace, trace)
    rows = json.loads(Path(buffers).read_text())
    shards = [(r["buffer"], r["bytes"]) for r in rows if r["buffer"].endswith(" shards")]
    check(shards == [("blocks.0 shards", 1798272), ("blocks.1 shards", 1798272), ("blocks.2 shards", 1798272),
                     ("root shards", 683376)], shards)
    gathers = {(r["buffer"], r["stream"]) for r in rows if r["buffer"].endswith("all-gather output")}
    check(gathers == {(f"{g} all-gather output", "all-gather copy-in")
                      for g in ("root", "blocks.0", "blocks.1", "blocks.2")}, gathers)
    outputs = {r["stream"] for r in rows if "reduce-scatter output" in r["buffer"]}
    check(outputs == {"reduce-scatter"}, outputs)
    # The sharded gradients view the reduce-scatter outputs: freed when zero_grad sets them to
    # None before the next forward; the last step's live on (issue 47).
    freed = {(r["allocated"], r["freed"]) for r in rows if "reduce-scatter output" in r["buffer"]}
    check(freed == {("step 1 backward", "step 2 forward"), ("step 2 backward", "step 3 forward"),
                    ("step 3 backward", None)}, freed)


def check_plan(exe, work):
    """vramscope plan end to end: on the chain whose answer is b1 and tail.w0 (tests/data), the
    table stars it, JSON names it, --code writes the code that wraps exactly those, and
    --model-out writes a model file that every command then runs with those marks, at the
    figures the plan printed."""
    chain = Path(__file__).resolve().parents[1] / "data" / "plan-chain.json"
    device = ["--device", "sim:capacity=640MiB,context=0"]
    # A device made for the chain: its plans use the last MiB (--headroom 0; 5% by default).
    room = ["--headroom", "0"]
    Path(work).mkdir(parents=True, exist_ok=True)
    code, planned = os.path.join(work, "plan.py"), os.path.join(work, "planned.json")
    table = run(exe, "plan", "--model-file", str(chain), *device, *room, "--search", "none", "--code", code,
                "--model-out", planned).stdout
    check("checkpoint 2 modules" in table and "yes *" in table and "Checkpointed: b1, tail.w0." in table, table)
    check("No checkpoint_sequential segment count fits (2, 4 tried)." in table, table)
    check(f"code: {code}" in table and f"model file: {planned}" in table, table)
    check('CHECKPOINTED = {"b1", "tail.w0"}' in Path(code).read_text(), Path(code).read_text())
    check(json.loads(Path(planned).read_text())["checkpoint_modules"] == ["b1", "tail.w0"], planned)
    best = json.loads(run(exe, "plan", "--model-file", str(chain), *device, *room, "--search", "none",
                          "--format", "json").stdout)
    plan = best["plans"][best["best"]]
    check(plan["checkpoint_modules"] == ["b1", "tail.w0"] and plan["fits"], plan)
    # The written file runs as the plan did, in sweep and with the same paths on the command line.
    row = json.loads(run(exe, "sweep", "--model-file", planned, *device, "--format", "json").stdout)["rows"][0]
    check(row["max_allocated"] == plan["max_allocated"] and row["max_nvidia_smi"] == plan["max_nvidia_smi"], (row, plan))
    by_path = json.loads(run(exe, "sweep", "--model-file", str(chain), *device, "--checkpoint-modules", "b1,tail.w0",
                             "--format", "json").stdout)["rows"][0]
    check(by_path["max_allocated"] == plan["max_allocated"], (by_path, plan))
    # --max-batch: the largest batch every repeated block checkpointed fits, and a plan that fits it.
    out = run(exe, "plan", "--model", "resnet18", "--max-batch", "--device", "sim:t4", "--search", "none",
              *room, "--brief").stdout
    check("The largest batch that fits with every one of the 8 repeated blocks checkpointed:" in out and
          "yes *" in out, out)
    largest = int(out.split("checkpointed: ")[1].split(".")[0])
    over = json.loads(run(exe, "sweep", "--model", "resnet18", "--device", "sim:t4", "--batch", str(largest + 1),
                          "--dtype", "f32", "--checkpoint-modules",
                          ",".join(f"layer{s}.{b}" for s in range(1, 5) for b in range(2)),
                          "--format", "json").stdout)["rows"][0]
    check(not over["fits"], over)
    # The default headroom (5% of the T4) is left free by the batch --max-batch finds too.
    roomy = run(exe, "plan", "--model", "resnet18", "--max-batch", "--device", "sim:t4", "--search", "none",
                "--format", "json").stdout
    check(0 < json.loads(roomy)["max_batch"]["largest"] < largest, roomy[:400])
    # Every example of `plan --help` runs as printed; the one with --code finds a plan to write
    # (issue 49: it found none and exited 1: no micro-batch fitted without checkpointing, and the
    # accumulation search never checkpointed).
    examples = [l.strip() for l in run(exe, "plan", "--help").stdout.splitlines() if l.strip().startswith("vramscope plan")]
    coded = [e for e in examples if "--code" in e]
    check(coded, examples)
    for example in coded:
        args = shlex.split(example)[1:]
        args[args.index("--code") + 1] = os.path.join(work, "help.py")
        out = run(exe, *args).stdout
        check("yes *" in out and Path(work, "help.py").read_text().startswith("# vramscope plan"), out)
    # The largest device there is: the plan's device and the sweep's unlimited twin both get
    # addresses (issue 47: "no room for another simulated device's addresses").
    p = run(exe, "plan", "--model", "mlp", "--max-batch", "--device", "sim:capacity=1PiB,context=0")
    check("The largest batch that fits" in p.stdout and "least recompute" in p.stdout, p.stdout[-400:])
    # Bad input: exit 2, one line naming the option.
    for args, words in ((["plan"], "name a model"), (["plan", "--model", "mlp", "--max-batch", "--batch", "8"], "--max-batch"), (["plan", "--model", "mlp", "--search", "x"], "--search"),
                        (["plan", "--model", "gpt2", "--model-out", planned], "--model-out"),
                        (["plan", "--model", "mlp", "--batch", "8,16"], "one --batch"),
                        (["plan", "--model", "mlp", "--headroom", "95%"], "--headroom"),
                        (["plan", "--model", "mlp", "--headroom", "x%"], "--headroom")):
        out = run(exe, *args, expect=2)
        check(words in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr))


def check_selective(exe, work):
    """--selective on an operator-level model (tests/data/selective-blocks.json: eight blocks of
    LayerNorm, Linear(256, 1024), GELU, Linear(1024, 256) at batch 4096, f32): with blocks 1, 3,
    5 and 7 checkpointed, keeping the products (addmm) keeps each block's two Linear outputs
    (16 MiB and 4 MiB) from the forward, seen by --saved under their modules, and the recompute
    runs none of the products."""
    os.makedirs(work, exist_ok=True)
    blocks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "selective-blocks.json")
    out = os.path.join(work, "saved.csv")
    common = ["--model-file", blocks, "--device", "sim:capacity=1GiB,context=0", "--checkpoint-modules", "1,3,5,7"]

    def saved(*extra):
        run(exe, "trace", *common, "--saved", out, "--no-pre", *extra)
        with open(out, newline="") as f:
            return {r["module"]: int(r["bytes"]) for r in csv.DictReader(f)}

    plain, kept = saved(), saved("--selective", "matmuls")
    check(sum(kept.values()) - sum(plain.values()) == 4 * 20 * MiB, (plain, kept))
    for b in "1357":
        check(kept.get(f"{b}.up") == 16 * MiB and kept.get(f"{b}.down") == 4 * MiB and f"{b}.up" not in plain,
              (b, kept))
    sweep = ["sweep", *common, "--dtype", "f32", "--format", "json"]
    p, s = json.loads(run(exe, *sweep).stdout), json.loads(run(exe, *sweep, "--selective", "aten.addmm.default").stdout)
    check(p["selective"] == [] and s["selective"] == ["aten.addmm.default"], (p["selective"], s["selective"]))
    pr, sr = p["rows"][0], s["rows"][0]
    check(0 < sr["recompute_share"] < 0.001 < 0.15 < pr["recompute_share"], (pr["recompute_share"], sr["recompute_share"]))
    check(sr["max_allocated"] > pr["max_allocated"], (pr["max_allocated"], sr["max_allocated"]))
    text = run(exe, "sweep", *common, "--dtype", "f32", "--selective", "matmuls").stdout
    check("4 modules, selective" in text, text[-800:])


def check_plan_auto(exe, work):
    """plan --parallel auto --gpus 2: the two-layer Llama's layouts of two GPUs, every one run (a
    pipeline's both stages, a ring's both ends), the pick first and fitting; the text and the JSON agree; the options
    that apply to one layout, a missing --gpus or --batch, and --gpus without the search refused."""
    data = Path(__file__).resolve().parents[1] / "data" / "h100-parallel-2026-11-26"
    model = ["--hf-config", str(data / "ref-llama-2layer.json"), "--seq", "128", "--attn", "sdpa", "--dtype", "bf16",
             "--device", "sim:h100-80g"]
    doc = json.loads(run(exe, "plan", *model, "--batch", "4", "--parallel", "auto", "--gpus", "2", "--format",
                         "json").stdout)
    layouts = {(x["parallel"], x["checkpoint"]): x for x in doc["layouts"]}
    interleaved = "pp:2 schedule=interleaved1f1b,microbatches=4"
    check({p for p, _ in layouts} == {"fsdp:2", "ddp:2", "tp:2", "cp:2", "pp:2 microbatches=4", interleaved},
          sorted(layouts))
    # A ring runs both its ends; its K and V travel besides FSDP's collectives, which are the
    # same over the same two GPUs whatever the batch.
    check(layouts[("cp:2", "none")]["runs"] == 2, layouts[("cp:2", "none")])
    check(layouts[("cp:2", "none")]["communication_bytes_per_step"] >
          layouts[("fsdp:2", "none")]["communication_bytes_per_step"], layouts)
    check(doc["best"] is not None and doc["layouts"][0]["fits"], doc["best"])
    check(layouts[("pp:2 microbatches=4", "none")]["runs"] == 2, layouts[("pp:2 microbatches=4", "none")])
    check(layouts[("pp:2 microbatches=4", "none")]["bubble_share"] == 0.2, layouts)
    # Two stages per rank (the embedding, each layer, lm_head: four stages): a bubble of 1 / (2 x 4 + 1).
    check(layouts[(interleaved, "none")]["runs"] == 2 and abs(layouts[(interleaved, "none")]["bubble_share"] - 1 / 9) < 1e-12,
          layouts[(interleaved, "none")])
    check(all(x["communication_bytes_per_step"] > 0 for x in doc["layouts"] if "not_run" not in x), doc["layouts"])
    text = run(exe, "plan", *model, "--batch", "4", "--parallel", "auto", "--gpus", "2").stdout
    check(f"picks: {doc['best']}:" in text and "How to read this" in text, text)
    for extra, says in ((["--max-batch"], "apply to one layout"), (["--batch", "4", "--code", "x.py"], "apply to one layout"),
                        (["--batch", "4", "--parallel-options", "rank=1"], "apply to one layout"),
                        (["--batch", "4", "--topology", "pcie"], "apply to one layout"),
                        (["--batch", "4"], "give --gpus"), (["--gpus", "2"], "give --batch")):
        args = [a for a in extra if a != "--gpus"] if says == "give --gpus" else extra
        gpus = [] if says == "give --gpus" else (["--gpus", "2"] if "--gpus" not in extra else [])
        err = run(exe, "plan", *model, "--parallel", "auto", *gpus, *args, expect=2).stderr
        check(says in err, (extra, err))
    err = run(exe, "plan", *model, "--batch", "4", "--parallel", "fsdp:2", "--gpus", "2", expect=2).stderr
    check("--parallel auto" in err, err)


CHECKS = {
    "plan": check_plan,
    "plan-auto": check_plan_auto,
    "fsdp": check_fsdp,
    "parallel": check_parallel,
    "exact": check_exact, "csv": check_csv, "json": check_json, "oom": check_oom,
    "bad-input": check_bad_input, "trace-files": check_trace_files, "trace-oom": check_trace_oom,
    "demo": check_demo, "help": check_help, "devices": check_devices, "models": check_models,
    "plot": check_plot, "inplace": check_inplace, "replay": check_replay,
    "reentrant": check_reentrant, "auto-segments": check_auto_segments,
    "compute-host-memory": check_compute_host_memory, "batch-lists": check_batch_lists,
    "max-batch": check_max_batch, "hf-config": check_hf_config, "trace-saved": check_trace_saved, "selective": check_selective,
    "files": check_files, "trace-log": check_trace_log,
}


def main():
    exe, name, work = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        CHECKS[name](exe, work)
    except AssertionError as e:
        print(f"FAIL {name}: {e}")
        return 1
    print(f"ok {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
