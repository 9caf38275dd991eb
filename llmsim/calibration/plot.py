"""The predicted-vs-measured scatter plot of ``llmsim validate``."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def scatter(report: dict, path: str | Path) -> Path:
    """Log-log scatter of predicted against measured step time, calibrated and bare roofline, with y = x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured_ms = report["measured_s"] * 1e3
    fig, ax = plt.subplots(figsize=(6, 6))
    for key, label, marker in (("calibrated_s", "calibrated profile", "o"),
                               ("roofline_s", "uncalibrated roofline", "x")):
        predicted_ms = report[key] * 1e3
        mape = np.mean(np.abs(predicted_ms / measured_ms - 1))
        ax.scatter(measured_ms, predicted_ms, marker=marker, label=f"{label} (MAPE {mape:.1%})", alpha=0.8)
    values = np.concatenate([measured_ms, report["calibrated_s"] * 1e3, report["roofline_s"] * 1e3])
    span = (values.min() / 1.5, values.max() * 1.5)
    ax.plot(span, span, color="black", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(span)
    ax.set_ylim(span)
    ax.set_xlabel("measured decode step (ms)")
    ax.set_ylabel("predicted decode step (ms)")
    ax.set_title(f"{report['profile']}: {len(report['shapes'])} held-out steps on {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def measured_scatter(layers, reduce, path: str | Path, title: str) -> Path:
    """Log-log scatter of predicted against measured operator times (``llmsim validate --measurements``):
    per-layer rows by regime, and all-reduces, with y = x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    series = []
    if layers is not None:
        whole = layers[layers["group"] == "layer"]
        series += [(f"layer, {regime}", part["measured_s"], part["predicted_s"])
                   for regime, part in whole.groupby("regime")]
    if reduce is not None:
        series.append(("all-reduce", reduce["time_s"], reduce["predicted_s"]))
    for label, measured, predicted in series:
        mape = float(np.mean(np.abs(predicted / measured - 1)))
        ax.scatter(measured * 1e6, predicted * 1e6, s=6, alpha=0.5, label=f"{label} (MAPE {mape:.1%})")
    values = np.concatenate([np.concatenate([m, p]) for _, m, p in series]) * 1e6
    span = [values.min() / 1.5, values.max() * 1.5]
    ax.plot(span, span, color="black", linewidth=1, label="y = x")
    ax.set(xscale="log", yscale="log", xlim=span, ylim=span, xlabel="measured (us)", ylabel="predicted (us)",
           title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
