"""Property-based tests of the scenario, comparison and grid readers (issue 35, "What to build" 3).

Each reader is called directly, without simulating: arbitrary bytes, arbitrary YAML trees and
mutations of the shipped files (``scenarios/*.yaml``, ``scenarios/comparisons``, ``scenarios/grids``)
must end in a typed result (a :class:`~llmsim.scenario.scenario.Scenario`, a comparison's runs, a
grid's points) or a :class:`~llmsim.errors.ConfigError` that names the file and, unless it is about
the file as a whole, the key and the value, within a time budget and without the process's memory
growing past a bound. The quick set runs a few examples per reader, the slow set 2,000.
"""
from __future__ import annotations

import copy
import resource
import string
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.config.reader import Node, load_yaml
from llmsim.errors import ConfigError
from llmsim.scenario.overrides import build_point, grid_points
from llmsim.scenario.scenario import Scenario, load_scenario, scenario_from_node
from llmsim.search.compare import load_comparison

from tests.fuzz import _dump, _paths, _set, raw_files, scalars, values
from tests.helpers import REPO, bounded

QUICK_EXAMPLES = 25
SLOW_EXAMPLES = 2_000
BUDGET_S = 20.0                    # one example past this is a hang (they take milliseconds)
MAX_GROWTH_BYTES = 1 * 2**30       # peak memory the examples of one reader may add to the process
POINTS_BUILT = 4                   # a grid's first points validated against its scenario

SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
COMPARISONS = sorted((REPO / "scenarios" / "comparisons").glob("*.yaml"))
GRIDS = sorted((REPO / "scenarios" / "grids").glob("*.yaml"))
GRID_BASE = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"      # the scenario the shipped grid sweeps




def check_error(error: ConfigError, file: str) -> None:
    """A refusal is one paragraph that names the file read (or a file it names, a trace say) and, when
    it is about a key rather than the document as a whole, the key path as text."""
    text = str(error)
    assert error.file and error.message, text
    assert error.key is None or (isinstance(error.key, str) and error.key), text
    assert text.startswith(f"Configuration error in {error.file}"), text
    assert "Traceback" not in text and "\n" not in text, text


def outcome(read, file: str):
    """``read()``'s result, or None when it raised a ConfigError that passes :func:`check_error`."""
    try:
        with bounded(BUDGET_S):
            return read()
    except ConfigError as error:
        check_error(error, file)
        return None


# -- what to feed them -------------------------------------------------------------------------------

KEYS = st.one_of(st.sampled_from(sorted({part for path in _paths(yaml.safe_load(SCENARIOS[0].read_text()))
                                         for part in path.split(".")} | {"base", "variants", "loads", "rate"})),
                 st.text(alphabet=string.ascii_letters + "._", min_size=1, max_size=8),
                 st.integers(-3, 3), st.booleans(), st.none())
yaml_trees = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=5)), max_leaves=30)
raw_bytes = st.one_of(st.binary(max_size=200), raw_files)


def mutations(document: dict):
    """``document`` with one to three of its own key paths set to hostile values or trees, dropped, or
    given unknown siblings."""
    paths = sorted(_paths(document))

    @st.composite
    def mutated(draw) -> dict:
        data = copy.deepcopy(document)
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            action = draw(st.sampled_from(["set", "set", "tree", "delete", "unknown"]))
            path = draw(st.sampled_from(paths))
            if action == "unknown":
                path = path.rsplit(".", 1)[0] + "." + draw(st.sampled_from(["bogus", "ratee", "k_mx"])) \
                    if "." in path else "bogus"
            value = draw(yaml_trees if action == "tree" else values)
            try:
                _set(data, path, value, delete=action == "delete")
            except AttributeError:          # a path through a list: leave this mutation out
                continue
        return data
    return mutated()


def shipped(files):
    return st.sampled_from(files).flatmap(lambda path: mutations(yaml.safe_load(path.read_text())).map(
        lambda data: (path, data)))


def _write(folder: Path, content, name: str) -> Path:
    path = folder / name
    path.write_bytes(content if isinstance(content, bytes) else _dump(content).encode())
    return path


# -- the readers -------------------------------------------------------------------------------------

def read_scenario_file(content) -> None:
    with tempfile.TemporaryDirectory(prefix="llmsim-prop-") as folder:
        path = _write(Path(folder), content, "scenario.yaml")
        result = outcome(lambda: load_scenario(path), str(path))
        assert result is None or isinstance(result, Scenario)


def read_shipped_scenario(case) -> None:
    path, data = case
    result = outcome(lambda: scenario_from_node(Node(data, file=str(path))), str(path))
    assert result is None or isinstance(result, Scenario)


def read_comparison_file(content) -> None:
    with tempfile.TemporaryDirectory(prefix="llmsim-prop-") as folder:
        path = _write(Path(folder), content, "comparison.yaml")
        _check_runs(outcome(lambda: load_comparison(path), str(path)))


def read_shipped_comparison(case) -> None:
    _, data = case                      # the shipped comparisons name no files of their own
    read_comparison_file(data)


def _check_runs(runs) -> None:
    if runs is None:
        return
    assert runs and all(isinstance(variant, str) and isinstance(load, str) and isinstance(scenario, Scenario)
                        for variant, load, scenario in runs)


def read_grid(content, source: str) -> None:
    base = load_yaml(GRID_BASE)

    def read():
        points = grid_points(content, source)
        assert points and all(isinstance(point, dict) for point in points)
        return [build_point(base, point, GRID_BASE.parent, str(GRID_BASE), source) for point in points[:POINTS_BUILT]]
    built = outcome(read, source)
    assert built is None or all(isinstance(scenario, Scenario) for scenario in built)


def read_grid_file(content) -> None:
    with tempfile.TemporaryDirectory(prefix="llmsim-prop-") as folder:
        path = _write(Path(folder), content, "grid.yaml")
        parsed = outcome(lambda: [load_yaml(path)], str(path))       # a list: YAML's null is a value too
        if parsed is not None:
            read_grid(parsed[0], str(path))


def read_shipped_grid(case) -> None:
    path, data = case
    read_grid(data, str(path))


# (reader, strategy) for each kind of input.
READERS = {
    "scenario bytes": (read_scenario_file, raw_bytes),
    "scenario trees": (read_scenario_file, yaml_trees),
    "scenario mutations": (read_shipped_scenario, shipped(SCENARIOS)),
    "comparison bytes": (read_comparison_file, raw_bytes),
    "comparison trees": (read_comparison_file, st.fixed_dictionaries(
        {}, optional={"name": scalars, "base": yaml_trees, "variants": yaml_trees, "loads": yaml_trees})),
    "comparison mutations": (read_shipped_comparison, shipped(COMPARISONS)),
    "grid bytes": (read_grid_file, raw_bytes),
    "grid trees": (read_grid_file, yaml_trees),
    "grid mutations": (read_shipped_grid, shipped(GRIDS)),
}


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # kB on Linux


def _check_reader(kind: str, examples: int) -> None:
    reader, strategy = READERS[kind]
    before = _peak_bytes()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        reader(case)

    check()
    assert _peak_bytes() - before < MAX_GROWTH_BYTES


@pytest.mark.parametrize("kind", list(READERS))
def test_a_reader_ends_in_a_result_or_a_named_error(kind):
    _check_reader(kind, QUICK_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(READERS))
def test_a_reader_ends_in_a_result_or_a_named_error_on_2000_inputs(kind):
    _check_reader(kind, SLOW_EXAMPLES)


def test_the_shipped_files_read_as_they_are():
    """The mutations start from valid files: unmutated, each reads to its typed result."""
    for path in SCENARIOS:
        assert isinstance(load_scenario(path), Scenario)
    for path in COMPARISONS:
        _check_runs(load_comparison(path))
    for path in GRIDS:
        read_grid(load_yaml(path), str(path))
        assert grid_points(load_yaml(path), str(path))


def test_the_contract_catches_an_error_without_its_file():
    """The check is not vacuous: an error that names no file, or a key that is not text, fails it."""
    for error in (ConfigError("bad", key="engine.max_num_seqs", value=3), ConfigError("bad", file="x.yaml", key=7)):
        with pytest.raises(AssertionError):
            check_error(error, "x.yaml")
    check_error(ConfigError("not valid YAML", file="x.yaml", has_value=False), "x.yaml")
