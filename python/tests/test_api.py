"""The package over the C API on a simulated GPU: torch.cuda's statistics keys and figures,
snapshots Python's pickle reads, the summary, scopes and errors."""
from __future__ import annotations

import json
import pickle

# torch.cuda.memory_stats()'s keys (c10/cuda/CUDACachingAllocator: DeviceStats, and
# torch/cuda/memory.py: memory_stats() flattens them as "<stat>.<pool>.<field>").
TORCH_ARRAYS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes",
                "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"]
TORCH_SCALARS = ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size"]
TORCH_KEYS = sorted(
    [f"{a}.{p}.{f}" for a in TORCH_ARRAYS for p in ("all", "small_pool", "large_pool")
     for f in ("current", "peak", "allocated", "freed")]
    + [f"{o}.{f}" for o in ("oversize_allocations", "oversize_segments")
       for f in ("current", "peak", "allocated", "freed")]
    + TORCH_SCALARS)

MiB = 1 << 20


def test_memory_stats_has_torch_keys_and_exact_figures(run_fresh):
    out = run_fresh(f"""
        import json, vramscope
        vramscope.init("sim:a100-80g", "")
        p = vramscope.malloc(5 * {MiB})
        s = vramscope.memory_stats()
        print(json.dumps({{"keys": list(s), "stats": s,
                           "alloc": vramscope.memory_allocated(),
                           "reserved": vramscope.memory_reserved(),
                           "device": vramscope.device_memory()}}))
        vramscope.free(p)
    """)
    got = json.loads(out)
    assert got["keys"] == TORCH_KEYS
    s = got["stats"]
    assert s["allocated_bytes.all.current"] == 5 * MiB
    assert s["reserved_bytes.all.current"] == 20 * MiB  # a 20 MiB segment for 1-10 MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["segment.all.current"] == 1
    assert s["num_device_alloc"] == 1
    assert got["alloc"] == 5 * MiB and got["reserved"] == 20 * MiB
    d = got["device"]
    assert d["used_bytes"] == d["context_bytes"] + 20 * MiB
    assert d["total_bytes"] > 70 * 1024 * MiB


def test_peaks_resets_and_empty_cache(run_fresh):
    out = run_fresh(f"""
        import vramscope
        vramscope.init("sim", "")
        a = vramscope.malloc(30 * {MiB}); b = vramscope.malloc(3 * {MiB})
        vramscope.free(a)
        print(vramscope.memory_allocated(), vramscope.max_memory_allocated(),
              vramscope.memory_reserved(), vramscope.max_memory_reserved())
        vramscope.reset_peak_memory_stats(); vramscope.empty_cache()
        print(vramscope.max_memory_allocated(), vramscope.memory_reserved())
        vramscope.free(b)
    """)
    first, second = out.splitlines()
    assert first.split() == [str(3 * MiB), str(33 * MiB), str(50 * MiB), str(50 * MiB)]
    assert second.split() == [str(3 * MiB), str(20 * MiB)]


def test_snapshot_pickle_loads_with_python_pickle(run_fresh, tmp_path):
    run_fresh(f"""
        import vramscope
        vramscope.init("sim", "")
        vramscope.record_memory_history(1000)
        with vramscope.scope("encoder.block0", "forward"):
            p = vramscope.malloc(2 * {MiB})
        vramscope.snapshot("{tmp_path}/s.pickle")
        vramscope.snapshot_json("{tmp_path}/s.json")
    """)
    with open(tmp_path / "s.pickle", "rb") as f:
        snap = pickle.load(f)  # plain data: dicts, lists, strings, ints
    assert set(snap) >= {"segments", "device_traces"}
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    active = [b for b in blocks if b["state"] == "active_allocated"]
    assert [b["size"] for b in active] == [2 * MiB]
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frame = allocs[-1]["frames"][0]
    assert (frame["filename"], frame["name"]) == ("encoder.block0", "forward"), frame
    doc = json.loads((tmp_path / "s.json").read_text())
    owners = [(b["module"], b["phase"]) for seg in doc["segments"] for b in seg["blocks"]
              if b["state"] == "active_allocated"]
    assert owners == [("encoder.block0", "forward")]


def test_memory_summary_is_torchs_table(run_fresh):
    out = run_fresh(f"""
        import vramscope
        vramscope.init("sim", "")
        p = vramscope.malloc(5 * {MiB})
        print(vramscope.memory_summary())
    """)
    assert "PyTorch CUDA memory summary" in out
    assert "Allocated memory" in out and "GPU reserved memory" in out


def test_errors_raise_with_the_librarys_message(run_fresh):
    out = run_fresh(f"""
        import vramscope
        vramscope.init("sim:capacity=1GiB,context=0", "")
        for call in (lambda: vramscope.malloc(0), lambda: vramscope.free(12345),
                     lambda: vramscope.init("sim:nope"),
                     lambda: vramscope.malloc(2048 * {MiB}),
                     lambda: vramscope.snapshot("/nonexistent/dir/s.pickle")):
            try:
                call()
                print("no error")
            except vramscope.OutOfMemoryError as e:
                print("oom", isinstance(e, MemoryError), str(e).split(".")[0])
            except vramscope.VramscopeError as e:
                print("error", str(e).split(":")[0])
        try:
            with vramscope.scope("m", "sideways"):
                pass
        except vramscope.VramscopeError as e:
            print("error", str(e).split(":")[0])
    """)
    lines = out.splitlines()
    assert lines[0] == "error vramscope_malloc"
    assert lines[1] == "error vramscope_free"
    assert lines[2] == "error vramscope_init"
    assert lines[3].startswith("oom True")
    assert lines[4] == "error vramscope_snapshot_pickle"
    assert lines[5] == "error vramscope_scope_push"


def test_library_not_found_says_what_to_do(run_fresh):
    out = run_fresh("""
        import vramscope
        try:
            vramscope.memory_allocated()
        except vramscope.VramscopeError as e:
            print(e)
    """, env={"VRAMSCOPE_LIBRARY": "/nonexistent/libvramscope.so"})
    assert "VRAMSCOPE_LIBRARY" in out and "/nonexistent/libvramscope.so" in out


def test_plugin_entry_points_through_ctypes(run_fresh):
    """PyTorch calls the plugin through plain function pointers; so does ctypes here."""
    out = run_fresh(f"""
        import ctypes, vramscope
        from vramscope._native import library
        vramscope.init("sim", "")
        lib = library()
        p = lib.vramscope_torch_malloc(5 * {MiB}, 0, ctypes.c_void_p(0x7000))
        print(vramscope.memory_allocated())
        lib.vramscope_torch_free(p, 5 * {MiB}, 0, ctypes.c_void_p(0x7000))
        print(vramscope.memory_allocated(), lib.vramscope_torch_malloc(0, 0, None))
    """)
    assert out.split() == [str(5 * MiB), "0", "None"]
