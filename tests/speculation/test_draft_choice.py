"""Draft choice against Leviathan's Theorem 3.8 on a fixed-cost device, and the 20-30% rule report.

On the fixed-cost device of tests/speculation/test_speculative.py every step costs its per-layer overhead: a
target of 100 layers and a draft of d layers have c = d / 100 whatever the batch, Theorem 3.8's
assumption. One request at a time (batch 1), the simulated TPOT is then the target step over the
speedup S, so the draft with the largest S must win.
"""
from __future__ import annotations

import pytest

from llmsim.catalog.models import model_from_node
from llmsim.config.reader import Node
from llmsim.search.draft_choice import (PLAIN_DECODING, Candidate, candidates, choose_draft, cost_ratio, theorem_3_8,
                                       tune_eligibility, with_candidate)
from llmsim.speculation.proposers import EAGLE, MEDUSA, MTP, NGRAM, head_spec

from tests.helpers import make_scenario
from tests.helpers import tiny_model


def leviathan_best(alpha: float, c: float) -> tuple[int, float]:
    """Theorem 3.8, S = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), maximised over integer k in 1..8."""
    return max(((k, (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))) for k in range(1, 9)), key=lambda t: t[1])


def one_at_a_time(profile: str, **extra):
    return make_scenario({
        "model": tiny_model("target", 100), "hardware": profile, "seed": 5,
        "engine": {"max_num_seqs": 1, "max_batch_tokens": 65536, "max_model_len": 65536},
        "speculation": {"draft": tiny_model("draft", 2), "k": 1,
                        "eligibility": {"min_sequence_tokens": 0, "min_concurrent_requests": 1}},
        "workload": {"arrival": {"process": "deterministic", "rate": 1e6}, "num_requests": 6,
                     "prompt_tokens": {"distribution": "fixed", "value": 16},
                     "output_tokens": {"distribution": "fixed", "value": 300}},
        "simulation": {"horizon": "1e7 s"}, **extra})


def drafts(alphas: dict[int, float]) -> list[Candidate]:
    """Draft models of the given layer counts (c = layers / 100) with the given acceptance."""
    out = [PLAIN_DECODING]
    for layers, alpha in alphas.items():
        model = model_from_node(Node(tiny_model(f"draft-{layers}", layers)))
        out.append(Candidate(f"draft-{layers}", "model", model, alpha))
    return out


@pytest.mark.parametrize("alphas, expected", [
    ({2: 0.50, 10: 0.85, 30: 0.88}, "draft-10"),        # a mid-size draft: S 1.79, 2.85, 1.75
    ({2: 0.70, 10: 0.75, 30: 0.80}, "draft-2"),         # the smallest: S 2.76, 2.2, 1.55
])
def test_the_choice_is_theorem_3_8s_best_draft_on_a_fixed_cost_device(fixed_cost, alphas, expected):
    speedups = {f"draft-{layers}": leviathan_best(alpha, layers / 100) for layers, alpha in alphas.items()}
    assert max(speedups, key=lambda name: speedups[name][1]) == expected
    choice = choose_draft(one_at_a_time(fixed_cost), drafts(alphas), simulate_top=3)
    assert choice.best.label == expected
    assert choice.best_k == speedups[expected][0]
    table = choice.table.set_index("candidate")
    for name, (k, speedup) in speedups.items():
        assert table.loc[name, "c"] == pytest.approx(int(name.split("-")[1]) / 100)
        assert table.loc[name, "k"] == k
        assert table.loc[name, "speedup_theorem_3_8"] == pytest.approx(speedup)
    # Simulated at batch 1, the best draft's speedup over plain decoding is Theorem 3.8's within the
    # acceptance noise of 6 x 300 tokens (a loose 10%).
    assert table.loc[expected, "speedup_simulated"] == pytest.approx(speedups[expected][1], rel=0.1)


def test_theorem_3_8_for_a_one_pass_proposer_charges_c_once():
    k, speedup = theorem_3_8(0.8, 0.1, sequential=False)
    assert k == 8 and speedup == pytest.approx((1 - 0.8 ** 9) / (0.2 * 1.1))


def test_the_rule_report_says_what_following_20_to_30_percent_costs(fixed_cost):
    """Draft-25 is 25% of the target's layers (and close to 25% of its parameters): the rule's draft.
    With acceptance that barely grows with size, the smallest wins and the report prices the rule."""
    options = drafts({2: 0.7, 25: 0.72})
    choice = choose_draft(one_at_a_time(fixed_cost), options, simulate_top=2)
    assert choice.best.label == "draft-2" and not choice.rule_holds
    table = choice.table.set_index("candidate")
    assert 0.2 <= table.loc["draft-25", "params_ratio"] <= 0.3
    assert choice.rule_cost == pytest.approx(table.loc["draft-25", "tpot_s"] / table.loc["draft-2", "tpot_s"] - 1)
    assert choice.rule_cost > 0 and "draft-25" in choice.rule_text


def test_eligibility_tuning_lets_a_single_stream_speculate():
    """A single stream with the default min_concurrent_requests of 2 never speculates; the tuner
    finds that 1 is faster and says how much of the time each setting speculated."""
    scenario = make_scenario({"model": "Llama-3.1-8B", "workload": {
        "num_requests": 8, "arrival": {"process": "deterministic", "rate": 0.5},
        "prompt_tokens": {"distribution": "fixed", "value": 200},
        "output_tokens": {"distribution": "fixed", "value": 100}},
        "speculation": {"draft": "Llama-3.2-1B", "k": 4, "acceptance": {"alpha": 0.8}}})
    rule, table = tune_eligibility(scenario)
    assert rule.min_concurrent_requests == 1
    default = table[(table.min_concurrent_requests == 2) & (table.min_sequence_tokens == 32)].iloc[0]
    assert default["speculating_share"] == 0.0
    assert table["tpot_s"].min() < default["tpot_s"]


def test_the_choice_reads_as_text(fixed_cost):
    from llmsim.search.draft_choice import format_draft_choice
    choice = choose_draft(one_at_a_time(fixed_cost), drafts({2: 0.7, 25: 0.72}), simulate_top=2)
    text = format_draft_choice(choice)
    assert text.startswith("draft: draft-2 at k") and "Theorem 3.8" in text and "20-30% rule" in text


def test_candidates_are_the_verifiable_smaller_models_their_fp8_variants_a_head_and_ngram():
    from llmsim.search.draft_choice import candidates
    scenario = make_scenario({"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4}})
    labels = {c.label: c for c in candidates(scenario)}
    for name in ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"):
        assert name in labels and f"{name} (fp8)" in labels
        assert labels[f"{name} (fp8)"].draft.weight_dtype == "fp8"
        assert labels[f"{name} (fp8)"].alpha < labels[name].alpha            # the assumed quantisation loss
    assert {"none", "EAGLE head", "n-gram lookup"} <= set(labels)
    assert not any(name.startswith(("Llama-2", "Llama-3.3-70B", "Llama-3.1-405B", "Qwen")) for name in labels)
    assert labels["Llama-3.2-1B"].alpha < labels["Llama-3.1-8B"].alpha


@pytest.mark.slow
def test_advice_for_recommend_chooses_a_draft_and_tunes_eligibility():
    """What ``llmsim recommend`` prints for a speculating scenario (``recommend(drafts=True)``): the
    draft among the catalog's candidates, at the workload its predicted acceptance names, and the
    eligibility tuned with it."""
    from llmsim.search.draft_choice import advise
    scenario = make_scenario({
        "model": "Llama-3.1-8B", "seed": 3,
        "workload": {"num_requests": 80, "arrival": {"process": "poisson", "rate": 2},
                     "prompt_tokens": {"distribution": "fixed", "value": 256},
                     "output_tokens": {"distribution": "fixed", "value": 64}},
        "speculation": {"draft": "Llama-3.2-1B", "k": 3, "acceptance": {"process": "predicted", "workload": "code"}},
        "slo": {"ttft": "500 ms", "tpot": "50 ms", "percentile": 95}})
    advice = advise(scenario)
    table = advice.choice.table.set_index("candidate")
    assert advice.choice.best.label in table.index and advice.choice.best.kind is not None
    assert table.loc["Llama-3.2-1B", "alpha"] == pytest.approx(scenario.speculation.acceptance.mean_alpha)
    assert advice.eligibility is not None and len(advice.eligibility_table) == 4
    text = advice.text()
    assert "draft: " in text and "Theorem 3.8" in text and "20-30% rule" in text and "eligibility:" in text


def test_a_target_with_an_mtp_module_offers_it_and_theorem_3_8_ranks_it(fixed_cost):
    """A target whose checkpoint ships a multi-token-prediction module (DeepSeek-V3's
    num_nextn_predict_layers) gets it as a candidate; one without does not. On the fixed-cost device
    the module, one layer as EAGLE's head, costs c = 1 / 100; with the acceptance model's higher
    alpha for MTP (0.87 against EAGLE's 0.82, chat) Theorem 3.8 puts it first, and it is the choice
    at Theorem 3.8's k."""
    plain = one_at_a_time(fixed_cost)
    assert MTP not in {c.kind for c in candidates(plain, catalog={})}
    with_mtp = one_at_a_time(fixed_cost, model={**tiny_model("target", 100), "mtp_modules": 1})
    options = candidates(with_mtp, catalog={})
    assert [c.kind for c in options] == [None, EAGLE, MTP, NGRAM]
    mtp = next(c for c in options if c.kind == MTP)
    assert mtp.alpha > next(c for c in options if c.kind is EAGLE).alpha
    assert cost_ratio(with_mtp, mtp, 100) == pytest.approx(1 / 100)
    choice = choose_draft(with_mtp, options, simulate_top=2)
    assert choice.best.kind == MTP and choice.best_k == leviathan_best(mtp.alpha, 1 / 100)[0]


def test_a_medusa_candidate_drafts_no_more_tokens_than_it_has_heads(fixed_cost):
    """Three Medusa heads draft at most three tokens: Theorem 3.8's k and the scenario built for the
    candidate stay within them (at alpha 0.9 and c 0.01 the unbounded best would be k = 8)."""
    scenario = one_at_a_time(fixed_cost)
    heads = Candidate("medusa-3", MEDUSA, head_spec(MEDUSA, scenario.model, 3), 0.9, heads=3)
    assert candidate_k(heads) == 3 and theorem_3_8(0.9, 0.01, False)[0] == 8
    built = with_candidate(scenario, heads, 3)
    assert built.speculation.policy.k_max == 3 and built.speculation.proposer.heads == 3


def candidate_k(candidate: Candidate) -> int:
    return theorem_3_8(candidate.alpha, 0.01, candidate.proposer.sequential, candidate.k_max)[0]
