#!/usr/bin/env python3
"""check_pickle.py — reads snapshot.pickle with python's own pickle module and
checks PyTorch's memory-snapshot schema (exact key names) and that only the
opcodes pytorch.org/memory_viz's JavaScript unpickler knows are used."""
import csv
import json
import pickle
import pickletools
import sys
from pathlib import Path

ALLOWED_OPCODES = {
    "PROTO", "EMPTY_DICT", "EMPTY_LIST", "MARK", "SETITEMS", "APPENDS", "BININT1",
    "BININT", "LONG1", "BINUNICODE", "BINFLOAT", "NEWTRUE", "NEWFALSE", "NONE",
    "TUPLE2", "STOP",
}
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id",
                "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
FRAME_KEYS = {"filename", "line", "name"}
PHASES = {"none", "forward", "backward", "recompute", "optimizer"}  # names of the frames
TRACE_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc",
                 "segment_free", "oom"}


def main(directory: Path) -> None:
    raw = (directory / "snapshot.pickle").read_bytes()
    used = {op.name for op, _arg, _pos in pickletools.genops(raw)}
    assert used <= ALLOWED_OPCODES, f"opcodes outside memory_viz's set: {used - ALLOWED_OPCODES}"
    assert raw[:2] == b"\x80\x02", "expected protocol 2"

    snap = pickle.loads(raw)
    expected = json.loads((directory / "expected.json").read_text())
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}, set(snap)

    allocated = 0
    reserved = 0
    blocks = 0
    for seg in snap["segments"]:
        assert set(seg) == SEGMENT_KEYS, set(seg) ^ SEGMENT_KEYS
        assert seg["segment_type"] in ("small", "large")
        assert seg["segment_pool_id"] == (0, 0) and isinstance(seg["segment_pool_id"], tuple)
        assert seg["is_expandable"] is False
        assert seg["device"] == 0
        address = seg["address"]
        seg_allocated = 0
        for block in seg["blocks"]:
            assert set(block) == BLOCK_KEYS, set(block)
            assert block["state"] in ("active_allocated", "active_pending_free", "inactive")
            assert block["address"] == address, "blocks must tile the segment"
            address += block["size"]
            for frame in block["frames"]:  # module path (and class) : 0 : phase
                assert set(frame) == FRAME_KEYS and frame["filename"] and frame["line"] == 0
                assert frame["name"] in PHASES, frame
            if block["state"] == "active_allocated":
                seg_allocated += block["size"]
            blocks += 1
        assert address == seg["address"] + seg["total_size"]
        assert seg_allocated == seg["allocated_size"]
        allocated += seg_allocated
        reserved += seg["total_size"]
    assert allocated == expected["allocated_bytes"], (allocated, expected)
    assert reserved == expected["reserved_bytes"], (reserved, expected)
    assert len(snap["segments"]) == expected["segments"]
    assert blocks == expected["blocks"]

    traces = snap["device_traces"]
    assert isinstance(traces, list) and len(traces) == 1
    trace = traces[0]
    assert len(trace) == expected["history_entries"], (len(trace), expected)
    actions = set()
    modules = set()
    last_time = 0
    for entry in trace:
        actions.add(entry["action"])
        assert entry["action"] in TRACE_ACTIONS
        where = "device_free" if entry["action"] == "oom" else "addr"
        assert set(entry) == {"action", where, "size", "stream", "time_us", "frames"}, set(entry)
        assert entry["time_us"] >= last_time
        last_time = entry["time_us"]
        for frame in entry["frames"]:
            assert set(frame) == FRAME_KEYS
            assert frame["line"] == 0 and frame["name"] in PHASES, frame
            modules.add(f'{frame["filename"]} ({frame["name"]})')
    assert actions == TRACE_ACTIONS, actions
    assert "model.layer2 (recompute)" in modules, sorted(modules)
    assert "optimizer (optimizer)" in modules

    # Like PyTorch (orig_size), alloc/free entries carry the caller's size, not
    # the block's; segment and oom entries carry the size the history records.
    with open(directory / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(trace), (len(rows), len(trace))
    odd = 0
    for entry, row in zip(trace, rows):
        assert entry["action"] == row["action"], (entry, row)
        if entry["action"] in ("alloc", "free_requested", "free_completed"):
            assert entry["size"] == int(row["requested_size"]), (entry, row)
            odd += entry["size"] != int(row["size"])
        else:
            assert entry["size"] == int(row["size"]), (entry, row)
    assert odd > 0, "no alloc whose request differs from its block size (see export_fixture)"
    requests = [b for seg in snap["segments"] for b in seg["blocks"]
                if b["state"] == "active_allocated" and b["requested_size"] != b["size"]]
    assert requests, "the snapshot's blocks should keep their rounded size next to the request"

    settings = snap["allocator_settings"]
    assert set(settings) == {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size",
                             "garbage_collection_threshold", "expandable_segments",
                             "pinned_num_register_threads", "release_lock_on_cudamalloc",
                             "pinned_use_cuda_host_register", "roundup_power2_divisions"}
    assert isinstance(settings["garbage_collection_threshold"], float)
    assert list(settings["roundup_power2_divisions"]) == [str(1 << i) for i in range(16)]
    print(f"pickle ok: {len(snap['segments'])} segments, {blocks} blocks, {len(trace)} trace entries")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
