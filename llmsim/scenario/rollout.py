"""Canary and shadow rollouts (``rollout:`` in a scenario): replica groups with their own engine
settings behind the one router.

The scenario's own deployment is the *control* group. Each group of ``rollout.groups`` has its
own replicas, engine settings (over the scenario's engine), optionally its own
``hardware`` profile, and a role:

``canary``
    serves a ``fraction`` of the requests in place of the control: its users see its latencies.
``shadow``
    gets a copy of a ``fraction`` of the requests (drawn among all of them) and serves it on its
    own replicas, but its answers go nowhere: its records are kept apart and no user-facing
    figure counts them. The copied requests are still served by the control or a canary, so
    each shadow request has a twin: the comparison is paired.

The router splits by a draw per request from the scenario seed, independent of the replicas'
state (as weighted routing in a service mesh does), so each group's requests are a Poisson
thinning of the arrivals and the groups never wait for one another: each group runs as its own
simulation on its share of the one trace (:mod:`llmsim.search.rollout`). The per-request draws are
common random numbers: the same seed sends the same requests to the canary whatever its settings.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.config.policies import RolloutRole, members_of
from llmsim.config.reader import Node, deep_merge
from llmsim.errors import ConfigError

ROLES = (RolloutRole.CANARY, RolloutRole.SHADOW)     # a group's; the control is the scenario's own deployment
MAX_REPLICATIONS = 1000               # each replication is a whole run of every group: more is a typo
CONTROL = RolloutRole.CONTROL.value    # the name the control group's records carry (the scenario's own deployment)


@dataclass(frozen=True)
class RolloutGroup:
    name: str
    role: RolloutRole
    fraction: float                        # canary: share of requests served; shadow: share copied
    replicas: int = 1
    engine: dict | None = None             # overrides of the scenario's engine: section (YAML keys)
    hardware: str | None = None            # another hardware profile (a canary on a new device type)

    def __post_init__(self) -> None:
        members_of(self, role=RolloutRole)


@dataclass(frozen=True)
class RolloutConfig:
    groups: tuple[RolloutGroup, ...]
    # Independent runs of the whole rollout (seeds seed, seed + 1, ...): 1 compares the groups by batch
    # means within the one run; 2 or more compare them across the runs (:mod:`llmsim.analysis.canary`).
    replications: int = 1

    @property
    def canaries(self) -> tuple[RolloutGroup, ...]:
        return tuple(g for g in self.groups if g.role is RolloutRole.CANARY)

    @property
    def shadows(self) -> tuple[RolloutGroup, ...]:
        return tuple(g for g in self.groups if g.role is RolloutRole.SHADOW)

    def assign(self, seed: int, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Which group serves each of ``n`` requests (0: control, i: the i-th canary) and, per shadow,
        the indices of the requests it copies. One uniform draw per request splits the serving
        groups by cumulative fraction; each shadow draws its own copy set."""
        streams = [np.random.default_rng(s) for s in np.random.SeedSequence([seed, 12]).spawn(1 + len(self.shadows))]
        draw = streams[0].random(n)
        edges = np.cumsum([g.fraction for g in self.canaries])
        serving = np.where(draw < edges[-1], np.searchsorted(edges, draw, side="right") + 1, 0) if len(edges) \
            else np.zeros(n, dtype=np.int64)
        copies = {g.name: np.flatnonzero(stream.random(n) < g.fraction)
                  for g, stream in zip(self.shadows, streams[1:])}
        return serving.astype(np.int64), copies


def rollout_from_node(node: Node) -> RolloutConfig:
    """``rollout: {groups: {<name>: {role, fraction, replicas, engine: {...}}}, replications: R}``; the
    canaries' fractions must leave the control some traffic. Whether each group's engine settings are
    valid is checked by the scenario reader, which reads each group as a file (:func:`group_document`)."""
    holder, names = node.named_entries(
        "groups", "group names to their settings",
        "e.g. {canary: {role: canary, fraction: 0.05, engine: {max_batch_tokens: 4096}}}")
    groups = []
    for name in names:
        if not isinstance(name, str) or name == CONTROL:
            raise holder.key_error(str(name), "a group needs a name of its own", name,
                                   f"a string other than '{CONTROL}' (the scenario's own deployment)")
        each = holder.child(name)
        engine = each.raw("engine", None)
        if engine is not None and not isinstance(engine, dict):
            raise each.key_error("engine", "expected a mapping of engine settings", engine,
                                 "e.g. {max_batch_tokens: 4096}")
        groups.append(RolloutGroup(
            name=name, role=RolloutRole(each.choice("role", tuple(role.value for role in ROLES))),
            fraction=each.number("fraction", minimum=0.0, maximum=1.0, exclusive_minimum=True),
            replicas=each.number("replicas", 1, integer=True, minimum=1), engine=engine,
            hardware=each.string("hardware", None)))
        each.done()
    replications = node.number("replications", 1, integer=True, minimum=1, maximum=MAX_REPLICATIONS)
    node.done()
    config = RolloutConfig(tuple(groups), replications)
    served = sum(g.fraction for g in config.canaries)
    if served >= 1.0:
        raise holder.error("the canaries' fractions leave the control no requests", key=holder.path,
                           value={g.name: g.fraction for g in config.canaries}, allowed="fractions summing to under 1")
    return config


def group_document(document: dict, group: RolloutGroup) -> dict:
    """The scenario document of one group's deployment, for the reader's check of the group: the scenario's
    ``document`` with the group's replicas, engine settings and chip, and no rollout of its own. A run builds
    the group from the typed scenario instead (:mod:`llmsim.scenario.rollout_groups`), to the same Scenario."""
    data = {key: value for key, value in document.items() if key != "rollout"}
    if group.hardware is not None:
        data["hardware"] = group.hardware
    return deep_merge(data, {"deployment": {"replicas": group.replicas}, "engine": group.engine or {}})


def group_error(group: RolloutGroup, error: ConfigError) -> ConfigError:
    """``error`` in one group's settings, its key named under ``rollout.groups.<name>``."""
    prefix = f"rollout.groups.{group.name}"
    key = error.key or ""
    if key.startswith("engine"):
        key = f"{prefix}.{key}"
    elif key in ("deployment.replicas", "hardware"):
        key = f"{prefix}.{key.split('.')[-1]}"
    else:
        key = f"{prefix} (with {key})" if key else prefix
    return ConfigError(f"rollout group '{group.name}': {error.message}", file=error.file, key=key,
                       value=error.value, allowed=error.allowed, has_value=error.has_value)
