"""Each test runs in a fresh interpreter (the library's allocators live for the process),
so tests that set the device go through `run_fresh`."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_fresh(tmp_path):
    def run(code: str, env: dict | None = None) -> str:
        script = tmp_path / "case.py"
        script.write_text(textwrap.dedent(code))
        full_env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR), **(env or {}))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=full_env, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        return done.stdout
    return run
