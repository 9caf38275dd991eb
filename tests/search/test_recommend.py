"""Recommendations: the settings found meet the SLO on fresh requests, and the search is sound."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import yaml

import llmsim
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.cli.recommend import format_recommendation
from llmsim.errors import ConfigError
from llmsim.scenario.variants import variant
from llmsim.config.policies import KPolicyName
from llmsim.search.recommend import OFF, Config, KChoice, analytic_rate, batch_token_rule, k_options, recommend
from llmsim.search.sweeps import reusing_runs
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, make_scenario, merge

# Small and fast: an n-gram speculator (no draft model to run), 400 requests.
SMALL = merge(BASE, {"workload": {"num_requests": 400, "arrival": {"rate": 20}},
                     "speculation": {"draft": "ngram", "policy": "static", "k": 2, "k_max": 4,
                                     "acceptance": {"process": "bernoulli", "alpha": 0.6}},
                     "slo": {"ttft": "200 ms", "tpot": "20 ms", "percentile": 95}})


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    path = tmp_path_factory.mktemp("recommend") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return llmsim.load_scenario(path)


@pytest.fixture(scope="module")
def shared_runs():
    """The module's searches share their runs, as a report's stages do: a run is deterministic in its
    scenario and seed, so a search finding one already made gets the numbers it would simulate."""
    with reusing_runs():
        yield


@pytest.fixture(scope="module")
def result(scenario, shared_runs):
    # Bisection to 10% (the report's tolerance; the CLI's is 4%): what these tests check holds at any width.
    return recommend(scenario, seeds=2, top=2, workers=2, tolerance=0.1)


@pytest.mark.slow
def test_recommended_settings_meet_the_slo_on_fresh_seeds(result, scenario):
    """Re-simulated at the scenario's rate on requests the search never saw."""
    overrides = result.best.overrides(scenario)
    for seed in (scenario.seed + 100, scenario.seed + 101):
        run = llmsim.simulate(variant(scenario, {**overrides, "seed": seed}))
        assert summarize(run).to_dict()["slo"]["met"]


@pytest.mark.slow
def test_goodput_is_a_bracketed_rate(result, scenario):
    """Just below the reported highest passing rate the settings pass; far above it they fail
    (checked for the first seed the search used)."""
    row = result.table.iloc[0]
    rate = row["per_seed_rates"][0]
    overrides = result.best.overrides(scenario)

    def met(r):
        run = llmsim.simulate(variant(scenario, {**overrides, "workload.arrival.rate": r}))
        return summarize(run).to_dict()["slo"]["met"]
    assert met(rate)
    assert not met(2 * rate)


@pytest.mark.slow
def test_search_covers_k_off_static_and_the_adaptive_rule(scenario, result):
    assert [str(k) for k in k_options(scenario)] == ["off", "static:1", "static:2", "static:3", "static:4",
                                                     "adaptive:4"]
    assert set(result.analytic["k"]) == set(k_options(scenario))
    assert result.table["default"].sum() == 3           # the rule of thumb at 50, 200 and 1000 ms
    assert result.table["meets_scenario_rate"].iloc[0]


def test_rule_of_thumb_max_batch_tokens_by_hand():
    """Llama-3.1-70B on 4 x H100: 4 x 81,559 MiB (NVML's total for an H100 80GB) x 0.9 less 2 bytes x 70.6e9
    parameters, over the KV bytes per token (80 layers x 2 x 8 KV heads x 128 x 2 bytes = 327,680), is the KV
    pool; at the workload's mean
    context (prompt + output / 2) it holds pool / context requests (at most max_num_seqs), and a step at
    that concurrency carries one token per request and its prompt spread over its output steps:
    requests x (1 + prompt / output). A real budget, below max_model_len, where the literal reading (the
    pool alone, over 100,000 tokens) is always cut to max_model_len."""
    scenario = make_scenario({"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4},
                              "engine": {"max_num_seqs": 1024, "max_model_len": 16_384}})
    trace = generate_trace(scenario.workload, scenario.seed)
    prompt, output = trace.prompt_tokens.mean(), trace.output_tokens.mean()
    pool = (4 * 81_559 * 2**20 * 0.9 - 2 * scenario.model.param_count) / 327_680
    in_flight = pool / (prompt + output / 2)
    assert in_flight < 1024                               # the memory binds here, not max_num_seqs
    rule = batch_token_rule(scenario)
    assert rule.kv_pool_tokens == pytest.approx(pool)
    assert rule.tokens == int(in_flight * (1 + prompt / output))
    assert 1024 < rule.tokens < 16_384 < pool             # a budget, not the cap
    roomy = replace(scenario, deployment=replace(scenario.deployment, tensor_parallel=8))
    assert batch_token_rule(roomy).sequences == 1024       # max_num_seqs binds with more memory
    assert batch_token_rule(roomy).tokens == min(int(1024 * (1 + prompt / output)), 16_384)


def test_config_overrides_are_valid_scenario_keys(scenario):
    for config in (Config(OFF, 1024, None), Config(KChoice(KPolicyName.STATIC, 3), 2048, 0.05),
                   Config(KChoice(KPolicyName.ADAPTIVE, 4), 4096, 1.0)):
        built = variant(scenario, config.overrides(scenario))
        assert built.engine.max_batch_tokens == config.max_batch_tokens
        assert built.engine.queue_timeout_s == config.queue_timeout_s
        assert built.speculating == (config.k != OFF)
        if config.k != OFF:
            assert (built.speculation.policy.policy, built.speculation.policy.k) == (config.k.policy, config.k.k)


def test_the_adaptive_search_stays_within_what_medusa_can_draft():
    """Three Medusa heads draft at most three tokens, and the scenario refuses k or k_max above
    that. The search's adaptive rule (k0 4, k_max 8 by default) is held to the heads: k0 = 3, k_max 3,
    and every setting it tries builds a valid scenario the fluid model can score."""
    medusa = make_scenario(merge(SMALL, {"speculation": {"draft": "medusa", "heads": 3, "k": 2, "k_max": 3}}))
    assert [str(k) for k in k_options(medusa)] == ["off", "static:1", "static:2", "static:3", "adaptive:3"]
    for k in k_options(medusa)[1:]:
        built = variant(medusa, Config(k, 2048, None).overrides(medusa))
        assert built.speculation.policy.k_max == 3 and built.speculation.policy.k <= 3
    assert analytic_rate(built) > 0                  # the adaptive rule, last: scored, not refused


@pytest.mark.slow
def test_printout_names_the_settings_and_the_gain(result, scenario):
    text = format_recommendation(result, scenario)
    assert str(result.best.k) in text and "rule-of-thumb defaults" in text and "goodput by" in text


@pytest.mark.parametrize("argv, message", [
    (["--objective", "latency"], "unknown objective"),
    (["--seeds", "1"], "at least 2 seeds"),
    (["--top", "0"], "argument --top: out of range"),
    (["--search", "everything"], "unknown search"),
    (["--search", "classes"], "no traffic classes"),
    (["--class-timeouts", "5 parsecs"], "cannot read this as a duration"),
    (["--class-timeouts", ","], "no queue timeout given"),
    (["--class-timeouts=-3ms"], "argument --class-timeouts: value out of range"),
])
def test_cli_errors_exit_2(scenario, capsys, argv, message):
    assert main(["recommend", scenario.path, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_unreachable_slo_exits_2_with_a_message(tmp_path, capsys):
    path = tmp_path / "tight.yaml"
    path.write_text(yaml.safe_dump(merge(SMALL, {"slo": {"tpot": "1 ms"}})))
    assert main(["recommend", str(path), "--seeds", "2", "--top", "1", "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "no searched setting meets the SLO targets" in err
    # One progress bar counting the simulations, with no total: the search decides as it goes how many it runs.
    bar = err.split("\r")[-1]
    done = re.search(r"recommend: (\d+) simulations \[", bar)
    assert done and int(done.group(1)) >= 2 * 4 and "/" not in bar.split("[")[0], bar


@pytest.mark.parametrize("slo, message", [
    ({"ttft": "1 s", "percentile": 0}, "value out of range"),
    ({"ttft": "1 s", "percentile": {"tpot": 99}}, "needs a limit"),
])
def test_bad_percentile_targets_are_config_errors(slo, message):
    with pytest.raises(ConfigError, match=message):
        make_scenario({"slo": slo})


@pytest.mark.slow
def test_cost_objective_ranks_by_dollars_per_million_tokens(scenario, shared_runs):
    rec = recommend(scenario, objective="cost", seeds=2, top=1, workers=2, tolerance=0.1)
    passing = rec.table[rec.table["meets_scenario_rate"]]
    assert rec.table.iloc[0]["usd_per_million_output_tokens"] == passing["usd_per_million_output_tokens"].min()
    assert "cuts cost by" in format_recommendation(rec, scenario)


def test_class_search_candidates_are_valid_scenarios_with_the_timeouts_searched():
    """Step 4's candidates (every policy x each class's timeout from the ladder or its own) build scenarios
    whose classes carry exactly those timeouts, under that policy; step 3 leaves them to step 4."""
    from llmsim.config.policies import SchedulingPolicy
    from llmsim.scenario.scenario import load_scenario
    from llmsim.search.recommend import (CLASS_TIMEOUTS_S, _neighbours, _with_timeout, class_timeout_options,
                                         class_timeouts)

    three = load_scenario("scenarios/llama3-8b-h100-three-classes.yaml")
    start = Config(OFF, 8192, None)
    # Practice tiers: 50, 200 and 1000 ms; each class's options are the ladder and its own.
    own = class_timeouts(start, three)
    assert dict(own) == {"interactive": 0.05, "standard": 0.2, "batch": 1.0}
    assert class_timeout_options(CLASS_TIMEOUTS_S, 0.3) == sorted([*CLASS_TIMEOUTS_S, 0.3])
    assert class_timeout_options(CLASS_TIMEOUTS_S, None) == sorted(CLASS_TIMEOUTS_S)
    for policy in SchedulingPolicy:
        config = _with_timeout(replace(start, policy=policy, class_timeouts=own), "standard", 0.025)
        built = variant(three, config.overrides(three))
        assert {c.name: c.queue_timeout_s for c in built.workload.classes} == {
            "interactive": 0.05, "standard": 0.025, "batch": 1.0}
        assert built.engine.scheduling_policy == policy
    # A class without a timeout keeps none (None is not written over the class's own setting).
    none = replace(start, class_timeouts=(("interactive", None), ("standard", 0.2), ("batch", 1.0)))
    assert "workload.classes.interactive.queue_timeout" not in none.overrides(three)
    # Step 3 leaves the policy and the class timeouts alone, with or without classes.
    assert not any(c.policy or c.class_timeouts for c in _neighbours(start, three))
    assert not any(c.policy or c.class_timeouts for c in _neighbours(start, make_scenario()))


def test_a_scenario_changed_with_replace_keeps_its_change_in_the_searched_settings():
    """recommend's settings (engine knobs, a class-free timeout) on a scenario whose max_num_seqs was changed with
    dataclasses.replace: before, they were laid over the YAML mapping and refused such a scenario (ValueError)."""
    scenario = make_scenario()
    changed = replace(scenario, engine=replace(scenario.engine, max_num_seqs=64))
    config = Config(OFF, max_batch_tokens=4096, queue_timeout_s=0.5)
    got = variant(changed, config.overrides(changed))
    assert got == make_scenario({"engine": {"max_num_seqs": 64, "max_batch_tokens": 4096, "queue_timeout": "500 ms"}})


@pytest.mark.slow
def test_runs_stopped_once_sure_to_miss_leave_the_search_unchanged(scenario, monkeypatch):
    """The search asks only whether points meet the targets, so stopping a run once it is sure to miss them
    (llmsim.sim.missed) must give the table the whole runs give: the same settings, rates and figures."""
    import contextlib
    from llmsim.search import recommend as recommend_module
    from llmsim.search import sweeps

    stopped = []
    whole_point = sweeps.simulate_point

    def counting(point_scenario, stop_when_missed=None, checkpoints=None):
        row = whole_point(point_scenario, stop_when_missed, checkpoints)
        stopped.append(row.get("stopped_by") == "missed")
        return row

    monkeypatch.setattr(sweeps, "simulate_point", counting)
    # The fluid model's rate doubled: every bisection starts far past capacity, where runs are sure to miss.
    fluid_rate = recommend_module.analytic_rate
    monkeypatch.setattr(recommend_module, "analytic_rate", lambda *args: 2 * fluid_rate(*args))
    with_stops = recommend(scenario, seeds=2, top=2, workers=1, tolerance=0.1)
    assert any(stopped), "no run of the search stopped: the test would not compare anything"
    monkeypatch.setattr(recommend_module, "stopping_decided_runs", contextlib.nullcontext)
    whole = recommend(scenario, seeds=2, top=2, workers=1, tolerance=0.1)
    assert with_stops.best == whole.best
    shown = ["config", "max_rate_per_s", "max_rate_per_s.ci95", "meets_scenario_rate"]
    assert with_stops.table[shown].equals(whole.table[shown])
    assert with_stops.at_scenario_rate.equals(whole.at_scenario_rate)


def test_max_batch_tokens_is_searched_only_where_a_pool_runs_the_engine_blocks():
    """Where both pools of a disaggregated deployment set their own max batch tokens, the engine block's changes
    no run (the simulator's records are the same at 512 and 16384): the search holds the scenario's, in its grid,
    its defaults and its refinement. Where one pool takes the block's, it changes the runs and is searched."""
    from llmsim.search.recommend import _Search, _neighbours, batch_token_options, searches_batch_tokens
    from llmsim.sim.simulate import simulate_whole

    base = variant(llmsim.load_scenario("scenarios/llama3-70b-disagg-h100.yaml"), {"workload.num_requests": 60})
    both = variant(base, {"deployment.disaggregation.prefill.engine": {"max_batch_tokens": 4096},
                          "deployment.disaggregation.decode.engine": {"max_batch_tokens": 1024}})
    one = variant(base, {"deployment.disaggregation.decode.engine": {"max_batch_tokens": 1024}})

    def records(scenario, tokens):
        return simulate_whole(variant(scenario, {"engine.max_batch_tokens": tokens}), force=True).requests

    assert records(both, 512).equals(records(both, 16384))
    assert not records(one, 512).equals(records(one, 16384))
    assert not searches_batch_tokens(both) and searches_batch_tokens(one) and searches_batch_tokens(base)
    own = both.engine.max_batch_tokens
    assert batch_token_options(both) == [own] and len(batch_token_options(one)) > 1
    assert {c.max_batch_tokens for c in _neighbours(Config(OFF, own, None), both)} == {own}
    assert {c.max_batch_tokens for c in _Search(both, [1, 2], "goodput", 1, 0.04, None).defaults} == {own}
