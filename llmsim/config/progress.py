"""Where a long computation reports how far it has got: a :class:`Progress` passed in by the caller.

Searches, sweeps and the report add the steps they will take (``add``), mark each one done
(``advance``) and say what they are working on (``note``). The base class reports nowhere
(:data:`QUIET`, every function's default); the command line passes one that draws a bar
(:mod:`llmsim.cli.progress`), so nothing below the command line draws or prints.
"""
from __future__ import annotations


class Progress:
    """Receives a computation's progress; this one ignores it."""

    def add(self, steps: int) -> None:
        """``steps`` more steps to do (totals grow as a search finds it needs more)."""

    def advance(self, steps: int = 1) -> None:
        """``steps`` steps done."""

    def note(self, text: str) -> None:
        """What the computation is doing now."""


QUIET = Progress()
