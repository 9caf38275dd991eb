"""Capacity plans: the fewest replicas that meet the SLO targets, checked by direct simulation."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml

import llmsim
from llmsim.analysis.metrics import summarize
from llmsim.search import plan as planning
from llmsim.cli.main import main
from llmsim.scenario.variants import variant
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import lookup_hardware

from tests.helpers import BASE, REPO, merge

SMALL = merge(BASE, {"workload": {"num_requests": 1200, "arrival": {"rate": 30}},
                     "slo": {"ttft": "300 ms", "tpot": "30 ms", "percentile": 95}})
RATE = 130.0


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "small.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "plan": {"hardware": ["H100-SXM", "H200"]}}))
    return path


@pytest.fixture(scope="module")
def table(scenario_file):
    return llmsim.plan(scenario_file, RATE, workers=1, keep_layout=True)


def met(scenario_file, hardware, replicas) -> bool:
    scenario = variant(llmsim.load_scenario(scenario_file),
                                {"hardware": hardware, "deployment.replicas": replicas,
                                 "workload.arrival.rate": RATE})
    return summarize(llmsim.simulate(scenario)).to_dict()["slo"]["met"]


def test_candidates_come_from_the_plan_section(table):
    assert list(table["hardware"]) == ["H100-SXM", "H200"]


def test_answer_is_the_fewest_replicas_that_meet_the_targets(table, scenario_file):
    for row in table.itertuples():
        assert row.replicas >= 1
        assert met(scenario_file, row.hardware, int(row.replicas))
        if row.replicas > 1:
            assert not met(scenario_file, row.hardware, int(row.replicas) - 1)


def test_cost_and_energy_follow_the_profiles(table):
    for row in table.itertuples():
        hw = lookup_hardware(row.hardware)
        devices = row.replicas * row.devices_per_replica
        assert row.devices == devices
        assert row.usd_per_hour == pytest.approx(devices * hw.price_per_hour_usd)
        assert row.usd_per_million_output_tokens == pytest.approx(
            row.usd_per_hour / 3600 / row.output_tokens_per_s * 1e6)
        assert row.joules_per_output_token == pytest.approx(devices * hw.tdp_w / row.output_tokens_per_s)


@pytest.mark.slow
def test_a_wrong_analytic_bracket_only_costs_simulations(table, scenario_file, monkeypatch):
    """Simulation decides: a bracket far too high, or far too low, gives the same answer."""
    expected = int(table.set_index("hardware").loc["H100-SXM", "replicas"])
    for bracket in ((7, 7), (1, 1)):
        monkeypatch.setattr(planning, "analytic_bracket", lambda *args, b=bracket: b)
        again = llmsim.plan(scenario_file, RATE, ["H100-SXM"], workers=1, keep_layout=True)
        assert int(again["replicas"].iloc[0]) == expected


def test_unreachable_within_the_replica_cap_is_reported(scenario_file):
    """Far beyond the cap (the analytic capacity bound, less its error, exceeds it) nothing is simulated;
    just beyond what the bound can tell, the cap itself is simulated and fails."""
    row = llmsim.plan(scenario_file, 400.0, ["H100-SXM"], workers=1, max_replicas=2, keep_layout=True).iloc[0]
    assert math.isnan(row["replicas"]) and row["simulations"] == 0
    assert "unreachable within 2 replicas" in row["note"]
    assert row["analytic_capacity_bound"] / (1 + planning.FLUID_CAPACITY_ERROR) > 2
    close = llmsim.plan(scenario_file, 400.0, ["H100-SXM"], workers=1, keep_layout=True,
                        max_replicas=math.ceil(row["analytic_capacity_bound"]) - 1).iloc[0]
    assert math.isnan(close["replicas"]) and close["simulations"] >= 1 and "not met with" in close["note"]


@pytest.mark.parametrize("argv, message", [
    (["--target-rate", "-3"], "positive number of requests per second"),
    (["--target-rate", "fast"], "cannot read this as a rate"),
    (["--target-rate", "10", "--hardware", "H100-PCIe-X"], "unknown hardware profile"),
    (["--target-rate", "400", "--hardware", "H100-SXM", "--max-replicas", "2", "--keep-layout"], "no candidate meets"),
])
def test_cli_errors_exit_2_with_a_message(scenario_file, capsys, argv, message):
    assert main(["plan", str(scenario_file), *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_plan_section_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "plan": {"hardware": "H100-SXM"}}))
    with pytest.raises(ConfigError, match="plan.hardware"):
        llmsim.plan(path, RATE)


def test_cli_prints_the_table_and_writes_csv(scenario_file, tmp_path, capsys):
    out = tmp_path / "plan.csv"
    assert main(["plan", str(scenario_file), "--target-rate", "130/s", "--hardware", "H200", "--workers", "1",
                 "--seeds", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "H200" in captured.out and "USD/M tok" in captured.out
    assert max(map(len, captured.out.splitlines())) <= 120            # a terminal's width; the CSV has every column
    assert "usd_per_million_output_tokens" in out.read_text().splitlines()[0]
    # The progress bar counts simulations: every replica count tried, once per seed.
    simulations = 2 * int(pd.read_csv(out)["simulations"].iloc[0])
    assert f"{simulations}/{simulations} " in captured.err.split("\r")[-1], captured.err


def test_a_profile_file_as_the_scenario_hardware_plans_like_the_profile(tmp_path, monkeypatch, capsys):
    """hardware: a profile YAML next to the scenario (what llmsim calibrate writes): plan finds it
    there (its own name is no catalog profile) and keeps the scenario's placement; --hardware with
    a file path finds it from the current folder."""
    folder = tmp_path / "scenarios"
    folder.mkdir()
    profile = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm.yaml").read_text())
    (folder / "my-gpu.yaml").write_text(yaml.safe_dump({**profile, "name": "my-gpu"}))
    small = merge(SMALL, {"workload": {"num_requests": 300}})
    path = folder / "custom.yaml"
    path.write_text(yaml.safe_dump({**small, "hardware": "my-gpu.yaml"}))
    reference = tmp_path / "reference.yaml"
    reference.write_text(yaml.safe_dump(small))
    monkeypatch.chdir(tmp_path)
    expected = llmsim.plan(reference, 60.0, workers=1, keep_layout=True)
    for hardware in (None, ["scenarios/my-gpu.yaml"]):
        row = llmsim.plan(path, 60.0, hardware, workers=1, keep_layout=True).iloc[0]
        assert row["replicas"] == expected["replicas"].iloc[0] >= 1 and row["placement"] == "tp1 x pp1"
        assert row["usd_per_hour"] == expected["usd_per_hour"].iloc[0]
    assert main(["plan", str(path), "--target-rate", "60", "--workers", "1"]) == 0
    assert "my-gpu.yaml" in capsys.readouterr().out


def test_other_chips_are_placed_afresh_and_speculation_keeps_one_stage():
    """Llama-3.1-70B with a 1B draft on H200: auto placement alone would choose 2 pipeline stages
    (fewest devices, smaller tp first), which speculative decoding does not support."""
    scenario = llmsim.load_scenario(REPO / "scenarios/llama3-70b-h100-speculative.yaml")
    plain = variant(scenario, {"speculation": None, "hardware": "H200",
                                        "deployment.tensor_parallel": "auto", "deployment.pipeline_parallel": "auto"})
    assert plain.deployment.pipeline_parallel == 2
    placed = variant(scenario, planning._placement_overrides(scenario, "H200"))
    assert (placed.deployment.tensor_parallel, placed.deployment.pipeline_parallel) == (2, 1)


def test_a_target_rate_the_workload_cannot_take_is_a_config_error(scenario_file, capsys):
    """Not a per-chip 'does not fit': at 1e-300/s the requests would arrive near 1e303 s."""
    assert main(["plan", str(scenario_file), "--target-rate", "1e-300"]) == 2
    err = capsys.readouterr().err
    assert "workload.arrival.rate" in err and "does not fit" not in err and "at least" in err


@pytest.mark.parametrize("search", ["plan", "layouts", "kept layout"])
def test_a_scenario_without_an_slo_is_refused_before_any_chip_is_tried(tmp_path, search):
    """Both plans (each chip's layouts searched, or the scenario's own kept) and the report's layout
    search start from the same checks: with no SLO there is nothing to plan for."""
    from llmsim.search.layout import cheapest_layouts, plan
    path = tmp_path / "no-slo.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in SMALL.items() if key != "slo"}))
    with pytest.raises(ConfigError, match="no SLO to plan for") as error:
        if search == "layouts":
            cheapest_layouts(path, RATE, ["H100-SXM"])
        else:
            plan(path, RATE, ["H100-SXM"], keep_layout=search == "kept layout")
    assert error.value.key == "slo"
