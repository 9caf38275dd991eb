"""Results kept from recent calls, for work a search repeats run after run on the same inputs (a cost model's
memos, a resolved deployment, a cost model, a hardware profile's digest): the most recently asked for are
kept, the oldest dropped beyond a bound."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

_K = TypeVar("_K", bound=Hashable)
_T = TypeVar("_T")
Keyed = OrderedDict[tuple[Hashable, ...], tuple[tuple[object, ...], _T]]     # recent_for's memory


def recent(memory: OrderedDict[_K, _T], key: _K, fresh: Callable[[], _T], kept: int) -> _T:
    """What ``memory`` holds under ``key`` (``fresh()`` the first time); ``memory`` keeps the ``kept`` most
    recently asked for."""
    value = memory.pop(key) if key in memory else fresh()
    memory[key] = value
    while len(memory) > kept:
        memory.popitem(last=False)
    return value


def recent_for(memory: Keyed[_T], objects: tuple[object, ...], values: tuple[Hashable, ...],
               fresh: Callable[[], _T], kept: int) -> _T:
    """:func:`recent` keyed by the identities of ``objects`` and by ``values``: for inputs that are frozen but
    costly to hash or compare (a model, a chip with its kernel tables, a scenario's parts; a variant made with
    ``dataclasses.replace`` shares the parts it did not change). The objects are held with the result, so no
    other object takes one of their ids while it is kept."""
    return recent(memory, (*map(id, objects), *values), lambda: (objects, fresh()), kept)[1]
