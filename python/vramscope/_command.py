"""_command.py: the `vramscope` command of a pip-installed package (its console entry point).

The wheel carries the C++ program at vramscope/bin/vramscope; this replaces the Python process
with it, so exit codes, signals and output are the program's own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def program() -> Path:
    """The bundled `vramscope` program (present in a wheel built by `pip install .`)."""
    return Path(__file__).resolve().parent / "bin" / "vramscope"


def main() -> None:
    exe = program()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(f"vramscope: this installation has no command ({exe} is missing); install the "
                         "package with `pip install .` from the vramscope repository, which builds it\n")
        sys.exit(1)
    os.execv(exe, [str(exe), *sys.argv[1:]])


if __name__ == "__main__":
    main()
