#!/usr/bin/env python3
"""check_json.py — reads snapshot.json and trace.json with python's json module
and checks the documented schemas (docs/EXPORTS.md), exact key names included."""
import json
import sys
from pathlib import Path


def check_snapshot(directory: Path) -> None:
    doc = json.loads((directory / "snapshot.json").read_text())
    expected = json.loads((directory / "expected.json").read_text())
    assert list(doc) == ["schema", "version", "device", "allocator_settings", "memory_stats",
                         "fragmentation", "segments", "history"], list(doc)
    assert doc["schema"] == "vramscope.snapshot" and doc["version"] == 1
    assert set(doc["device"]) == {"name", "simulated", "granularity", "assumptions", "total_bytes",
                                  "free_bytes", "free_from_device", "used_bytes",
                                  "peak_used_bytes", "context_bytes"}, set(doc["device"])
    stats = doc["memory_stats"]
    for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                 "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for metric in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{metric}" in stats, f"{name}.{pool}.{metric}"
    for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "oversize_allocations.current", "oversize_segments.current",
                 "max_split_size", "device_used_bytes.peak", "device_total_bytes", "context_bytes"):
        assert name in stats, name
    assert stats["allocated_bytes.all.current"] == expected["allocated_bytes"]
    assert stats["num_ooms"] == 1
    assert doc["device"]["used_bytes"] == stats["device_used_bytes.current"]

    allocated = 0
    for seg in doc["segments"]:
        assert set(seg) == {"address", "total_size", "allocated_size", "active_size",
                            "requested_size", "stream", "pool", "expandable", "blocks"}
        assert seg["expandable"] is False
        for block in seg["blocks"]:
            assert set(block) == {"address", "size", "requested_size", "state", "module", "phase"}
            if block["state"] == "active_allocated":
                allocated += block["size"]
    assert allocated == expected["allocated_bytes"]
    assert len(doc["history"]) == expected["history_entries"]
    assert set(doc["history"][0]) == {"seq", "time_us", "action", "address", "size",
                                      "requested_size", "stream", "module", "phase", "pool",
                                      "allocated_bytes", "reserved_bytes", "device_used_bytes"}
    frag = doc["fragmentation"]
    assert frag["reserved_unallocated_bytes"] == (stats["reserved_bytes.all.current"]
                                                  - stats["allocated_bytes.all.current"])


def check_trace(directory: Path) -> None:
    doc = json.loads((directory / "trace.json").read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}, set(doc)
    assert doc["otherData"]["schema"] == "vramscope.perfetto"
    events = doc["traceEvents"]
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"allocated", "reserved", "nvidia-smi view"}, counters
    for e in events:
        assert e["ph"] in ("C", "X", "M", "i"), e
        if e["ph"] == "i":  # an out-of-memory mark: what was asked, and the totals then
            assert e["name"].startswith("out of memory (asked "), e
            assert e["s"] == "g" and e["args"]["requested_bytes"] > 0, e
        if e["ph"] == "C":
            assert set(e) == {"name", "ph", "ts", "pid", "tid", "args"}
            assert set(e["args"]) == {"bytes"} and e["args"]["bytes"] >= 0
        if e["ph"] == "X":
            assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
            assert e["cat"] in ("forward", "backward", "recompute", "optimizer", "none")
            assert e["dur"] >= 0
            assert e["name"], e  # every slice named (the step's own scope is "step")
    slices = [e for e in events if e["ph"] == "X"]
    cats = {e["cat"] for e in slices}
    assert {"forward", "backward", "recompute", "optimizer"} <= cats, cats
    peak = max(e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "allocated")
    assert peak > 0
    assert doc["otherData"]["clock"].startswith("allocator events"), doc["otherData"]


def main(directory: Path) -> None:
    check_snapshot(directory)
    check_trace(directory)
    print("json ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
