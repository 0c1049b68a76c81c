#!/usr/bin/env python3
"""doc_examples.py: every `vramscope` output pasted in README.md and docs/*.md, run and compared.

A fenced block whose first line is `$ vramscope ARGS` (or `$ build/release/tools/vramscope
ARGS`, or `$ python3 -m vramscope.export ARGS`, run with python/ on the path, or `$ python3
NAME.py`, a file the document saved, run so too, with the command's build's libraries) is an
example: the lines after it are what the command prints. A line `...` in the
block stands for output left out; every other line must equal the command's output line
for line, in order, and a run of lines between two `...` must be consecutive in the output.

    python3 scripts/doc_examples.py check VRAMSCOPE [FILE.md ...]    # CTest runs this
    python3 scripts/doc_examples.py check-torch VRAMSCOPE [FILE.md ...]
    python3 scripts/doc_examples.py update VRAMSCOPE [FILE.md ...]   # rewrite the blocks

An example needs PyTorch when it runs the exporter or reads a file an earlier exporter example
of its document wrote (`-o net.json`, then `--model-file net.json`). `check` leaves those out
and says how many; `check-torch` checks only those, on a Python with torch (the current-stack
environment, VRAMSCOPE_STACK_PYTHON), and exits 77 (skipped) without one, unless
VRAMSCOPE_REQUIRE_STACK=1 (CI), where a missing stack fails.

`update` replaces each shown line by the output line at its place (the same rows stay
shown), so the documents follow the program. A document's commands run in order in one scratch
folder (a file one writes is there for the next); it is thrown away after. A block right after a line `<!-- unsanitized: WHY -->` is checked by the unsanitized build
only (a search of hundreds of dry runs). A fenced block right after a line `<!-- file: NAME -->` is a file
the document asks the reader to save: it is written into the scratch folder as NAME before
the document's commands run, so an example such as `vramscope sweep --model-file
net.json` runs on exactly the text the document shows.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = re.compile(r"^\$ (?:build/release/tools/)?(?P<cmd>vramscope|python3 -m vramscope\.export|python3 [A-Za-z0-9_-]+\.py)"
                    r"(?P<args>(?: .*)?)$")
FENCE = "```"


def examples(text: str):
    """(line index of the $ line, args, [output lines], index after the block)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith(FENCE) and i + 1 < len(lines) and PROMPT.match(lines[i + 1]):
            m = PROMPT.match(lines[i + 1])
            args = shlex.split(m.group("args"))
            if m.group("cmd").endswith(".py"):
                args = [SCRIPT, m.group("cmd").split()[1]] + args
            elif m.group("cmd") != "vramscope":
                args = [EXPORT] + args
            j = i + 2
            while j < len(lines) and not lines[j].startswith(FENCE):
                j += 1
            yield i + 1, args, lines[i + 2:j], j
            i = j + 1
        else:
            i += 1


FILE_MARK = re.compile(r"^<!-- file: (?P<name>[A-Za-z0-9_.-]+) -->$")
# A block right after `<!-- unsanitized: WHY -->` is a search of hundreds of dry runs: the
# sanitized builds leave it to the plain build (their unit tests run the same code on small models).
UNSANITIZED_MARK = re.compile(r"^<!-- unsanitized: .+ -->$")


def saved_files(text: str) -> dict[str, str]:
    """{NAME: content} of the blocks marked `<!-- file: NAME -->`."""
    lines, files = text.split("\n"), {}
    for i, line in enumerate(lines):
        m = FILE_MARK.match(line)
        if m and i + 1 < len(lines) and lines[i + 1].startswith(FENCE):
            j = i + 2
            while j < len(lines) and not lines[j].startswith(FENCE):
                j += 1
            files[m.group("name")] = "\n".join(lines[i + 2:j]) + "\n"
    return files


EXPORT = "<export>"  # `python3 -m vramscope.export ...`: the exporter of python/, on a python3 with torch
SCRIPT = "<script>"  # `python3 NAME.py ...`: a file the document saved, on that python, the package of python/


_TORCH: list = []  # the answer of python_with_torch(), asked once


def python_with_torch() -> str | None:
    """The current-stack environment's python (VRAMSCOPE_STACK_PYTHON, scripts/stack_env.sh),
    else this one or Debian's, whichever has torch; None when none has."""
    import os
    if not _TORCH:
        found = None
        for python in (os.environ.get("VRAMSCOPE_STACK_PYTHON") or sys.executable, sys.executable, "/usr/bin/python3"):
            if Path(python).exists() and subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
                found = python
                break
        _TORCH.append(found)
    return _TORCH[0]


def needs_torch(args: list[str], written: set) -> bool:
    """Whether an example runs the exporter or reads what one wrote (and notes what it writes)."""
    if args[:1] == [SCRIPT]:
        return True
    if args[:1] == [EXPORT]:
        for flag, value in zip(args, args[1:]):
            if flag in ("-o", "--output"):
                written.add(value)
        return True
    return any(a in written or a.split("=", 1)[-1] in written for a in args)


def run(exe: str, args: list[str], scratch: Path) -> list[str]:
    """Runs one example in the document's scratch folder (shared by its examples, in order:
    a file the exporter writes is there for the sweep after it)."""
    import os
    env = None
    if args and args[0] == EXPORT:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        command = [python_with_torch() or sys.executable, "-m", "vramscope.export", *args[1:]]
    elif args and args[0] == SCRIPT:
        # The package of python/ with the libraries of the build the command is from.
        bindings = Path(exe).resolve().parents[1] / "bindings"
        # No progress bars in the documents' output (tqdm draws them on stderr, which is shown).
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), VRAMSCOPE_LIBRARY=str(bindings / "libvramscope.so"),
                   VRAMSCOPE_PLANNER_LIBRARY=str(bindings / "libvramscope_planner.so"), TQDM_DISABLE="1")
        command = [python_with_torch() or sys.executable, *args[1:]]
    else:
        command = [exe, *args]
    p = subprocess.run(command, capture_output=True, text=True, cwd=scratch, timeout=300, env=env)
    return (p.stdout + p.stderr).rstrip("\n").split("\n")


def runs(shown: list[str]):
    """The block's shown lines as runs separated by `...`: [(starts_after_gap, [lines])]."""
    out, current, gap = [], [], False
    for line in shown:
        if line.strip() == "...":
            if current:
                out.append((gap, current))
            current, gap = [], True
        else:
            current.append(line)
    if current:
        out.append((gap, current))
    return out


def place(shown: list[str], output: list[str]):
    """Output positions of each run, matching runs by their first line (their key, up to
    the figures) and in order; None where a run's first line has no match."""
    positions, at = [], 0
    for gap, lines in runs(shown):
        key = re.split(r"\s+[-+]?\d", lines[0].rstrip(), maxsplit=1)[0]
        found = None
        for k in range(at, len(output)):
            if output[k] == lines[0] or (gap and output[k].startswith(key) and key.strip()):
                found = k
                break
            if not gap:
                break  # a run with no gap before it must start right here
        if found is None:
            # A run with no gap before it is at its place whatever its first line says: check
            # names the line that differs, update rewrites it.
            found = at if not gap and at < len(output) else None
        positions.append(found)
        if found is not None:
            at = found + len(lines)
    return positions


def check_block(shown: list[str], output: list[str]) -> str | None:
    for (gap, lines), pos in zip(runs(shown), place(shown, output)):
        if pos is None:
            return f"'{lines[0]}' is not in the output"
        for n, line in enumerate(lines):
            got = output[pos + n] if pos + n < len(output) else "<end of output>"
            if got != line:
                return f"shown:  {line}\n    output: {got}"
    return None


def update_block(shown: list[str], output: list[str]) -> list[str]:
    if not any(line.strip() == "..." for line in shown):
        return output
    new = []
    for (gap, lines), pos in zip(runs(shown), place(shown, output)):
        if gap:
            new.append("...")
        new.extend(output[pos:pos + len(lines)] if pos is not None else lines)
    if shown and shown[-1].strip() == "...":
        new.append("...")
    return new


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("check", "check-torch", "update"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, exe = argv[1], str(Path(argv[2]).resolve())
    if mode == "check-torch" and python_with_torch() is None:
        import os
        why = "no Python with torch for the exporter's examples (python=$(scripts/stack_env.sh) makes one)"
        if os.environ.get("VRAMSCOPE_REQUIRE_STACK") == "1":
            print(f"FAIL doc_examples: {why}")
            return 1
        print(f"doc_examples: skipped, {why}")
        return 77
    import os
    # A sanitized build's libraries cannot be loaded into Python through ctypes (the sanitizer's
    # runtime must come first in the process): its `python3 NAME.py` examples are the plain
    # build's to check.
    sanitized = bool(os.environ.get("VRAMSCOPE_SANITIZE"))
    left_out = not_loadable = long_runs = 0
    files = [Path(f) for f in argv[3:]] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    failures = checked = 0
    for path in files:
        text = path.read_text()
        lines = text.split("\n")
        replacements = []
        scratch_dir = tempfile.TemporaryDirectory()
        scratch = Path(scratch_dir.name)
        for name, content in saved_files(text).items():
            (scratch / name).write_text(content)
        written: set = set()
        for prompt, args, shown, end in examples(text):
            torch_part = needs_torch(args, written)
            if mode == "check" and torch_part:
                left_out += 1  # check-torch's (a later example reading its file is too)
                continue
            if sanitized and args[:1] == [SCRIPT]:
                not_loadable += 1
                continue
            if sanitized and prompt >= 2 and UNSANITIZED_MARK.match(lines[prompt - 2]):
                long_runs += 1
                continue
            output = run(exe, args, scratch)
            if mode == "check-torch" and not torch_part:
                continue  # run for what it leaves in the scratch folder, checked by `check`
            checked += 1
            if mode in ("check", "check-torch"):
                problem = check_block(shown, output)
                if problem:
                    failures += 1
                    shown_args = (["python3 -m vramscope.export", *args[1:]] if args[:1] == [EXPORT]
                                  else ["python3", *args[1:]] if args[:1] == [SCRIPT] else ["vramscope", *args])
                    print(f"{path.name}:{prompt + 1}: {' '.join(shown_args)}\n    {problem}")
            else:
                replacements.append((prompt + 1, end, update_block(shown, output)))
        scratch_dir.cleanup()
        if mode == "update" and replacements:
            for start, end, new in reversed(replacements):
                lines[start:end] = new
            path.write_text("\n".join(lines))
    print(f"doc_examples: {checked} examples, {failures} differ from the program"
          + (f"; {left_out} that need PyTorch are check-torch's (ctest docs.examples_torch)" if left_out else "")
          + (f"; {not_loadable} Python scripts left to the unsanitized build (a sanitized library "
             "cannot be loaded through ctypes)" if not_loadable else "")
          + (f"; {long_runs} long searches left to the unsanitized build" if long_runs else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
