#!/usr/bin/env python3
"""doc_snippets.py: every C++ block of README.md and docs/*.md, compiled.

A ```cpp block with a main() is compiled as it is. Any other block is a fragment: it is
compiled as the body of a function that has what the documents assume in scope (`alloc`,
the process allocator, unless the block declares it; `bytes`, a size), with every public
header included; lines that begin with "..." stand for the user's own code and are left
out. Only syntax and types are checked (-fsyntax-only): nothing runs.

    python3 scripts/doc_snippets.py CXX -I<include dir> ... [-- FILE.md ...]
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/instrumentation.hpp"
#include "vramscope/runtime/all.hpp"

[[maybe_unused]] static std::string type_name_of(std::string_view) { return {}; }
"""


def blocks(markdown: Path):
    lines = markdown.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```cpp":
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield i + 1, "\n".join(lines[i + 1:j])
            i = j + 1
        else:
            i += 1


def source(block: str, n: int) -> str:
    if re.search(r"\bint\s+main\s*\(", block):
        return block
    lines = [line for line in block.split("\n") if not line.lstrip().startswith("...")]
    # A fragment's own #include lines go to the top of the file, before the function.
    includes = "\n".join(line for line in lines if line.startswith("#include"))
    body = "\n".join(line for line in lines if not line.startswith("#include"))
    declares_alloc = re.search(r"(CachingAllocator&?\s+alloc\b)|(\balloc\s*=)", body)
    setup = "" if declares_alloc else "  mem::CachingAllocator& alloc = mem::process_allocator();\n"
    return (f"{PRELUDE}{includes}\n[[maybe_unused]] static void snippet_{n}() {{\n{setup}"
            f"  [[maybe_unused]] std::size_t bytes = 1024;\n{body}\n}}\n")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    args = argv[1:]
    files = []
    if "--" in args:
        files = [Path(f) for f in args[args.index("--") + 1:]]
        args = args[:args.index("--")]
    cxx, flags = args[0], args[1:]
    files = files or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    failures = count = 0
    with tempfile.TemporaryDirectory() as scratch:
        for md in files:
            for line, block in blocks(md):
                count += 1
                cpp = Path(scratch) / f"snippet_{count}.cpp"
                cpp.write_text(source(block, count))
                p = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", *flags, str(cpp)],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    failures += 1
                    print(f"{md.name}:{line}: the C++ block does not compile:\n{p.stderr[-2000:]}")
    print(f"doc_snippets: {count} C++ blocks, {failures} do not compile")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
