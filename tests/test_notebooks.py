"""The shipped notebooks execute as saved, in a real Jupyter kernel, and are saved with their outputs.

Each notebook runs top to bottom with nbclient (from the notebooks folder, as a reader would run
it); a cell that raises fails the test. The notebooks state their findings in prose and check the
numbers those findings rest on with ``assert`` in a cell, so a model change that breaks a
conclusion fails here too.
"""
from __future__ import annotations

import re

import pytest

import llmsim

from tests.helpers import REPO

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_uses_the_public_api_only_and_saves_no_warnings(path):
    """A reader copies what a notebook does: only ``import llmsim`` and its public names, no internal module,
    and no saved stderr (a warning that prints the path of the machine the notebook was run on)."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    internal = [line for cell in code for line in cell.source.splitlines()
                if re.match(r"\s*(from llmsim\.|import llmsim\.)", line)]
    assert internal == []
    used = {name for cell in code for name in re.findall(r"\bllmsim\.(\w+)", cell.source)}
    assert used and used <= set(llmsim.__all__), used - set(llmsim.__all__)
    assert [output for cell in code for output in cell.outputs if output.get("name") == "stderr"] == []


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()          # raises CellExecutionError, with the cell and its traceback, on any error
    assert all(output.get("output_type") != "error" for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs)
