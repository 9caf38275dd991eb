"""Summary figures recomputed independently from the per-request records and the iteration log."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from llmsim import simulate
from llmsim.analysis.metrics import slo_summary, summarize
from llmsim.analysis.summary import ClassSummary, Distribution

from tests.helpers import make_scenario


@pytest.fixture(scope="module")
def result():
    return simulate(make_scenario({"slo": {"ttft": "200 ms", "tpot": "15 ms"},
                                   "workload": {"arrival": {"rate": 20.0}, "num_requests": 3000},
                                   "simulation": {"warmup": "20 s"}}))


def test_latency_percentiles_cover_the_steady_state_only(result):
    summary = summarize(result).to_dict()
    records = result.requests
    start, stop = summary["window_s"]
    assert start == 20.0 and stop == pytest.approx(records["arrival_s"].max())
    steady = records[(records["arrival_s"] >= start) & (records["arrival_s"] <= stop)]
    assert summary["latency"]["ttft_s"]["p95"] == pytest.approx(np.percentile(steady["ttft_s"], 95))
    assert summary["latency"]["tpot_s"]["mean"] == pytest.approx(steady["tpot_s"].mean())
    assert summary["latency"]["ttft_s"]["p95"] != pytest.approx(np.percentile(records["ttft_s"], 95))


def test_tpot_and_ttft_follow_their_definitions(result):
    r = result.requests
    assert np.allclose(r["ttft_s"], r["first_token_s"] - r["arrival_s"])
    many = r[r["output_tokens"] > 1]
    assert np.allclose(many["tpot_s"], (many["finish_s"] - many["first_token_s"]) / (many["output_tokens"] - 1))
    # The longest gap of a request is at least its average gap.
    assert (many["max_itl_s"] >= many["tpot_s"] - 1e-12).all()


def test_token_weighted_itl_mean_equals_decode_time_over_decode_tokens(result):
    """Every gap belongs to one token: the mean ITL is total decode time over decode tokens."""
    summary = summarize(result).to_dict()
    everything = result.inter_token_gaps.summary(0, np.inf)
    r = result.requests
    total_gap_time = (r["finish_s"] - r["first_token_s"]).sum()
    assert everything["mean"] == pytest.approx(total_gap_time / (r["output_tokens"] - 1).sum(), rel=1e-9)
    assert summary["latency"]["itl_s"]["p50"] <= summary["latency"]["itl_s"]["p99"]


def test_goodput_and_attainment(result):
    summary = summarize(result).to_dict()
    r = result.requests
    start, stop = summary["window_s"]
    steady = r[(r["arrival_s"] >= start) & (r["arrival_s"] <= stop)]
    good = (steady["ttft_s"] <= 0.2) & (steady["tpot_s"] <= 0.015)
    assert summary["slo"]["attainment"] == pytest.approx(good.mean())
    assert summary["slo"]["goodput_requests_per_s"] == pytest.approx(good.sum() / (stop - start))
    assert 0 < summary["slo"]["attainment"] < 1     # the SLO was chosen to bind sometimes


def test_throughput_and_utilisation_from_the_iteration_log(result):
    summary = summarize(result).to_dict()
    it = result.iterations
    start, stop = summary["window_s"]
    window = it[(it["end_s"] > start) & (it["end_s"] <= stop)]
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(window["tokens_out"].sum() / (stop - start))
    hw = result.scenario.hardware
    # Utilisation counts the part of each iteration inside the window, and that share of its FLOPs.
    overlap = (np.minimum(it["end_s"], stop) - np.maximum(it["start_s"], start)).clip(lower=0)
    share = overlap / it["duration_s"]
    assert summary["utilisation"]["busy_fraction"] == pytest.approx(overlap.sum() / (stop - start))
    assert summary["utilisation"]["mfu"] == pytest.approx((share * it["flops"]).sum() / (stop - start)
                                                          / hw.peak_for("bf16"))
    assert 0 < summary["utilisation"]["mfu"] < hw.compute_efficiency
    assert 0 < summary["utilisation"]["bandwidth_utilisation"] < hw.memory_efficiency
    assert (it["mfu"] <= hw.compute_efficiency + 1e-9).all()
    assert (it["bandwidth_utilisation"] <= hw.memory_efficiency + 1e-9).all()
    # Output tokens per second cannot exceed finished requests' output over the same window by much:
    # in steady state both measure the same flow.
    r = result.requests
    done = r[(r["finish_s"] > start) & (r["finish_s"] <= stop)]
    assert summary["throughput"]["requests_per_s"] == pytest.approx(len(done) / (stop - start))


def test_queue_length_series_is_consistent(result):
    series = result.queue_length
    assert (series["length"] >= 0).all()
    assert series["length"].iloc[-1] == 0
    assert series["time_s"].is_monotonic_increasing



OVERLAP_UNDER_THREADS = """
import numpy as np
from llmsim.analysis.metrics import iteration_overlap
rng = np.random.default_rng(7)
n = 30_000                                     # over OpenBLAS's 10,000 elements, where it splits a dot over threads
duration = rng.lognormal(-6, 1, n)
start = np.cumsum(duration) - duration          # back to back
flops, moved = rng.lognormal(30, 1, n), rng.lognormal(25, 1, n)
window = (float(start[n // 10] + duration[n // 10] / 2), float(start[-n // 10] + duration[-n // 10] / 3))
got = iteration_overlap(start, start + duration, duration, flops, moved, rng.integers(0, 500, n),
                        rng.integers(1, 64, n), *window)
print(repr(got))
"""


def test_the_iteration_sums_do_not_depend_on_the_machines_threads():
    """The FLOPs and bytes inside the window are the same to the last digit whether BLAS may use one thread or
    four (a dot product split over threads adds its partial sums in another order), and equal, within rounding,
    to the exact sums (math.fsum) of each iteration's share inside the window, the edges' iterations cut."""
    runs = [subprocess.run([sys.executable, "-c", OVERLAP_UNDER_THREADS], capture_output=True, text=True, check=True,
                           env={**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}).stdout
            for threads in ("1", "4")]
    assert runs[0] == runs[1]
    namespace: dict = {}
    exec(OVERLAP_UNDER_THREADS.replace("print(repr(got))", ""), namespace)
    start, duration, (begin, end) = namespace["start"], namespace["duration"], namespace["window"]
    shares = [(min(s + d, end) - max(s, begin)) / d for s, d in zip(start.tolist(), duration.tolist())]
    for column, figure in (("flops", 1), ("moved", 2)):
        exact = math.fsum(share * value for share, value in zip(shares, namespace[column].tolist()) if share > 0)
        assert namespace["got"][figure] == pytest.approx(exact, rel=1e-12)
    assert sum(1e-6 < share < 1 - 1e-6 for share in shares) == 2      # the two the window's edges cut


def test_class_figures_are_those_of_each_class_own_records():
    """Each traffic class's summary is the one its own rows of the records give, taken as a table: the counts by
    status, the window's latencies and rates, and its SLO figures (a class without its own SLO held to the
    top-level one, by its class's limits), exactly; with requests rejected by a class's timeout."""
    scenario = make_scenario({
        "engine": {"max_num_seqs": 8, "max_batch_tokens": 512},
        "slo": {"ttft": "400 ms", "classes": {"urgent": {"ttft": "150 ms", "tpot": "30 ms"}}},
        "workload": {"arrival": {"rate": 14.0}, "num_requests": 1200,
                     "classes": {"urgent": {"share": 0.3, "priority": 0},
                                 "bulk": {"share": 0.7, "priority": 1, "queue_timeout": "2 s",
                                          "on_timeout": "reject"}}},
        "simulation": {"warmup": "10 s"}})
    result = simulate(scenario)
    summary = summarize(result)
    records = result.requests
    start, stop = summary.window_s
    window = stop - start
    assert set(records["status"]) >= {"finished", "rejected"}
    for name in ("urgent", "bulk"):
        mine = records[records["class"] == name]
        steady = mine[(mine["arrival_s"] >= start) & (mine["arrival_s"] <= stop)]
        done = mine[(mine["status"] == "finished") & (mine["finish_s"] > start) & (mine["finish_s"] <= stop)]
        finished = steady[steady["status"] == "finished"]
        expected = ClassSummary(
            arrived=len(mine), finished=int((mine["status"] == "finished").sum()),
            rejected=int((mine["status"] == "rejected").sum()), unfinished=int((mine["status"] == "unfinished").sum()),
            **{column: Distribution.of(finished[column]) for column in ("queue_wait_s", "ttft_s", "tpot_s", "e2e_s")},
            requests_per_s=len(done) / window, output_tokens_per_s=float(done["output_tokens"].sum()) / window,
            offered_requests_per_s=len(steady) / window,
            slo=slo_summary(steady, scenario.slo.for_class(name), window))
        assert repr(summary.classes[name]) == repr(expected)
