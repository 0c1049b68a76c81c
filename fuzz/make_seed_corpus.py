#!/usr/bin/env python3
"""make_seed_corpus.py — writes fuzz/corpus/: one seed per (run setup, scenario).

Each seed is a byte string in the format OpDecoder reads
(tests/reliability/operations.cpp): byte 0 picks the run setup, then each op is
an opcode byte (mod 32) and its parameter bytes. Keep the encoder below in step
with OpDecoder::next() and OpDecoder::decode_size().

    python3 fuzz/make_seed_corpus.py            # rewrites fuzz/corpus/
"""
import pathlib
import random

SETUPS = ["default", "max-split", "roundup", "gc", "split-rounding", "everything"]


# --- the encoder: mirrors OpDecoder -------------------------------------------

def alloc(size_class, value, stream=0):
    """Allocate: opcode 0..12, stream byte, size class byte, value bytes."""
    widths = {0: 2, 1: 3, 2: 3, 3: 3, 4: 1, 5: 2, 6: 1, 7: 4}
    return bytes([0, stream, size_class]) + value.to_bytes(widths[size_class], "big")


def tiny(n, stream=0):        # 1 + n % 4096 bytes
    return alloc(0, n, stream)


def small(n, stream=0):       # 1 + n % 1 MiB
    return alloc(1, n, stream)


def large(n, stream=0):       # 1 MiB + 1 + (9n) % 9 MiB
    return alloc(2, n, stream)


def own(n, stream=0):         # 10 MiB + (118n) % 118 MiB
    return alloc(3, n, stream)


def edge(i, stream=0):        # the policy-edge table
    return alloc(4, i, stream)


def huge(n, stream=0):        # capacity / 4 + n * (2 capacity / 65536)
    return alloc(5, n, stream)


def absurd(i):                # 0 or past 1 PiB: mem::Error
    return alloc(6, i)


def free(pick=0):
    return bytes([13, pick])


def record(pick, stream):
    return bytes([23, pick, stream])


HOLD, UNHOLD, RELEASE, EMPTY = bytes([25]), bytes([26]), bytes([27]), bytes([28])


def fraction(byte):           # <= 200: byte / 200; above: misuse
    return bytes([29, byte])


def inject(nth):              # fail the nth segment allocation from now
    return bytes([30, nth - 1])


def stale(pick=0):            # double free of an earlier pointer (pick < 224)
    return bytes([31, pick])


def replace(stream):          # destroy created stream #1 or #2, create another
    return bytes([31, 224 + (stream - 1)])


# --- scenarios ---------------------------------------------------------------

def tiny_churn(rng):
    ops = []
    for i in range(40):
        ops.append(tiny(rng.randrange(65536), stream=i % 3))
        if i % 3 == 2:
            ops.append(free(rng.randrange(256)))
    return ops


def pool_edges(rng):
    ops = [edge(i, stream=i % 3) for i in range(20)]
    ops += [free(rng.randrange(256)) for _ in range(10)]
    ops += [edge(i) for i in range(0, 20, 3)]
    return ops + [EMPTY]


def split_and_coalesce(rng):
    ops = [large(rng.randrange(1 << 24)) for _ in range(12)]
    ops += [small(rng.randrange(1 << 24)) for _ in range(12)]
    ops += [free(i * 7) for i in range(16)]
    ops += [large(rng.randrange(1 << 24)) for _ in range(6)]
    return ops


def own_segments_until_oom(rng):
    ops = [own(rng.randrange(1 << 24), stream=i % 2) for i in range(14)]
    ops += [huge(rng.randrange(65536))]
    ops += [free(rng.randrange(256)) for _ in range(7)]
    ops += [huge(rng.randrange(65536)), EMPTY, own(0)]
    return ops


def record_stream_held(rng):
    ops = [small(1000), large(5000), own(70000)]
    ops += [record(0, 1), record(1, 2), record(2, 1), HOLD]
    ops += [free(0), free(0), small(1000), large(5000)]
    ops += [UNHOLD, small(20), RELEASE, small(20), free(1)]
    ops += [large(7), record(0, 2), HOLD, free(0), EMPTY, small(3)]
    return ops


def fraction_and_gc(rng):
    ops = [fraction(100)]
    for _ in range(10):
        ops += [own(rng.randrange(1 << 24)), large(rng.randrange(1 << 24))]
        ops += [free(rng.randrange(256))]
    ops += [fraction(0), small(5), fraction(200), huge(100)]
    return ops


def injected_failures(rng):
    ops = []
    for nth in (1, 2, 3, 4):
        ops += [inject(nth), own(rng.randrange(1 << 24)), small(rng.randrange(1 << 24))]
        ops += [large(rng.randrange(1 << 24)), free(rng.randrange(256))]
    ops += [inject(1), huge(30000), EMPTY]
    return ops


def misuse(rng):
    ops = [absurd(i) for i in range(6)]
    ops += [small(4), free(0), stale(0), fraction(250), fraction(255)]
    ops += [large(9), stale(1), free(0), stale(0)]
    return ops


def streams_destroyed(rng):
    # Blocks allocated on, and recorded on, streams that go away before the free.
    ops = [small(300, stream=1), large(4000, stream=2), own(9000, stream=1)]
    ops += [record(0, 2), record(1, 1), HOLD, replace(2), free(0), free(0)]
    ops += [small(300, stream=1), replace(1), free(0), RELEASE, small(7)]
    ops += [large(rng.randrange(1 << 24), stream=2), record(0, 1), replace(1), free(0)]
    return ops + [UNHOLD, EMPTY]


SCENARIOS = [tiny_churn, pool_edges, split_and_coalesce, own_segments_until_oom,
             record_stream_held, fraction_and_gc, injected_failures, misuse,
             streams_destroyed]


def main():
    out = pathlib.Path(__file__).resolve().parent / "corpus"
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    for index, setup in enumerate(SETUPS):
        for scenario in SCENARIOS:
            rng = random.Random(f"{setup}/{scenario.__name__}")
            data = bytes([index]) + b"".join(scenario(rng))
            name = f"{setup}-{scenario.__name__.replace('_', '-')}"
            (out / name).write_bytes(data)
    print(f"wrote {len(SETUPS) * len(SCENARIOS)} seeds to {out}")


if __name__ == "__main__":
    main()
