"""Policies are read once into enum members at the edge (:mod:`llmsim.config.policies`): the simulator,
the cost model and the analysis compare members or look up the object that implements one, never the
name the user wrote. A comparison against a policy's name, or a table keyed by names, outside the
config readers is what this scan refuses."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmsim
from llmsim.config.policies import Choice

PACKAGE = Path(llmsim.__file__).parent
CHECKED = ("sim", "cost", "analysis", "speculation")


def _policy_names() -> set[str]:
    kinds, found = list(Choice.__subclasses__()), set()
    while kinds:
        kind = kinds.pop()
        kinds += kind.__subclasses__()
        found |= set(kind.names())
    return found


def _constants(node: ast.AST) -> list[ast.Constant]:
    if isinstance(node, ast.Constant):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e for e in node.elts if isinstance(e, ast.Constant)]
    return []


def policy_name_uses(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that compare against a policy name or key a table by one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            sides = [key for key in node.keys if key is not None]
        else:
            continue
        if any(c.value in names for side in sides for c in _constants(side) if isinstance(c.value, str)):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_name_compared_or_keyed():
    names = {"round_robin", "edf"}
    source = ('if policy == "round_robin":\n    pass\nkeys = {"edf": 1}\nok = status == "finished"\n'
              'also = mode in ("edf", "x")\n')
    assert policy_name_uses(source, names) == [1, 3, 5]


@pytest.mark.parametrize("layer", CHECKED)
def test_no_policy_name_is_compared_past_the_readers(layer):
    names = _policy_names()
    assert {"least_outstanding", "guaranteed_no_evict", "weighted_fair", "pid", "dedicated"} <= names
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for path in sorted((PACKAGE / layer).rglob("*.py"))
             for line in policy_name_uses(path.read_text(), names)]
    assert not found, "policy names compared as strings (compare enum members instead):\n" + "\n".join(found)


def test_a_functions_argument_becomes_a_member_once_or_a_config_error_naming_it():
    from llmsim.config.policies import Objective
    from llmsim.errors import ConfigError

    assert Objective.of("cost", "objective") is Objective.COST
    assert Objective.of(Objective.GOODPUT, "objective") is Objective.GOODPUT
    for bad in ("latency", 3, None, "GOODPUT"):
        with pytest.raises(ConfigError) as error:
            Objective.of(bad, "objective")
        assert error.value.key == "objective" and "goodput, cost" in str(error.value)
