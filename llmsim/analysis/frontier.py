"""Latency/throughput frontiers across a sweep and their knee.

A point is *dominated* when another point has latency no higher and throughput no lower,
one of them strictly. The Pareto frontier is every point that is not dominated: sorted by
latency, its throughput rises strictly, so it is the best throughput on offer at each
latency (or the best latency at each throughput). Of several identical points the frontier
keeps the first.

The *knee* is the frontier point furthest above the chord joining the frontier's two ends,
with both axes scaled to [0, 1] over the frontier (so the units do not matter). Scaled that
way the ends are (0, 0) and (1, 1) and the knee maximises ``throughput - latency``: past it,
each further gain in throughput costs more in latency than it gained before. On a frontier
of one or two points the knee is the lowest-latency point.
"""
from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

import numpy as np
import pandas as pd

from llmsim.analysis.names import OUTPUT_TOKENS_PER_S_PER_DEVICE, TPOT_P95

LATENCY = TPOT_P95
THROUGHPUT = OUTPUT_TOKENS_PER_S_PER_DEVICE


def pareto_frontier(df: pd.DataFrame, latency: str = LATENCY, throughput: str = THROUGHPUT) -> pd.DataFrame:
    """The rows of ``df`` that no other row dominates (minimise ``latency``, maximise ``throughput``).

    Rows with a missing value in either column (failed points, runs where nothing finished)
    take no part. The result is sorted by latency, with throughput strictly rising, and has
    a boolean ``knee`` column marking the knee (see the module docstring).
    """
    for column in (latency, throughput):
        if column not in df.columns:
            raise KeyError(f"no column {column!r} to draw a frontier from")
    usable = df[df[latency].notna() & df[throughput].notna()]
    # Latency ascending, then throughput descending: the first of a run of equal latencies is
    # its best, and a point joins the frontier when it beats the best throughput seen so far.
    ordered = usable.sort_values([latency, throughput], ascending=[True, False], kind="stable")
    values = ordered[throughput].to_numpy(dtype=float)
    best_before = np.concatenate(([-np.inf], np.maximum.accumulate(values)[:-1]))[:len(values)]
    frontier = ordered[values > best_before].copy()
    frontier["knee"] = False
    if len(frontier):
        frontier.iloc[knee_position(frontier[latency], frontier[throughput]),
                      frontier.columns.get_loc("knee")] = True
    return frontier


def knee_position(latency: Sequence[float], throughput: Sequence[float]) -> int:
    """Index of the knee of a frontier given sorted by latency (the module docstring's rule)."""
    x, y = np.asarray(latency, dtype=float), np.asarray(throughput, dtype=float)
    if len(x) < 3:
        return 0
    scaled_x = (x - x[0]) / (x[-1] - x[0])
    scaled_y = (y - y[0]) / (y[-1] - y[0])
    return int(np.argmax(scaled_y - scaled_x))


def plot_frontier(df: pd.DataFrame, path: str | Path, latency: str = LATENCY, throughput: str = THROUGHPUT,
                  color_by: str | None = None, eligible: pd.Series | None = None) -> Path:
    """Every point, the frontier through them and its knee, as a PNG; ``color_by`` colours points by a column
    (a colour scale for numbers, one colour per value otherwise). ``eligible`` (a boolean per row, e.g. the
    SLO met): only those rows may join the frontier; the others are drawn as grey crosses."""
    from llmsim.analysis.plots import plt

    eligible = pd.Series(True, index=df.index) if eligible is None else eligible.reindex(df.index, fill_value=False)
    frontier = pareto_frontier(df[eligible], latency, throughput)
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    excluded = df[~eligible & df[latency].notna() & df[throughput].notna()]
    if len(excluded):
        ax.scatter(excluded[latency], excluded[throughput], marker="x", color="0.6", s=26, zorder=2,
                   label="misses the SLO (not on the frontier)")
    df = df[eligible]
    usable = df[df[latency].notna() & df[throughput].notna()]
    if color_by is not None and pd.api.types.is_numeric_dtype(usable[color_by]):
        dots = ax.scatter(usable[latency], usable[throughput], c=usable[color_by], cmap="viridis", s=22, zorder=2)
        fig.colorbar(dots, ax=ax, label=color_by)
    elif color_by is not None:
        for value, rows in usable.groupby(usable[color_by].astype(str), sort=False, dropna=False):   # null too
            ax.scatter(rows[latency], rows[throughput], s=22, zorder=2, label=f"{color_by} = {value}")
    else:
        ax.scatter(usable[latency], usable[throughput], color="0.6", s=22, zorder=2, label="all points")
    ax.step(frontier[latency], frontier[throughput], where="post", color="C3", lw=1.2, zorder=3,
            label="Pareto frontier")
    ax.scatter(frontier[latency], frontier[throughput], color="C3", s=30, zorder=4)
    knee = frontier[frontier["knee"]]
    ax.scatter(knee[latency], knee[throughput], marker="*", s=260, color="C1", edgecolor="k", zorder=5, label="knee")
    ax.set_xlabel(f"{latency} (lower is better)")
    ax.set_ylabel(f"{throughput} (higher is better)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
