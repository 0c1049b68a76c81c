"""The exporter's two errors: one for the user, one for a single unmapped operation, and
how an exception from the user's code is told in one line."""
from __future__ import annotations

import os
from typing import Sequence


class ExportError(Exception):
    """What could not be exported: one line per problem, each with its source location."""

    def __init__(self, problems: Sequence[str], headline: str = "cannot export the model"):
        self.problems = list(problems)
        self.headline = headline
        super().__init__(headline + ":\n" + "\n".join("  - " + p for p in self.problems))


class Unsupported(Exception):
    """One operation without a model-file equivalent (collected into an ExportError)."""


def debugging() -> bool:
    """VRAMSCOPE_EXPORT_DEBUG=1: the original exceptions propagate, with their tracebacks
    (the exporter's own bugs are otherwise reported in one line too)."""
    return os.environ.get("VRAMSCOPE_EXPORT_DEBUG", "") not in ("", "0")


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, cut short: torch's messages can run to pages."""
    if isinstance(e, SystemExit):
        return f"sys.exit({e.code!r})" if e.code is not None else "sys.exit()"
    # torch 1.x's ShapeProp wraps the user's error in "ShapeProp error for: node=..." with
    # the whole fx node dumped: the cause is what went wrong.
    while str(e).startswith("ShapeProp error") and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
