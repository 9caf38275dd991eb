"""One speculation answer from recommend's search, and the 20-30% draft rule judged on simulated drafts
inside the band."""
from __future__ import annotations

import pytest

from llmsim.catalog.models import model_catalog
from llmsim.config.policies import KPolicyName
from llmsim.search.draft_choice import RULE_BAND, in_band_candidates
from llmsim.search.recommend import OFF, Config, KChoice, _eligibility_options, eligibility_of, recommend
from tests.helpers import make_scenario


def test_in_band_drafts_are_20_to_30_percent_of_the_target():
    # Llama-3.1-70B: 70.6e9 published parameters, of which the embeddings and the LM head are
    # 2 x 128,256 x 8,192; the rest is spread over 80 equal layers. The first n layers with both
    # matrices are (n / 80 x the layers' share + the matrices) of the target.
    target = model_catalog()["Llama-3.1-70B"]
    matrices = 2 * 128_256 * 8_192
    layers = {c.draft.num_layers: c for c in in_band_candidates(target)}
    assert layers                                           # the catalog has none in the band; these are
    for n, candidate in layers.items():
        share = (n / 80 * (70.6e9 - matrices) + matrices) / 70.6e9
        assert RULE_BAND[0] - 0.005 <= share <= RULE_BAND[1] + 0.005
        assert candidate.draft.param_count / target.param_count == pytest.approx(share, rel=0.01)
        assert candidate.alpha > 0                          # predicted by the acceptance model
    assert min(layers) == 15 and max(layers) == 22         # the fewest and the most layers in the band


@pytest.mark.slow
def test_recommend_gives_one_speculation_answer_and_simulates_an_in_band_draft():
    scenario = make_scenario({"engine": {"max_num_seqs": 64}, "workload": {"arrival": {"rate": 5.0},
                                                                           "num_requests": 300},
                              "speculation": {"draft": "Llama-3.2-1B", "policy": "adaptive", "k": 4, "k_max": 8,
                                              "acceptance": {"process": "bernoulli", "alpha": 0.7}},
                              "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
    rec = recommend(scenario, seeds=2, top=1, workers=1, drafts=True)
    assert rec.drafts.best == rec.best                      # the speculation section states the one answer
    screened = rec.drafts.screened
    band = screened[screened["in_band"]]
    assert len(band) >= 1
    for config in band["config"]:
        assert 0.2 <= config.draft.draft.param_count / scenario.model.param_count <= 0.3
    simulated = band[band["max_rate_per_s"].notna() & ~band["raced_out"]]
    assert len(simulated) >= 1                              # bisected to the end, not screened alone
    table = rec.table.set_index(rec.table["config"].map(lambda c: c.label))
    for config in simulated["config"]:
        assert len(table.loc[config.label, "per_seed_rates"]) == 2
    # the verdict agrees with the simulated figures it names
    best_band = simulated["max_rate_per_s"].max()
    best_any = screened["max_rate_per_s"].max()
    assert rec.drafts.rule_holds == (rec.best.draft is not None and rec.best.draft.label in set(band["candidate"]))
    assert best_band <= best_any


def test_the_eligibility_rules_tried_leave_out_the_one_the_best_setting_runs_with():
    # The scenario leaves eligibility at the engine's defaults (32 tokens, 2 requests): the best setting, with
    # no rule of its own, runs under that rule, so it is not simulated again as a setting of its own.
    scenario = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "static", "k": 3,
                                              "acceptance": {"process": "bernoulli", "alpha": 0.7}}})
    best = Config(KChoice(KPolicyName.STATIC, 3), 1024, None)
    assert eligibility_of(best, scenario) == (32, 2)
    tried = {config.eligibility for config in _eligibility_options(best, scenario)}
    assert tried == {(0, 1), (0, 2), (32, 1)}
    assert eligibility_of(Config(OFF, 1024, None), scenario) is None
