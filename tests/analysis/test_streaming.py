"""A run streamed to disk: the same records as a run kept whole, the same summary (its percentiles
within the sketch's stated bound of the exact ones), and time series that conserve what was counted."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsim.analysis.metrics import summarize
from llmsim.analysis.sketch import RELATIVE_ACCURACY, QuantileSketch
from llmsim.analysis.streaming import StreamedRun, csv_text
from llmsim.analysis.summary import PERCENTILES, flatten
from llmsim.cli import run as run_command
from llmsim.cli.main import main
from llmsim.sim.simulate import simulate
from tests.helpers import BASE, make_scenario, merge

PERCENTILE_KEYS = tuple(f"p{p}" for p in PERCENTILES)


class Frames:
    """A records writer that keeps the chunks it is given."""

    def __init__(self):
        self.frames: list[pd.DataFrame] = []

    def write(self, frame: pd.DataFrame) -> None:
        self.frames.append(frame)

    def close(self) -> None:
        pass


def streamed(scenario, chunk_rows: int = 97):
    """(result, summary mapping, records) of ``scenario`` streamed in chunks of ``chunk_rows`` requests."""
    frames = Frames()
    stream = StreamedRun([frames], chunk_rows=chunk_rows, bin_s=5.0)
    result = simulate(scenario, stream=stream)
    return result, stream, pd.concat(frames.frames, ignore_index=True)


def _equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    return a == b


# A Poisson chat load, classes with their own SLOs, speculation, static batching, a run the horizon cuts
# (requests unfinished), and a warm-up as long as the arrivals (the whole run is measured).
CASES = {
    "plain": {"slo": {"ttft": "200 ms", "tpot": "15 ms"}, "workload": {"arrival": {"rate": 20.0}}},
    "classes": {"workload": {"arrival": {"rate": 12.0}, "classes": {"interactive": {"share": 0.6},
                                                                    "batch": {"share": 0.4}}},
                "slo": {"classes": {"interactive": {"ttft": "100 ms", "percentile": 95},
                                    "batch": {"e2e": "60 s"}}}},
    "speculative": {"workload": {"num_requests": 400}, "speculation": {
        "draft": "Llama-3.2-1B", "k": 3, "acceptance": {"process": "bernoulli", "alpha": 0.7}}},
    "static": {"engine": {"batching": "static", "max_num_seqs": 8}, "workload": {"num_requests": 300}},
    "horizon": {"workload": {"arrival": {"rate": 40.0}}, "simulation": {"horizon": "30 s"}},
    "whole-run": {"workload": {"num_requests": 300}, "simulation": {"warmup": "10 min"}},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request):
    scenario = make_scenario(CASES[request.param])
    kept = simulate(scenario)
    return kept, summarize(kept).to_dict(), *streamed(scenario)


def test_streamed_records_are_the_records_of_the_run_kept_whole(runs):
    kept, _, _, _, records = runs
    assert records.to_csv(index=False) == kept.requests.to_csv(index=False)


def test_streamed_summary_is_the_summary_but_for_percentiles_from_the_sketch(runs):
    _, exact, result, stream, _ = runs
    summary = flatten(stream.summary(result).to_dict())
    exact = flatten(exact)
    assert summary.keys() == exact.keys()
    different = [key for key in exact if key.rsplit(".", 1)[-1] not in PERCENTILE_KEYS
                 and not _equal(summary[key], exact[key])]
    assert different == [], [(key, exact[key], summary[key]) for key in different]


def test_streamed_percentiles_are_within_the_stated_bound_of_the_exact_ones(runs):
    """Each percentile against numpy's value at its rank (rounded down) over the run's own records,
    and the inter-token gaps against the weighted gaps the run kept whole."""
    kept, _, result, stream, _ = runs
    summary = stream.summary(result).to_dict()
    start, stop = summary["window_s"]
    records = kept.requests
    steady = records[(records["arrival_s"] >= start) & (records["arrival_s"] <= stop)]
    finished = steady[steady["status"] == "finished"]
    for column in ("queue_wait_s", "ttft_s", "tpot_s", "e2e_s", "max_itl_s"):
        values = finished[column].dropna().to_numpy()
        for p in PERCENTILES:
            got = summary["latency"][column][f"p{p}"]
            if not len(values):
                assert math.isnan(got)
                continue
            exact = np.percentile(values, p, method="lower")
            assert abs(got - exact) <= RELATIVE_ACCURACY * exact, (column, p, got, exact)
    gaps, weights = kept.inter_token_gaps.in_window(start, stop)
    tokens = np.repeat(gaps, weights.astype(np.int64))
    for p in PERCENTILES:
        exact = np.percentile(tokens, p, method="lower")
        got = summary["latency"]["itl_s"][f"p{p}"]
        assert abs(got - exact) <= RELATIVE_ACCURACY * exact, (p, got, exact)


def test_the_time_series_counts_every_arrival_finish_and_output_token(runs):
    kept, exact, _, stream, _ = runs
    series = stream.series.frame()
    records = kept.requests
    assert series["arrived"].sum() == len(records)
    assert series["finished"].sum() == (records["status"] == "finished").sum()
    assert math.isclose(series["output_tokens_per_s"].sum() * stream.series.bin_s,
                        kept.iterations["tokens_out"].sum())
    assert series["max_queue_length"].max() == exact["queue"]["max_length"]


@pytest.mark.parametrize("n", [1, 2, 10, 1000, 50_000])
def test_sketch_percentiles_are_within_the_relative_accuracy_of_the_exact_ones(n):
    rng = np.random.default_rng(n)
    values = rng.lognormal(-3.0, 1.5, n)
    values[: n // 10] = 0.0                            # a queue wait is often exactly zero
    sketch = QuantileSketch()
    for part in np.array_split(values, 7):
        sketch.add(part)
    assert sketch.count == n and math.isclose(sketch.mean, values.mean())
    for p in (0, 1, 50, 95, 99, 99.9, 100):
        exact = np.percentile(values, p, method="lower")
        assert abs(sketch.percentile(p) - exact) <= RELATIVE_ACCURACY * exact


def test_weighted_and_merged_sketches_are_the_sketch_of_every_value():
    rng = np.random.default_rng(3)
    values, weights = rng.gamma(2.0, 0.01, 4000), rng.integers(1, 9, 4000)
    weighted, first, second = QuantileSketch(), QuantileSketch(), QuantileSketch()
    weighted.add(values, weights)
    every = np.repeat(values, weights)
    first.add(every[: len(every) // 3])
    second.add(every[len(every) // 3:])
    first.merge(second)
    for p in (1, 50, 95, 99):
        exact = np.percentile(every, p, method="lower")
        assert weighted.percentile(p) == first.percentile(p)
        assert abs(weighted.percentile(p) - exact) <= RELATIVE_ACCURACY * exact


def test_an_empty_sketch_gives_nan_and_a_negative_value_is_refused():
    sketch = QuantileSketch()
    sketch.add(np.array([np.nan]))
    assert math.isnan(sketch.percentile(50)) and math.isnan(sketch.mean)
    with pytest.raises(ValueError, match="non-negative"):
        sketch.add(np.array([-1.0]))


@pytest.mark.parametrize("parquet", [False, True])
def test_llmsim_run_streams_a_long_run_into_the_same_files(tmp_path, monkeypatch, capsys, parquet):
    """Above the threshold (lowered here) the command writes the records it writes for a run kept whole."""
    if parquet:
        pytest.importorskip("pyarrow")
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, {"workload": {"num_requests": 500, "arrival": {"rate": 20.0}}})))
    flags = ["--parquet"] if parquet else []
    assert main(["run", str(path), "--out", str(tmp_path / "whole"), *flags]) == 0
    monkeypatch.setattr(run_command, "STREAM_ABOVE_REQUESTS", 100)
    assert main(["run", str(path), "--out", str(tmp_path / "streamed"), *flags]) == 0
    assert "streaming the records to disk" in capsys.readouterr().err
    whole, stream = tmp_path / "whole", tmp_path / "streamed"
    assert (stream / "requests.csv").read_text() == (whole / "requests.csv").read_text()
    if parquet:
        pd.testing.assert_frame_equal(pd.read_parquet(stream / "requests.parquet"),
                                      pd.read_parquet(whole / "requests.parquet"))
    a, b = (json.loads((folder / "summary.json").read_text())["requests"] for folder in (whole, stream))
    assert a == b
    series = pd.read_csv(stream / "timeseries.csv")
    assert series["arrived"].sum() == 500


def test_llmsim_run_refuses_what_a_streamed_run_cannot_write(tmp_path, monkeypatch, capsys):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, {"workload": {"num_requests": 200}})))
    monkeypatch.setattr(run_command, "STREAM_ABOVE_REQUESTS", 100)
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--iterations"]) == 2
    assert "--iterations" in capsys.readouterr().err
    assert not (tmp_path / "out" / "requests.csv").exists()


def test_a_streamed_run_takes_every_inter_token_gap_once_and_most_before_it_ends(monkeypatch):
    """The engines hand their gaps over as the run goes (the stream folds them into sketches), so the
    run does not keep a gap per decode step to its end: every token's gap arrives exactly once (the
    weights sum to the run kept whole's), and most of them before the last records chunk is written."""
    scenario = make_scenario(CASES["plain"])
    kept = simulate(scenario)
    frames = Frames()
    stream = StreamedRun([frames], chunk_rows=97, bin_s=5.0)
    received: list[tuple[int, float]] = []           # (records chunks written so far, tokens' gaps taken)
    take = StreamedRun.gaps

    def gaps(self, gaps, settled_s):
        received.append((len(frames.frames), sum(float(weight.sum()) for _, _, weight in gaps.chunks())))
        take(self, gaps, settled_s)

    monkeypatch.setattr(StreamedRun, "gaps", gaps)
    simulate(scenario, stream=stream)
    total = sum(float(weight.sum()) for _, _, weight in kept.inter_token_gaps.chunks())
    assert sum(tokens for _, tokens in received) == total
    chunks = len(frames.frames)
    assert chunks > 5
    assert sum(tokens for written, tokens in received if written < chunks - 1) > 0.5 * total


_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, 1e16, 9.999999999999998e15, 1e-4, 9.99e-5, 5e-324]))
_TEXTS = st.one_of(st.none(), st.sampled_from(["finished", "timeout", ""]), st.text(max_size=6))


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(st.integers(0, 12).flatmap(lambda rows: st.tuples(
    st.lists(_FLOATS, min_size=rows, max_size=rows), st.lists(st.integers(-2**63, 2**63 - 1), min_size=rows,
                                                              max_size=rows),
    st.lists(st.booleans(), min_size=rows, max_size=rows), st.lists(_TEXTS, min_size=rows, max_size=rows))),
    st.booleans(), st.booleans())
def test_records_csv_text_is_what_pandas_writes(columns, header, string_dtype):
    floats, ints, flags, texts = columns
    status = pd.array(texts, dtype="string") if string_dtype else pd.Series(texts, dtype=object)
    frame = pd.DataFrame({"finish_s": np.array(floats, float), "id": np.array(ints, np.int64),
                          "meets_slo": np.array(flags, bool), "status": status})
    assert csv_text(frame, header) == frame.to_csv(index=False, header=header)
