"""Deployments side by side: one base scenario, several variants, each at several loads.

A comparison file holds ``base`` (scenario keys shared by all), ``variants`` (a name
and the keys it changes: model, hardware, deployment, engine...) and optionally
``loads`` (a name and an arrival rate each). Every variant at every load runs on the
same requests: the trace depends only on the workload and the seed, which the
variants share unless they change them.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd

from llmsim.analysis.metrics import summarize
from llmsim.config.reader import Node, deep_merge, load_yaml
from llmsim.errors import ConfigError
from llmsim.scenario.overrides import REPLACED_WHOLE
from llmsim.scenario.scenario import Scenario, scenario_from_node
from llmsim.sim.resources import check_run_size
from llmsim.sim.simulate import simulate_whole


def load_comparison(path: str | Path) -> list[tuple[str, str, Scenario]]:
    """(variant, load, scenario) for every variant at every load, validated."""
    root = Node(load_yaml(path), file=str(path))
    name = root.string("name", Path(path).stem)
    base = root.raw("base", {})
    if not isinstance(base, dict):
        raise root.key_error("base", "expected a mapping of scenario keys", base)
    variants = root.child("variants")
    if not variants.data:
        raise root.error("no variants to compare", key="variants", has_value=False,
                         allowed="a mapping from variant names to the scenario keys they change")
    loads = root.child("loads", {})
    load_changes = {str(label): _load(loads, label) for label in list(loads.data)} or {"": {}}
    loads.done()
    if loads.data:
        _check_overridden(base, root.child("base"))
    runs = []
    for variant in list(variants.data):
        changes = variants.raw(variant)
        if not isinstance(changes, dict):
            raise variants.key_error(variant, "expected a mapping of scenario keys", changes)
        if loads.data:
            _check_overridden(changes, variants.child(variant))
        for label, load in load_changes.items():
            data = deep_merge(deep_merge(copy.deepcopy(base), changes, REPLACED_WHOLE), load)
            data.setdefault("name", f"{name}: {variant}")
            try:
                scenario = scenario_from_node(Node(data, file=str(path), base_dir=Path(path).parent))
            except ConfigError as error:
                raise ConfigError(f"variant '{variant}': {error.message}", file=error.file, key=error.key,
                                  value=error.value, allowed=error.allowed, has_value=error.has_value) from None
            runs.append((str(variant), label, scenario))
    variants.done()
    root.done()
    return runs


def _load(loads: Node, label: str) -> dict:
    """A load is an arrival rate, or ``{rate: ..., num_requests: ...}``: workload keys to lay over the base."""
    if not isinstance(loads.raw(label), dict):
        return {"workload": {"arrival": {"rate": loads.quantity(label, "rate")}}}
    entry = loads.child(label)
    workload = {"arrival": {"rate": entry.quantity("rate", "rate")}}
    if entry.has("num_requests"):
        workload["num_requests"] = entry.number("num_requests", integer=True, minimum=1, exclusive_minimum=False)
    entry.done()
    return {"workload": workload}


def _check_overridden(data: dict, node: Node) -> None:
    """The keys every load replaces (the arrival rate, the request count) where the base or a variant
    sets them: each load hides them, but a wrong value there is still a mistake in the file."""
    workload = data.get("workload")
    if not isinstance(workload, dict):
        return
    held = node.child("workload")
    if isinstance(workload.get("arrival"), dict) and workload["arrival"].get("rate") is not None:
        held.child("arrival").quantity("rate", "rate")
    held.number("num_requests", None, integer=True, minimum=1, exclusive_minimum=False)


def compare(path: str | Path, force: bool = False) -> pd.DataFrame:
    """Simulate every variant at every load; one row each, the columns a planner compares.
    Every run's size is checked before the first starts (``force``: see :func:`simulate`)."""
    rows = []
    runs = load_comparison(path)
    for variant, load, scenario in runs:
        try:
            check_run_size(scenario, force=force)
        except ConfigError as error:
            raise ConfigError(f"variant '{variant}'{f' at load {load}' if load else ''}: {error.message}",
                              file=str(path), key=error.key, allowed=error.allowed, has_value=False) from None
    for variant, load, scenario in runs:
        summary = summarize(simulate_whole(scenario, force=True)).to_dict()   # Ctrl-C stops the comparison
        gap = summary["latency"]["itl_s"]["mean"]     # over every token in the window, finished or not
        rows.append({
            "variant": variant, "load": load,
            "offered_req_per_s": summary["throughput"]["offered_requests_per_s"],
            "devices": _devices_paid(summary),
            "placement": f"tp{summary['memory']['tensor_parallel']} x pp{summary['memory']['pipeline_parallel']}",
            "tokens_per_s_per_user": 1.0 / gap if gap == gap and gap > 0 else float("nan"),
            "ttft_p50_s": summary["latency"]["ttft_s"]["p50"],
            "tpot_p50_s": summary["latency"]["tpot_s"]["p50"],
            "tpot_p95_s": summary["latency"]["tpot_s"]["p95"],
            "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "output_tokens_per_s_per_device": summary["throughput"]["output_tokens_per_s_per_device"],
            "usd_per_million_tokens": summary["economics"]["usd_per_million_output_tokens"],
            "kwh_per_million_tokens": summary["economics"]["kwh_per_million_output_tokens_at_tdp"],
            "slo_attainment": summary["slo"]["attainment"],
            "unfinished": summary["requests"]["unfinished_queued"] + summary["requests"]["unfinished_running"],
            **_speculation_columns(summary.get("speculation")),
        })
    return pd.DataFrame(rows)


def _devices_paid(summary: dict) -> float:
    """The devices the run's economics divide by: the deployment's, or with autoscaling the mean paid
    for in the window (replicas change during the run)."""
    scaling = summary.get("autoscaling")
    if scaling is None:
        return summary["devices"]
    return scaling["mean_replicas_in_window"] * scaling["devices_per_replica"]


def _speculation_columns(spec: dict | None) -> dict:
    """Mean draft length and acceptance; k 0 and no acceptance for plain decoding."""
    if spec is None:
        return {"mean_k": 0.0, "acceptance_rate": float("nan")}
    fraction = spec["speculating_fraction"]
    # Over all decode steps, plain ones at 0 (no step speculated: 0, not the NaN of 0 / 0 times 0).
    return {"mean_k": spec["mean_k"] * fraction if fraction else fraction,
            "acceptance_rate": spec["acceptance_rate"]}
