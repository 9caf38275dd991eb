"""Pricing measured shapes with llmsim's CostModel, and fitting its parameters to them.

Every prediction comes from :class:`~llmsim.cost.roofline.CostModel`: a ModelSpec of the
benchmark model of each width (:func:`~llmsim.calibration.design.model_spec`) and a
HardwareProfile holding the measured peaks and candidate efficiencies. The fit
(``scipy.optimize.least_squares``) minimises the squared log ratios
``log(predicted / measured)``, so a 10% miss counts the same on a 50 us step as on
a 2 s one. The KV read penalty is not fitted: it is measured directly (paged over
contiguous attention) and held fixed. What is fitted (see :func:`parameter_names`):
compute, attention and memory efficiency per dtype (a CPU runs bf16 and fp32 through
different kernels: AMX or AVX-512-BF16 tiles against AVX-512 FMAs), the context at
which decode attention reaches half its efficiency (each sequence's attention has a
fixed cost: the batched matmuls and softmax of a few rows, the gather of its blocks),
and the per-step and per-layer overheads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from llmsim.cost.roofline import CostModel
from llmsim.catalog.hardware import HardwareProfile
from llmsim.calibration.design import Shape, model_spec

EFFICIENCIES = ("compute", "attention", "memory_bandwidth")   # fitted per dtype: each dtype has its own kernels
SHARED = ("attention_half_context", "per_step_overhead_s", "per_layer_overhead_s")
EFFICIENCY_FLOOR = 1e-3          # a kernel reaching under 0.1% of the measured peak is a broken benchmark
OVERHEAD_SCALE_S = 1e-6          # overheads are fitted in microseconds, for conditioning
HALF_CONTEXT_SCALE = 100.0       # the half-efficiency context is fitted in hundreds of tokens
STARTING_EFFICIENCIES = (0.1, 0.4, 1.0)
STARTING_HALF_CONTEXTS = (64.0, 512.0, 4096.0)   # tokens
CEILING_TOLERANCE = 1e-6         # an efficiency this close to 1 is at its bound
PRIMARY_DTYPES = ("bf16", "fp16")  # whose efficiencies stand for the device (other dtypes, transfers)


def predict_s(shapes: list[Shape], hardware: HardwareProfile) -> np.ndarray:
    """Decode-step time of every shape, from CostModel.iteration on the batch features."""
    predicted = np.empty(len(shapes))
    groups: dict[tuple, list[int]] = {}
    for index, shape in enumerate(shapes):
        groups.setdefault((shape.hidden, shape.layers, shape.dtype), []).append(index)
    for (hidden, layers, dtype), indices in groups.items():
        cost = CostModel(model_spec(hidden, layers, dtype), hardware)
        features = np.array([cost.features(prefill_new=[], prefill_context=[],
                                           decode_context=[shapes[i].context] * shapes[i].batch)
                             for i in indices])
        predicted[indices] = cost.iteration(features)[0]
    return predicted


def parameter_names(dtypes) -> list[str]:
    """The fitted parameters, in the order of the fit's vector: per-dtype efficiencies, then SHARED."""
    return [f"{kind}/{dtype}" for dtype in dtypes for kind in EFFICIENCIES] + list(SHARED)


def primary_dtype(dtypes) -> str:
    """The dtype whose efficiencies a profile gives as its defaults: bf16 or fp16 where fitted."""
    return next((d for d in PRIMARY_DTYPES if d in dtypes), dtypes[0])


def with_parameters(hardware: HardwareProfile, values: dict) -> HardwareProfile:
    """``hardware`` with fitted ``values`` ({parameter_names: value}) in place."""
    dtypes = list(dict.fromkeys(name.split("/")[1] for name in values if "/" in name))
    by_dtype = {d: {kind: float(values[f"{kind}/{d}"]) for kind in EFFICIENCIES} for d in dtypes}
    primary = by_dtype[primary_dtype(dtypes)]
    shared: dict[str, Any] = {name: float(values[name]) for name in SHARED}
    return replace(hardware, efficiency_by_dtype=by_dtype, compute_efficiency=primary["compute"],
                   attention_efficiency=primary["attention"], memory_efficiency=primary["memory_bandwidth"],
                   **shared)


def uncalibrated(hardware: HardwareProfile) -> HardwareProfile:
    """The bare roofline of the same peaks: every efficiency 1, no overheads, no paging penalty."""
    return replace(hardware, compute_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                   efficiency_by_dtype={}, attention_half_context=0.0,
                   per_step_overhead_s=0.0, per_layer_overhead_s=0.0, kv_read_penalty=1.0)


@dataclass(frozen=True)
class FitResult:
    hardware: HardwareProfile          # the roofline with the fitted parameters and penalty
    values: dict                       # parameter_names -> value
    mape: float                        # in-sample mean absolute percentage error, as a fraction
    worst_error: float                 # largest |predicted / measured - 1|
    starts: int                        # starting points tried
    at_ceiling: tuple[str, ...] = ()   # efficiencies the fit pushed to 1: the measured peak does not bound the step


def fit_parameters(shapes: list[Shape], measured_s, roofline: HardwareProfile, kv_read_penalty: float,
                   initial_overheads_s: tuple[float, float]) -> FitResult:
    """Least squares on log(predicted / measured), from several starting efficiencies.

    Every dtype of ``shapes`` gets its own compute, attention and memory efficiency; the
    context at which decode attention reaches half its efficiency and the per-step and
    per-layer overheads are shared. The roofline's max() makes the objective piecewise
    smooth with several basins (which operators are compute- or memory-bound), so every
    combination of STARTING_EFFICIENCIES (the same for each dtype) is tried with attention
    independent of context, then the best of those from each of STARTING_HALF_CONTEXTS;
    the lowest cost is kept.
    """
    from scipy.optimize import least_squares

    measured_s = np.asarray(measured_s, dtype=float)
    dtypes = list(dict.fromkeys(shape.dtype for shape in shapes))
    names = parameter_names(dtypes)
    n_eff = len(EFFICIENCIES) * len(dtypes)
    base = replace(uncalibrated(roofline), kv_read_penalty=kv_read_penalty)
    scale = np.array([1.0] * n_eff + [HALF_CONTEXT_SCALE, OVERHEAD_SCALE_S, OVERHEAD_SCALE_S])

    def values_of(x):
        return dict(zip(names, (float(v) for v in x * scale)))

    def residuals(x):
        return np.log(predict_s(shapes, with_parameters(base, values_of(x))) / measured_s)

    lower = [EFFICIENCY_FLOOR] * n_eff + [0.0, 0.0, 0.0]
    upper = [1.0] * n_eff + [np.inf, np.inf, np.inf]
    overheads = [v / OVERHEAD_SCALE_S for v in initial_overheads_s]
    best: Any = None          # scipy's OptimizeResult of the lowest cost so far

    def keep_best(start):
        nonlocal best
        result = least_squares(residuals, start, bounds=(lower, upper), x_scale=[0.1] * n_eff + [1.0, 10.0, 10.0])
        if best is None or result.cost < best.cost:
            best = result

    # Efficiencies from every corner, attention independent of context; then the half-context
    # from a few starts around the best of those.
    starts = [(c, a, m) for c in STARTING_EFFICIENCIES for a in STARTING_EFFICIENCIES
              for m in STARTING_EFFICIENCIES]
    for efficiencies in starts:
        keep_best([*efficiencies * len(dtypes), 0.0, *overheads])
    first = best.x.copy()
    for half_context in STARTING_HALF_CONTEXTS:
        keep_best([*first[:n_eff], half_context / HALF_CONTEXT_SCALE, *first[n_eff + 1:]])
    values = values_of(best.x)
    hardware = with_parameters(base, values)
    errors = relative_errors(predict_s(shapes, hardware), measured_s)
    at_ceiling = tuple(name for name in names[:n_eff] if values[name] >= 1.0 - CEILING_TOLERANCE)
    return FitResult(hardware, values, float(np.mean(np.abs(errors))), float(np.max(np.abs(errors))),
                     len(starts) + len(STARTING_HALF_CONTEXTS), at_ceiling)


def relative_errors(predicted_s, measured_s) -> np.ndarray:
    """predicted / measured - 1, per shape."""
    return np.asarray(predicted_s, dtype=float) / np.asarray(measured_s, dtype=float) - 1.0
