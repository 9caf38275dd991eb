"""The command line's progress bar: a total it knows up front, or a count without a total for a search
that decides as it goes how much it runs (a total that jumps from 12 to 209 misleads)."""
from __future__ import annotations

from llmsim.cli.progress import Bar


def test_a_bar_with_a_known_total_grows_it_as_work_is_added(capsys):
    with Bar("sweep", "point") as bar:
        bar.add(3)
        bar.add(2)
        bar.advance(5)
        assert (bar._bar.total, bar._bar.n) == (5, 5)
    assert "5/5" in capsys.readouterr().err


def test_an_open_ended_bar_counts_without_a_total(capsys):
    with Bar("recommend", " simulations", open_ended=True) as bar:
        bar.add(12)
        bar.advance(12)
        bar.add(197)
        bar.advance(197)
        assert (bar._bar.total, bar._bar.n) == (None, 209)
    shown = capsys.readouterr().err.split("\r")[-1]
    assert "209 simulations" in shown and "/209" not in shown and "%" not in shown
