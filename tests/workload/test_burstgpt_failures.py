"""Real BurstGPT files: failed requests are logged with 0 response tokens, often with 0 request tokens
too. The excerpt in tests/data is the first rows of BurstGPT_1.csv in its published layout (HPMLL/BurstGPT,
CC-BY-4.0, as the dataset viewer of lzzmm/BurstGPT shows them), four of them failures."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml

from llmsim.cli.main import main
from llmsim.errors import ConfigError
from llmsim.workload.trace_formats import load_trace
from tests.helpers import REPO, make_scenario

EXCERPT = REPO / "tests" / "data" / "burstgpt-excerpt.csv"


def published_rows() -> list[dict]:
    """The excerpt read with the csv module alone, in the dataset's own column names."""
    with open(EXCERPT, newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
    return rows


def failed(rows: list[dict]) -> list[bool]:
    return [int(row["Response tokens"]) == 0 for row in rows]


def test_the_excerpt_holds_failures_with_no_prompt_either():
    rows = published_rows()
    assert sum(failed(rows)) == 4
    assert all(int(row["Request tokens"]) == 0 for row, bad in zip(rows, failed(rows)) if bad)


def test_failed_requests_are_dropped_by_default_and_counted():
    rows = published_rows()
    trace = load_trace(EXCERPT)
    kept = [row for row, bad in zip(rows, failed(rows)) if not bad]
    assert len(trace) == len(kept) == len(rows) - 4
    assert list(trace.prompt_tokens) == [int(row["Request tokens"]) for row in kept]
    assert list(trace.output_tokens) == [int(row["Response tokens"]) for row in kept]
    np.testing.assert_array_equal(trace.arrival_s, [float(row["Timestamp"]) for row in kept])
    assert "4 failed requests, logged with 0 output tokens, dropped" in trace.description


def test_failed_requests_can_be_replayed_as_a_prompt_and_one_token():
    rows = published_rows()
    trace = load_trace(EXCERPT, failed="replay")
    assert len(trace) == len(rows)
    bad = np.array(failed(rows))
    assert (trace.output_tokens[bad] == 1).all() and (trace.prompt_tokens[bad] == 1).all()
    assert list(trace.output_tokens[~bad]) == [int(row["Response tokens"]) for row, b in zip(rows, bad) if not b]
    assert "4 failed requests, logged with 0 output tokens, replayed" in trace.description


def test_a_request_that_generated_tokens_without_a_prompt_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,0,18,18,API log\n")
    with pytest.raises(ConfigError) as raised:
        load_trace(path)
    assert raised.value.key == "line 2, column Request tokens" and "needs a prompt" in str(raised.value)


def scenario_file(tmp_path, **arrival) -> str:
    path = tmp_path / "burstgpt.yaml"
    path.write_text(yaml.safe_dump({
        "name": "burstgpt-excerpt", "seed": 1, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
        "workload": {"arrival": {"process": "trace", "path": str(EXCERPT), **arrival}},
        "simulation": {"warmup": "0 s"}}))
    return str(path)


@pytest.mark.parametrize("mode, arrived, said", [(None, 38, "dropped"), ("replay", 42, "replayed")])
def test_run_replays_a_real_file_and_says_what_it_did_with_the_failures(tmp_path, capsys, mode, arrived, said):
    arrival = {"failed": mode} if mode else {}
    assert main(["run", scenario_file(tmp_path, **arrival), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"4 failed requests, logged with 0 output tokens, {said}" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests"]["arrived"] == arrived and "4 failed requests" in summary["trace"]


def test_a_bad_failed_setting_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as raised:
        make_scenario({"workload": {"arrival": {"process": "trace", "path": str(EXCERPT), "failed": "keep"},
                                    "num_requests": None, "prompt_tokens": None, "output_tokens": None}})
    assert raised.value.key == "workload.arrival.failed" and "replay" in raised.value.allowed
