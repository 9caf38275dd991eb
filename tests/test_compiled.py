"""Entry points (llmsim.compiled): a kernel's specialization, compiled on first read, called without the
dispatcher, and giving what the dispatcher gives."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

from llmsim.compiled import KERNEL_MODULES, PACKAGE, EntryPoint, KernelSourcesLocator, kernel_sources_stamp


@numba.njit
def _weighted_sum(values, weight):
    total = 0.0
    for value in values:
        total += value * weight
    return total


_SIGNATURE = (numba.float64[::1], numba.float64)


class _Holder:
    weighted_sum = EntryPoint(_weighted_sum, _SIGNATURE)

    def total(self, values):
        return self.weighted_sum(values, 0.5)


def test_an_entry_point_is_compiled_on_first_read_and_then_a_plain_class_attribute():
    assert isinstance(vars(_Holder)["weighted_sum"], EntryPoint)          # importing compiled nothing
    values = np.arange(5.0)
    assert _Holder().total(values) == _weighted_sum(values, 0.5) == 5.0  # through an instance: not bound
    compiled = vars(_Holder)["weighted_sum"]
    assert not isinstance(compiled, EntryPoint) and _Holder.weighted_sum is compiled
    assert _Holder().weighted_sum is compiled                            # read again: the same function


def test_a_subclass_reading_it_first_compiles_it_for_the_class_that_declared_it():
    class Declaring:
        entry = EntryPoint(_weighted_sum, _SIGNATURE)

    class Child(Declaring):
        pass

    assert Child().entry(np.ones(3), 2.0) == 6.0
    assert "entry" not in vars(Child) and not isinstance(vars(Declaring)["entry"], EntryPoint)


def _declares_kernels(path) -> bool:
    return any(line.lstrip().startswith("@kernel") for line in path.read_text().splitlines())


def test_the_kernel_modules_are_every_module_that_declares_a_kernel():
    """The freshness stamp covers exactly the modules whose kernels may be compiled into one another."""
    declaring = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if _declares_kernels(path)}
    assert declaring == set(KERNEL_MODULES)
    compiled_otherwise = [path.name for path in PACKAGE.rglob("*.py") if path.name != "compiled.py"
                          and any(word in path.read_text() for word in ("numba.njit", "numba.jit", "@njit", "@jit"))]
    assert not compiled_otherwise      # every kernel through llmsim.compiled.kernel


def test_every_kernel_is_cached_through_the_kernel_sources_locator():
    """numba's on-disk cache of each kernel is fresh only against every kernel module, not its own file alone."""
    kernels = 0
    for module in KERNEL_MODULES:
        namespace = importlib.import_module("llmsim." + module.removesuffix(".py").replace("/", "."))
        for value in vars(namespace).values():
            if isinstance(value, Dispatcher) and value.__module__ == namespace.__name__:
                kernels += 1
                assert isinstance(value._cache._impl.locator, KernelSourcesLocator), value
                assert value._cache._impl.locator.get_source_stamp()[1] == kernel_sources_stamp()
    assert kernels >= len(KERNEL_MODULES)


def test_the_stamp_follows_every_kernel_module_by_its_contents(tmp_path):
    """An edit to any one kernel module changes every kernel's stamp; a file rewritten with the same
    contents (a checkout) does not."""
    for module in KERNEL_MODULES:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PACKAGE / module, tmp_path / module)
    before = kernel_sources_stamp(tmp_path)
    assert before == kernel_sources_stamp()
    for module in KERNEL_MODULES:
        path = tmp_path / module
        text = path.read_text()
        path.write_text(text + "# edited\n")
        edited = kernel_sources_stamp(tmp_path)
        assert edited != before and sum(a != b for a, b in zip(edited, before)) == 1
        path.write_text(text)
        assert kernel_sources_stamp(tmp_path) == before


def test_an_edit_to_a_called_kernel_reaches_its_cached_caller(tmp_path):
    """End to end, in a copy of the package: a cached kernel that calls another module's kernel gives the
    callee's new result after an edit to the callee's module alone (numba's own check, the caller's file,
    would load the stale caller and give the old one)."""
    copy = tmp_path / "llmsim"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    callee, caller = copy / "speculation/kernels.py", copy / "sim/speculative_kernels.py"
    callee.write_text(callee.read_text() + "\n\n@kernel\ndef probe_value():\n    return 1\n")
    caller.write_text(caller.read_text() + "\n\nfrom llmsim.speculation.kernels import probe_value  # noqa: E402\n\n\n"
                      "@kernel\ndef probe_caller():\n    return probe_value() * 10\n")
    program = ("import llmsim.sim.speculative_kernels as kernels; "
               "print(kernels.probe_caller(), sum(kernels.probe_caller.stats.cache_hits.values()))")

    def run() -> list[str]:
        environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
        environment.pop("NUMBA_CACHE_DIR", None)
        done = subprocess.run([sys.executable, "-c", program], env=environment, cwd=tmp_path, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert run() == ["10", "0"]                 # compiled, and cached beside the copy's sources
    assert run() == ["10", "1"]                 # loaded from the cache
    callee.write_text(callee.read_text().replace("    return 1\n", "    return 2\n"))
    assert run() == ["20", "0"]                 # the caller compiled again
