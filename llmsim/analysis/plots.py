"""Pictures of a run, for when a timeline says more than a table."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")          # files, not windows: works on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from llmsim.analysis.rolling import rolling_worst_ratio, time_over_slo  # noqa: E402
from llmsim.config.policies import ControllerKnob  # noqa: E402


def timeline_panels(result) -> list[str]:
    """The panels :func:`timeline` draws for ``result``, top to bottom: the four every run has, then the
    draft length when it speculated, the controlled knob with a controller, the replicas with autoscaling."""
    panels = ["queue", "batch", "kv_cache", "latency"]
    if result.iterations["spec_seqs"].any():
        panels.append("draft_length")
    if result.control is not None:
        panels.append("controlled_knob")
    if result.provisioned is not None:
        panels.append("replicas")
    return panels


def timeline(result, path: str | Path) -> Path:
    """Queue, batch, KV cache and latencies over simulated time, one panel each, as a PNG; and the
    draft length, the controlled knob and the replica count where the run has them (:func:`timeline_panels`)."""
    it, records, queue = result.iterations, result.requests, result.queue_length
    scenario = result.scenario
    panels = timeline_panels(result)
    extra = len(panels) - 4
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 10 + 2 * extra), sharex=True, constrained_layout=True)
    start, stop = result.warmup_s, result.arrival_window_s
    for ax in axes:
        ax.axvspan(0, start, color="0.92", lw=0)
        ax.grid(alpha=0.3)
    changes = queue.sort_values("time_s", kind="stable")
    axes[0].step(changes["time_s"], _summed_steps(changes), where="post", lw=0.8)
    axes[0].set_ylabel("waiting requests")
    for replica, rows in it.groupby("replica"):
        axes[1].plot(rows["end_s"], rows["decode_seqs"] + rows["prefill_seqs"], lw=0.6, label=f"replica {replica}")
        axes[2].plot(rows["end_s"], 100 * rows["kv_used_blocks"] / result.kv_blocks_per_replica, lw=0.6)
    axes[1].set_ylabel("sequences in batch")
    if it["replica"].nunique() > 1:
        axes[1].legend(loc="upper right", fontsize=7)
    axes[2].set_ylabel("KV cache used (%)")
    axes[2].set_ylim(0, 100)
    done = records[records["status"] == "finished"]
    axes[3].scatter(done["arrival_s"], 1e3 * done["ttft_s"], s=2, alpha=0.5, label="TTFT")
    axes[3].scatter(done["arrival_s"], 1e3 * done["tpot_s"], s=2, alpha=0.5, label="TPOT")
    for value, label in ((scenario.slo.ttft_s, "TTFT SLO"), (scenario.slo.tpot_s, "TPOT SLO")):
        if value is not None:
            axes[3].axhline(1e3 * value, ls="--", lw=0.8, color="k")
            axes[3].annotate(label, (0, 1e3 * value), fontsize=7, va="bottom")
    axes[3].set_yscale("log")
    axes[3].set_ylabel("latency (ms), by arrival")
    axes[3].legend(loc="upper right", fontsize=7, markerscale=4)
    if "draft_length" in panels:
        _draft_length(axes[panels.index("draft_length")], it)
    if "controlled_knob" in panels:
        _controlled_knob(axes[panels.index("controlled_knob")], result)
    if "replicas" in panels:
        _replicas(axes[panels.index("replicas")], result)
    axes[-1].set_xlabel("simulated time (s); grey: warm-up, excluded from the summary")
    scaling = scenario.autoscaling
    where = (f"{scaling.min_replicas}-{scaling.max_replicas} replicas of {scenario.devices_per_replica} x"
             if scaling is not None else f"{scenario.deployment.replicas * scenario.devices_per_replica} x")
    axes[0].set_title(f"{scenario.name}: {scenario.model.name} on {where} "
                      f"{scenario.hardware.name} ({scenario.engine.batching} batching)")
    axes[0].set_xlim(0, max(result.end_s, stop))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _controlled_knob(ax, result) -> None:
    """The controller's knob after each decision, from the scenario's setting at time 0."""
    control = result.control
    knob = control["knob"].iloc[0] if len(control) else result.scenario.controller.knob
    start = (result.scenario.speculation.policy.k if knob == ControllerKnob.SPECULATION_K
             else getattr(result.scenario.engine, knob))
    ax.step(np.concatenate(([0.0], control["time_s"], [result.end_s])),
            np.concatenate(([start], control["value"], control["value"].iloc[-1:] if len(control) else [start])),
            where="post", lw=1, label=knob)
    changed = control[control["changed"].astype(bool)]
    ax.scatter(changed["time_s"], changed["value"], s=8, color="C3", zorder=3, label="changed")
    ax.set_ylabel(f"controller: {knob}")
    ax.legend(loc="upper right", fontsize=7)


def _replicas(ax, result) -> None:
    """Replicas paid for (starting and draining included) and serving, over the run."""
    paid = result.provisioned
    ax.step(np.append(paid["time_s"], result.end_s), np.append(paid["replicas"], paid["replicas"].iloc[-1]),
            where="post", lw=1, label="paid for")
    log = result.scaling
    if log is not None and len(log):
        ax.step(log["time_s"], log["serving"], where="post", lw=1, ls="--", label="serving (at each check)")
    ax.set_ylabel("replicas")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=7)


def _summed_steps(queue):
    """Total waiting over several queues, at every change of any of them."""
    current: dict[int, int] = {}
    totals = []
    for q, length in zip(queue["queue"], queue["length"]):
        current[q] = length
        totals.append(sum(current.values()))
    return np.array(totals)


def _draft_length(ax, it, steps: int = 50) -> None:
    """Mean k and acceptance over time, each point pooling ``steps`` consecutive iterations."""
    spec = it[it["spec_seqs"] > 0].sort_values("end_s", kind="stable")
    group = np.arange(len(spec)) // steps
    pooled = spec.groupby(group).agg(end_s=("end_s", "last"), proposed=("draft_tokens", "sum"),
                                     accepted=("accepted_tokens", "sum"), seqs=("spec_seqs", "sum"))
    ax.plot(pooled["end_s"], pooled["proposed"] / pooled["seqs"], lw=0.8, label="mean k")
    ax.set_ylabel("draft length k")
    ax.set_ylim(bottom=0)
    rate = ax.twinx()
    rate.plot(pooled["end_s"], 100 * pooled["accepted"] / pooled["proposed"], lw=0.8, color="C1",
              label="acceptance (%)")
    rate.set_ylabel("acceptance (%)")
    rate.set_ylim(0, 100)
    ax.legend(handles=ax.get_lines() + rate.get_lines(), loc="upper right", fontsize=7)


def controller_timeline(runs: dict, path: str | Path, window_s: float, step_s: float) -> Path:
    """Runs of one trace side by side (label -> SimulationResult), as a PNG: arrivals per second,
    the rolling worst latency-to-SLO ratio (:mod:`llmsim.analysis.rolling`) and the controlled knob."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True, constrained_layout=True)
    first = next(iter(runs.values()))
    arrivals = first.requests["arrival_s"].to_numpy()
    stop = float(first.arrival_window_s)
    edges = np.arange(0.0, stop + step_s, step_s)
    axes[0].step(edges[:-1], np.histogram(arrivals, bins=edges)[0] / step_s, where="post", lw=0.8, color="0.3")
    axes[0].set_ylabel("arrivals per second")
    controlled = [r.control for r in runs.values() if r.control is not None]
    knob = controlled[0]["knob"].iloc[0] if controlled else ControllerKnob.MAX_BATCH_TOKENS
    for i, (label, result) in enumerate(runs.items()):
        scenario, color = result.scenario, f"C{i}"
        rolling = rolling_worst_ratio(result.requests, scenario.slo, scenario.workload.class_names, window_s, step_s,
                                      0.0, stop)
        over = time_over_slo(rolling, step_s)
        axes[1].plot(rolling["time_s"], rolling["worst_ratio"], lw=1, color=color,
                     label=f"{label} ({over:.0f} s over the SLO)")
        start = getattr(scenario.engine, knob)
        if result.control is None:
            axes[2].axhline(start, lw=1, ls="--", color=color, label=label)
        else:
            axes[2].step(np.concatenate(([0.0], result.control["time_s"])),
                         np.concatenate(([start], result.control["value"])), where="post", lw=1, color=color,
                         label=label)
    axes[1].axhline(1.0, color="k", lw=0.8, ls=":")
    axes[1].set_ylabel(f"worst P/limit, {window_s:g} s window")
    axes[1].legend(fontsize=8)
    axes[2].set_ylabel(knob)
    axes[2].set_yscale("log", base=2)
    axes[2].legend(fontsize=8)
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
