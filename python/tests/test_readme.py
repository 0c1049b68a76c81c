"""The README's PyTorch example: run as written where PyTorch sees a GPU; elsewhere it must
at least compile and use only functions the package has, so it cannot drift silently."""
from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

import vramscope

SOURCE = Path(os.environ.get("VRAMSCOPE_SOURCE_DIR", Path(__file__).resolve().parents[2]))


def readme_example() -> str:
    spec = importlib.util.spec_from_file_location("readme_snippets",
                                                  SOURCE / "scripts" / "readme_snippets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocks = {name: body for kind, name, body in module.snippets((SOURCE / "README.md").read_text())
              if kind == "file"}
    return blocks["pytorch_example.py"]


def test_example_uses_only_what_the_package_has():
    tree = ast.parse(readme_example())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "vramscope"}
    assert used >= {"enable", "track_modules", "snapshot", "memory_stats"}
    missing = sorted(name for name in used if not hasattr(vramscope, name))
    assert not missing, f"the README calls vramscope.{missing}, which the package lacks"
    assert set(used) <= set(vramscope.__all__)


def test_example_runs_on_a_gpu(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the plugin replaces PyTorch's CUDA allocator")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), "README.md:pytorch_example.py", "exec"), {})
    assert (tmp_path / "step.pickle").stat().st_size > 0
