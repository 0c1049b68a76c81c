#!/usr/bin/env python3
"""readme_snippets.py: the code blocks of a Markdown file that are marked to be tested.

A fenced block right after `<!-- file: PATH -->` is a source file; one right after
`<!-- output: NAME -->` is what program NAME prints. `extract` writes them under OUTDIR
(files at OUTDIR/PATH, outputs at OUTDIR/expected/NAME.txt), so tests build and run the
documentation exactly as written.

    python3 scripts/readme_snippets.py extract README.md build/snippets
    python3 scripts/readme_snippets.py list README.md
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

MARKER = re.compile(r"^<!--\s*(file|output):\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")


def snippets(text: str) -> list[tuple[str, str, str]]:
    """(kind, name, body) of every marked block, in order."""
    lines = text.splitlines(keepends=True)
    found: list[tuple[str, str, str]] = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        kind, name = m.group(1), m.group(2)
        if i >= len(lines) or not FENCE.match(lines[i]):
            raise ValueError(f"line {i}: the {kind} marker '{name}' is not followed by a fenced block")
        fence = FENCE.match(lines[i]).group(1)
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"the block of '{name}' is not closed")
        i += 1
        found.append((kind, name, "".join(body)))
    return found


def extract(markdown: Path, outdir: Path) -> None:
    for kind, name, body in snippets(markdown.read_text()):
        target = outdir / name if kind == "file" else outdir / "expected" / f"{name}.txt"
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise ValueError(f"'{name}' must be a relative path inside the output folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "extract":
        extract(Path(argv[2]), Path(argv[3]))
        return 0
    if len(argv) == 3 and argv[1] == "list":
        for kind, name, body in snippets(Path(argv[2]).read_text()):
            print(f"{kind:6} {name} ({len(body.splitlines())} lines)")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
