"""Runs stopped once sure to fail (llmsim.search.window.stopping_decided_runs): the verdict is the one the whole
runs give, the rows say they were stopped, and a point only some of whose seeds stopped is settled only where
the other seeds' figures settle it."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from llmsim.analysis import names
from llmsim.analysis.statistics import BATCHES
from llmsim.search.sweeps import reusing_runs
from llmsim.scenario.variants import RATE_KEY, variant
from llmsim.analysis.metrics import share_with_stderr
from llmsim.search.window import (DECIDED_FAIL, FAILING_MARGIN, WIDEST_STDERR, Z, decided_fail_below, judge,
                                  measurement_window, simulate_until_decided, stopping_decided_runs,
                                  typical_latency_s)
from llmsim.sim.missed import ShortfallStop

from tests.helpers import make_scenario

SEEDS = [5, 6]
SLO = {"slo": {"ttft": "500 ms", "tpot": "50 ms", "percentile": 95}, "simulation": {"warmup": "2 s"}}


def _judged(rate: float):
    scenario = make_scenario({**SLO, "workload": {"arrival": {"rate": rate}, "num_requests": 2000}})
    window = measurement_window(scenario, rate, typical_latency_s(scenario, rate))
    return simulate_until_decided(scenario, [{}], [window], [rate], seeds=SEEDS, workers=1)[0]


def test_the_widest_standard_error_of_a_share():
    """Batch means of a 0/1 series lie in [0, 1]: their sample deviation is at most that of half 0s and half 1s."""
    widest = pd.Series([0.0, 1.0] * (BATCHES // 2)).std(ddof=1) / math.sqrt(BATCHES)
    assert pytest.approx(widest) == WIDEST_STDERR


@pytest.mark.parametrize("share", [0.5, 0.9, 0.95, 0.99, 1.0])
def test_the_decided_fail_bound_is_where_the_widest_verdict_reaches_the_target(share):
    below = decided_fail_below(share)
    assert below + Z * math.sqrt(below * (1 - below) / (BATCHES - 1)) == pytest.approx(share)
    assert share - Z * WIDEST_STDERR <= below < share


def _series(hits: int, counted: int, arrangement: str, rng: np.random.Generator) -> pd.Series:
    """``hits`` requests within the limit among ``counted``, in arrival order: first, last, or at random."""
    within = np.zeros(counted, bool)
    if arrangement == "first":
        within[:hits] = True
    elif arrangement == "last":
        within[counted - hits:] = True
    else:
        within[rng.choice(counted, hits, replace=False)] = True
    return pd.Series(within)


@pytest.mark.parametrize("counted", [40, 117, 1000, 5017])
@pytest.mark.parametrize("share", [0.5, 0.95, 0.99])
def test_a_run_the_decided_stop_stops_fails_beyond_doubt_however_it_ends(counted, share):
    """One more sure miss than the rule allows: every way the rest of the window can end (every count of requests
    within the limit left, its hits all first, which makes the batched share highest and its batches two-valued,
    all last, or at random) gives the summary's share and batch-means standard error a decided fail. The
    reference is the summary's own estimator (share_with_stderr), not the bound the rule is derived from."""
    rng = np.random.default_rng(counted)
    most_hits = counted - (DECIDED_FAIL.allowed(share, counted) + 1)
    assert most_hits >= 0 or share == 0.5            # (a window of 117 at 0.5: 17 odd requests, never stopped)
    for hits in range(most_hits + 1):
        for arrangement in ("first", "last", "random"):
            attainment, stderr = share_with_stderr(_series(hits, counted, arrangement, rng))
            assert attainment + Z * stderr < share, (hits, arrangement)
            assert attainment < DECIDED_FAIL.highest(share)


def test_a_point_whose_runs_stop_gets_the_whole_runs_verdict():
    whole = _judged(300.0)
    with reusing_runs(), stopping_decided_runs():
        stopped = _judged(300.0)
    assert (whole.verdict.met, whole.verdict.decided) == (False, True)
    assert (stopped.verdict.met, stopped.verdict.decided) == (False, True)
    assert stopped.stopped and not whole.stopped
    assert (stopped.rows[names.STOPPED_BY] == "missed").all()
    assert set(stopped.rows[names.STOPPED_ON]) <= {"ttft", "e2e", "ttft,e2e"}    # this SLO's watched limits
    assert (stopped.rows["simulated_s"] < whole.rows["simulated_s"]).all()
    # each seed's whole run fails, beyond doubt, every limit its stopped run names
    for seed, on in enumerate(stopped.rows[names.STOPPED_ON]):
        one = judge(whole.rows.iloc[[seed]].reset_index(drop=True))
        for limit in on.split(","):
            margin, spread = one.margins[limit]
            assert margin + spread < 0, (seed, limit)


def test_a_passing_point_is_the_same_with_the_stop():
    whole = _judged(5.0)
    with reusing_runs(), stopping_decided_runs():
        watched = _judged(5.0)
    assert whole.verdict == watched.verdict and not watched.stopped
    pd.testing.assert_frame_equal(whole.rows.drop(columns="point_id"), watched.rows.drop(columns="point_id"))


def _one_run_each(rates: list[float]):
    """Each rate judged on one run (seed 5), an undecided fail taken as failed (recommend's bisection probes)."""
    scenario = make_scenario({**SLO, "workload": {"num_requests": 2000}})
    points = [{RATE_KEY: rate, "seed": 5} for rate in rates]
    windows = [measurement_window(one, rate, typical_latency_s(one, rate), own_floor=False)
               for rate, one in zip(rates, (variant(scenario, point) for point in points))]
    return simulate_until_decided(scenario, points, windows, rates, workers=1, escalate_failing=False)


def test_a_one_run_point_stops_once_it_cannot_pass_and_its_whole_run_fails():
    """Where one run is the verdict and an undecided fail counts as failed, a run stops once its window's sure
    misses leave the share within a limit below the target at all: the whole runs (no stop) of every point
    it stopped fail, decided or not (51 req/s: undecided), and every other point's verdict is the same."""
    rates = [40.0, 50.0, 51.0, 52.0, 60.0]
    whole = _one_run_each(rates)
    with reusing_runs(), stopping_decided_runs():
        watched = _one_run_each(rates)
    assert [w.verdict.met for w in whole] == [True, True, False, False, False]
    assert not whole[2].verdict.decided           # the whole run at 51 req/s fails only on its estimate
    for full, stopped in zip(whole, watched):
        assert stopped.verdict.met == full.verdict.met
        if stopped.stopped:
            assert not full.verdict.met
            # a stop short of the decided fail shows a fail on the estimate only
            assert not stopped.verdict.decided
            assert stopped.rows["simulated_s"].iloc[0] < full.rows["simulated_s"].iloc[0]
        else:
            assert stopped.verdict == full.verdict
    assert all(stopped.stopped for stopped in watched[2:])


def test_a_stopped_seed_is_decided_only_by_a_stop_that_leaves_a_decided_fail():
    rows = _rows(["ttft"], [0.5], [0.01])
    failing = ShortfallStop(2 * BATCHES, FAILING_MARGIN)
    assert judge(rows).decided and not judge(rows, stop=failing).decided
    assert not judge(rows, stop=failing).met
    # a fixed margin as wide as Z times the widest standard error leaves a decided fail too
    assert judge(rows, stop=ShortfallStop(2 * BATCHES, Z * WIDEST_STDERR)).decided


def _rows(stopped_on: list[str], attainment: list[float], stderr: list[float],
          e2e: tuple[list[float], list[float]] | None = None) -> pd.DataFrame:
    """A point's rows, one per seed: ``stopped_on`` the limits each seed's run was stopped on as missed ("": not
    stopped); TTFT (and, given, E2E) attainments and standard errors, each against a 95% target."""
    n = len(stopped_on)
    rows = pd.DataFrame({"error": [""] * n, names.STEADY: [False] * n,
                         names.STOPPED_BY: ["missed" if on else "completed" for on in stopped_on],
                         names.STOPPED_ON: [on or math.nan for on in stopped_on],
                         names.slo_attainment("ttft"): attainment, names.slo_attainment_stderr("ttft"): stderr,
                         names.slo_percentile("ttft"): [95.0] * n,
                         names.SLO_ATTAINMENT: attainment, names.SLO_ATTAINMENT_STDERR: stderr})
    if e2e is not None:
        rows[names.slo_attainment("e2e")], rows[names.slo_attainment_stderr("e2e")] = e2e
        rows[names.slo_percentile("e2e")] = 95.0
    return rows


def test_a_point_some_of_whose_seeds_stopped():
    # the stopped seed's whole run was below decided_fail_below(0.95) (about 0.75): with the other at 1.0 +- 0 the
    # pair could still lie within two standard errors of the target, so the point fails undecided
    verdict = judge(_rows(["ttft", ""], [0.1, 1.0], [0.01, 0.0]))
    assert (verdict.met, verdict.decided) == (False, False)
    # with the other seed far below the target it fails beyond doubt whatever the stopped seed's whole run was
    verdict = judge(_rows(["ttft", ""], [0.1, 0.3], [0.01, 0.01]))
    assert (verdict.met, verdict.decided) == (False, True)
    # the other seed's error unknown: not settled
    assert not judge(_rows(["ttft", ""], [0.1, 0.3], [0.01, math.nan])).decided


# Two seeds' figures on TTFT and E2E, each well below the 95% target on both (what a stopped run's rows show).
LOW = ([0.1, 0.1], [0.01, 0.01])


def test_seeds_stopped_on_different_limits_are_not_a_decided_fail():
    """The fault: a point all of whose seeds stopped was taken as a decided fail, but a seed stopped on TTFT is
    known to be below the bound on TTFT only. Seed 1 stopped on TTFT may have met E2E entirely and seed 2,
    stopped on E2E, TTFT: on each limit the pair's pooled figure can be (bound + 1) / 2 + Z * bound's error
    / 2, which is above the target (the bound plus Z of its error is the target itself)."""
    below = decided_fail_below(0.95)
    best = (below + 1) / 2 + Z * math.sqrt(below * (1 - below) / (BATCHES - 1)) / 2
    assert best > 0.95
    verdict = judge(_rows(["ttft", "e2e"], *LOW, e2e=LOW))
    assert (verdict.met, verdict.decided) == (False, False)


def test_seeds_stopped_on_the_same_limit_are_a_decided_fail():
    """Both below the bound on TTFT: their pooled TTFT figure is at most the bound plus Z times their mean
    error, the target; likewise a seed stopped on both limits with one stopped on either."""
    for stopped_on in (["ttft", "ttft"], ["e2e", "e2e"], ["ttft,e2e", "e2e"], ["ttft", "ttft,e2e"]):
        verdict = judge(_rows(stopped_on, *LOW, e2e=LOW))
        assert (verdict.met, verdict.decided) == (False, True), stopped_on


def test_a_seed_stopped_on_one_limit_with_another_failing_a_second():
    """Seed 1 stopped on TTFT, seed 2 ran whole and fails E2E far below the target: the pair fails E2E beyond
    doubt even with seed 1 meeting E2E entirely; seed 2 near the target leaves it open."""
    assert judge(_rows(["ttft", ""], [0.1, 1.0], [0.01, 0.0], e2e=([1.0, 0.3], [0.0, 0.01]))).decided
    assert not judge(_rows(["ttft", ""], [0.1, 1.0], [0.01, 0.0], e2e=([1.0, 0.94], [0.0, 0.01]))).decided


def test_a_stopped_row_that_names_no_limit_is_taken_at_its_best():
    """A run stopped as missed whose row does not say on which limit (``stopped_on`` absent) may have met each
    limit entirely: alone, or beside a seed that ran whole and shows nothing, it settles nothing."""
    rows = _rows(["ttft", "ttft"], *LOW).drop(columns=names.STOPPED_ON)
    assert not judge(rows).decided
    assert judge(_rows(["ttft", "ttft"], *LOW)).decided


def test_a_stopped_run_is_not_judged_on_a_joint_target():
    with pytest.raises(ValueError, match="joint attainment"):
        judge(_rows(["ttft", "ttft"], [0.1, 0.1], [0.01, 0.01]), target=0.9)


def _class_rows(stopped_on: list[str], attainment: list[float], stderr: list[float]) -> pd.DataFrame:
    """One class's section of the summary (``classes.chat.slo...``), as a class scenario's rows carry it."""
    prefix = f"{names.CLASSES}.chat."
    n = len(stopped_on)
    return pd.DataFrame({"error": [""] * n, names.STEADY: [False] * n,
                         names.STOPPED_BY: ["missed" if on else "completed" for on in stopped_on],
                         names.STOPPED_ON: [on or math.nan for on in stopped_on],
                         prefix + names.slo_attainment("ttft"): attainment,
                         prefix + names.slo_attainment_stderr("ttft"): stderr,
                         prefix + names.slo_percentile("ttft"): [95.0] * n,
                         prefix + names.SLO_ATTAINMENT: attainment})


def test_a_class_point_some_of_whose_seeds_stopped():
    """A class's check is named ``chat.ttft``: it is a watched limit like the top-level ``ttft`` (the fault: it
    was skipped as unwatched, so a point only some of whose seeds stopped was always taken as decided)."""
    assert (judge(_class_rows(["chat.ttft", ""], [0.1, 1.0], [0.01, 0.0])).decided,
            judge(_class_rows(["chat.ttft", ""], [0.1, 0.3], [0.01, 0.01])).decided) == (False, True)
    # stopped on the class's limit, named as the check is: decided alone; on another class's limit: not
    assert judge(_class_rows(["chat.ttft"], [0.1], [0.01])).decided
    assert not judge(_class_rows(["batch.ttft"], [0.1], [0.01])).decided


def test_the_best_case_of_a_point_s_first_seeds_bounds_its_whole_verdict():
    """judge() on a point's first seeds completed by best_case is, limit by limit, at least the margin every
    seed's own runs give, and meets the targets wherever those do: checked against the whole runs at rates on
    either side of capacity (one passing, one failing, one near)."""
    from llmsim.search.window import best_case

    seeds = [5, 6, 7]
    for rate in (5.0, 40.0, 300.0):
        scenario = make_scenario({**SLO, "workload": {"arrival": {"rate": rate}, "num_requests": 2000}})
        window = measurement_window(scenario, rate, typical_latency_s(scenario, rate))
        whole = simulate_until_decided(scenario, [{}], [window], [rate], seeds=seeds, workers=1)[0]
        full = judge(whole.rows)
        for first in (1, 2):
            bound = judge(best_case(whole.rows.iloc[:first].reset_index(drop=True), len(seeds)))
            assert full.met <= bound.met
            assert set(bound.margins) == set(full.margins)
            for name, (margin, _) in full.margins.items():
                assert margin <= bound.margins[name][0] + 1e-12, (rate, first, name)
        assert judge(best_case(whole.rows, len(seeds))) == full        # every seed run: the verdict itself
