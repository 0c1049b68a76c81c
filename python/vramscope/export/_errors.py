"""The exporter's two errors: one for the user, one for a single unmapped operation."""
from __future__ import annotations

from typing import Sequence


class ExportError(Exception):
    """What could not be exported: one line per problem, each with its source location."""

    def __init__(self, problems: Sequence[str], headline: str = "cannot export the model"):
        self.problems = list(problems)
        super().__init__(headline + ":\n" + "\n".join("  - " + p for p in self.problems))


class Unsupported(Exception):
    """One operation without a model-file equivalent (collected into an ExportError)."""
