"""Each rollout group's scenario, derived from the typed scenario it runs beside.

A group (:class:`~llmsim.scenario.rollout.RolloutGroup`) is the scenario's deployment without the rollout,
with the group's replicas, engine settings and chip set as a search sets a variant's
(:func:`~llmsim.scenario.variants.variant`, the reader's rules and checks). Built from the Scenario each time it
is asked for, a group follows a change made to the scenario with ``dataclasses.replace``. (The scenario reader,
below the variants, checks each group's settings by reading the group as a file,
:func:`~llmsim.scenario.rollout.group_document`: the same Scenario.)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmsim.errors import ConfigError
from llmsim.scenario.rollout import RolloutGroup, group_error
from llmsim.scenario.scenario import Scenario
from llmsim.scenario.variants import HARDWARE_KEY, REPLICAS_KEY, variant


def group_point(group: RolloutGroup) -> dict[str, Any]:
    """The group's settings as a variant's point: its replicas, engine keys and chip."""
    point: dict[str, Any] = {REPLICAS_KEY: group.replicas}
    if group.hardware is not None:
        point[HARDWARE_KEY] = group.hardware
    point.update({f"engine.{key}": value for key, value in (group.engine or {}).items()})
    return point


def group_scenario(scenario: Scenario, group: RolloutGroup) -> Scenario:
    """The scenario of one rollout group, checked as the reader checks a scenario; an error in the group's
    settings names its key under ``rollout.groups.<name>``."""
    base = replace(scenario, rollout=None)
    try:
        built = variant(base, group_point(group))
    except ConfigError as error:
        raise group_error(group, error) from None
    return replace(built, name=f"{scenario.name} [{group.name}]", seed=scenario.seed, path=scenario.path)


def group_scenarios(scenario: Scenario) -> tuple[Scenario, ...]:
    """Each rollout group's scenario, in the order of ``rollout.groups`` (none without a rollout)."""
    rollout = scenario.rollout
    return () if rollout is None else tuple(group_scenario(scenario, group) for group in rollout.groups)
