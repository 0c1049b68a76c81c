#!/usr/bin/env python3
"""check_svg.py — parses memory.svg with xml.etree: well-formed SVG 1.1 with the
three series, the peak marker, the phase bands, axes and legend."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

NS = "{http://www.w3.org/2000/svg}"


def main(directory: Path) -> None:
    root = ET.parse(directory / "memory.svg").getroot()
    assert root.tag == NS + "svg", root.tag
    assert float(root.get("width")) > 0 and float(root.get("height")) > 0
    ids = {e.get("id") for e in root.iter() if e.get("id")}
    for want in ("allocated", "allocated-area", "reserved", "nvidia-smi", "peak", "phases",
                 "x-axis", "y-axis", "legend"):
        assert want in ids, f"missing #{want}: {sorted(ids)}"
    texts = [t.text or "" for t in root.iter(NS + "text")]
    assert any(t.startswith("peak allocated ") for t in texts), texts
    assert any(t.endswith(" GiB") for t in texts), "y axis should be in GiB for this run"
    legend = [t.text for t in root.find(f".//{NS}g[@id='legend']").iter(NS + "text")]
    for label in ("allocated", "reserved", "nvidia-smi view", "forward", "backward", "recompute",
                  "optimizer"):
        assert label in legend, (label, legend)
    bands = root.find(f".//{NS}g[@id='phases']").findall(NS + "rect")
    assert len(bands) >= 4, len(bands)
    for path_id in ("allocated", "reserved", "nvidia-smi"):
        d = root.find(f".//{NS}path[@id='{path_id}']").get("d")
        assert d.startswith("M") and len(d) > 20
    print(f"svg ok: {len(ids)} ids, {len(bands)} phase bands")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
