"""A progress bar on stderr (tqdm) fed by a search's :class:`~llmsim.config.progress.Progress` calls."""
from __future__ import annotations

from llmsim.config.progress import Progress


class Bar(Progress):
    """A tqdm bar whose total grows with ``add``; use it as a context manager (it closes the bar).

    ``open_ended``: the computation decides as it goes how many steps it takes (a search that
    refines until its answer is decided), so the bar counts steps and shows no total: a total that
    jumps from 12 to 209 would say it was nearly done when it was not."""

    def __init__(self, desc: str, unit: str, *, open_ended: bool = False):
        from tqdm.auto import tqdm
        self._open_ended = open_ended
        self._bar = tqdm(total=None if open_ended else 0, desc=desc, unit=unit)

    def add(self, steps: int) -> None:
        if not self._open_ended:
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
