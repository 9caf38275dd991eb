"""One measurement session: the roofline, decode steps and KV layouts, interleaved.

All jobs of a session go into one :func:`~llmsim.calibration.bench.time_interleaved`
run, so the achieved peaks, the decode steps and the layout study see the same
machine. Needs torch (through ``bench``).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from llmsim.calibration import bench
from llmsim.calibration.design import Design, Shape
from llmsim.config.progress import QUIET, Progress


@dataclass
class Session:
    """What one session measured: medians in seconds, with their relative interquartile ranges."""
    roofline: dict                                     # see bench.roofline_figures
    steps: dict[Shape, tuple[float, float]]            # shape -> (median_s, relative IQR)
    layouts: list[dict] = field(default_factory=list)  # one row per (dtype, batch, context)

    @property
    def kv_read_penalty(self) -> float:
        """Paged (engine block size) over contiguous attention time, median over the study, >= 1."""
        ratios = [row["paged_over_contiguous"] for row in self.layouts]
        return max(1.0, statistics.median(ratios)) if ratios else 1.0

    @property
    def median_relative_iqr(self) -> float:
        """The typical noise of one decode-step figure on this machine."""
        return statistics.median(spread for _, spread in self.steps.values())


def measure(design: Design, device: bench.Device, dtypes, shapes: list[Shape], layouts: bool, seed: int = 0,
            progress: Progress = QUIET) -> Session:
    """Time ``shapes`` (and, when ``layouts``, the KV layout study) together with the roofline."""
    jobs, roofline_work = bench.roofline_jobs(design, device, dtypes)
    jobs.update(_step_jobs(shapes, device, seed))
    layout_keys = []
    if layouts:
        for dtype in dtypes:
            for batch, context in design.layout_shapes:
                for name, job in bench.layout_jobs(design.layout_hidden, dtype, batch, context, device, seed).items():
                    jobs[("layout", dtype, batch, context, name)] = job
                layout_keys.append((dtype, batch, context))
    samples = bench.time_interleaved(jobs, device, design.rounds, design.warmup, seed, progress)
    stats = {key: bench.median_and_spread(values) for key, values in samples.items()}
    medians = {key: value[0] for key, value in stats.items()}
    return Session(roofline=bench.roofline_figures({k: medians[k] for k in roofline_work}, roofline_work),
                   steps={shape: stats[("step", shape)] for shape in shapes},
                   layouts=[_layout_row(design.layout_hidden, key, medians) for key in layout_keys])


def _step_jobs(shapes: list[Shape], device: bench.Device, seed: int) -> dict:
    """One DecodeModel per (width, dtype), as deep and with as many KV blocks as its shapes need."""
    by_model: dict[tuple, list[Shape]] = {}
    for shape in shapes:
        by_model.setdefault((shape.hidden, shape.dtype), []).append(shape)
    jobs = {}
    for (hidden, dtype), group in by_model.items():
        model = bench.DecodeModel(hidden, max(s.layers for s in group), dtype, device,
                                  num_blocks=max(bench.blocks_needed(s) for s in group))
        for index, shape in enumerate(group):
            jobs[("step", shape)] = model.step_job(shape, seed + index)
    return jobs


def _layout_row(hidden: int, key: tuple, medians: dict) -> dict:
    dtype, batch, context = key
    times = {name: medians[("layout", dtype, batch, context, name)] for name in bench.LAYOUTS}
    paged = times[f"paged {bench.STEP_BLOCK_SIZE}"]
    return {"hidden": hidden, "dtype": dtype, "batch": batch, "context": context,
            "median_s": {name: float(f"{t:.4g}") for name, t in times.items()},
            "paged_over_contiguous": float(f"{paged / times[bench.LAYOUTS[0]]:.4g}")}
