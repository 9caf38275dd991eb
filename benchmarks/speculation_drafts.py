"""Best draft and k across loads for Llama-3.1-70B on 4 x H100 (the README's speculation figure).

Candidates: Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B drafts, an EAGLE head and n-gram lookup
(50 us of CPU per speculating sequence per step: an assumption), each with the acceptance the
acceptance model predicts for chat (llmsim/speculation/data/acceptance.yaml), static k in 1..6,
every sequence eligible (min_concurrent_requests 1, min_sequence_tokens 0). Every configuration
runs on the same arrival trace per load. Prints the best k and its mean-TPOT speedup over plain
decoding per candidate and load, and writes benchmarks/speculation_drafts.png.

    .venv/bin/python benchmarks/speculation_drafts.py [--requests 300]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import matplotlib
import pandas as pd

from llmsim import load_scenario, simulate
from llmsim.catalog.models import model_catalog
from llmsim.scenario.overrides import variant
from llmsim.search.draft_choice import Candidate, with_candidate
from llmsim.speculation.config import Eligibility, predicted_acceptance
from llmsim.speculation.proposers import EAGLE, MODEL, NGRAM, Proposer, head_spec
from llmsim.workload.trace import generate_trace

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOADS = (0.5, 4.0, 8.0, 12.0, 16.0)
KS = (1, 2, 3, 4, 6)
NGRAM_CPU_S = 50e-6


def candidates(target) -> list[Candidate]:
    catalog = model_catalog()
    out = []
    for name in ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"):
        estimate = predicted_acceptance(Proposer(MODEL), catalog[name], target)
        out.append(Candidate(name, MODEL, catalog[name], estimate.alpha))
    out.append(Candidate("EAGLE head", EAGLE, head_spec(EAGLE, target), predicted_acceptance(Proposer(EAGLE), None,
                                                                                             target).alpha))
    out.append(Candidate("n-gram (50 us/seq)", NGRAM, None, predicted_acceptance(Proposer(NGRAM), None, target).alpha,
                         cpu_s_per_sequence=NGRAM_CPU_S))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    base = load_scenario(REPO / "scenarios" / "llama3-70b-h100-speculative.yaml")
    rows = []
    started = time.time()
    for load in LOADS:
        scenario = variant(base, {"workload.arrival.rate": load, "workload.num_requests": args.requests})
        trace = generate_trace(scenario.workload, scenario.seed)
        plain = simulate(replace(scenario, speculation=None), trace).summary()["latency"]["tpot_s"]["mean"]
        for candidate in candidates(scenario.model):
            for k in KS:
                spec_scenario = with_candidate(scenario, candidate, k)
                spec_scenario = replace(spec_scenario, speculation=replace(spec_scenario.speculation,
                                                                           eligibility=Eligibility(0, 1)))
                tpot = simulate(spec_scenario, trace).summary()["latency"]["tpot_s"]["mean"]
                rows.append(dict(load=load, candidate=candidate.label, alpha=candidate.alpha, k=k,
                                 tpot_ms=1e3 * tpot, plain_tpot_ms=1e3 * plain, speedup=plain / tpot))
    table = pd.DataFrame(rows)
    best = table.loc[table.groupby(["load", "candidate"])["speedup"].idxmax()]
    print(best.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"({len(table) + len(LOADS)} simulations, {time.time() - started:.0f} s)")
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, group in best.groupby("candidate", sort=False):
        axis.plot(group["load"], group["speedup"], marker="o", label=f"{name} (alpha {group['alpha'].iloc[0]:.2f})")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("arrival rate (requests/s)")
    axis.set_ylabel("mean TPOT speedup over plain (best static k)")
    axis.set_title("Llama-3.1-70B on 4 x H100: which draft pays off, and until when")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(REPO / "benchmarks" / "speculation_drafts.png", dpi=120)


if __name__ == "__main__":
    main()
