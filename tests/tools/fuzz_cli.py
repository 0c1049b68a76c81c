#!/usr/bin/env python3
"""fuzz_cli.py — a property test of the `vramscope` command over random argument vectors.

Usage: fuzz_cli.py VRAMSCOPE [--runs N] [--seed S] [--jobs J]

Each vector mixes valid and invalid options, names and extreme numbers, and hostile files the
run writes first (hostile_files): model files and Hugging Face configs nested 100,000 deep,
repeating a layer a million times, with numbers past any double, NaN, nulls and lists of the
wrong length; snapshots that claim device -1 or nest without end; and outputs that name an input.
Every run must:
- finish within a time limit (no hang, no unbounded work),
- stay under an address-space limit (setrlimit: no unbounded memory),
- exit 0, 1 or 2 (never a signal, an abort or another code),
- print exactly one line on stderr when it exits 1 or 2,
and every hostile input must be unchanged at the end (no output ever replaces an input).
A failure prints the vector, so it can be rerun by hand. The seed makes a run repeatable.
"""
import argparse
import hashlib
import json
import os
import pickle
import tempfile
import time
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
             "fsdp1:8", "none,zero3:8", "zero3:8,fsdp:8", "zero3:1048577", "zero9:8",
             # Pipeline meshes: FSDP2 and tensor parallel inside the stages, and what is refused there.
             "pp:2xfsdp:2", "pp:2xfsdp:2xtp:2", "pp:0xfsdp:2", "pp:2xddp:2", "pp:2xzero3:2", "pp:2xfsdp:0",
             "pp:2xfsdp:2xtp:2xtp:2", "fsdp:2xpp:2"]
PARALLEL_OPTIONS = ["", "stage3_prefetch_bucket_size=0", "stage3_max_reuse_distance=0,stage3_param_persistence_threshold=0",
                    "stage3_max_live_parameters=1", "sub_group_size=1", "zero3_init_flag=false", "zero3_init_flag=x",
                    "reduce_bucket_size=1", "reduce_bucket_size=1e13", "stage3_prefetch_bucket_size=-1",
                    "sub_group_size=0", "rank=7", "rank=8", "bucket_cap_mb=5", "overlap_comm=false",
                    "stage3_model_persistence_threshold=1e30", ",", "offload_policy=cpu", "offload_policy=disk",
                    "pin_memory=false", "microbatches=2,reshard_after_forward=true", "microbatches=0,stage=9",
                    "offload_optimizer=cpu", "offload_optimizer=cpu,pin_memory=false", "offload_param=cpu"]
NUMBERS = ["0", "1", "2", "3", "4", "7", "16", "64", "256", "1024", "-1", "-3", "1e3", "0x10",
           "4294967296", "4611686018427387904", "9223372036854775807",
           "99999999999999999999", "", "abc", " 8", "10001", "100000", "1099511627776"]


def hostile_files(folder):
    """{kind: [paths]} of hostile inputs written into `folder`."""
    def deep(n):
        text = "0"
        for _ in range(n):
            text = "[" + text + "]"
        return text
    layer = {"type": "Linear", "in_features": 64, "out_features": 64}
    base = {"format": "vramscope-model", "version": 1, "name": "h", "options": {"batch": 4},
            "input": {"shape": ["batch", 64]}, "loss": {"type": "mse"}, "layers": [layer]}
    model_texts = {
        "deep": json.dumps(base)[:-1] + ', "description": ' + deep(100_000) + "}",
        # 100,000 times (issue 47 had a million: 28 s here, past this run's time limit).
        "repeat": json.dumps({**base, "input": {"shape": ["batch", 4096]}, "layers": [{"repeat": 100_000, "layers": [
            {"type": "Linear", "in_features": 4096, "out_features": 4096}]}]}),
        "overflow": json.dumps(base).replace('"in_features": 64', '"in_features": 1e400', 1),
        "nan": json.dumps(base).replace('"in_features": 64', '"in_features": NaN', 1),
        "null": json.dumps({**base, "layers": [{**layer, "out_features": None}]}),
        "wrong_list": json.dumps({**base, "input": {"shape": []}}),
        "huge_width": json.dumps({**base, "layers": [{**layer, "out_features": 9223372036854775807}]}),
        "empty": "",
    }
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512}
    config_texts = {
        "deep": json.dumps(config)[:-1] + ', "rope_parameters": ' + deep(100_000) + "}",
        "layer_types": json.dumps({**config, "layer_types": ["full_attention"] * 5}),
        "overflow": json.dumps(config)[:-1] + ', "rope_theta": 1e400}',
        "nan": json.dumps(config)[:-1] + ', "rms_norm_eps": NaN}',
        "null": json.dumps({**config, "num_key_value_heads": None, "head_dim": None, "sliding_window": None}),
        "layers": json.dumps({**config, "num_hidden_layers": 1_000_000_000}),
        "recorded": json.dumps({**config, "model_type": "qwen3"}),  # the exporter: no Python here (fast)
        "tied_gpt2": json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
                                 "n_positions": 128, "n_inner": None, "tie_word_embeddings": True}),
    }
    segment = {"device": -1, "address": 1 << 30, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
               "blocks": [{"address": 1 << 30, "size": 2 << 20, "state": "active_allocated", "frames": []}]}
    snapshots = {
        "device_minus_1": pickle.dumps({"segments": [segment], "device_traces": [[]]}, protocol=4),
        # 100,000 lists each in the next: EMPTY_LIST pushed, then APPEND folds each into the one below.
        "deep": b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".",
        "truncated": pickle.dumps({"segments": [segment], "device_traces": [[]]}, protocol=4)[:40],
    }
    files = {"model": [], "config": [], "snapshot": []}
    for kind, texts, suffix in (("model", model_texts, ".json"), ("config", config_texts, ".json")):
        for name, text in texts.items():
            path = os.path.join(folder, f"{kind}-{name}{suffix}")
            with open(path, "w") as f:
                f.write(text)
            files[kind].append(path)
    for name, data in snapshots.items():
        path = os.path.join(folder, f"snapshot-{name}.pickle")
        with open(path, "wb") as f:
            f.write(data)
        files["snapshot"].append(path)
    return files


HOSTILE = {}  # set by main(): the hostile files by kind


def number(rng):
    if rng.random() < 0.5:
        return rng.choice(NUMBERS)
    return str(rng.choice([1, 2, 4, 8, 16, 32, 64, 128]))


def small_size(rng):
    # Mostly sizes that keep a valid run quick; sometimes anything.
    return str(rng.choice([1, 2, 4, 8, 16])) if rng.random() < 0.8 else number(rng)


def model_options(rng, args):
    if HOSTILE and rng.random() < 0.15:
        kind = rng.choice(["model", "config"])
        path = rng.choice(HOSTILE[kind])
        args += ["--model-file" if kind == "model" else "--hf-config", path]
        if rng.random() < 0.3:  # an output that names this run's input: refused, the input untouched
            args += [rng.choice(["--plot", "--plot", "--snapshot", "--model-out"]), path]
        return
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
        args += [rng.choice(["/nonexistent.pickle", "/etc/hostname", "/dev/null", ""] + HOSTILE.get("snapshot", []))]
        if rng.random() < 0.5:
            args += ["-a", rng.choice(CONFS)]
    if rng.random() < 0.05:
        args += [rng.choice(["--nosuchflag", "--batch", "-", "--", "--model=mlp"])]
    return args


def limit_resources():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_one(exe, args):
    """(exit code, problem or None, seconds)."""
    start = time.monotonic()
    code, problem = _run_one(exe, args)
    return code, problem, time.monotonic() - start


def _run_one(exe, args):
    try:
        # No Python for --hf-config's exporter: a model_type it would record fails at once.
        env = dict(os.environ, VRAMSCOPE_PYTHON="/nonexistent/python3")
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TIME_LIMIT_S,
                           preexec_fn=limit_resources, cwd="/tmp", env=env)
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
    scratch = tempfile.TemporaryDirectory()
    HOSTILE.update(hostile_files(scratch.name))
    digest = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()  # noqa: E731
    before = {path: digest(path) for paths in HOSTILE.values() for path in paths}
    vectors = [vector(rng) for _ in range(opts.runs)]
    failures = 0
    codes = {0: 0, 1: 0, 2: 0}
    slowest = []  # (seconds, args): what comes nearest the time limit, to see it coming
    with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        for args, (code, problem, seconds) in zip(vectors, pool.map(lambda a: run_one(opts.exe, a), vectors)):
            slowest = sorted(slowest + [(seconds, args)], key=lambda s: -s[0])[:3]
            if code in codes:
                codes[code] += 1
            if problem:
                failures += 1
                print(f"FAIL {problem}\n  vramscope {' '.join(repr(a) if (not a or ' ' in a) else a for a in args)}")
    for path, hashed in before.items():
        if not os.path.exists(path) or digest(path) != hashed:
            failures += 1
            print(f"FAIL an input was changed: {path}")
    scratch.cleanup()
    print(f"fuzz_cli: {opts.runs} vectors, seed {seed}: exit 0 {codes[0]}, exit 1 {codes[1]}, "
          f"exit 2 {codes[2]}; {failures} failures")
    for seconds, args in slowest:
        print(f"  {seconds:.1f} s: vramscope {' '.join(repr(a) if (not a or ' ' in a) else a for a in args)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
