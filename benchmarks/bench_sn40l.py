"""SambaNova's published per-user speeds beside llmsim on ONE SN40L parameter set (hardware_profiles/sn40l.yaml),
like for like: the decoding SambaNova's documentation names for each model, on one 16-socket SambaRack.

Published speeds (output tokens/s per user, artificialanalysis.ai measurements of SambaNova's endpoints):
  - Llama 3.1 8B / 70B / 405B at 16 bits: 1,042 / 457 / 129 (SambaNova blog 'Why SambaNova's SN40L Chip is
    The Best for Inference', Gottscho and Prabhakar, 10 Sep 2024, Table 1);
  - DeepSeek-R1 (DeepSeek-V3's architecture) 198 on 16 RDUs (DAC 2025 talk abstract, R. Prabhakar) and later
    "over 250" (SambaNova blog 'Inference speed or throughput with RDUs, you don't have to choose').
Decoding: SambaNova's model table (docs.sambanova.ai, 'SambaStack models') lists 'Optimizations: Speculative
decoding' for Meta-Llama-3.1-405B-Instruct and Meta-Llama-3.3-70B-Instruct (the 3.1 70B's architecture) and
'None' for Meta-Llama-3.1-8B-Instruct; nothing for DeepSeek, which runs plain here. The draft model, its k
and its acceptance are not published: llmsim picks the draft (Llama-3.2-1B, Llama-3.2-3B or Llama-3.1-8B, on
the same 16 sockets) and the static k (1-8) with the lowest simulated TPOT, each at the acceptance its
acceptance model predicts for chat (llmsim/speculation/data/acceptance.yaml), and shows the speed at the
prediction's one-sd range too. These are assumptions, not SambaNova's settings.
Each run: one request at a time (0.02 requests/s, 1,000-token prompts, 256 output tokens, an assumption of
the benchmark's prompts), per-user speed = 1 / mean TPOT. "batch for published" is the number of sequences
decoding together at which the plain per-user speed falls to the published one (the endpoints are shared
and their batch is not published; SambaNova's bundles offer batch 1-8 for DeepSeek and up to 32 for the 70B).
Nothing here is fitted to these figures.

    .venv/bin/python benchmarks/bench_sn40l.py          (a few CPU seconds)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from llmsim.analysis.metrics import summarize
from llmsim.catalog.models import model_catalog
from llmsim.config.reader import Node
from llmsim.cost.roofline import CostModel
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import Scenario, scenario_from_node
from llmsim.search.draft_choice import Candidate, predicted_candidate, with_candidate
from llmsim.search.draft_sweep import EVERYONE
from llmsim.sim.simulate import simulate_whole
from llmsim.speculation.proposers import MODEL
from llmsim.workload.generate import generate_trace

REPO = Path(__file__).resolve().parent.parent
SOCKETS = 16                 # a SambaRack SN40L-16
DRAFTS = ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B")
KS = range(1, 9)
BLOG_2024 = "SambaNova blog 10 Sep 2024, Table 1"


@dataclass(frozen=True)
class Published:
    model: str
    tokens_per_s: float
    source: str
    speculative: bool          # what SambaNova's model table lists for it


PUBLISHED = (
    Published("Llama-3.1-8B", 1042.0, BLOG_2024, False),
    Published("Llama-3.1-70B", 457.0, BLOG_2024, True),
    Published("Llama-3.1-405B", 129.0, BLOG_2024, True),
    Published("DeepSeek-V3", 198.0, "DAC 2025 talk (R1 launch)", False),
    Published("DeepSeek-V3", 250.0, "SambaNova blog (later, 'over 250')", False),
)


def scenario(model: str) -> Scenario:
    data = {"name": f"sn40l-{model}", "seed": 7, "model": model, "hardware": "SN40L",
            "deployment": {"tensor_parallel": SOCKETS},
            "engine": {"runtime_reserve": "0 GB", "max_model_len": 8192},
            "workload": {"arrival": {"process": "poisson", "rate": 0.02}, "num_requests": 12,
                         "prompt_tokens": 1000, "output_tokens": 256}}
    return scenario_from_node(Node(data, file="<bench_sn40l>", base_dir=REPO / "scenarios"))


def per_user_tokens_per_s(run: Scenario, trace) -> float:
    return 1.0 / summarize(simulate_whole(run, trace)).to_dict()["latency"]["tpot_s"]["mean"]


def speculating(base: Scenario, candidate: Candidate, k: int) -> Scenario:
    """``base`` speculating with ``candidate`` at static ``k``, every sequence eligible (one user at a time)."""
    built = with_candidate(base, candidate, k)
    assert built.speculation is not None
    return replace(built, speculation=replace(built.speculation, eligibility=EVERYONE))


def best_speculation(base: Scenario, trace) -> tuple[Candidate, int, float]:
    """The draft and static k with the highest simulated per-user speed, at the predicted acceptance."""
    catalog = model_catalog()
    best: tuple[Candidate, int, float] | None = None
    for name in DRAFTS:
        candidate = predicted_candidate(name, MODEL, catalog[name], base.model)
        for k in KS:
            speed = per_user_tokens_per_s(speculating(base, candidate, k), trace)
            if best is None or speed > best[2]:
                best = (candidate, k, speed)
    assert best is not None
    return best


def batch_for(cost: CostModel, tokens_per_s: float, context: int) -> str:
    """Sequences decoding together at which the plain per-user speed first falls to ``tokens_per_s``."""
    if 1.0 / cost.decode_time(1, context) <= tokens_per_s:
        return "none (slower at 1)"
    for batch in range(2, 65):
        if 1.0 / cost.decode_time(batch, context) <= tokens_per_s:
            return str(batch)
    return "> 64"


def main() -> None:
    started = time.process_time()
    rows = []
    done: dict[str, tuple[str, float, str, float]] = {}
    for published in PUBLISHED:
        if published.model not in done:
            base = scenario(published.model)
            trace = generate_trace(base.workload, base.seed)
            plain = per_user_tokens_per_s(base.plain_decoding(), trace)
            decoding, simulated, spread = "plain", plain, ""
            if published.speculative:
                candidate, k, simulated = best_speculation(base, trace)
                assert candidate.alpha_range is not None
                low, high = (per_user_tokens_per_s(speculating(base, replace(candidate, alpha=alpha), k), trace)
                             for alpha in candidate.alpha_range)
                decoding = f"{candidate.label}, k {k}, alpha {candidate.alpha:.2f} (assumed)"
                spread = f"{low:,.0f}-{high:,.0f}"
            done[published.model] = (decoding, simulated, spread, plain)
        decoding, simulated, spread, plain = done[published.model]
        cost = ResolvedDeployment.of(scenario(published.model)).cost
        rows.append((published.model, f"{published.tokens_per_s:,.0f}", published.source, decoding, f"{plain:,.0f}",
                     f"{simulated:,.0f}", spread or "-", f"{simulated / published.tokens_per_s:.2f}",
                     "-" if published.speculative else batch_for(cost, published.tokens_per_s, 1128)))
    header = ("model", "published", "source", "decoding (llmsim)", "plain", "simulated", "alpha +-1 sd", "ratio",
              "batch for published")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    ratios = np.array([float(row[7]) for row in rows])
    print(f"ratio simulated / published: {ratios.min():.2f}-{ratios.max():.2f} "
          f"({time.process_time() - started:.0f} CPU s)")


if __name__ == "__main__":
    main()
