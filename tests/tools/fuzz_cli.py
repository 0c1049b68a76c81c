#!/usr/bin/env python3
"""fuzz_cli.py — a property test of the `vramscope` command over random argument vectors.

Usage: fuzz_cli.py VRAMSCOPE [--runs N] [--seed S] [--jobs J]

Each vector mixes valid and invalid options, names and extreme numbers. Every run must:
- finish within a time limit (no hang, no unbounded work),
- stay under an address-space limit (setrlimit: no unbounded memory),
- exit 0, 1 or 2 (never a signal, an abort or another code),
- print exactly one line on stderr when it exits 1 or 2.
A failure prints the vector, so it can be rerun by hand. The seed makes a run repeatable.
"""
import argparse
import os
import concurrent.futures
import random
import resource
import subprocess
import sys

TIME_LIMIT_S = 20
MEMORY_LIMIT = 6 << 30  # address space; the dry run needs a few hundred MiB at most

MODELS = ["mlp", "forum-cnn", "resnet18", "resnet50", "gpt2", "gpt2-medium", "nosuchnet", "",
          "MLP", "resnet"]
DEVICES = ["sim:rtx2080s", "sim:t4", "sim:a100-80g", "sim:h100-80g", "sim:b200",
           "sim:capacity=1GiB,context=100MiB", "sim:capacity=600MiB", "sim:capacity=0",
           "sim:capacity=8XB", "sim:capacity=1e99GiB", "sim:rtx2080s,context=9GiB", "sim:",
           "sim:nosuch", "cuda:x", "tpu:0", "auto", "sim", "sim:a100-80g,backing=host"]
DTYPES = ["f32", "f16", "bf16", "amp", "amp-bf16", "f32,f16", "f8", "f32,,f16", "", "f32,"]
CONFS = ["", "max_split_size_mb:128", "max_split_size_mb:abc", "garbage_collection_threshold:0.8",
         "roundup_power2_divisions:4", "nosuchkey:1", "max_split_size_mb:-1",
         "max_split_size_mb:99999999999999999999", "expandable_segments:True"]
PARALLELS = ["ddp:8", "fsdp:8", "zero1:8", "zero2:8", "zero3:8", "zero3:64", "zero3:1", "zero3:0", "zero3:",
             "fsdp1:8", "none,zero3:8", "zero3:8,fsdp:8", "zero3:1048577", "zero9:8"]
PARALLEL_OPTIONS = ["", "stage3_prefetch_bucket_size=0", "stage3_max_reuse_distance=0,stage3_param_persistence_threshold=0",
                    "stage3_max_live_parameters=1", "sub_group_size=1", "zero3_init_flag=false", "zero3_init_flag=x",
                    "reduce_bucket_size=1", "reduce_bucket_size=1e13", "stage3_prefetch_bucket_size=-1",
                    "sub_group_size=0", "rank=7", "rank=8", "bucket_cap_mb=5", "overlap_comm=false",
                    "stage3_model_persistence_threshold=1e30", ","]
NUMBERS = ["0", "1", "2", "3", "4", "7", "16", "64", "256", "1024", "-1", "-3", "1e3", "0x10",
           "4294967296", "4611686018427387904", "9223372036854775807",
           "99999999999999999999", "", "abc", " 8", "10001", "100000", "1099511627776"]


def number(rng):
    if rng.random() < 0.5:
        return rng.choice(NUMBERS)
    return str(rng.choice([1, 2, 4, 8, 16, 32, 64, 128]))


def small_size(rng):
    # Mostly sizes that keep a valid run quick; sometimes anything.
    return str(rng.choice([1, 2, 4, 8, 16])) if rng.random() < 0.8 else number(rng)


def model_options(rng, args):
    model = rng.choice(MODELS)
    args += ["--model", model]
    if rng.random() < 0.6:
        args += ["--batch", small_size(rng) if rng.random() < 0.8 else
                 rng.choice(["2,4", "1,,2", "4,4", ",", "8,99999999999999999999", "2,-1"])]
    for opt in ("--depth", "--width", "--seq", "--image", "--classes"):
        if rng.random() < 0.15:
            args += [opt, small_size(rng) if opt != "--image" else rng.choice(["32", "64", "0", "-1"])]
    if rng.random() < 0.1:
        args += ["--model-options", rng.choice(["dropout=0", "inplace=1", "depth=3", "depth=0",
                                                "width=1e9", "x", "seq=2000", "dropout=2", ""])]
    if model.startswith("resnet") and "--image" not in args and rng.random() < 0.8:
        args += ["--image", "32"]  # keep valid resnet runs small
    if model.startswith("gpt2") and "--seq" not in args and rng.random() < 0.8:
        args += ["--seq", "32"]
    if model == "mlp" and "--width" not in args and rng.random() < 0.7:
        args += ["--width", "64"]


def common(rng, args):
    if rng.random() < 0.7:
        args += ["--device", rng.choice(DEVICES)]
    if rng.random() < 0.5:
        args += ["--dtype", rng.choice(DTYPES)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        args += ["-a", rng.choice(CONFS)]
    if rng.random() < 0.3:
        args += ["--steps", rng.choice(["1", "2", "0", "-1", "1001", "x"])]
    if rng.random() < 0.2:
        args += ["--optimizer", rng.choice(["adam", "adam8bit", "sgd", "sgd-momentum", "none", "lion", ""])]
    if rng.random() < 0.1:
        args += ["--parallel", rng.choice(PARALLELS)]
        if rng.random() < 0.5:
            args += ["--parallel-options", rng.choice(PARALLEL_OPTIONS)]
    if rng.random() < 0.2:
        args += ["--checkpoint", rng.choice(["non-reentrant", "reentrant", "sideways"])]
    if rng.random() < 0.1:
        args += ["--input-requires-grad"]


def vector(rng):
    command = rng.choices(["sweep", "trace", "plan", "models", "devices", "replay", "nosuch", "--help", ""],
                          weights=[36, 27, 10, 10, 3, 5, 2, 2, 1])[0]
    args = [command] if command else []
    if command in ("sweep", "trace", "plan", "models"):
        model_options(rng, args)
    if command == "plan":
        if rng.random() < 0.7:
            args += ["--device", rng.choice(DEVICES)]
        if rng.random() < 0.4:
            args += ["--dtype", rng.choice(DTYPES)]
        if rng.random() < 0.3:
            args += ["--search", rng.choice(["none", "allocator,precision", "optimizer", "precision,,x", "", "all"])]
        if rng.random() < 0.2:
            args += ["--headroom", rng.choice(["0", "1GiB", "1TiB", "-1", "x", "100000000000000000000"])]
        if rng.random() < 0.2:
            args += ["--top", rng.choice(["1", "0", "1001", "x"])]
        if rng.random() < 0.1:
            args += ["--max-batch"]
        if rng.random() < 0.2:
            args += ["--format", rng.choice(["table", "json", "csv"])]
    if command in ("sweep", "trace"):
        common(rng, args)
    if command == "sweep":
        if rng.random() < 0.6:
            args += ["--segments", rng.choice(["0", "0,2", "0,2,4", "auto", "2,2", "0,,2", "9999",
                                               "two", "", "1", "-2", "0,3"])]
        if rng.random() < 0.2:
            args += ["--format", rng.choice(["table", "csv", "json", "xml"])]
        if rng.random() < 0.1:
            args += ["--max-batch"]
    if command == "trace":
        if rng.random() < 0.4:
            args += ["--segments", rng.choice(["0", "2", "3", "99", "-1"])]
        if rng.random() < 0.3:
            args += ["--max-depth", rng.choice(["0", "1", "2", "-1", "1001", "x"])]
        if rng.random() < 0.1:
            args += ["--plot", rng.choice(["/nonexistent/x.svg", "/", ""])]
    if command == "replay":
        args += [rng.choice(["/nonexistent.pickle", "/etc/hostname", "/dev/null", ""])]
        if rng.random() < 0.5:
            args += ["-a", rng.choice(CONFS)]
    if rng.random() < 0.05:
        args += [rng.choice(["--nosuchflag", "--batch", "-", "--", "--model=mlp"])]
    return args


def limit_resources():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_one(exe, args):
    """(exit code, problem or None)."""
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TIME_LIMIT_S,
                           preexec_fn=limit_resources, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {TIME_LIMIT_S} s"
    if p.returncode not in (0, 1, 2):
        return p.returncode, f"exit {p.returncode}; stderr: {p.stderr[-600:]!r}"
    if p.returncode in (1, 2):
        err = p.stderr.rstrip("\n")
        if err.count("\n") != 0 or not err:
            lines = err.count("\n") + 1 if err else 0
            return p.returncode, f"exit {p.returncode} with {lines} stderr lines: {p.stderr[-600:]!r}"
    return p.returncode, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("exe")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    opts.exe = os.path.abspath(opts.exe)
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    vectors = [vector(rng) for _ in range(opts.runs)]
    failures = 0
    codes = {0: 0, 1: 0, 2: 0}
    with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        for args, (code, problem) in zip(vectors, pool.map(lambda a: run_one(opts.exe, a), vectors)):
            if code in codes:
                codes[code] += 1
            if problem:
                failures += 1
                print(f"FAIL {problem}\n  vramscope {' '.join(repr(a) if (not a or ' ' in a) else a for a in args)}")
    print(f"fuzz_cli: {opts.runs} vectors, seed {seed}: exit 0 {codes[0]}, exit 1 {codes[1]}, "
          f"exit 2 {codes[2]}; {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
