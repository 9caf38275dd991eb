"""A progress bar on stderr (tqdm) fed by a search's :class:`~llmsim.config.progress.Progress` calls."""
from __future__ import annotations

from llmsim.config.progress import Progress


class Bar(Progress):
    """A tqdm bar whose total grows with ``add``; use it as a context manager (it closes the bar)."""

    def __init__(self, desc: str, unit: str):
        from tqdm.auto import tqdm
        self._bar = tqdm(total=0, desc=desc, unit=unit)

    def add(self, steps: int) -> None:
        self._bar.total += steps
        self._bar.refresh()

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def note(self, text: str) -> None:
        self._bar.set_postfix_str(text)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
