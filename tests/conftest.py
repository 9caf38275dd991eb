"""pytest-xdist runs the tests on every core (``-n auto --dist loadgroup`` in pyproject.toml).

A test using a module-scoped fixture (a recommendation, a report, a calibration, a wheel: seconds to
minutes each) joins its module's group, so that one worker runs all of them and computes the fixture
once; every other test goes to whichever worker is free.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        if definitions is None:
            continue
        if any(d.scope == "module" for defs in definitions.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
