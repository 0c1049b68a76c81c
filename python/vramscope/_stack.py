"""The installed PyTorch, transformers and PEFT as a `vramscope --stack` spec: what a layer
keeps for backward changes between releases, so the command should model the versions the
user runs (runtime/src/engine/stack.cpp lists those it knows)."""
from __future__ import annotations

import importlib
from typing import Optional


def _minor(version: str) -> str:
    """'2.15.0+cu132' -> '2.15'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_stack() -> Optional[str]:
    """'torch=2.15,transformers=5.24,peft=0.21' for the packages importable here (each
    left out when absent), or None when none is."""
    parts = []
    for package in ("torch", "transformers", "peft"):
        try:
            version = importlib.import_module(package).__version__
        except Exception:  # noqa: BLE001 (absent, or broken: then the command's default)
            continue
        parts.append(f"{package}={_minor(version)}")
    return ",".join(parts) or None
