"""The public API: every name in ``llmsim.__all__`` is the object its module defines, and importing
the package loads none of the numerical libraries until a name is used."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import llmsim

HEAVY = ("numpy", "pandas", "scipy", "numba", "matplotlib", "simpy")


@pytest.mark.parametrize("name", llmsim.__all__)
def test_each_public_name_is_its_modules_object(name):
    module = importlib.import_module(llmsim._PUBLIC[name])
    assert getattr(llmsim, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        llmsim.no_such_name  # noqa: B018


def test_importing_the_package_loads_no_numerical_library():
    code = ("import sys, llmsim; print(' '.join(sorted(m for m in " + repr(HEAVY) +
            " if m in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.split() == []
    code = "import sys, llmsim; llmsim.load_scenario; print('pandas' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "True"


def test_every_module_of_the_package_imports():
    import pkgutil
    names = [m.name for m in pkgutil.walk_packages(llmsim.__path__, "llmsim.")]
    assert len(names) > 50
    for name in names:
        importlib.import_module(name)
