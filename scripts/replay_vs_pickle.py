#!/usr/bin/env python3
"""replay_vs_pickle.py: `vramscope replay FILE` against Python's `pickle.load` of the same file.

    python3 scripts/replay_vs_pickle.py build/release/tools/vramscope A.pickle [B.pickle ...] [--runs 3]

Each file is replayed (default settings, table output thrown away) and unpickled by a fresh
`python3 -c 'pickle.load(...)'`, alternating, --runs times each, in one run of this script, so
both sides see the same machine. Prints per file: its size, the wall time ranges, the ratio
of pickle.load's time to the replay's, and the replay's peak memory (max RSS) against the
file's size. Make the files with scripts/make_snapshot.py (see docs/BENCHMARKS.md).
"""
import argparse
import os
import subprocess
import sys
import time


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {code}\n{err}")
    return elapsed, usage.ru_maxrss * 1024  # Linux: KiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vramscope")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print("| file | size | replay | pickle.load | ratio | replay memory |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in a.files:
        size = os.path.getsize(path)
        replay, load, rss = [], [], []
        for _ in range(a.runs):
            t, m = timed([a.vramscope, "replay", path])
            replay.append(t)
            rss.append(m)
            t, _ = timed([sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", path])
            load.append(t)
        ratio_lo, ratio_hi = min(load) / max(replay), max(load) / min(replay)
        print(f"| {os.path.basename(path)} | {size / 1e6:.1f} MB | {min(replay):.2f}-{max(replay):.2f} s "
              f"| {min(load):.2f}-{max(load):.2f} s | {ratio_lo:.1f}-{ratio_hi:.1f}x "
              f"| {max(rss) / 1e6:.0f} MB ({max(rss) / size:.1f}x) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
