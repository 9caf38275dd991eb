"""The report's figures, drawn with matplotlib and kept as inline SVG text.

Figures are built on ``matplotlib.figure.Figure`` without pyplot, so making a report never changes
the caller's backend (a notebook keeps drawing inline). Static SVG, not an interactive library: the page
must open without a network and without scripts (nothing to fail in a browser console), SVG stays sharp
at any zoom and prints, its text is real text, and matplotlib is already a dependency. Each figure gets its own
id salt so the ids of several SVGs in one page never collide.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

_STYLE: dict[RcKeyType, Any] = {"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
          "axes.spines.top": False, "axes.spines.right": False}


def to_svg(fig, key: str) -> str:
    """The figure as an ``<svg>`` element (no XML prolog), its ids unique to ``key``."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": key}):
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _figure(rows: int = 1, cols: int = 1, size=(7.5, 3.2), **kwargs):
    with matplotlib.rc_context(_STYLE):
        fig = Figure(figsize=size, layout="constrained")
        axes = fig.subplots(rows, cols, **kwargs)
    return fig, axes


def workload(times_s, rate_per_s, prompt_tokens, output_tokens, key: str) -> str:
    with matplotlib.rc_context(_STYLE):
        fig, (ax_rate, ax_len) = _figure(1, 2, (9, 3))
        ax_rate.plot(times_s, rate_per_s, lw=1)
        ax_rate.set_xlabel("time (s)")
        ax_rate.set_ylabel("arrivals (requests/s)")
        ax_rate.set_title("arrival rate over time")
        bins = np.geomspace(1, max(prompt_tokens.max(), output_tokens.max(), 2) + 1, 40)
        ax_len.hist(prompt_tokens, bins=bins, alpha=0.6, label="prompt")
        ax_len.hist(output_tokens, bins=bins, alpha=0.6, label="output")
        ax_len.set_xscale("log")
        ax_len.set_xlabel("tokens")
        ax_len.set_ylabel("requests")
        ax_len.set_title("length distributions")
        ax_len.legend()
        return to_svg(fig, key)


def candidates(labels, usd_per_hour, feasible, key: str) -> str:
    with matplotlib.rc_context(_STYLE):
        fig, ax = _figure(size=(7.5, 0.5 + 0.45 * len(labels)))
        colours = ["C2" if ok else "0.7" for ok in feasible]
        values = [v if np.isfinite(v) else 0 for v in usd_per_hour]
        ax.barh(labels[::-1], values[::-1], color=colours[::-1])
        for y, value in enumerate(values[::-1]):
            ax.annotate(f"${value:,.2f}/h" if value else "no layout", (value, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel("USD per hour at the target rate (cheapest layout meeting the SLO targets)")
        return to_svg(fig, key)


def load_curve(rates, attainment_by_metric: dict, targets: dict, target_rate, breaking_rate, key: str) -> str:
    with matplotlib.rc_context(_STYLE):
        fig, ax = _figure()
        for i, (metric, shares) in enumerate(attainment_by_metric.items()):
            ax.plot(rates, 100 * np.asarray(shares), "o-", ms=3, color=f"C{i}", label=f"{metric.upper()} within limit")
            ax.axhline(targets[metric], color=f"C{i}", ls=":", lw=0.8)
        ax.axvline(target_rate, color="k", lw=1, label=f"target {target_rate:.3g}/s")
        if np.isfinite(breaking_rate):
            ax.axvline(breaking_rate, color="C3", ls="--", lw=1, label=f"breaking point {breaking_rate:.3g}/s")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("requests within the limit (%)")
        ax.set_ylim(min(50, ax.get_ylim()[0]), 101)
        ax.legend(fontsize=7, loc="lower left")
        return to_svg(fig, key)


def frontier(throughput, latency_s: dict, on_frontier: dict, load_factors, limits_s: dict, key: str) -> str:
    """One panel per latency metric (``latency_s``: metric -> P95 per load point), against output
    tokens/s per device: the points coloured by their load (a legend, not a label beside each point,
    since points at high load crowd together), the frontier joining ``on_frontier[metric]``, and the
    metric's SLO limit (``limits_s``, None for none) as a labelled line."""
    with matplotlib.rc_context(_STYLE):
        fig, axes = _figure(1, len(latency_s), (9, 3.2), squeeze=False)
        throughput = np.asarray(throughput, dtype=float)
        colours = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, len(load_factors)))
        for ax, (metric, values) in zip(axes[0], latency_s.items()):
            latency_ms = 1000 * np.asarray(values, dtype=float)
            front = np.asarray(on_frontier[metric], dtype=bool)
            order = np.argsort(throughput[front])
            ax.plot(throughput[front][order], latency_ms[front][order], "-", color="0.55", lw=1, zorder=1,
                    label="frontier")
            for x, y, factor, colour in zip(throughput, latency_ms, load_factors, colours):
                ax.scatter([x], [y], s=28, color=colour, edgecolor="k", linewidth=0.4, zorder=2,
                           label=f"x{factor:g}")
            finite = latency_ms[np.isfinite(latency_ms) & (latency_ms > 0)]
            log = len(finite) and finite.max() > 30 * finite.min()     # a queue's blow-up would flatten the rest
            if log:
                ax.set_yscale("log")
            if limits_s.get(metric) is not None:
                limit_ms = 1000 * limits_s[metric]
                ax.axhline(limit_ms, color="C3", ls="--", lw=1)
                # labelled at the left, where the light loads sit well below it, with room above it
                ax.annotate(f"SLO limit {limit_ms:.4g} ms", (0, limit_ms), xycoords=("axes fraction", "data"),
                            xytext=(3, 2), textcoords="offset points", ha="left", va="bottom", fontsize=7,
                            color="C3")
                ax.set_ylim(top=max(ax.get_ylim()[1], limit_ms * (1.6 if log else 1.12)))
            ax.set_xlabel("output tokens/s per device")
            ax.set_ylabel(f"P95 {metric.upper()} (ms)")
            ax.set_title(f"P95 {metric.upper()}")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, loc="outside right center", title="load (x target)", title_fontsize=7)
        return to_svg(fig, key)


def disaggregation(kinds, labels, usd_per_hour, latency_s: dict, limits_s: dict, key: str) -> str:
    """Aggregated against disaggregated layouts: one panel per latency metric (``latency_s``: metric -> P95 per
    layout) against the layout's cost per hour, each kind's layouts joined in order of cost and labelled, the
    metric's SLO limit (``limits_s``, None for none) as a dashed line."""
    with matplotlib.rc_context(_STYLE):
        fig, axes = _figure(1, len(latency_s), (9, 3.4), squeeze=False)
        kinds, labels = np.asarray(kinds), np.asarray(labels)
        cost = np.asarray(usd_per_hour, dtype=float)
        for ax, (metric, values) in zip(axes[0], latency_s.items()):
            latency_ms = 1000 * np.asarray(values, dtype=float)
            for kind, (colour, marker) in zip(sorted(set(kinds)), (("C0", "o"), ("C1", "s"))):
                rows = np.flatnonzero(kinds == kind)
                rows = rows[np.argsort(cost[rows], kind="stable")]
                ax.plot(cost[rows], latency_ms[rows], "-", marker=marker, color=colour, lw=1, ms=5, label=kind)
                for row in rows:
                    ax.annotate(labels[row], (cost[row], latency_ms[row]), xytext=(3, 3), textcoords="offset points",
                                fontsize=6, color=colour)
            finite = latency_ms[np.isfinite(latency_ms) & (latency_ms > 0)]
            if len(finite) and finite.max() > 30 * finite.min():
                ax.set_yscale("log")
            if limits_s.get(metric) is not None:
                ax.axhline(1000 * limits_s[metric], color="C3", ls="--", lw=1, label="SLO limit")
            ax.set_xlabel("USD per hour (both pools)")
            ax.set_ylabel(f"P95 {metric.upper()} (ms)")
            ax.set_title(f"P95 {metric.upper()} against cost")
        axes[0][0].legend(fontsize=7)
        return to_svg(fig, key)


def diurnal(hours, rate_per_s, mean_rate, peak_rate, key: str) -> str:
    with matplotlib.rc_context(_STYLE):
        fig, ax = _figure()
        ax.plot(hours, rate_per_s, lw=1.2, label="arrival rate")
        ax.axhline(mean_rate, color="C1", ls=":", label=f"mean {mean_rate:.3g}/s")
        ax.axhline(peak_rate, color="C3", ls="--", label=f"peak {peak_rate:.3g}/s")
        ax.set_xlabel("hour of the day")
        ax.set_ylabel("requests/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="lower right")
        return to_svg(fig, key)


def sensitivity(labels, replicas, base_replicas, key: str) -> str:
    with matplotlib.rc_context(_STYLE):
        fig, ax = _figure(size=(7.5, 0.6 + 0.35 * len(labels)))
        values = np.asarray(replicas, dtype=float)
        colours = ["C3" if v > base_replicas else "C2" if v < base_replicas else "0.6" for v in values]
        ax.barh(labels[::-1], np.nan_to_num(values[::-1]), color=colours[::-1])
        ax.axvline(base_replicas, color="k", lw=1, label=f"recommended: {base_replicas}")
        ax.set_xlabel("replicas needed to meet the SLO targets")
        ax.legend(fontsize=7)
        return to_svg(fig, key)


def monitoring(series, slo_limits: dict, key: str) -> str:
    """Six dashboard panels over simulated time from :func:`llmsim.report.build.monitoring_series`."""
    with matplotlib.rc_context(_STYLE):
        fig, axes = _figure(3, 2, (10, 7.5), sharex=True)
        t = series["time_s"]
        ax = axes[0, 0]
        ax.plot(t, series["arrivals_per_s"], label="arrivals")
        ax.plot(t, series["completions_per_s"], label="completions")
        ax.set_ylabel("QPS")
        ax.legend(fontsize=7)
        ax = axes[0, 1]
        ax.plot(t, series["output_tokens_per_s"], label="output")
        ax.plot(t, series["prefill_tokens_per_s"], label="prefill")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
        for ax, metric in ((axes[1, 0], "ttft"), (axes[1, 1], "tpot")):
            for p, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                ax.plot(t, 1000 * series[f"{metric}_{p}_s"], style, color="C0", label=p.upper())
            if slo_limits.get(metric) is not None:
                ax.axhline(1000 * slo_limits[metric], color="C3", lw=0.8, label="SLO limit")
            ax.set_ylabel(f"{metric.upper()} (ms)")
            ax.legend(fontsize=7)
        ax = axes[2, 0]
        ax.plot(t, series["queue_length"], color="C4")
        ax.set_ylabel("waiting requests")
        ax = axes[2, 1]
        ax.plot(t, 100 * series["kv_used"], label="KV cache used")
        ax.plot(t, 100 * series["busy"], label="busy (utilisation)")
        ax.plot(t, 100 * series["mfu"], label="MFU")
        ax.set_ylabel("%")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=7)
        for ax in axes[2]:
            ax.set_xlabel("simulated time (s)")
        return to_svg(fig, key)
