"""Best draft and k across loads for Llama-3.1-70B on 4 x H100 (the speculation guide's figure,
docs/guides/speculation.md).

Candidates: Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B drafts, an EAGLE head and n-gram lookup
(50 us of CPU per speculating sequence per step: an assumption), each with the acceptance the
acceptance model predicts for chat (llmsim/speculation/data/acceptance.yaml), static k in 1..6,
every sequence eligible (min_concurrent_requests 1, min_sequence_tokens 0). Every configuration
runs on the same arrival trace per load. Prints the best k and its mean-TPOT speedup over plain
decoding per candidate and load, and writes docs/images/speculation_drafts.png. The sweep is
:func:`llmsim.search.draft_sweep.load_sweep` (the speculation notebook runs it on the fluid model).

    .venv/bin/python benchmarks/speculation_drafts.py [--requests 300]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

from llmsim import load_scenario
from llmsim.scenario.variants import variant
from llmsim.search.draft_sweep import best_k, load_sweep, named_candidates

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOADS = (0.5, 4.0, 8.0, 12.0, 16.0)
KS = (1, 2, 3, 4, 6)
NGRAM_CPU_S = 50e-6
DRAFTS = ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    base = load_scenario(REPO / "scenarios" / "llama3-70b-h100-speculative.yaml")
    scenario = variant(base, {"workload.num_requests": args.requests})
    started = time.time()
    table = load_sweep(scenario, named_candidates(scenario.model, DRAFTS, NGRAM_CPU_S), LOADS, KS,
                       method="simulate")
    best = best_k(table)
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
    figure.savefig(REPO / "docs" / "images" / "speculation_drafts.png", dpi=120)


if __name__ == "__main__":
    main()
