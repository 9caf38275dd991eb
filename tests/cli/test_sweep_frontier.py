"""`llmsim sweep`: the frontier holds only points that meet the SLO on every seed, and a rerun without
--plot leaves no frontier.png of the earlier results beside the new frontier.csv."""
from __future__ import annotations

import pandas as pd
import yaml

from llmsim.analysis.names import OUTPUT_TOKENS_PER_S_PER_DEVICE, SLO_MET, TPOT_P95
from llmsim.cli.main import main
from tests.helpers import BASE, merge

RATES = [2.0, 8.0, 30.0, 60.0]          # one H100: TPOT p95 rises with the load, past the limit at the top
SCENARIO = merge(BASE, {"workload": {"num_requests": 200}, "slo": {"tpot": "14 ms"}})


def sweep(tmp_path, *flags: str) -> int:
    scenario, grid = tmp_path / "scenario.yaml", tmp_path / "grid.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    grid.write_text(yaml.safe_dump({"workload.arrival.rate": RATES}))
    return main(["sweep", str(scenario), "--grid", str(grid), "--out", str(tmp_path / "out"), "--workers", "1",
                 "--seeds", "1,2", *flags])


def dominated(point: pd.Series, by: pd.Series) -> bool:
    """``by`` is no slower and no less productive than ``point``, and better on one of the two."""
    latency, throughput = TPOT_P95, OUTPUT_TOKENS_PER_S_PER_DEVICE
    return (by[latency] <= point[latency] and by[throughput] >= point[throughput]
            and (by[latency] < point[latency] or by[throughput] > point[throughput]))


def test_the_frontier_leaves_out_points_that_miss_the_slo_and_no_stale_plot_stays(tmp_path, capsys):
    assert sweep(tmp_path, "--plot") == 0
    out = tmp_path / "out"
    rows = pd.read_csv(out / "results.csv")
    met = rows[SLO_MET].astype(str).str.lower().eq("true").groupby(rows["workload.arrival.rate"]).all()
    assert met.any() and not met.all()                     # the grid has points on both sides of the SLO
    points = rows.groupby("workload.arrival.rate")[[TPOT_P95, OUTPUT_TOKENS_PER_S_PER_DEVICE]].mean()
    # The point of highest throughput misses the SLO: without the filter it would be on the frontier.
    assert not met[points[OUTPUT_TOKENS_PER_S_PER_DEVICE].idxmax()]
    frontier = pd.read_csv(out / "frontier.csv")
    on = set(frontier["workload.arrival.rate"])
    assert on and all(met[rate] for rate in on)
    meeting = points[met]
    for rate, point in meeting.iterrows():            # brute force: every other meeting point is dominated
        if rate not in on:
            assert any(dominated(point, meeting.loc[other]) for other in on)
    printed = capsys.readouterr().out
    assert f"{int((~met).sum())} missing the SLO on some seed left out of it" in printed
    assert (out / "frontier.png").exists()

    assert sweep(tmp_path) == 0
    assert not (out / "frontier.png").exists()
    assert "removed the earlier" in capsys.readouterr().out
