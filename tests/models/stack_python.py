"""stack_python.py: run a check on the current-stack environment's python.

A check that needs today's torch and transformers calls reexec_on_stack(name) first: on an
interpreter without them it re-runs itself with VRAMSCOPE_STACK_PYTHON (scripts/stack_env.sh),
or exits 77 (skipped), or fails when VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import os
import subprocess
import sys
from pathlib import Path


def reexec_on_stack(name: str) -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return
    except ImportError:
        pass
    nested = "VRAMSCOPE_STACK_NESTED_" + name.upper()
    python = os.environ.get("VRAMSCOPE_STACK_PYTHON", "")
    if python and Path(python).exists() and not os.environ.get(nested):
        env = dict(os.environ, **{nested: "1"})  # a venv's python resolves to its base
        sys.exit(subprocess.run([python, sys.argv[0], *sys.argv[1:]], env=env).returncode)
    if os.environ.get("VRAMSCOPE_REQUIRE_STACK") == "1":
        sys.exit(f"FAIL {name}: no current-stack environment (VRAMSCOPE_STACK_PYTHON, scripts/stack_env.sh)")
    print(f"{name}: skipped, no torch + transformers (python=$(scripts/stack_env.sh) makes them)")
    sys.exit(77)
