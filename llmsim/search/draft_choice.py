"""Which draft to speculate with, and when to let sequences speculate.

:func:`choose_draft` compares candidates (:func:`candidates`: no speculation; every catalog
model the target can verify, same vocabulary and smaller, in its own dtype and quantised to
fp8; an EAGLE head; the target's own multi-token-prediction module where its checkpoint ships one
(``mtp_modules``, DeepSeek-V3's ``num_nextn_predict_layers``); n-gram lookup; the scenario's own
draft) in two stages:

1. **Theorem 3.8** (Leviathan et al.): each candidate's acceptance alpha (the acceptance
   model's prediction for the pair and the workload, or the scenario's measured acceptance
   for its own draft) and its cost ratio c (one draft step over one target step at batch 1,
   from the cost models at the workload's mean context; a proposer that runs once a step,
   Medusa or n-gram, costs c whatever k) give the best k and the batch-1 speedup
   S = (1 - alpha^(k+1)) / ((1 - alpha)(draft_steps(k) c + 1)), k up to 8 or the proposer's own
   limit (Medusa: one token per head).
2. **Simulation**: the best ``simulate_top`` of them, and plain decoding, run at the
   scenario's rate on the same arrival trace with their best k; the choice is the lowest mean
   TPOT among those meeting the SLO (all of them if none does).

It reports whether the practice rule "a draft of 20-30% of the target's parameters" holds
(the choice is within it), and what following it costs: the best candidate inside the band
against the choice, in simulated mean TPOT.

:func:`tune_eligibility` simulates the chosen setting over a small grid of the eligibility
thresholds (``min_concurrent_requests`` 1 or the scenario's, ``min_sequence_tokens`` 0 or the
scenario's) and keeps the fastest that meets the SLO.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

import numpy as np
import pandas as pd

from llmsim.analysis.metrics import summarize
from llmsim.catalog.models import ModelSpec, model_catalog
from llmsim.config.policies import AcceptanceProcess, KPolicyName, ProposerKind
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import Scenario
from llmsim.sim.simulate import simulate_whole
from llmsim.speculation.config import (Acceptance, Eligibility, KPolicy, SpeculationConfig, predicted_acceptance,
                                       resolve_draft_parallelism)
from llmsim.speculation.proposers import EAGLE, MEDUSA, MODEL, MTP, NGRAM, Proposer, draft_cost_model, head_spec
from llmsim.workload.generate import generate_trace

RULE_BAND = (0.2, 0.3)         # the practice rule: a draft of 20-30% of the target's parameters
K_MAX = 8


@dataclass(frozen=True)
class Candidate:
    """A way to draft (``kind`` None is plain decoding) and the acceptance it is expected to get."""
    label: str
    kind: ProposerKind | None
    draft: ModelSpec | None = None
    alpha: float = 0.0
    alpha_range: tuple[float, float] | None = None     # the acceptance model's one-sd range, if predicted
    cpu_s_per_sequence: float = 0.0                     # n-gram lookup
    heads: int = K_MAX                                  # Medusa: its heads, the longest draft

    @property
    def proposer(self) -> Proposer:
        assert self.kind is not None, "plain decoding has no proposer"
        return Proposer(self.kind, heads=self.heads if self.kind == MEDUSA else 0,
                        cpu_s_per_sequence=self.cpu_s_per_sequence)

    @property
    def k_max(self) -> int:
        """The longest draft tried: K_MAX, or less where the proposer cannot draft so far."""
        return min(K_MAX, self.proposer.max_k or K_MAX)


class _Scored(TypedDict):
    """A candidate in :func:`choose_draft`'s table: its cost ratio c and Theorem 3.8's k and speedup."""
    candidate: Candidate
    c: float
    k: int
    speedup_theorem: float


class _Row(_Scored, total=False):
    """A scored candidate, with its simulated mean TPOT and SLO verdict once simulated."""
    tpot_s: float
    slo_met: bool


@dataclass
class DraftChoice:
    best: Candidate
    best_k: int
    table: pd.DataFrame          # every candidate: alpha, c, Theorem 3.8's k and speedup, simulated TPOT
    rule_holds: bool             # the choice is a model of 20-30% of the target's parameters
    rule_cost: float | None      # mean TPOT of the best in-band candidate over the choice's, minus 1 (None: none)
    rule_text: str


PLAIN_DECODING = Candidate("none", None)


def candidates(scenario: Scenario, workload: str = "chat", catalog: dict[str, ModelSpec] | None = None,
               own_draft: bool = True) -> list[Candidate]:
    """No speculation; catalog models the target can verify (same vocabulary, smaller), in their
    dtype and at fp8; an EAGLE head; the target's MTP module if it ships one; n-gram lookup; and
    the scenario's own draft, with its measured acceptance when the scenario gives one."""
    target = scenario.model
    out = [PLAIN_DECODING]
    for model in (catalog or model_catalog()).values():
        if model.vocab_size != target.vocab_size or model.param_count >= target.param_count:
            continue
        for variant in {model.weight_dtype: model, "fp8": model.with_dtypes("fp8", "fp8")}.values():
            label = model.name if variant is model else f"{model.name} (fp8)"
            out.append(predicted_candidate(label, MODEL, variant, target, workload))
    out.append(predicted_candidate("EAGLE head", EAGLE, head_spec(EAGLE, target), target, workload))
    if target.mtp_modules:
        out.append(predicted_candidate("MTP module", MTP, head_spec(MTP, target), target, workload))
    out.append(predicted_candidate("n-gram lookup", NGRAM, None, target, workload))
    own = scenario.speculation
    if own_draft and own is not None and _measured(scenario):
        label = f"{own.draft.name if own.draft is not None else own.proposer.kind} (measured acceptance)"
        out.append(Candidate(label, own.proposer.kind, own.draft, own.acceptance.mean_alpha,
                             cpu_s_per_sequence=own.proposer.cpu_s_per_sequence,
                             heads=own.proposer.heads if own.proposer.kind == MEDUSA else K_MAX))
    return out


def in_band_candidates(target: ModelSpec, workload: str = "chat") -> list[Candidate]:
    """Drafts inside the practice rule's band (:data:`RULE_BAND`) where the catalog has none: the target's
    own first layers with its embeddings and LM head (a self-speculative draft, as LayerSkip builds), at
    the fewest and the most layers whose parameters are 20-30% of the target's, each at the acceptance
    the acceptance model predicts for its size."""
    low, high = RULE_BAND
    sizes = [n for n in range(1, target.num_layers)
             if low <= replace(target, num_layers=n).param_count / target.param_count <= high]
    return [predicted_candidate(f"{target.name} first {n} layers", MODEL,
                                replace(target, num_layers=n, name=f"{target.name}-first-{n}-layers",
                                        params_published=None, mtp_modules=0), target, workload)
            for n in dict.fromkeys(sizes[:1] + sizes[-1:])]


def in_band(candidate: Candidate, target: ModelSpec) -> bool:
    """A draft model whose parameters are 20-30% of the target's."""
    low, high = RULE_BAND
    ratio = params_ratio(candidate, target)
    return ratio is not None and low <= ratio <= high


def params_ratio(candidate: Candidate, target: ModelSpec) -> float | None:
    """A draft model's parameters over the target's (None for a candidate of another kind)."""
    if candidate.kind != MODEL:
        return None
    assert candidate.draft is not None          # a draft-model candidate carries its model
    return candidate.draft.param_count / target.param_count


def model_mapping(spec: ModelSpec) -> dict:
    """A model as a scenario's inline fields (``model:`` or ``speculation.draft:``)."""
    keys = ("name", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
            "head_dim", "tie_word_embeddings", "num_experts", "experts_per_token", "qkv_bias", "sliding_window",
            "max_context", "weight_dtype", "kv_dtype", "activation_dtype", "moe_intermediate_size",
            "shared_expert_intermediate_size", "dense_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
            "v_head_dim", "expert_dtype", "embedding_dtype", "mtp_modules", "sliding_window_layers")
    return {key: getattr(spec, key) for key in keys if getattr(spec, key) is not None}


def candidate_overrides(candidate: Candidate, scenario: Scenario) -> dict:
    """Scenario overrides that speculate with ``candidate`` (its proposer and predicted acceptance), keeping
    the scenario's eligibility rule; the k policy is set apart."""
    point: dict = {"speculation": None, "speculation.draft": candidate.kind}
    if candidate.kind == MODEL:
        assert candidate.draft is not None      # a draft-model candidate carries its model
        point["speculation.draft"] = model_mapping(candidate.draft)
    if candidate.kind == MEDUSA:
        point["speculation.heads"] = candidate.heads
    if candidate.kind == NGRAM and candidate.cpu_s_per_sequence:
        point["speculation.ngram_cpu_per_sequence"] = f"{candidate.cpu_s_per_sequence!r} s"
    point["speculation.acceptance"] = {"process": "bernoulli", "alpha": candidate.alpha}
    own = scenario.speculation.eligibility if scenario.speculation is not None else Eligibility()
    point["speculation.eligibility"] = {"min_sequence_tokens": own.min_sequence_tokens,
                                        "min_concurrent_requests": own.min_concurrent_requests}
    return point


def predicted_candidate(label: str, kind: ProposerKind, draft: ModelSpec | None, target: ModelSpec,
                        workload: str = "chat") -> Candidate:
    """A candidate at the acceptance the acceptance model predicts for it, with its one-sd range."""
    estimate = predicted_acceptance(Proposer(kind), draft, target, workload)
    return Candidate(label, kind, draft, estimate.alpha, (estimate.low, estimate.high))


def _measured(scenario: Scenario) -> bool:
    """Whether the scenario states its acceptance (a measurement), rather than the default or a prediction."""
    return scenario.speculation is not None and scenario.speculation.acceptance.measured


def theorem_3_8(alpha: float, c: float, sequential: bool = True, k_max: int = K_MAX) -> tuple[int, float]:
    """The best k in 1..k_max and its batch-1 speedup S (a one-pass proposer costs c whatever k)."""
    ks = np.arange(1, k_max + 1)
    tokens = (1 - alpha ** (ks + 1)) / (1 - alpha) if alpha < 1 else ks + 1.0
    speedup = tokens / ((ks if sequential else 1) * c + 1)
    best = int(np.argmax(speedup))
    return int(ks[best]), float(speedup[best])


def cost_ratio(scenario: Scenario, candidate: Candidate, context: float) -> float:
    """One draft step over one target step, both for one sequence at ``context`` tokens."""
    resolved = ResolvedDeployment.of(scenario)
    row = resolved.cost.features([], [], [context])
    target_s = resolved.cost.iteration(row)[0]
    tp = scenario.deployment.tensor_parallel
    if candidate.draft is not None and candidate.draft.num_heads % tp:
        tp = 1
    draft = draft_cost_model(candidate.proposer, candidate.draft, scenario.hardware, tp, resolved.memory)
    return float(draft.iteration(row)[0]) / target_s if draft is not None else 0.0


def with_candidate(scenario: Scenario, candidate: Candidate, k: int) -> Scenario:
    """The scenario speculating with ``candidate`` at a static ``k`` (plain decoding for ``none``)."""
    if candidate.kind is None:
        return scenario.plain_decoding()
    own = scenario.speculation
    eligibility = own.eligibility if own is not None else Eligibility()
    config = SpeculationConfig(candidate.draft, policy=KPolicy(KPolicyName.STATIC, k, max(k, candidate.k_max)),
                               acceptance=Acceptance(AcceptanceProcess.BERNOULLI, alpha=candidate.alpha),
                               eligibility=eligibility, proposer=candidate.proposer)
    return replace(scenario, speculation=resolve_draft_parallelism(config, scenario.deployment.tensor_parallel))


def choose_draft(scenario: Scenario, options: list[Candidate] | None = None, workload: str = "chat",
                 simulate_top: int = 4, trace=None) -> DraftChoice:
    """The candidate with the lowest simulated mean TPOT at the scenario's rate (see the module docstring)."""
    options = candidates(scenario, workload) if options is None else options
    trace = generate_trace(scenario.workload, scenario.seed) if trace is None else trace
    context = float(np.mean(trace.prompt_tokens) + np.mean(trace.output_tokens) / 2)
    rows: list[_Row] = []
    for candidate in options:
        if candidate.kind is None:
            rows.append({"candidate": candidate, "c": 0.0, "k": 0, "speedup_theorem": 1.0})
            continue
        scenario_with = with_candidate(scenario, candidate, 1)
        if scenario_with.memory.kv_capacity_tokens < scenario.max_model_len:
            continue                                 # the draft leaves no room for one longest request
        c = cost_ratio(scenario, candidate, context)
        k, speedup = theorem_3_8(candidate.alpha, c, candidate.proposer.sequential, candidate.k_max)
        rows.append({"candidate": candidate, "c": c, "k": k, "speedup_theorem": speedup})
    rows.sort(key=lambda row: -row["speedup_theorem"])
    simulated = [row for row in rows if row["candidate"].kind is None] + \
        [row for row in rows if row["candidate"].kind is not None][:simulate_top]
    for row in simulated:
        summary = summarize(simulate_whole(with_candidate(scenario, row["candidate"], row["k"]), trace)).to_dict()
        row["tpot_s"], row["slo_met"] = summary["latency"]["tpot_s"]["mean"], summary["slo"]["met"]
    table = pd.DataFrame([{
        "candidate": row["candidate"].label, "kind": row["candidate"].kind or PLAIN_DECODING.label,
        "speculates": row["candidate"].kind is not None,
        "params_ratio": (params_ratio(row["candidate"], scenario.model)
                         if row["candidate"].kind == MODEL else np.nan),
        "alpha": row["candidate"].alpha,
        "alpha_low": (row["candidate"].alpha_range or (np.nan, np.nan))[0],
        "alpha_high": (row["candidate"].alpha_range or (np.nan, np.nan))[1],
        "c": row["c"], "k": row["k"], "speedup_theorem_3_8": row["speedup_theorem"],
        "tpot_s": row.get("tpot_s", np.nan), "slo_met": row.get("slo_met", None)} for row in rows])
    ran = [row for row in rows if "tpot_s" in row]
    passing = [row for row in ran if row["slo_met"]] or ran
    best = min(passing, key=lambda row: row["tpot_s"])
    none_tpot = next(row["tpot_s"] for row in ran if row["candidate"].kind is None)
    table["speedup_simulated"] = none_tpot / table["tpot_s"]
    holds, cost, text = _rule(scenario, best, ran)
    return DraftChoice(best["candidate"], best["k"], table, holds, cost, text)


def _rule(scenario: Scenario, best: _Row, ran: list[_Row]) -> tuple[bool, float | None, str]:
    """Whether the 20-30% rule picks the choice, and the TPOT cost of the best draft inside the band."""
    low, high = RULE_BAND
    chosen = params_ratio(best["candidate"], scenario.model)
    holds = chosen is not None and low <= chosen <= high
    inside = [row for row in ran if in_band(row["candidate"], scenario.model)]
    described = (f"{best['candidate'].label}" + (f" ({100 * chosen:.1f}% of the target's parameters)"
                                                  if chosen is not None else ""))
    if holds:
        return True, 0.0, f"the 20-30% rule holds: the best draft is {described}"
    if not inside:
        return False, None, (f"the 20-30% rule does not hold: the best is {described}, and no candidate "
                             "simulated lies within 20-30% of the target's parameters")
    rule_row = min(inside, key=lambda row: row["tpot_s"])
    cost = rule_row["tpot_s"] / best["tpot_s"] - 1
    return False, cost, (f"the 20-30% rule does not hold: the best is {described}; following the rule "
                         f"({rule_row['candidate'].label}) costs {100 * cost:+.0f}% mean TPOT")


def tune_eligibility(scenario: Scenario, trace=None) -> tuple[Eligibility, pd.DataFrame]:
    """The eligibility thresholds (min_concurrent_requests 1 or the scenario's, min_sequence_tokens
    0 or the scenario's) with the lowest simulated mean TPOT among those meeting the SLO."""
    trace = generate_trace(scenario.workload, scenario.seed) if trace is None else trace
    speculation = scenario.speculation
    assert speculation is not None              # the scenario speculating with the chosen draft (advise)
    own = speculation.eligibility
    grid = sorted({(concurrent, tokens) for concurrent in (1, own.min_concurrent_requests)
                   for tokens in (0, own.min_sequence_tokens)})
    rows = []
    for concurrent, tokens in grid:
        rule = Eligibility(tokens, concurrent)
        tuned = replace(scenario, speculation=replace(speculation, eligibility=rule))
        summary = summarize(simulate_whole(tuned, trace)).to_dict()
        rows.append({"min_concurrent_requests": concurrent, "min_sequence_tokens": tokens,
                     "tpot_s": summary["latency"]["tpot_s"]["mean"], "slo_met": summary["slo"]["met"],
                     "speculating_share": summary["speculation"]["blocked_share"].get("speculated", 0.0)})
    table = pd.DataFrame(rows)
    passing = table[table["slo_met"]] if table["slo_met"].any() else table
    best = passing.loc[passing["tpot_s"].idxmin()]
    return Eligibility(int(best["min_sequence_tokens"]), int(best["min_concurrent_requests"])), table


def format_draft_choice(choice: DraftChoice, eligibility: Eligibility | None = None,
                        eligibility_table: pd.DataFrame | None = None) -> str:
    """The draft choice (and the tuned eligibility) as a person reads it."""
    lines = [f"draft: {choice.best.label} at k {choice.best_k}" if choice.best.kind is not None
             else "draft: none (plain decoding is fastest here)"]
    for row in choice.table.itertuples():
        alpha = "" if not row.speculates else f"alpha {row.alpha:.2f}" + (
            f" ({row.alpha_low:.2f}-{row.alpha_high:.2f})" if row.alpha_low == row.alpha_low else " (measured)")
        simulated = f", simulated TPOT {1e3 * row.tpot_s:.1f} ms ({row.speedup_simulated:.2f}x)" \
            if row.tpot_s == row.tpot_s else ""
        theorem = ("" if not row.speculates
                   else f", c {row.c:.3f}, Theorem 3.8: k {row.k}, {row.speedup_theorem_3_8:.2f}x")
        lines.append(f"  {row.candidate:<34} {alpha}{theorem}{simulated}")
    lines.append(f"  {choice.rule_text}")
    if eligibility is not None:
        lines.append(f"eligibility: min_concurrent_requests {eligibility.min_concurrent_requests}, "
                     f"min_sequence_tokens {eligibility.min_sequence_tokens}")
        assert eligibility_table is not None    # the tuned eligibility comes with its table (DraftAdvice)
        for row in eligibility_table.itertuples():
            lines.append(f"  min_concurrent_requests {row.min_concurrent_requests}, min_sequence_tokens "
                         f"{row.min_sequence_tokens}: TPOT {1e3 * row.tpot_s:.1f} ms, "
                         f"{100 * row.speculating_share:.0f}% of sequence-steps speculating"
                         + ("" if row.slo_met else ", SLO missed"))
    return "\n".join(lines)


@dataclass
class DraftAdvice:
    """What ``llmsim recommend`` adds for a speculating scenario: the draft and the eligibility."""
    choice: DraftChoice
    eligibility: Eligibility | None           # None when plain decoding is the choice
    eligibility_table: pd.DataFrame | None

    def text(self) -> str:
        return format_draft_choice(self.choice, self.eligibility, self.eligibility_table)


def advise(scenario: Scenario) -> DraftAdvice:
    """Choose the draft (for the workload the scenario's predicted acceptance names, else chat),
    then tune the eligibility thresholds with it."""
    speculation = scenario.speculation
    choice = choose_draft(scenario, workload=speculation.acceptance.workload if speculation is not None else "chat")
    if choice.best.kind is None:
        return DraftAdvice(choice, None, None)
    eligibility, table = tune_eligibility(with_candidate(scenario, choice.best, choice.best_k))
    return DraftAdvice(choice, eligibility, table)
