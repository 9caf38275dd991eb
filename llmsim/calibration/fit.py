"""Pricing measured shapes with llmsim's CostModel, and fitting its parameters to them.

Every prediction comes from :class:`~llmsim.costmodel.CostModel`: a ModelSpec of the
benchmark model of each width (:func:`~llmsim.calibration.plan.model_spec`) and a
HardwareProfile holding the measured peaks and candidate efficiencies. The fit
(``scipy.optimize.least_squares``) minimises the squared log ratios
``log(predicted / measured)``, so a 10% miss counts the same on a 50 us step as on
a 2 s one. The KV read penalty is not fitted: it is measured directly (paged over
contiguous attention) and held fixed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..costmodel import CostModel
from ..hardware import HardwareProfile
from .plan import Shape, model_spec

FITTED = ("compute_efficiency", "attention_efficiency", "memory_efficiency",
          "per_step_overhead_s", "per_layer_overhead_s")
EFFICIENCY_FLOOR = 1e-3          # a kernel reaching under 0.1% of the measured peak is a broken benchmark
OVERHEAD_SCALE_S = 1e-6          # overheads are fitted in microseconds, for conditioning
STARTING_EFFICIENCIES = (0.1, 0.4, 1.0)
CEILING_TOLERANCE = 1e-6         # an efficiency this close to 1 is at its bound


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


def with_parameters(hardware: HardwareProfile, values) -> HardwareProfile:
    """``hardware`` with the fitted parameters (in FITTED order) replaced."""
    return replace(hardware, **dict(zip(FITTED, (float(v) for v in values))))


def uncalibrated(hardware: HardwareProfile) -> HardwareProfile:
    """The bare roofline of the same peaks: every efficiency 1, no overheads, no paging penalty."""
    return replace(hardware, compute_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                   per_step_overhead_s=0.0, per_layer_overhead_s=0.0, kv_read_penalty=1.0)


@dataclass(frozen=True)
class FitResult:
    hardware: HardwareProfile          # the roofline with the fitted parameters and penalty
    values: dict                       # FITTED name -> value
    mape: float                        # in-sample mean absolute percentage error, as a fraction
    worst_error: float                 # largest |predicted / measured - 1|
    starts: int                        # starting points tried
    at_ceiling: tuple[str, ...] = ()   # efficiencies the fit pushed to 1: the measured peak does not bound the step


def fit_parameters(shapes: list[Shape], measured_s, roofline: HardwareProfile, kv_read_penalty: float,
                   initial_overheads_s: tuple[float, float]) -> FitResult:
    """Least squares on log(predicted / measured), from several starting efficiencies.

    The roofline's max() makes the objective piecewise smooth with several basins
    (which operators are compute- or memory-bound), so every combination of
    STARTING_EFFICIENCIES is tried and the lowest cost kept.
    """
    from scipy.optimize import least_squares

    measured_s = np.asarray(measured_s, dtype=float)
    base = replace(uncalibrated(roofline), kv_read_penalty=kv_read_penalty)
    scale = np.array([1.0, 1.0, 1.0, OVERHEAD_SCALE_S, OVERHEAD_SCALE_S])

    def residuals(x):
        return np.log(predict_s(shapes, with_parameters(base, x * scale)) / measured_s)

    lower = [EFFICIENCY_FLOOR] * 3 + [0.0, 0.0]
    upper = [1.0, 1.0, 1.0, np.inf, np.inf]
    overheads = [value / OVERHEAD_SCALE_S for value in initial_overheads_s]
    best = None
    starts = [(c, a, m) for c in STARTING_EFFICIENCIES for a in STARTING_EFFICIENCIES
              for m in STARTING_EFFICIENCIES]
    for efficiencies in starts:
        result = least_squares(residuals, [*efficiencies, *overheads], bounds=(lower, upper),
                               x_scale=[0.1, 0.1, 0.1, 10.0, 10.0])
        if best is None or result.cost < best.cost:
            best = result
    hardware = with_parameters(base, best.x * scale)
    errors = relative_errors(predict_s(shapes, hardware), measured_s)
    values = dict(zip(FITTED, (float(v) for v in best.x * scale)))
    at_ceiling = tuple(name for name in FITTED[:3] if values[name] >= 1.0 - CEILING_TOLERANCE)
    return FitResult(hardware, values, float(np.mean(np.abs(errors))), float(np.max(np.abs(errors))), len(starts),
                     at_ceiling)


def relative_errors(predicted_s, measured_s) -> np.ndarray:
    """predicted / measured - 1, per shape."""
    return np.asarray(predicted_s, dtype=float) / np.asarray(measured_s, dtype=float) - 1.0
