"""The per-token acceptance rate a draft can expect, from the draft/target pair and the workload.

Fitted to the published measurements in ``data/acceptance.yaml`` (each cited there). The
model is linear in the logit of alpha:

    logit(alpha) = b0 + b_ratio * log10(draft params / target params)   (separate draft models)
                 + b_kind                                              (EAGLE heads, MTP modules)
                 + b_workload                                          (code, math, summarisation,
                                                                        translation; chat is 0)
                 + distilled + different family + draft dtype          (fixed assumed offsets)

A bigger draft agrees more with its target (b_ratio > 0), which is what makes the 20-30% rule
a trade-off rather than "always the smallest". The first two lines are fitted by weighted
least squares, each point weighted by its spread (in logit units, spread / (alpha (1 - alpha)));
the offsets with no measurement behind them (distillation, family, quantisation; Medusa and
n-gram acceptance) are the table's ``assumptions``, said to be such. The estimate's uncertainty
is the fit's parameter covariance at the query plus the points' typical spread (a new
measurement scatters as much as the ones in the table).

Every point's measure is converted to alpha under i.i.d. acceptance (Leviathan Eq. 1): a mean
acceptance length tau at chain depth k solves (1 - alpha^(k+1)) / (1 - alpha) = tau; a draft
acceptance rate r (accepted / drafted) at k solves sum_{j=1..k} alpha^j = r k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np
import yaml

from llmsim.speculation.proposers import EAGLE, MEDUSA, MODEL, MTP, NGRAM

WORKLOADS = ("chat", "code", "math", "summarisation", "translation")
COLUMNS = ("intercept", "log10_ratio", "kind_eagle", "kind_mtp") + tuple(f"workload_{w}" for w in WORKLOADS[1:])


def _logit(p):
    return math.log(p / (1 - p))


def _logistic(x):
    return 1 / (1 + math.exp(-x))


def alpha_from(measure: str, value: float, k: int | None = None) -> float:
    """A published acceptance figure as a per-token alpha (see the module docstring). scipy.optimize is
    imported where a figure needs solving, not with this module (about 0.3 CPU s a process)."""
    from scipy.optimize import brentq

    if measure == "alpha":
        return value
    if k is None:
        raise ValueError(f"the measure {measure!r} needs the number of drafted tokens k")
    if measure == "acceptance_length":
        return brentq(lambda a: sum(a ** j for j in range(k + 1)) - value, 1e-9, 1 - 1e-12)
    if measure == "draft_acceptance_rate":
        return brentq(lambda a: sum(a ** j for j in range(1, k + 1)) - value * k, 1e-9, 1 - 1e-12)
    raise ValueError(f"unknown acceptance measure {measure!r}")


@dataclass(frozen=True)
class Point:
    """One published measurement, as alpha."""
    id: str
    kind: str
    workload: str
    log10_ratio: float          # 0 for heads (they have no size of their own to compare)
    alpha: float
    spread: float               # in alpha
    source: str

    @property
    def logit_spread(self) -> float:
        return self.spread / (self.alpha * (1 - self.alpha))


@lru_cache(maxsize=1)
def reference_table() -> dict:
    """The shipped table of points and assumptions (``data/acceptance.yaml``)."""
    text = resources.files("llmsim.speculation").joinpath("data/acceptance.yaml").read_text()
    return yaml.safe_load(text)


def points() -> list[Point]:
    out = []
    for row in reference_table()["points"]:
        ratio = math.log10(row["draft_params_b"] / row["target_params_b"]) if row["kind"] == MODEL else 0.0
        out.append(Point(row["id"], row["kind"], row["workload"], ratio,
                         alpha_from(row["measure"], row["value"], row.get("k")), row["spread"], row["source"]))
    return out


def _row(kind: str, workload: str, log10_ratio: float) -> np.ndarray:
    x = np.zeros(len(COLUMNS))
    x[0] = 1.0
    x[1] = log10_ratio if kind == MODEL else 0.0
    x[2], x[3] = kind == EAGLE, kind == MTP
    if workload != WORKLOADS[0]:
        x[COLUMNS.index(f"workload_{workload}")] = 1.0
    return x


@dataclass(frozen=True)
class Estimate:
    """A predicted acceptance rate and its uncertainty (``low``..``high``: one standard deviation
    on the logit scale, mapped back)."""
    alpha: float
    low: float
    high: float
    basis: str                  # "fit" (the fitted terms), or "assumption"

    @property
    def spread(self) -> float:
        return (self.high - self.low) / 2


@dataclass(frozen=True)
class AcceptanceModel:
    coef: np.ndarray
    cov: np.ndarray
    typical_logit_spread: float
    fitted: tuple[str, ...]     # ids of the points fitted

    def predict(self, kind: str, workload: str = "chat", draft_params: float | None = None,
                target_params: float | None = None, distilled: bool = False, same_family: bool = True,
                draft_dtype: str = "bf16") -> Estimate:
        """alpha for a draft of ``kind`` (a ``model`` needs both parameter counts) on ``workload``."""
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
        assumed = reference_table()["assumptions"]
        if kind in (MEDUSA, NGRAM):
            alpha = assumed[kind]["alpha"][workload]
            sd = self.typical_logit_spread * 2                      # an assumption: twice a measurement's spread
            centre = _logit(alpha)
            return Estimate(alpha, _logistic(centre - sd), _logistic(centre + sd), "assumption")
        ratio = 0.0
        if kind == MODEL:
            if draft_params is None or target_params is None:
                raise ValueError("a draft model's acceptance needs both parameter counts")
            ratio = math.log10(draft_params / target_params)
        x = _row(kind, workload, ratio)
        centre = float(x @ self.coef)
        if kind == MODEL:
            centre += assumed["distilled"]["logit"] * distilled
            centre += assumed["different_family"]["logit"] * (not same_family)
            centre += assumed["draft_dtype"][draft_dtype]["logit"]
        sd = math.sqrt(float(x @ self.cov @ x) + self.typical_logit_spread ** 2)
        return Estimate(_logistic(centre), _logistic(centre - sd), _logistic(centre + sd), "fit")


def fit(leave_out: tuple[str, ...] = ()) -> AcceptanceModel:
    """Weighted least squares of logit(alpha) on the design (see the module docstring) over the
    table's points but ``leave_out``."""
    used = [p for p in points() if p.id not in leave_out]
    X = np.array([_row(p.kind, p.workload, p.log10_ratio) for p in used])
    y = np.array([_logit(p.alpha) for p in used])
    w = np.array([1 / p.logit_spread ** 2 for p in used])
    informative = X.any(axis=0)                 # a column no point has (a left-out kind) stays 0
    Xi = X[:, informative]
    precision = Xi.T @ (w[:, None] * Xi)
    coef_i = np.linalg.solve(precision, Xi.T @ (w * y))
    coef = np.zeros(len(COLUMNS))
    coef[informative] = coef_i
    cov = np.zeros((len(COLUMNS), len(COLUMNS)))
    cov[np.ix_(informative, informative)] = np.linalg.inv(precision)
    typical = float(np.sqrt(np.mean([p.logit_spread ** 2 for p in used])))
    return AcceptanceModel(coef, cov, typical, tuple(p.id for p in used))


@lru_cache(maxsize=1)
def default_model() -> AcceptanceModel:
    return fit()
