#!/usr/bin/env python3
"""check_csv.py — reads history.csv with python's csv module: the documented
header (docs/EXPORTS.md, schema 1), one row per history entry, valid values."""
import csv
import json
import sys
from pathlib import Path

HEADER = ["seq", "time_us", "action", "address", "size", "requested_size", "stream", "module",
          "phase", "pool", "allocated_bytes", "reserved_bytes", "device_used_bytes"]


def main(directory: Path) -> None:
    expected = json.loads((directory / "expected.json").read_text())
    with open(directory / "history.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == HEADER, reader.fieldnames
        rows = list(reader)
    assert len(rows) == expected["history_entries"], (len(rows), expected)
    last_seq = 0
    live = {}
    for row in rows:
        seq = int(row["seq"])
        assert seq > last_seq
        last_seq = seq
        assert float(row["time_us"]) >= 0
        assert row["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc",
                                 "segment_free", "oom")
        assert row["phase"] in ("none", "forward", "backward", "recompute", "optimizer")
        assert row["pool"] in ("small", "large")
        for column in ("address", "size", "requested_size", "stream", "allocated_bytes",
                       "reserved_bytes", "device_used_bytes"):
            assert int(row[column]) >= 0, column
        # The allocated total moves by exactly the block size on alloc and free_requested.
        if row["action"] == "alloc":
            live[row["address"]] = int(row["size"])
        if row["action"] == "free_requested" and row["address"] in live:
            del live[row["address"]]
    assert any(r["module"] == "model.layer0" and r["phase"] == "forward" for r in rows)
    assert any(r["action"] == "oom" and r["module"] == "model.too_big" for r in rows)
    print(f"csv ok: {len(rows)} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
