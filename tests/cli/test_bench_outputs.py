"""`vllm bench serve`-style JSON, Parquet records and `llmsim diff` (issue 14)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from llmsim.analysis.bench_format import diff_metrics, vllm_bench_result
from llmsim.cli.main import main
from llmsim.sim.request import InterTokenGaps

# Field names of vLLM's serving benchmark result (vllm/benchmarks/serve.py: the result dict and the
# f"{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms" entries of its percentile metrics).
VLLM_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
               "ttfts") + tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                for s in ("mean", "median", "std", "p99"))


def fake_result():
    """Three requests written by hand: one rejected, two finished."""
    records = pd.DataFrame({
        "status": ["finished", "finished", "rejected"], "arrival_s": [0.0, 1.0, 2.0],
        "prompt_tokens": [100, 300, 50], "generated_tokens": [11, 1, 0],
        "ttft_s": [0.2, 0.4, np.nan], "e2e_s": [1.2, 0.4, np.nan], "finish_s": [1.2, 1.4, np.nan],
        "meets_slo": [True, False, False]})
    gaps = InterTokenGaps()
    gaps.add([0.5, 0.6, 1.2], [0.1, 0.1, 0.4], [6, 2, 2])      # ten gaps of request 0: 0.1 s x 8, 0.4 s x 2
    scenario = SimpleNamespace(model=SimpleNamespace(name="m"), slo=SimpleNamespace(defined=True))
    return SimpleNamespace(scenario=scenario, requests=records, inter_token_gaps=gaps)


def test_bench_fields_by_hand():
    bench = vllm_bench_result(fake_result())
    assert set(VLLM_FIELDS) <= set(bench)
    assert bench["completed"] == 2 and bench["duration"] == pytest.approx(1.4)        # first arrival to last finish
    assert bench["total_input_tokens"] == 400 and bench["total_output_tokens"] == 12
    assert bench["request_throughput"] == pytest.approx(2 / 1.4)
    assert bench["request_goodput"] == pytest.approx(1 / 1.4)
    assert bench["output_throughput"] == pytest.approx(12 / 1.4)
    assert bench["total_token_throughput"] == pytest.approx(412 / 1.4)
    assert bench["mean_ttft_ms"] == pytest.approx(300) and bench["std_ttft_ms"] == pytest.approx(100)
    # TPOT only for outputs of 2+ tokens: (1.2 - 0.2) / (11 - 1) = 100 ms.
    assert bench["mean_tpot_ms"] == pytest.approx(100) and bench["p99_tpot_ms"] == pytest.approx(100)
    # ITL over the ten gaps: mean (8 x 100 + 2 x 400) / 10 = 160 ms, median 100 ms, p99 400 ms.
    assert bench["mean_itl_ms"] == pytest.approx(160) and bench["median_itl_ms"] == pytest.approx(100)
    assert bench["p99_itl_ms"] == pytest.approx(400) and bench["std_itl_ms"] == pytest.approx(120)
    assert bench["mean_e2el_ms"] == pytest.approx(800) and bench["input_lens"] == [100, 300]


def test_diff_errors_by_hand():
    table = diff_metrics({"request_throughput": 4.0, "mean_ttft_ms": 50.0, "p99_itl_ms": None, "completed": 100},
                         {"request_throughput": 5.0, "mean_ttft_ms": 45.0, "p99_itl_ms": 3.0})
    assert list(table["metric"]) == ["request_throughput", "mean_ttft_ms"]      # only what both carry as numbers
    assert list(table["error_pct"]) == pytest.approx([25.0, -10.0])


def test_run_writes_bench_json_and_parquet_and_diff_reads_them(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("model: Llama-3.1-8B\nhardware: H100-SXM\nseed: 3\nworkload:\n"
                        "  arrival: {process: poisson, rate: 4}\n  num_requests: 40\n  prompt_tokens: 200\n"
                        "  output_tokens: 20\nslo: {ttft: 1 s}\n")
    out = tmp_path / "run"
    assert main(["run", str(scenario), "--out", str(out), "--bench-json", "--parquet"]) == 0
    bench = json.loads((out / "vllm_bench.json").read_text())
    records = pd.read_csv(out / "requests.csv")
    parquet = pd.read_parquet(out / "requests.parquet")
    assert len(parquet) == len(records) == 40 and list(parquet.columns) == list(records.columns)
    np.testing.assert_allclose(parquet["ttft_s"], records["ttft_s"], rtol=1e-12)
    assert bench["completed"] == 40 and bench["total_output_tokens"] == 40 * 20
    assert bench["mean_ttft_ms"] == pytest.approx(1000 * records["ttft_s"].mean(), rel=1e-9)
    measured = dict(bench, request_throughput=bench["request_throughput"] * 2)
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "measured.json"), str(out / "vllm_bench.json")]) == 0
    text = capsys.readouterr().out
    assert "request_throughput" in text and "-50" in text
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["diff", str(tmp_path / "bad.json"), str(out / "vllm_bench.json")]) == 2


def test_detailed_itls_are_each_requests_own_gaps(tmp_path):
    """Every token time recorded per request, checked against the records and the engine's own gap log:
    a request of n tokens has n - 1 gaps, summing to its last token's time minus its first's (e2e - ttft),
    the largest is its max_itl_s, and all of them pooled are the ITLs vLLM's statistics use (mean and
    count equal to the per-step log's). Memory is tight, so preemptions and recomputes are among them."""
    from llmsim.sim.simulate import simulate
    from llmsim.sim.token_times import TokenTimes
    from tests.helpers import make_scenario

    scenario = make_scenario({"engine": {"memory_utilization": 0.25, "max_model_len": 8192},
                              "workload": {"arrival": {"rate": 30.0}, "num_requests": 300}})
    times = TokenTimes()
    result = simulate(scenario, observers=[times])
    records = result.requests
    assert (records["status"] == "finished").all() and result.preemptions > 0
    itls = times.itls(records["id"])
    for gaps, row in zip(itls, records.itertuples()):
        assert len(gaps) == row.generated_tokens - 1
        assert sum(gaps) == pytest.approx(row.e2e_s - row.ttft_s, abs=1e-9)
        assert max(gaps, default=0.0) == pytest.approx(row.max_itl_s, abs=1e-12)
    bench = vllm_bench_result(result, itls)
    pooled = np.concatenate([g for g in bench["itls"] if g])
    step_gaps, weights = result.inter_token_gaps.in_window(-np.inf, np.inf)
    assert len(pooled) == pytest.approx(weights.sum())
    assert pooled.mean() * 1000 == pytest.approx(bench["mean_itl_ms"], rel=1e-9)
    assert bench["errors"] == [""] * len(records) and "generated_texts" not in bench
    assert "no text" in bench["llmsim_notes"][0]


def test_bench_detailed_on_the_command_line(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    data = {"name": "detailed", "seed": 1, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
            "workload": {"arrival": {"process": "poisson", "rate": 5.0}, "num_requests": 40,
                         "prompt_tokens": {"distribution": "fixed", "value": 200},
                         "output_tokens": {"distribution": "fixed", "value": 30}}}
    scenario.write_text(json.dumps(data))
    assert main(["run", str(scenario), "--out", str(tmp_path / "out"), "--bench-detailed"]) == 0
    bench = json.loads((tmp_path / "out" / "vllm_bench.json").read_text())
    assert [len(g) for g in bench["itls"]] == [29] * bench["completed"] and len(bench["ttfts"]) == bench["completed"]
    # Static batching has no per-iteration engine for the recorder to follow: refused, exit 2.
    data["engine"] = {"batching": "static"}
    scenario.write_text(json.dumps(data))
    assert main(["run", str(scenario), "--out", str(tmp_path / "static"), "--bench-detailed"]) == 2
    assert "--bench-detailed" in capsys.readouterr().err and not (tmp_path / "static").exists()


def test_speculative_itls_are_one_gap_per_step_that_emitted():
    """With speculation a step emits its accepted tokens and one more together, one gap per step (as vLLM's
    client records one per streamed chunk): per request, fewer gaps than tokens less one when drafts were
    accepted, still summing to e2e - ttft and peaking at max_itl_s."""
    from llmsim.sim.simulate import simulate
    from llmsim.sim.token_times import TokenTimes
    from tests.helpers import make_scenario

    scenario = make_scenario({"workload": {"num_requests": 150},
                              "speculation": {"draft": "ngram", "k": 3,
                                              "acceptance": {"process": "bernoulli", "alpha": 0.7}}})
    times = TokenTimes()
    result = simulate(scenario, observers=[times])
    records = result.requests
    assert (records["status"] == "finished").all()
    itls = times.itls(records["id"])
    for gaps, row in zip(itls, records.itertuples()):
        assert len(gaps) + row.accepted_tokens == row.generated_tokens - 1
        assert sum(gaps) == pytest.approx(row.e2e_s - row.ttft_s, abs=1e-9)
        assert max(gaps, default=0.0) == pytest.approx(row.max_itl_s, abs=1e-12)
    assert records["accepted_tokens"].sum() > 0
