"""The shipped notebooks run as they are (their code cells, in order, from the notebooks folder)."""
from __future__ import annotations

import json

import matplotlib
import pytest

from .helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_code_runs(path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    assert all(len(v) > 0 for v in namespace.values() if hasattr(v, "columns"))   # every DataFrame has rows
