"""Each test runs in a fresh interpreter (the library's allocators live for the process),
so tests that set the device go through `run_fresh`.

Two ways to run: against this checkout (CTest: PYTHONPATH=python, VRAMSCOPE_LIBRARY and
VRAMSCOPE_BUILD_DIR from the build), or against an installed wheel (VRAMSCOPE_TEST_INSTALLED=1,
scripts/check_wheel.sh): then nothing points into the checkout, and the package must find
its own library and command."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]
INSTALLED = os.environ.get("VRAMSCOPE_TEST_INSTALLED") == "1"


def package_env(env: dict | None = None) -> dict:
    """The environment of a child Python: this checkout's package unless testing the installed one."""
    return dict(os.environ, **({} if INSTALLED else {"PYTHONPATH": str(PYTHON_DIR)}), **(env or {}))


def vramscope_command() -> str | None:
    """The `vramscope` program: the installed command, or the one CTest's build made."""
    if INSTALLED:
        return shutil.which("vramscope")
    exe = os.path.join(os.environ.get("VRAMSCOPE_BUILD_DIR", ""), "tools", "vramscope")
    return exe if os.path.exists(exe) else None


@pytest.fixture
def run_fresh(tmp_path):
    def run(code: str, env: dict | None = None) -> str:
        script = tmp_path / "case.py"
        script.write_text(textwrap.dedent(code))
        full_env = package_env(env)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=full_env, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        return done.stdout
    return run
