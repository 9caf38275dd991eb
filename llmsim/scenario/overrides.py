"""Scenarios with overrides: a YAML mapping, dotted key paths laid over it, validated again.

A *point* maps dotted key paths of the scenario YAML (``workload.arrival.rate``,
``speculation.k``, ``engine.max_batch_tokens``, ``hardware``...) to values. Its overrides
are laid over the scenario's own YAML mapping and the result is validated exactly as a
file would be, so a bad value is a :class:`~llmsim.errors.ConfigError` before anything
runs. Sweep grids (YAML at the edge) and comparisons build their variants this way; a loaded
Scenario's variants are set on its typed settings where they can be (:mod:`llmsim.scenario.variants`).
"""
from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from llmsim.config.limits import MAX_GRID_POINTS
from llmsim.config.reader import Node, deep_merge
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario, scenario_from_node

# Keys whose mapping is replaced whole, never merged: a new length distribution replaces the old one.
REPLACED_WHOLE = ("prompt_tokens", "output_tokens")


def grid_points(grid: Any, source: str | None = None) -> list[dict]:
    """Every combination of a grid's values, in the grid's key order (the last key varies fastest)."""
    node = Node(grid, file=source)
    if not node.data:
        raise node.error("the grid is empty", has_value=False,
                         allowed="a mapping from dotted scenario keys to lists of values")
    values = []
    for key, options in node.data.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise node.error("expected a dotted scenario key path", key=str(key), value=key,
                             allowed="e.g. workload.arrival.rate, speculation.k, engine.max_batch_tokens")
        if not isinstance(options, list) or not options:
            raise node.key_error(key, "expected a non-empty list of values to sweep", options, "a YAML list")
        values.append(options)
    keys = list(node.data)
    if math.prod(map(len, values)) > MAX_GRID_POINTS:
        longest = max(keys, key=lambda key: len(node.data[key]))
        raise node.error(f"the grid has {math.prod(map(len, values)):,} points (every combination of its lists)",
                         key=str(longest), value=f"{len(node.data[longest]):,} values",
                         allowed=f"at most {MAX_GRID_POINTS:,} points: shorter lists")
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def apply_overrides(base: dict, point: Mapping[str, Any], source: str | None = None) -> dict:
    """A copy of a scenario mapping with each dotted key path set to its value.

    A mapping value is merged into the mapping it replaces, as ``llmsim compare`` merges
    variants (length distributions are replaced whole); ``None`` removes the key, so its
    default applies (``speculation: None`` is plain decoding); anything else replaces the value.
    """
    data = copy.deepcopy(base)
    for path, value in point.items():
        parent, parts = data, path.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = parent.get(part)
            if child is None:
                child = parent[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"'{'.'.join(parts[:depth + 1])}' is a value, not a mapping of keys, so it has "
                                  f"no key '{parts[depth + 1]}'", file=source, key=path, value=value)
            parent = child
        leaf = parts[-1]
        old = parent.get(leaf)
        if value is None:
            parent.pop(leaf, None)
        elif isinstance(value, dict) and isinstance(old, dict) and leaf not in REPLACED_WHOLE:
            parent[leaf] = deep_merge(old, value, REPLACED_WHOLE)
        else:
            parent[leaf] = copy.deepcopy(value)
    return data


def build_point(base: dict, point: Mapping[str, Any], base_dir: Path, file: str | None,
                source: str | None = None) -> Scenario:
    """A scenario mapping with a point's overrides (:func:`apply_overrides`), validated again like
    a file: errors name ``file``, or ``source`` for a key path the overrides cannot set."""
    return scenario_from_node(Node(apply_overrides(base, point, source), file=file, base_dir=base_dir))
