"""The shipped notebooks execute as saved, in a real Jupyter kernel, and are saved with their outputs.

Each notebook runs top to bottom with nbclient (from the notebooks folder, as a reader would run
it); a cell that raises fails the test. The notebooks state their findings in prose and check the
numbers those findings rest on with ``assert`` in a cell, so a model change that breaks a
conclusion fails here too.
"""
from __future__ import annotations

import pytest

from .helpers import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_the_walkthroughs_are_shipped():
    assert {"capacity-planning", "speculative-or-batching", "gpu-vs-wafer-scale"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_with_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), "run the notebook and save it with its outputs"
    assert all(output.get("output_type") != "error" for cell in code for output in cell.outputs)
    assert any("image/png" in output.get("data", {}) for cell in code for output in cell.outputs), "a plot"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()          # raises CellExecutionError, with the cell and its traceback, on any error
    assert all(output.get("output_type") != "error" for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs)
