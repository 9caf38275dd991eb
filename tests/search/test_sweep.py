"""Sweeps: each row is the simulation of its scenario, seeds replicate, results resume from
disk, a failing point keeps the others, bad grids are clear errors, Dask gives the same rows."""
from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import yaml

import llmsim
import llmsim.search.sweeps as sweeps
from llmsim import ConfigError, flatten, simulate, sweep
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.scenario.overrides import apply_overrides, grid_points
from llmsim.search.sweeps import mean_over_seeds, run_points

from tests.helpers import BASE, REPO, make_scenario, merge, roofline_document

SMALL = {"workload": {"num_requests": 60}, "slo": {"ttft": "300 ms", "tpot": "40 ms"}}
GRID = {"workload.arrival.rate": [5.0, 20.0], "engine.max_batch_tokens": [2048, 8192]}
METRICS = ["latency.ttft_s.p95", "latency.tpot_s.p95", "throughput.output_tokens_per_s",
           "slo.attainment", "requests.finished", "utilisation.mean_batch_size"]


def small():
    return make_scenario(SMALL)


def direct(overrides: dict, seed: int | None = None) -> dict:
    """The summary of the scenario built by nesting the overrides by hand (not through the sweep)."""
    scenario = make_scenario(merge(SMALL, overrides))
    return flatten(summarize(simulate(scenario if seed is None else scenario.with_seed(seed))).to_dict())


def same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_each_row_is_the_simulation_of_its_point():
    rows = sweep(small(), GRID, workers=2)
    assert len(rows) == 4 and (rows["error"] == "").all()
    assert list(rows.columns[:5]) == ["workload.arrival.rate", "engine.max_batch_tokens", "seed", "point_id", "error"]
    own = small().workload
    for _, row in rows.iterrows():
        # The arrival window keeps its length in seconds: the request count follows the rate.
        count = math.ceil(own.num_requests * row["workload.arrival.rate"] / own.arrival.rate_per_s)
        expected = direct({"workload": {"arrival": {"rate": row["workload.arrival.rate"]}, "num_requests": count},
                           "engine": {"max_batch_tokens": int(row["engine.max_batch_tokens"])}})
        assert row["requests.arrived"] == count
        assert all(same(row[key], expected[key]) for key in expected if key != "hardware"), row["point_id"]
    assert rows["point_id"].is_unique


def test_seeds_replicate_points_on_shared_traces():
    rows = sweep(small(), {"engine.max_batch_tokens": [2048, 8192]}, seeds=[1, 2], workers=1)
    assert list(rows["seed"]) == [1, 2, 1, 2]
    for _, row in rows.iterrows():
        expected = direct({"engine": {"max_batch_tokens": int(row["engine.max_batch_tokens"])}}, row["seed"])
        assert all(same(row[k], expected[k]) for k in METRICS)
    # Common random numbers: the same seed gives both settings the same requests (same offered
    # load and window); different seeds give different requests.
    by_seed = rows.groupby("seed")["throughput.offered_requests_per_s"]
    assert (by_seed.nunique() == 1).all() and rows.loc[0, "window_s"] != rows.loc[1, "window_s"]
    means = mean_over_seeds(rows, ["slo.attainment"])
    assert list(means["seeds"]) == [2, 2]
    first = rows[rows["engine.max_batch_tokens"] == 2048]["latency.tpot_s.p95"]
    assert means.loc[0, "latency.tpot_s.p95"] == pytest.approx(first.mean())
    # Two seeds: the 95% t interval half-width is t(0.975, 1) = 12.706 standard errors.
    assert means.loc[0, "slo.attainment.ci95"] == pytest.approx(
        12.7062 * rows[rows["engine.max_batch_tokens"] == 2048]["slo.attainment"].std() / math.sqrt(2), rel=1e-4)


def test_overrides_follow_dotted_paths():
    base = merge(BASE, SMALL)
    data = apply_overrides(base, {"workload.prompt_tokens.mean": 64, "engine.chunked_prefill": False,
                                  "workload.output_tokens": {"distribution": "fixed", "value": 7},
                                  "slo": None, "deployment.replicas": 2})
    assert data["workload"]["prompt_tokens"] == {**base["workload"]["prompt_tokens"], "mean": 64}
    assert data["workload"]["output_tokens"] == {"distribution": "fixed", "value": 7}     # replaced whole
    assert data["engine"] == {**base["engine"], "chunked_prefill": False}
    assert data["deployment"] == {"replicas": 2} and base.get("deployment") is None      # base untouched
    assert "slo" not in data and "slo" in base                                            # None: unset
    with pytest.raises(ConfigError, match="'hardware' is a value"):
        apply_overrides(base, {"hardware.name": "x"}, "grid.yaml")
    points = grid_points({"a.b": [1, 2, 3], "c": ["x", "y"]})
    assert points == [{"a.b": a, "c": c} for a in (1, 2, 3) for c in ("x", "y")]


def test_resume_skips_finished_points_and_drops_a_torn_line(tmp_path, monkeypatch):
    calls = []
    real = sweeps.simulate_point
    monkeypatch.setattr(sweeps, "simulate_point", lambda scenario, rule=None: calls.append(1) or real(scenario, rule))
    grid = {"workload.arrival.rate": [4.0, 8.0, 16.0]}
    first = sweep(small(), grid, out=tmp_path, workers=1)
    assert len(calls) == 3
    results = tmp_path / "results.csv"
    lines = results.read_text().splitlines(keepends=True)
    # Interrupted while writing the third point: header, two points and half a line.
    results.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    again = sweep(small(), grid, out=tmp_path, workers=1)
    assert len(calls) == 4
    pd.testing.assert_frame_equal(again, first)
    sweep(small(), grid, out=tmp_path, workers=1)
    assert len(calls) == 4                                   # nothing left to do
    # Another point in the same folder runs alone; the old ones stay in the file.
    sweep(small(), {"workload.arrival.rate": [4.0, 32.0]}, out=tmp_path, workers=1)
    assert len(calls) == 5 and len(pd.read_csv(results)) == 4


def test_reused_runs_are_simulated_once_and_give_the_simulated_rows(monkeypatch):
    """Inside reusing_runs a point that resolves to a run already made there (here the scenario's own
    max_batch_tokens written out, and a repeat) is not simulated again; its row equals a fresh
    simulation's. A changed point, or the same one outside the block, is simulated."""
    calls = []
    real = sweeps.simulate_point
    monkeypatch.setattr(sweeps, "simulate_point", lambda scenario, rule=None: calls.append(1) or real(scenario, rule))
    own = small().engine.max_batch_tokens
    with sweeps.reusing_runs():
        first = run_points(small(), [{}], workers=1)
        again = run_points(small(), [{"engine.max_batch_tokens": own}, {}, {"engine.max_batch_tokens": 2 * own}],
                           workers=1)
    assert len(calls) == 2                                   # the first point, then only the changed one
    outside = run_points(small(), [{}], workers=1)
    assert len(calls) == 3
    expected = direct({})
    for rows in (first.iloc[0], again.iloc[0], again.iloc[1], outside.iloc[0]):
        assert all(same(rows[k], expected[k]) for k in METRICS)
    assert again.iloc[2]["requests.arrived"] == expected["requests.arrived"]


def test_resume_simulates_again_when_a_named_file_changed(tmp_path, monkeypatch):
    """The journal key covers what the scenario's files resolved to: after the hardware profile
    it names is recalibrated (same file, new efficiency), the point is simulated again, not read
    back stale; with the file unchanged it is not."""
    calls = []
    real = sweeps.simulate_point
    monkeypatch.setattr(sweeps, "simulate_point", lambda scenario, rule=None: calls.append(1) or real(scenario, rule))
    # The roofline form of the profile, where halving the memory efficiency slows decode 2x.
    profile = roofline_document(yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm.yaml").read_text()))
    write(tmp_path / "gpu.yaml", {**profile, "name": "gpu"})
    scenario = write(tmp_path / "scenario.yaml", merge(merge(BASE, SMALL), {"hardware": "gpu.yaml"}))
    grid = {"workload.arrival.rate": [20.0]}
    first = sweep(scenario, grid, out=tmp_path / "out", workers=1)
    sweep(scenario, grid, out=tmp_path / "out", workers=1)
    assert len(calls) == 1
    slower = copy.deepcopy(profile)
    slower["efficiency"]["memory_bandwidth"]["value"] = profile["efficiency"]["memory_bandwidth"]["value"] / 2
    write(tmp_path / "gpu.yaml", {**slower, "name": "gpu"})
    again = sweep(scenario, grid, out=tmp_path / "out", workers=1)
    assert len(calls) == 2
    assert again.loc[0, "latency.tpot_s.mean"] > 1.5 * first.loc[0, "latency.tpot_s.mean"]


def test_a_second_grid_in_the_same_folder_keeps_its_points_apart(tmp_path):
    """The journal also holds the first grid's rows and columns: the second grid's key must still
    be a point key (before ``seed``), or mean_over_seeds would average distinct points together."""
    sweep(small(), {"workload.arrival.rate": [4.0, 8.0]}, out=tmp_path, workers=1)
    rows = sweep(small(), {"engine.max_batch_tokens": [1024, 8192]}, out=tmp_path, workers=1)
    assert list(rows.columns[:4]) == ["engine.max_batch_tokens", "seed", "point_id", "error"]
    means = mean_over_seeds(rows)
    assert list(means["engine.max_batch_tokens"]) == [1024, 8192] and list(means["seeds"]) == [1, 1]
    # Points with different keys (run_points): every key is a point key, wherever it first appears.
    mixed = run_points(small(), [{"engine.max_batch_tokens": 1024}, {"engine.queue_timeout": "50 ms"},
                                 {"engine.queue_timeout": "200 ms"}], workers=1)
    assert list(mixed.columns[:3]) == ["engine.max_batch_tokens", "engine.queue_timeout", "seed"]
    assert list(mean_over_seeds(mixed)["seeds"]) == [1, 1, 1]


def test_a_scenario_changed_after_loading_keeps_its_change_in_sweeps_and_plans():
    """A sweep over the arrival rate and a plan set their points on the loaded Scenario itself, so a field
    changed with dataclasses.replace is kept: the rows are those of the scenario written with that change
    (built from YAML, not through the sweep). Before, both refused the changed scenario with a ValueError."""
    from dataclasses import replace

    changed = replace(small(), engine=replace(small().engine, max_batch_tokens=1024))
    written = make_scenario(merge(SMALL, {"engine": {"max_batch_tokens": 1024}}))
    grid = {"workload.arrival.rate": [5.0, 40.0]}
    rows, expected = sweep(changed, grid, workers=1), sweep(written, grid, workers=1)
    unchanged = sweep(small(), grid, workers=1)
    assert list(rows["error"]) == ["", ""]
    for metric in METRICS:
        assert list(rows[metric]) == list(expected[metric]), metric
    assert list(rows["latency.ttft_s.p95"]) != list(unchanged["latency.ttft_s.p95"])     # the change mattered
    planned, from_yaml = llmsim.plan(changed, 5.0), llmsim.plan(written, 5.0)
    assert planned.drop(columns="note").equals(from_yaml.drop(columns="note"))
    rows = sweep(small().with_seed(3), {"workload.arrival.rate": [5.0]}, workers=1)
    assert list(rows["seed"]) == [3]


def test_a_point_the_reader_resolves_keeps_a_change_made_with_replace():
    """A key without a typed setter (the memory utilization) is laid over the scenario written out, so a
    change made with replace stays: the rows are those of the file with both settings. Before, it was laid
    over the YAML mapping the scenario was read from, and a changed scenario was refused with a ValueError."""
    from dataclasses import replace

    changed = replace(small(), engine=replace(small().engine, max_batch_tokens=1024))
    written = make_scenario(merge(SMALL, {"engine": {"max_batch_tokens": 1024}}))
    grid = {"engine.memory_utilization": [0.8]}
    rows, expected = sweep(changed, grid, workers=1), sweep(written, grid, workers=1)
    assert list(rows["error"]) == [""]
    for metric in METRICS:
        assert list(rows[metric]) == list(expected[metric]), metric
    assert list(rows["latency.ttft_s.p95"]) != list(sweep(small(), grid, workers=1)["latency.ttft_s.p95"])


def test_a_failing_point_is_recorded_and_the_others_kept(tmp_path, monkeypatch):
    real = sweeps.simulate_point

    def flaky(scenario, stop_when_missed=None):
        if scenario.workload.arrival.rate_per_s == 8.0:
            raise RuntimeError("device on fire\nsecond line")
        return real(scenario, stop_when_missed)

    monkeypatch.setattr(sweeps, "simulate_point", flaky)
    grid = {"workload.arrival.rate": [4.0, 8.0, 16.0]}
    rows = sweep(small(), grid, out=tmp_path, workers=1)
    assert list(rows["error"]) == ["", "RuntimeError: device on fire second line", ""]
    assert rows["requests.finished"].notna().tolist() == [True, False, True]
    monkeypatch.setattr(sweeps, "simulate_point", real)
    rows = sweep(small(), grid, out=tmp_path, workers=1)      # retried, now fine
    assert (rows["error"] == "").all() and rows["requests.finished"].notna().all()


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("grid, key, words", [
    ({"engine.max_batch_tokenz": [4096]}, "engine.max_batch_tokenz", "did you mean 'max_batch_tokens'"),
    ({"workload.arrival.rate": [5, -1]}, "workload.arrival.rate", "out of range"),
    ({"engine.max_batch_tokens": [64]}, "engine.max_batch_tokens", "at least max_num_seqs"),
    ({"speculation.k": 4}, "speculation.k", "non-empty list"),
    ({"hardware": ["H100-SXM", "H900"]}, "hardware", "H900"),
])
def test_bad_grids_name_the_grid_file_key_and_value(tmp_path, capsys, grid, key, words):
    scenario = write(tmp_path / "scenario.yaml", merge(BASE, SMALL))
    grid_file = write(tmp_path / "grid.yaml", grid)
    with pytest.raises(ConfigError) as caught:
        sweep(scenario, grid_file)
    message = str(caught.value)
    assert str(grid_file) in message and f"'{key}'" in message and words in message
    assert main(["sweep", str(scenario), "--grid", str(grid_file), "--out", str(tmp_path / "out")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_invalid_points_can_be_recorded_instead(tmp_path):
    for _ in range(2):
        rows = run_points(small(), [{"engine.max_batch_tokens": 64}, {}], workers=1,
                          on_invalid="record", out=tmp_path)
    assert "at least max_num_seqs" in rows.loc[0, "error"] and rows.loc[1, "error"] == ""
    assert len(pd.read_csv(tmp_path / "results.csv")) == 2                  # recorded once
    means = mean_over_seeds(rows.drop(columns="engine.max_batch_tokens"))    # no point keys: one group
    assert len(means) == 1 and means.loc[0, "seeds"] == 1


@pytest.mark.slow
def test_dask_local_cluster_gives_the_same_rows():
    distributed = pytest.importorskip("distributed")     # installed by CI: pip install ".[distributed]"
    grid = {"workload.arrival.rate": [5.0, 20.0]}
    local = sweep(small(), grid, workers=1)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        remote = sweep(small(), grid, engine="dask", client=client)
        assert "llmsim" in cluster.scheduler.task_prefixes        # the points ran as the cluster's tasks
    pd.testing.assert_frame_equal(remote, local)


def test_cli_sweep_prints_a_table_and_writes_results_and_plot(tmp_path, capsys):
    scenario = write(tmp_path / "scenario.yaml", merge(BASE, SMALL))
    grid_file = write(tmp_path / "grid.yaml", {"workload.arrival.rate": [5.0, 10.0, 20.0]})
    out = tmp_path / "out"
    assert main(["sweep", str(scenario), "--grid", str(grid_file), "--out", str(out), "--workers", "2",
                 "--seeds", "1,2", "--plot"]) == 0
    printed = capsys.readouterr().out
    assert "knee" in printed and "tpot_p95_s" in printed
    assert len(pd.read_csv(out / "results.csv")) == 6
    frontier = pd.read_csv(out / "frontier.csv")                # means over the two seeds
    assert 1 <= len(frontier) <= 3 and frontier["knee"].sum() == 1 and (frontier["seeds"] == 2).all()
    assert frontier["latency.tpot_s.p95.ci95"].notna().all()
    assert (out / "frontier.png").stat().st_size > 1000


def test_cli_sweep_table_shows_a_null_option(tmp_path, capsys):
    """speculation: [null, {...}] (plain decoding against a draft): the null option reads back from
    results.csv as NaN, and the table must still show the column that tells the rows apart."""
    scenario = write(tmp_path / "scenario.yaml", merge(BASE, SMALL))
    grid_file = write(tmp_path / "grid.yaml", {"speculation": [None, {"draft": "ngram", "k": 2}]})
    assert main(["sweep", str(scenario), "--grid", str(grid_file), "--out", str(tmp_path / "out"),
                 "--workers", "1"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split()[0] == "speculation" and "ngram" in lines[1]
