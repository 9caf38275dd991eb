"""Figures and settings that make sense: utilisations within [0, 1], one meaning for --seeds,
lengths whose clipping keeps their mean, a KV cache that holds the longest request, and an
arrival rate that brings requests within the window."""
from __future__ import annotations

import math

import pytest
import yaml

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import build_parser, main
from llmsim.cli.options import SEEDS_HELP, parse_seeds
from llmsim.errors import ConfigError

from tests.helpers import BASE, make_scenario, merge

UTILISATIONS = ("busy_fraction", "mfu", "mfu_while_busy", "bandwidth_utilisation",
                "kv_occupancy_mean", "kv_occupancy_max")

# Saturated runs (busy all the time), where iterations straddling the window's edges used to
# count in full: static batching, continuous batching, and two pipeline stages of each.
SATURATED = {
    "static": {"engine": {"batching": "static", "max_num_seqs": 32}},
    "continuous": {},
    "pipelined": {"deployment": {"tensor_parallel": 1, "pipeline_parallel": 2}},
    "pipelined-static": {"engine": {"batching": "static", "max_num_seqs": 32},
                         "deployment": {"tensor_parallel": 1, "pipeline_parallel": 2}},
}


@pytest.mark.parametrize("name", SATURATED)
def test_every_utilisation_is_a_fraction(name):
    overrides = {"workload": {"arrival": {"rate": 40.0}, "num_requests": 600}, "simulation": {"warmup": "3 s"}}
    result = simulate(make_scenario({**SATURATED[name], **overrides}))
    util = summarize(result).to_dict()["utilisation"]
    for key in UTILISATIONS:
        assert 0.0 <= util[key] <= 1.0, (key, util[key])
    assert util["busy_fraction"] > 0.95                  # saturated: the bound is what is tested
    assert util["mfu_while_busy"] == pytest.approx(util["mfu"] / util["busy_fraction"])


def test_a_rate_too_low_for_simulated_time_is_refused():
    """At 1e-300/s arrivals land near 1e301 s, where a float64 second cannot hold a millisecond:
    every latency read 0 and every SLO was met."""
    with pytest.raises(ConfigError, match="workload.arrival.rate.*take about 1e\\+303 s"):
        make_scenario({"workload": {"arrival": {"rate": "1e-300/s"}}})


def test_a_window_without_arrivals_meets_no_slo():
    result = simulate(make_scenario({"workload": {"arrival": {"rate": "1e-300/s"}, "num_requests": None,
                                                  "duration": "60 s"}, "slo": {"ttft": "500 ms"}}))
    summary = summarize(result).to_dict()
    assert summary["requests"]["arrived"] == 0
    assert math.isnan(summary["slo"]["attainment"]) and not summary["slo"]["met"]


def test_the_kv_cache_must_hold_one_longest_request():
    """A cache of 11,136 tokens (0.23 of an H100 after Llama-3.1-8B's weights) holds a request of
    max_model_len 11,136 tokens, not one of 11,137: those would all be rejected at run time."""
    engine = {"memory_utilization": 0.23}
    capacity = make_scenario({"engine": {**engine, "max_model_len": 4096}}).memory.kv_capacity_tokens
    assert capacity == 11136
    make_scenario({"engine": {**engine, "max_model_len": capacity}})
    with pytest.raises(ConfigError) as caught:
        make_scenario({"engine": {**engine, "max_model_len": capacity + 1}})
    text = str(caught.value)
    for fragment in ("engine.max_model_len", "11,136 tokens", "11,137", "max_model_len <= 11,136",
                     "memory_utilization"):
        assert fragment in text, (fragment, text)


# --seeds: one meaning in sweep, plan and recommend ----------------------------------------------

def test_seeds_are_a_count_from_the_scenarios_seed_or_a_list(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("seed: 40\n")
    assert parse_seeds(None, path) is None
    assert parse_seeds("3", path) == [40, 41, 42]
    assert parse_seeds("3,7,11", path) == [3, 7, 11]
    assert parse_seeds("7,", path) == [7]
    assert parse_seeds("2", make_scenario()) == [11, 12]          # helpers' BASE has seed 11
    (tmp_path / "noseed.yaml").write_text("name: x\n")
    assert parse_seeds("2", tmp_path / "noseed.yaml") == [0, 1]
    for bad in ("0", "-1", "two", "1 2", "3,3", "1,-2", ","):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad, path)


def test_every_command_reads_seeds_the_same_way():
    """The same option with the same help in sweep, plan and recommend; bad values exit 2."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    helps = {}
    for name in ("sweep", "plan", "recommend"):
        option = next(a for a in commands[name]._actions if "--seeds" in a.option_strings)
        assert option.nargs is None and option.type("3,7") == "3,7"       # checked as read, kept as text
        helps[name] = option.help.split(" (default")[0]
    assert len(set(helps.values())) == 1 and SEEDS_HELP in helps["plan"]


@pytest.mark.parametrize("command", [["sweep", "--grid", "g.yaml"], ["plan", "--target-rate", "5"], ["recommend"]])
def test_bad_seeds_exit_2_in_every_command(tmp_path, capsys, command):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, {"slo": {"ttft": "1 s"}})))
    assert main([command[0], str(path), *command[1:], "--seeds", "1,1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and "'1,1'" in err and "Traceback" not in err


def test_run_requests_sets_how_many_requests_arrive(tmp_path):
    """`run --requests N` simulates N requests of a scenario that asks for another count; they are the
    first N of the scenario's own arrivals (the same seed draws the same stream)."""
    import csv

    from tests.helpers import REPO
    scenario = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
    assert yaml.safe_load(scenario.read_text())["workload"]["num_requests"] == 300
    for count in (60, 120):
        assert main(["run", str(scenario), "--requests", str(count), "--out", str(tmp_path / str(count))]) == 0
    arrivals = {count: [row["arrival_s"] for row in csv.DictReader((tmp_path / str(count) / "requests.csv").open())]
                for count in (60, 120)}
    assert len(arrivals[60]) == 60 and len(arrivals[120]) == 120
    assert sorted(arrivals[60], key=float) == sorted(arrivals[120], key=float)[:60]
