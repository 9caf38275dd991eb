"""Compiled kernels: cached on disk while fresh, and called through their entry points.

Every kernel is declared with :func:`kernel`, numba's ``njit`` with its on-disk cache. numba keeps a
cached kernel while the file that defines it is unchanged, but a kernel that calls a kernel of another
module has that one compiled into it: an edit there alone would leave the caller's cache stale, and a
simulation would run the old code without a word. So a kernel's cache here is fresh only while every
module in :data:`KERNEL_MODULES` is unchanged, and an edit to any of them compiles them all again.

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

import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

import numba
from numba.core import caching

PACKAGE = Path(__file__).resolve().parent
# The modules that declare kernels (a test checks the list against the package's sources).
KERNEL_MODULES = ("cost/features.py", "cost/roofline.py", "sim/decode.py", "sim/iterations.py", "sim/missed.py",
                  "sim/replica_steps.py", "sim/speculative_kernels.py", "speculation/kernels.py")

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


def kernel(function=None, /, **options):
    """``numba.njit(cache=True, **options)`` for one of llmsim's kernels: ``@kernel`` or ``@kernel(inline=...)``.
    Its cache is kept only while every kernel module is unchanged (:class:`KernelSourcesLocator`)."""
    compile_ = numba.njit(cache=True, **options)
    return compile_ if function is None else compile_(function)


def kernel_sources_stamp(package: Path = PACKAGE) -> tuple[str, ...]:
    """The contents of every kernel module (under ``package``), hashed: what a cached kernel is fresh against."""
    return tuple(_hashed(package / module, *_stat(package / module)) for module in KERNEL_MODULES)


def _stat(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_mtime_ns, status.st_size


@cache
def _hashed(path: Path, mtime_ns: int, size: int) -> str:
    """A file's SHA-256, read again only when its time or size changes (the arguments are the memo's key)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


class KernelSourcesLocator(caching._CacheLocator):
    """numba's cache locator for the package's kernels: the place numba's own locators choose (beside the
    source, a user-wide folder, ``NUMBA_CACHE_DIR``), and a freshness stamp that adds every kernel
    module's contents to the defining file's."""

    def __init__(self, located):
        self._located = located

    def ensure_cache_path(self):
        self._located.ensure_cache_path()

    def get_cache_path(self):
        return self._located.get_cache_path()

    def get_source_stamp(self):
        return self._located.get_source_stamp(), kernel_sources_stamp()

    def get_disambiguator(self):
        return self._located.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not Path(py_file).resolve().is_relative_to(PACKAGE):
            return None
        for other in _LOCATORS:
            located = None if other is cls else other.from_function(py_func, py_file)
            if located is not None:
                return cls(located)
        return None


_LOCATORS: list = caching.CacheImpl._locator_classes      # numba's, tried in order for every cached function
if KernelSourcesLocator not in _LOCATORS:
    _LOCATORS.insert(0, KernelSourcesLocator)
