#!/usr/bin/env python3
"""make_snapshot.py: a large PyTorch memory snapshot for replay benchmarks.

    VRAMSCOPE_LIBRARY=build/release/bindings/libvramscope.so \\
    PYTHONPATH=python python3 scripts/make_snapshot.py EVENTS OUT.pickle [--frames 12] [--live 5000]
        [--max-size BYTES] [--diverge]

Runs a training-like allocation pattern (a working set of about --live blocks of 512 B to
64 MiB, with bursts that grow and shrink it) through vramscope's allocator on
a simulated A100 with history recording on, writes the snapshot, and gives every trace event
and block a stack of --frames frames. The frames are drawn from a few hundred distinct ones
and shared between events as Python objects, so the pickle stores each once and refers to it
(pickle's memo, as PyTorch's snapshot pickler does). The trace is what the allocator did, so a
replay with default settings reproduces it exactly. With --diverge every block event's recorded
address is moved by 512 B, so every allocation of the replay lands elsewhere than recorded (a
trace recorded by another allocator, or under settings that are not known).
"""
import argparse
import pickle
import random
import sys
import tempfile
from pathlib import Path

import vramscope


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("events", type=int)
    ap.add_argument("out")
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--live", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-size", type=int, default=64 << 20,
                    help="largest block (smaller ones let a large --live fit an 80 GB GPU: 1048576 for 300k)")
    ap.add_argument("--diverge", action="store_true",
                    help="move every alloc's and free's recorded address by 512 B: every allocation diverges")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    vramscope.init("sim:a100-80g", "")
    # alloc + free_requested + free_completed per block, plus segment events: ~3 per block.
    vramscope.record_memory_history(max_entries=a.events + a.live * 4)
    live = []
    sizes = [512, 4096, 65536, 262144, 1 << 20, 3 << 20, 8 << 20, 24 << 20, 64 << 20]
    weights = [30, 20, 15, 10, 8, 7, 5, 3, 2]
    weights = [w for s, w in zip(sizes, weights) if s <= a.max_size]
    sizes = [s for s in sizes if s <= a.max_size]
    target = a.live
    allocs = 0
    while allocs * 3 < a.events:
        if allocs % 20000 == 0:
            target = rng.randint(a.live // 2, a.live)  # a step's working set grows and shrinks
        if len(live) < target or rng.random() < 0.5:
            size = rng.choices(sizes, weights)[0]
            size = rng.randint(size // 2, size) if size > 512 else size
            live.append(vramscope.malloc(size))
            allocs += 1
        elif live:
            vramscope.free(live.pop(rng.randrange(len(live))))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.pickle"
        vramscope.snapshot(raw)
        snap = pickle.loads(raw.read_bytes())
    # Stacks: a few hundred distinct frames, each stack a tuple of shared frame dicts.
    files = [f"/opt/project/model/layer_{i}.py" for i in range(40)]
    frames = [{"filename": rng.choice(files), "line": rng.randint(1, 2000), "name": f"forward_{i}"} for i in range(300)]
    stacks = [[rng.choice(frames) for _ in range(a.frames)] for _ in range(500)]
    trace = snap["device_traces"][0]
    for e in trace:
        e["frames"] = rng.choice(stacks)
        if a.diverge and e["action"] in ("alloc", "free_requested", "free_completed"):
            e["addr"] += 512
    for seg in snap["segments"]:
        seg["frames"] = rng.choice(stacks)
        for b in seg["blocks"]:
            b["frames"] = rng.choice(stacks)
    with open(a.out, "wb") as f:
        pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)
    live_blocks = sum(b["state"] == "active_allocated" for seg in snap["segments"] for b in seg["blocks"])
    print(f"{a.out}: {len(trace):,} trace events, {len(snap['segments'])} segments, {live_blocks:,} live blocks, "
          f"{Path(a.out).stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
