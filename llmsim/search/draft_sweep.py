"""Which draft, at which k, pays off at which load: one deployment swept over loads.

:func:`load_sweep` gives every candidate (:class:`~llmsim.search.draft_choice.Candidate`, for
instance from :func:`named_candidates`) at every static k and arrival rate its mean TPOT and
its speedup over plain decoding on the same requests, by simulation (one run per load,
candidate and k, all of a load on one arrival trace: common random numbers) or by the fluid
model (every load at once, in milliseconds; its error against the simulator is bounded in
tests/analysis/test_analytic.py). :func:`best_k` keeps each candidate's best k per load. The speculation
guide's figure (``benchmarks/speculation_drafts.py``, simulated) and the speculation
notebook (fluid, with a simulated spot check) are both built from these.
"""
from __future__ import annotations

from dataclasses import replace
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from llmsim.analysis.fluid import FluidModel
from llmsim.analysis.metrics import summarize
from llmsim.catalog.models import ModelSpec, model_catalog
from llmsim.config.policies import EstimateMethod
from llmsim.scenario.variants import at_rate
from llmsim.scenario.scenario import Scenario
from llmsim.search.draft_choice import Candidate, predicted_candidate, with_candidate
from llmsim.sim.simulate import simulate_whole
from llmsim.speculation.config import Eligibility
from llmsim.speculation.proposers import EAGLE, MODEL, NGRAM, head_spec
from llmsim.workload.generate import generate_trace

EVERYONE = Eligibility(min_sequence_tokens=0, min_concurrent_requests=1)


def named_candidates(target: ModelSpec, models: Sequence[str], ngram_cpu_s_per_sequence: float,
                     workload: str = "chat") -> list[Candidate]:
    """Catalog drafts by name, an EAGLE head and n-gram lookup costing ``ngram_cpu_s_per_sequence``
    of CPU per speculating sequence and step, each at the acceptance the acceptance model predicts."""
    catalog = model_catalog()
    out = [predicted_candidate(name, MODEL, catalog[name], target, workload) for name in models]
    out.append(predicted_candidate("EAGLE head", EAGLE, head_spec(EAGLE, target), target, workload))
    lookup = predicted_candidate(f"n-gram ({ngram_cpu_s_per_sequence * 1e6:g} us/seq)", NGRAM, None, target, workload)
    return out + [replace(lookup, cpu_s_per_sequence=ngram_cpu_s_per_sequence)]


def load_sweep(scenario: Scenario, options: Sequence[Candidate], loads: Sequence[float],
               ks: Sequence[int] | Mapping[str, Sequence[int]], method: str | EstimateMethod = EstimateMethod.FLUID,
               eligibility: Eligibility = EVERYONE) -> pd.DataFrame:
    """Mean TPOT of every candidate at every static k and load (requests/s), and of plain decoding.

    ``ks``: the draft lengths tried, for all candidates or by candidate label. Rows: load,
    candidate, kind, alpha, k, tpot_ms, plain_tpot_ms, speedup (plain over the candidate; NaN
    where the fluid model finds either past its capacity). ``eligibility`` applies to every
    candidate (default: every sequence may speculate, as the fluid model assumes).
    """
    method = EstimateMethod.of(method, "method")
    load_values = np.asarray(loads, dtype=float)
    settings = [(candidate, k) for candidate in options
                for k in (ks[candidate.label] if isinstance(ks, Mapping) else ks)]
    if method is EstimateMethod.FLUID:
        trace = generate_trace(scenario.workload, scenario.seed)        # lengths only: the rate is the model's
        plain = FluidModel(scenario.plain_decoding(), trace).evaluate(load_values)["tpot_mean_s"].to_numpy()
        tpots = [FluidModel(_speculating(scenario, candidate, k, eligibility), trace).evaluate(load_values)[
            "tpot_mean_s"].to_numpy() for candidate, k in settings]
    else:
        plain, per_load = [], []
        for load in load_values:
            at_load = at_rate(scenario, float(load))
            trace = generate_trace(at_load.workload, at_load.seed)
            plain.append(_mean_tpot(at_load.plain_decoding(), trace))
            per_load.append([_mean_tpot(_speculating(at_load, candidate, k, eligibility), trace)
                             for candidate, k in settings])
        plain, tpots = np.array(plain), list(np.array(per_load).T)
    rows = []
    for (candidate, k), tpot in zip(settings, tpots):
        with np.errstate(invalid="ignore"):
            speedup = np.where(np.isfinite(tpot) & np.isfinite(plain), plain / tpot, np.nan)
        rows.append(pd.DataFrame({"load": load_values, "candidate": candidate.label, "kind": candidate.kind,
                                  "alpha": candidate.alpha, "k": k, "tpot_ms": 1e3 * tpot,
                                  "plain_tpot_ms": 1e3 * plain, "speedup": speedup}))
    return pd.concat(rows, ignore_index=True)


def best_k(sweep: pd.DataFrame) -> pd.DataFrame:
    """Each candidate's row with the highest speedup at each load (loads where none is defined dropped)."""
    defined = sweep.dropna(subset=["speedup"])
    return defined.loc[defined.groupby(["load", "candidate"], sort=False)["speedup"].idxmax()].reset_index(drop=True)


def _speculating(scenario: Scenario, candidate: Candidate, k: int, eligibility: Eligibility) -> Scenario:
    built = with_candidate(scenario, candidate, k)
    assert built.speculation is not None
    return replace(built, speculation=replace(built.speculation, eligibility=eligibility))


def _mean_tpot(scenario: Scenario, trace) -> float:
    return summarize(simulate_whole(scenario, trace)).to_dict()["latency"]["tpot_s"]["mean"]
