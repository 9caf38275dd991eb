"""Results kept from recent calls (llmsim.config.recent): the most recently asked for are kept, and a result
keyed by objects belongs to those very objects, never to an equal copy or to a later object at a reused address."""
from __future__ import annotations

import gc
from collections import OrderedDict

from llmsim.config.recent import recent, recent_for


def test_the_most_recently_asked_for_are_kept():
    memory: OrderedDict[str, int] = OrderedDict()
    made = []

    def fresh(key):
        return lambda: made.append(key) or len(made)

    assert [recent(memory, k, fresh(k), kept=2) for k in "aba"] == [1, 2, 1]      # a asked again: kept
    recent(memory, "c", fresh("c"), kept=2)                                       # b, the oldest, dropped
    assert list(memory) == ["a", "c"]
    assert recent(memory, "b", fresh("b"), kept=2) == 4 and made == ["a", "b", "c", "b"]


class Part:
    """A frozen input compared by identity (as a model or a chip is)."""


def test_a_result_keyed_by_objects_is_theirs_alone():
    memory: OrderedDict = OrderedDict()
    calls = []

    def result(part, value):
        return recent_for(memory, (part,), (value,), lambda: calls.append((part, value)) or object(), kept=8)

    first, other = Part(), Part()
    assert result(first, 1) is result(first, 1)
    assert result(first, 2) is not result(first, 1) and result(other, 1) is not result(first, 1)
    assert len(calls) == 3
    # the object is held with its result: while kept, no new object can take its address
    ids = {id(first)}
    del first
    gc.collect()
    assert all(id(Part()) not in ids for _ in range(1000))
    assert len(memory) == 3
