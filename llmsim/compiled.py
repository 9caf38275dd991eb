"""Compiled kernels called through their entry points.

A numba dispatcher matches its arguments' types to a compiled specialization on every call; on the engine's
small per-step kernels that matching costs more than the kernel itself. A class that calls such a kernel on
its hot path holds the specialization instead, as an :class:`EntryPoint`: compiled (or loaded from numba's
on-disk cache) the first time a simulation reads it, never when the module is imported, and kept on the
class, not the instance, since a compiled function does not pickle and objects that hold one go to sweep
workers.

An entry point does not check its arguments: a caller passes exactly the types its signature declares (an
int64 array where it says int64, a float where it says float64), or the kernel misreads them silently.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry", bound=Callable[..., Any])


class EntryPoint(Generic[Entry]):
    """A class attribute that is ``kernel`` compiled for ``signature``.

    The first read compiles it and puts the compiled function on the owning class in the descriptor's place,
    so every later read is a plain class attribute lookup. The compiled function is a builtin, so reading it
    through an instance gives the function itself, not a bound method.
    """

    def __init__(self, kernel, signature: tuple):
        self.kernel, self.signature = kernel, signature

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, instance: object, owner: type | None = None) -> Entry:
        compiled = self.kernel.compile(self.signature)
        setattr(self.owner, self.name, compiled)
        return compiled
