#!/usr/bin/env python3
"""Turns Google Benchmark JSON from vramscope_allocator_bench and
vramscope_replay_bench into the results tables of docs/BENCHMARKS.md.

    interleaved="--benchmark_repetitions=5 --benchmark_enable_random_interleaving=true
                 --benchmark_report_aggregates_only=true --benchmark_out_format=json"
    build/release/bench/vramscope_allocator_bench --benchmark_min_time=0.5 $interleaved \
        --benchmark_out=alloc.json
    build/release/bench/vramscope_replay_bench --benchmark_min_time=0.5 $interleaved \
        --benchmark_out=replay.json
    python3 scripts/bench_tables.py alloc.json replay.json

Within one file a benchmark's figure is the median over its repetitions (else
its single run); random interleaving spreads the repetitions of every peer over
the whole run, so a slow spell of a shared machine does not fall on one column.
Given several files (alloc1.json alloc2.json ... replay1.json ...), each figure
is the median over them, and each ratio the median of the ratios taken within
each file, with their range.
"""
import json
import statistics
import sys

PEERS = ("Vramscope", "Cub", "CubGrowth2", "Glibc")


def load(path):
    """(context, name -> the run's record: the median where repetitions were run)."""
    with open(path) as f:
        data = json.load(f)
    runs, medians = {}, {}
    for b in data["benchmarks"]:
        if b.get("error_occurred"):  # skipped (no trace, out of memory): no figures
            continue
        # BM_TraceOps times itself (UseManualTime): the same row with or without
        # the suffix, so files from before and after compare.
        name = b["run_name"].removesuffix("/manual_time")
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians[name] = b
        else:
            runs.setdefault(name, b)
    runs.update(medians)
    return data["context"], runs


def median_of(files):
    """name -> one record whose numbers are the medians over the files that have it."""
    merged = {}
    for name in {n for runs in files for n in runs}:
        records = [runs[name] for runs in files if name in runs]
        first = dict(records[0])
        for key, value in first.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                first[key] = statistics.median(r[key] for r in records if key in r)
        merged[name] = first
    return merged


def ns(run, counter):
    """A seconds-valued rate counter (time_per_pair, time_per_op...) in ns."""
    return run[counter] * 1e9


def fmt_ns(x):
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def ratio(files, counter, vramscope, cub, growth2):
    """The best CUB setting's time over vramscope's, taken within each file (one
    run on one machine), then the median over the files, with the range when
    there are several."""
    ratios = []
    for runs in files:
        if vramscope not in runs:
            continue
        peers = [runs[name][counter] for name in (cub, growth2) if name in runs]
        if peers:
            ratios.append(min(peers) / runs[vramscope][counter])
    if not ratios:
        return "-"
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def allocator_tables(files):
    runs = median_of(files)

    def pair(family, suffix=""):
        out = []
        for peer in PEERS:
            run = runs.get(f"{family}<{peer}>{suffix}")
            out.append(ns(run, "time_per_pair") if run else None)
        return out

    rows = [("fast path, 1 KiB cached", "BM_FastPath", ""),
            ("mixed sizes 512 B..8 MiB, window 8", "BM_MixedSizes", "")]
    rows += [(f"cached blocks {n:,}", "BM_CachedBlocks", f"/cached_blocks:{n}")
             for n in (100, 1000, 10000, 100000)]
    rows += [("1 thread, shared allocator", "BM_Threads", "/real_time/threads:1"),
             ("2 threads, shared allocator, per pair", "BM_Threads", "/real_time/threads:2")]
    print("| workload | vramscope | cub | cub-growth2 | glibc | vramscope vs best CUB |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, family, suffix in rows:
        v, c, g, m = pair(family, suffix)
        if v is None:
            continue
        cells = [fmt_ns(x) if x is not None else "-" for x in (v, c, g, m)]
        r = ratio(files, "time_per_pair", *(f"{family}<{p}>{suffix}" for p in PEERS[:3]))
        print(f"| {label} | {' | '.join(cells)} | {r} |")

    print()
    print("| N, max | vramscope | cub | cub-growth2 | glibc | vs best CUB (time) |")
    print("|---|---|---|---|---|---:|")
    for n in (1000, 10000, 100000):
        for max_mib, label in ((1, "1 MiB"), (64, "64 MiB"), (1024, "1 GiB")):
            suffix = f"/N:{n}/max_MiB:{max_mib}"
            if f"BM_RandomWorkload<Vramscope>{suffix}" not in runs:
                continue
            cells = []
            for peer in PEERS:
                run = runs.get(f"BM_RandomWorkload<{peer}>{suffix}")
                if run is None:
                    cells.append("-")
                elif peer == "Glibc":
                    cells.append(f"{ns(run, 'time_per_pair'):.0f}")
                else:
                    cells.append(f"{ns(run, 'time_per_pair'):.0f} / "
                                 f"{run['reserved_per_requested']:.3f} / {run['cache_hit_rate']:.4g}")
            r = ratio(files, "time_per_pair",
                      *(f"BM_RandomWorkload<{p}>{suffix}" for p in PEERS[:3]))
            print(f"| {n // 1000}k, {label} | {' | '.join(cells)} | {r} |")

    print()
    random_live_table(files)


# Issue 35's rows: (live, max KiB) -> the ratio vramscope / cub-growth2 it asks for.
RANDOM_LIVE_TARGETS = {(10000, 65536): 0.16, (1000, 1024): 0.17, (1000, 65536): 0.33}


def random_live_table(files):
    """The random live set against cub-growth2: ns per operation, and vramscope's time over
    cub-growth2's taken within each file, median and range (issue 35 states its targets so)."""
    runs = median_of(files)
    print("| live, sizes | vramscope | cub-growth2 | vramscope / cub-growth2 | target | "
          "peak reserved / requested |")
    print("|---|---:|---:|---:|---:|---:|")
    for (live, max_kib), target in RANDOM_LIVE_TARGETS.items():
        suffix = f"/live:{live}/max_KiB:{max_kib}"
        v, g = (runs.get(f"BM_RandomLive<{p}>{suffix}") for p in ("Vramscope", "CubGrowth2"))
        if v is None or g is None:
            continue
        ratios = []
        for one in files:
            a, b = (one.get(f"BM_RandomLive<{p}>{suffix}") for p in ("Vramscope", "CubGrowth2"))
            if a is not None and b is not None:
                ratios.append(a["ns_per_op"] / b["ns_per_op"])
        text = f"{statistics.median(ratios):.3f}"
        if len(ratios) > 1:
            text += f" ({min(ratios):.3f}-{max(ratios):.3f})"
        size = f"512 B..{max_kib // 1024} MiB"
        print(f"| {live:,}, {size} | {fmt_ns(ns(v, 'ns_per_op'))} | {fmt_ns(ns(g, 'ns_per_op'))} | "
              f"{text} | {target:.2f} | {v['reserved_per_requested']:.2f} |")


def replay_tables(files):
    runs = median_of(files)

    traces = sorted({name.split("/", 1)[1] for name in runs if name.startswith("BM_TraceOps<")},
                    key=str.lower)
    print("| trace (trace events) | vramscope | cub | cub-growth2 | vs best CUB |")
    print("|---|---|---|---|---:|")
    for trace in traces:
        cells = []
        for peer in PEERS[:3]:
            run = runs.get(f"BM_TraceOps<{peer}>/{trace}")
            if run is None:
                cells.append("-")
                continue
            cells.append(f"{fmt_ns(ns(run, 'time_per_op'))} / {run['reserved_per_requested']:.2f} / "
                         f"{run['device_allocs']:,.0f}")
        whole = runs.get(f"BM_Replay/vramscope/{trace}")
        events = f" ({whole['events']:,.0f})" if whole is not None and "events" in whole else ""
        r = ratio(files, "time_per_op", *(f"BM_TraceOps<{p}>/{trace}" for p in PEERS[:3]))
        print(f"| {trace.split('__')[0]}{events} | {' | '.join(cells)} | {r} |")

    print()
    print("| trace | vramscope `replay` | cub `replay_on` | cub-growth2 `replay_on` |")
    print("|---|---:|---:|---:|")
    for trace in traces:
        cells = []
        for who in ("vramscope", "cub", "cub-growth2"):
            run = runs.get(f"BM_Replay/{who}/{trace}")
            cells.append(f"{run['real_time']:.3g}" if run and run["time_unit"] == "ms" else "-")
        print(f"| {trace.split('__')[0]} | {' | '.join(cells)} |")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    allocator, replay = [], []
    for path in argv[1:]:
        try:
            context, runs = load(path)
        except (OSError, ValueError) as e:  # ValueError: not JSON, e.g. empty
            # A suite with nothing to run (the replay suite without the real
            # traces) leaves an empty file behind.
            print(f"<!-- {path}: skipped ({e}) -->")
            continue
        kind = replay if "replay" in context.get("executable", "") else allocator
        kind.append(runs)
        print(f"<!-- {path}: {context.get('date', '?')}, load average "
              f"{', '.join(f'{x:.2f}' for x in context.get('load_avg', []))} -->")
    if allocator:
        print(f"\n<!-- allocator suite: medians over {len(allocator)} file(s) -->")
        allocator_tables(allocator)
    if replay:
        print(f"\n<!-- replay suite: medians over {len(replay)} file(s) -->")
        replay_tables(replay)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
