"""The controller, autoscaling and rollouts are visible: `run --plot` draws the controlled knob and
the replica count, and a rollout run writes what --plot, --iterations, --bench-json and --parquet ask
for (or refuses a flag it cannot honour, exit 2)."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from PIL import Image

from llmsim.cli.main import main
from tests.helpers import REPO

SCENARIOS = REPO / "scenarios"
DPI, BASE_INCHES, PANEL_INCHES = 110, 10, 2      # plots.timeline's figure: 10 in for its four panels, 2 per extra


def panels_drawn(png) -> int:
    """The panels in a timeline, from its height in pixels (the figure grows by a fixed height per panel)."""
    height = Image.open(png).size[1]
    return 4 + round((height / DPI - BASE_INCHES) / PANEL_INCHES)


@pytest.mark.parametrize("name, panel_file", [("llama3-8b-h100-controller", "control.csv"),
                                              ("llama3-8b-h100-autoscaling", None)])
def test_plot_has_a_panel_for_what_changes_during_the_run(tmp_path, capsys, name, panel_file):
    out = tmp_path / "out"
    assert main(["run", str(SCENARIOS / f"{name}.yaml"), "--out", str(out), "--plot"]) == 0
    assert panels_drawn(out / "timeline.png") == 5
    if panel_file:              # the knob moved: what the panel draws is in the run's decisions
        control = pd.read_csv(out / panel_file)
        assert control["value"].nunique() > 1
    else:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["autoscaling"]["scale_ups"] >= 1


def test_a_plain_run_keeps_its_four_panels(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(SCENARIOS / "llama3-8b-h100-chat.yaml"), "--out", str(out), "--plot",
                 "--requests", "200"]) == 0
    assert panels_drawn(out / "timeline.png") == 4


def test_a_rollout_writes_every_file_its_flags_ask_for(tmp_path, capsys):
    out = tmp_path / "out"
    scenario = str(SCENARIOS / "llama3-8b-h100-canary.yaml")
    assert main(["run", scenario, "--out", str(out), "--requests", "1500", "--plot", "--iterations",
                 "--bench-json", "--parquet"]) == 0
    users = pd.read_csv(out / "requests.csv")
    parquet = pd.read_parquet(out / "requests.parquet")
    assert list(parquet.columns) == list(users.columns)
    for column in ("id", "group", "status", "arrival_s", "finish_s"):
        pd.testing.assert_series_equal(parquet[column], users[column], check_dtype=False)
    bench = json.loads((out / "vllm_bench.json").read_text())
    assert bench["completed"] == int((users["status"] == "finished").sum())
    iterations = pd.read_csv(out / "iterations.csv")
    groups = set(json.loads((out / "summary.json").read_text())["rollout"]["groups"])
    assert set(iterations["group"]) == groups
    assert (out / "timeline.png").stat().st_size > 1000
    # Run again without the flags: no earlier optional file is left beside the new records.
    assert main(["run", scenario, "--out", str(out), "--requests", "1500", "--overwrite"]) == 0
    assert not any((out / name).exists() for name in ("requests.parquet", "vllm_bench.json", "iterations.csv",
                                                      "timeline.png"))


def test_a_rollout_refuses_per_token_gaps_with_a_reason(tmp_path, capsys):
    assert main(["run", str(SCENARIOS / "llama3-8b-h100-canary.yaml"), "--out", str(tmp_path / "o"),
                 "--bench-detailed"]) == 2
    err = capsys.readouterr().err
    assert "--bench-detailed" in err and "rollout" in err
