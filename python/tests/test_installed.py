"""The pip-installed package (VRAMSCOPE_TEST_INSTALLED=1, scripts/check_wheel.sh): it loads its
own library and runs its own command with no environment variable, and nothing of it comes
from the checkout the tests live in."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import INSTALLED, PYTHON_DIR, package_env

pytestmark = pytest.mark.skipif(not INSTALLED, reason="tests the installed wheel (VRAMSCOPE_TEST_INSTALLED=1)")


def test_the_package_and_its_library_are_the_installed_ones():
    env = {k: v for k, v in package_env().items() if not k.startswith("VRAMSCOPE_") or k == "VRAMSCOPE_TEST_INSTALLED"}
    done = subprocess.run([sys.executable, "-c", "import vramscope, vramscope._native as n; "
                           "print(vramscope.__file__); print(n.library_path())"],
                          capture_output=True, text=True, env=env, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    package, library = (Path(line) for line in done.stdout.split())
    assert PYTHON_DIR not in package.parents, package
    assert library.parent == package.parent and library.name == "libvramscope.so"


def test_the_command_is_on_the_path_and_runs_the_bundled_program(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSCOPE_")}
    done = subprocess.run(["vramscope", "sweep", "--model", "mlp", "--depth", "4", "--segments", "0,2", "--dtype", "f32",
                           "--format", "csv"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("model,") and done.stdout.count("\n") == 3
    bad = subprocess.run(["vramscope", "sweep", "--model", "nosuchnet"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("vramscope: error:")


def test_the_zoo_files_are_in_the_package():
    import vramscope
    zoo = Path(vramscope.__file__).parent / "zoo"
    assert (zoo / "resnet50.json").is_file() and (zoo / "hf").is_dir()
