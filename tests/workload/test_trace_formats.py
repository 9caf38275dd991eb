"""Production trace readers and trace transforms, on small files written here in each format.

Expected counts, lengths and times are worked out by hand from the rows written (a date-time
difference, milliseconds to seconds, characters over characters per token), not read back
from the reader.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from llmsim import generate_trace
from llmsim.cli.main import main
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.workload.trace_transforms import mean_rate_per_s
from llmsim.workload.workload import workload_from_node


def replay(path, seed: int = 0, **arrival):
    node = Node({"arrival": {"process": "trace", "path": str(path), **arrival}}, file="<test>")
    return generate_trace(workload_from_node(node, max_tokens=100000), seed)


AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:51.0000000,110,0
2023-11-16 18:16:01.5000000,1021,27
"""

AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,2162,5
2024-05-10 00:00:00.509930+00:00,938,91
2024-05-10 00:01:00.009930+00:00,171,2
"""

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
190,ChatGPT,214,43,257,API log
"""

MOONCAKE = [
    {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1, 2]},
    {"timestamp": 27482, "input_length": 6472, "output_length": 26, "hash_ids": [0, 1, 46]},
    {"timestamp": 30535, "input_length": 600, "output_length": 2, "hash_ids": [47]},
]


def test_azure_2023_and_2024(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(AZURE_2023)
    t = replay(path)
    # The request with 0 generated tokens is dropped; times count from the first TIMESTAMP.
    assert len(t) == 3
    np.testing.assert_allclose(t.arrival_s, [0.0, 4.314579, 14.81941], rtol=0, atol=1e-9)
    assert list(t.prompt_tokens) == [4808, 3180, 1021] and list(t.output_tokens) == [10, 8, 27]
    assert "1 failed request, logged with 0 output tokens, dropped" in t.description
    path.write_text(AZURE_2024)
    t = replay(path, format="azure")
    np.testing.assert_allclose(t.arrival_s, [0.0, 0.5, 60.0], rtol=0, atol=1e-9)
    assert list(t.prompt_tokens) == [2162, 938, 171] and list(t.output_tokens) == [5, 91, 2]


def test_burstgpt_and_filters(tmp_path):
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text(BURSTGPT)
    t = replay(path)
    assert list(t.arrival_s) == [5.0, 118.0, 190.0]            # the failed request (0 response tokens) dropped
    assert list(t.prompt_tokens) == [472, 417, 214] and list(t.output_tokens) == [18, 276, 43]
    assert list(t.model) == ["ChatGPT", "GPT-4", "ChatGPT"]
    t = replay(path, filter={"model": "ChatGPT", "log_type": ["API log"]})
    assert list(t.arrival_s) == [190.0] and list(t.prompt_tokens) == [214]
    with pytest.raises(ConfigError, match="no request of the trace is left"):
        replay(path, filter={"model": "Claude"})


def test_mooncake_keeps_hash_ids(tmp_path):
    path = tmp_path / "mooncake_trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MOONCAKE) + "\n")
    t = replay(path)
    np.testing.assert_array_equal(t.arrival_s, [0.0, 27.482, 30.535])
    assert list(t.prompt_tokens) == [6955, 6472, 600] and list(t.output_tokens) == [52, 26, 2]
    assert t.hash_ids == ((0, 1, 2), (0, 1, 46), (47,))
    assert replay(path, window={"start": "10 s"}).hash_ids == ((0, 1, 46), (47,))


def test_sharegpt_dataset_by_characters_and_by_tokenizer(tmp_path):
    data = [{"id": "a", "conversations": [{"from": "human", "value": "x" * 41}, {"from": "gpt", "value": "y" * 8}]},
            {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "z" * 400},
                                          {"from": "human", "value": "ignored third turn"}]}]
    path = tmp_path / "ShareGPT_V3.json"
    path.write_text(json.dumps(data))
    workload = {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 1000,
                "dataset": {"path": str(path), "chars_per_token": 4}}
    t = generate_trace(workload_from_node(Node(workload), max_tokens=100000), 5)
    # ceil(41 / 4) = 11 and ceil(8 / 4) = 2; ceil(2 / 4) = 1 and 400 / 4 = 100; the one-turn entry skipped.
    pairs = set(zip(t.prompt_tokens.tolist(), t.output_tokens.tolist()))
    assert pairs == {(11, 2), (1, 100)}
    assert abs(int(np.sum(t.prompt_tokens == 11)) - 500) <= 1      # reshuffled rounds: each appears once per round
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    data = [{"conversations": [{"from": "human", "value": "hello world hello"}, {"from": "gpt", "value": "world"}]}]
    path.write_text(json.dumps(data))
    workload["dataset"] = {"path": str(path), "tokenizer": str(tmp_path / "tokenizer.json")}
    t = generate_trace(workload_from_node(Node(workload), max_tokens=100000), 5)
    assert set(t.prompt_tokens) == {3} and set(t.output_tokens) == {1}


def dataset_lengths(path, chars_per_token=4):
    """(prompt, output) token pairs a dataset gives, by characters per token."""
    from llmsim.workload.trace_formats import read_trace
    trace = read_trace(path, Node({"path": str(path), "chars_per_token": chars_per_token}, file="<test>"), "path",
                       tokenizer=None, chars_per_token=chars_per_token)
    return list(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist()))


def test_openai_messages_and_prompt_completion_datasets(tmp_path):
    """The other entry shapes of vLLM's benchmark datasets, as a JSON list or JSON lines: lengths exact."""
    messages = [{"messages": [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "u" * 41},
                              {"role": "assistant", "content": "a" * 8}, {"role": "user", "content": "later"}]},
                {"messages": [{"role": "user", "content": "no reply"}]},                        # skipped
                {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y" * 12},
                              {"role": "assistant", "content": "z" * 400}]}]
    as_list = tmp_path / "chat.json"
    as_list.write_text(json.dumps(messages))
    # The first user message and the reply after it; the system prompt and later turns not counted.
    assert dataset_lengths(as_list) == [(11, 2), (3, 100)]
    as_lines = tmp_path / "chat.jsonl"
    as_lines.write_text("\n".join(json.dumps(m) for m in messages) + "\n")
    assert dataset_lengths(as_lines) == [(11, 2), (3, 100)]
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"prompt": "p" * 9, "completion": "c" * 16}) + "\n\n"
                      + json.dumps({"prompt": "q" * 4, "output_tokens": 77}) + "\n")
    assert dataset_lengths(custom) == [(3, 4), (1, 77)]
    conversations = tmp_path / "sharegpt.jsonl"             # ShareGPT entries as JSON lines too
    conversations.write_text(json.dumps({"conversations": [{"from": "human", "value": "h" * 8},
                                                           {"from": "gpt", "value": "g" * 20}]}) + "\n")
    assert dataset_lengths(conversations) == [(2, 5)]
    # As a scenario's dataset: the lengths of the arrivals come from it.
    workload = {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 50,
                "dataset": {"path": str(custom), "chars_per_token": 4}}
    t = generate_trace(workload_from_node(Node(workload), max_tokens=100000), 5)
    assert set(zip(t.prompt_tokens.tolist(), t.output_tokens.tolist())) == {(3, 4), (1, 77)}


@pytest.mark.parametrize("text, where, fragment", [
    ('{"prompt": "hi"}\n', "line 1, completion", "output_tokens: an integer"),
    ('{"prompt": "hi", "output_tokens": 0}\n', "line 1, output_tokens", "0"),
    ('{"prompt": "hi", "output_tokens": 5}\n{"prompt": 7, "completion": "x"}\n', "line 2, prompt", "7"),
    ('{"prompt": "hi", "output_tokens": 5}\n{"prompt": "x", \n', "line 2", "not valid JSON"),
    ('[{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}]',
     "entry 0, messages[0].content", "5"),
    ('[{"text": "neither shape"}]', "entry 0", "conversations"),
])
def test_bad_dataset_entries_are_config_errors_naming_where(tmp_path, text, where, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        dataset_lengths(path)
    message = str(error.value)
    assert "bad.jsonl" in message and where in message and fragment in message


def test_sharegpt_needs_a_token_count_and_has_no_times(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"conversations": [{"value": "a"}, {"value": "b"}]}]))
    with pytest.raises(ConfigError, match="say how to count"):
        workload_from_node(Node({"arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 3,
                                 "dataset": {"path": str(path)}}), 1000)
    with pytest.raises(ConfigError, match="has no arrival times"):
        replay(path)


@pytest.mark.parametrize("text, where", [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,4\n", "line 1"),                                # missing column
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,4,1\n2023-11-16 18:15:40,4,1\n",
     "line 3, column TIMESTAMP"),                                                                 # unsorted
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,4,1\nyesterday,4,1\n",
     "line 3, column TIMESTAMP"),                                                                 # not a date
    ("Timestamp,Model,Request tokens,Response tokens\n-1,ChatGPT,4,1\n", "line 2, column Timestamp"),  # negative
    ("Timestamp,Model,Request tokens,Response tokens\n1,ChatGPT,4,1\n2,ChatGPT,many,1\n",
     "line 3, column Request tokens"),                                                            # text
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 5, "input_length": "x", '
     '"output_length": 1}\n', "line 2, column input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 5, \n', "line 2, column"),
    ('{"timestamp": 0, "input_length": 5}\n', "line 1, column output_length"),
])
def test_malformed_rows_exit_2_naming_file_line_and_column(tmp_path, capsys, text, where):
    path = tmp_path / ("t.jsonl" if text.startswith("{") else "t.csv")
    path.write_text(text)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"model: Llama-3.1-8B\nhardware: H100-SXM\nworkload:\n  arrival: {{process: trace, "
                        f"path: {path.name}}}\n")
    assert main(["run", str(scenario), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and where in err and "Traceback" not in err


def test_rescale_gives_the_target_mean_rate_and_speed_halves_every_gap(tmp_path):
    rng = np.random.default_rng(1)
    times = np.cumsum(rng.exponential(0.7, 200)) + 3.0
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{float(t)!r},10,5\n" for t in times))
    rescaled = replay(path, rate="12.5/s")
    assert mean_rate_per_s(rescaled.arrival_s) == pytest.approx(12.5, rel=1e-12)
    # mean rate = (n - 1) / span, computed here without the library:
    assert (len(rescaled) - 1) / (rescaled.arrival_s[-1] - rescaled.arrival_s[0]) == pytest.approx(12.5, rel=1e-12)
    fast = replay(path, speed=2)
    np.testing.assert_allclose(np.diff(fast.arrival_s), np.diff(times) / 2, rtol=1e-12)
    with pytest.raises(ConfigError, match="either speed or rate"):
        replay(path, speed=2, rate=3.0)


def test_window_and_sample(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{t},{t + 1},1\n" for t in range(100)))
    t = replay(path, window={"start": "10 s", "end": "20 s"})
    assert list(t.arrival_s) == list(range(10)) and list(t.prompt_tokens) == list(range(11, 21))
    assert "window 10 s to 20 s" in t.description
    a, b = replay(path, seed=3, sample=0.25), replay(path, seed=3, sample=0.25)
    assert len(a) == 25 and np.array_equal(a.arrival_s, b.arrival_s) and np.all(np.diff(a.arrival_s) > 0)
    assert not np.array_equal(replay(path, seed=4, sample=0.25).arrival_s, a.arrival_s)
    with pytest.raises(ConfigError, match="must be after start"):
        replay(path, window={"start": "20 s", "end": "10 s"})


def test_fit_recovers_rate_burstiness_profile_and_lengths():
    from llmsim.workload.trace import Trace
    from llmsim.workload.trace_fit import fit_workload
    rng = np.random.default_rng(7)
    shape, n = 0.25, 20000                                  # Gamma gaps with CV 1/sqrt(shape) = 2
    gaps = rng.gamma(shape, 1 / shape, n) / 5.0             # mean gap 0.2 s: 5 requests/s
    sigma = 0.9
    trace = Trace(np.cumsum(gaps), np.maximum(1, np.rint(rng.lognormal(6.0, sigma, n))).astype(np.int64),
                  np.full(n, 7, dtype=np.int64))
    fit = fit_workload(trace, profile_bin_s=1000.0)
    # Standard errors: mean gap (CV / sqrt(n)); sample std of Gamma(k) gaps, Var(s^2) = (2k^2 + 6k) / n.
    assert fit.rate_per_s == pytest.approx(5.0, rel=4 * 2 / np.sqrt(n))
    se_cv = np.sqrt((2 * shape ** 2 + 6 * shape) / n) / (2 * np.sqrt(shape)) / shape
    assert abs(fit.gap_cv - 2.0) < 4 * se_cv
    assert abs(fit.prompt.sigma - sigma) < 4 * sigma / np.sqrt(2 * n) + 0.01     # + rounding to whole tokens
    assert fit.output.sigma == pytest.approx(0, abs=1e-12) and fit.output.mean == pytest.approx(7)
    # Profile: every full 1000 s bin near 5/s (Poisson-like count SE sqrt(count) x CV).
    full = np.asarray(fit.profile_rates_per_s[:-1])
    assert np.all(np.abs(full - 5.0) < 4 * 2 * np.sqrt(5000) / 1000)
    workload = fit.to_workload(scale=2.0, num_requests=5000)
    t = generate_trace(workload_from_node(Node(workload), max_tokens=10 ** 6), 1)
    assert mean_rate_per_s(t.arrival_s) == pytest.approx(10.0, rel=4 * 2 / np.sqrt(5000))


def test_fitted_time_of_day_profile_replays_each_bins_rate():
    from llmsim.workload.trace import Trace
    from llmsim.workload.trace_fit import fit_workload
    rng = np.random.default_rng(8)
    quiet, busy = np.sort(rng.uniform(0, 600, 600)), np.sort(rng.uniform(600, 1200, 3000))   # 1/s, then 5/s
    times = np.concatenate((quiet, busy))
    fit = fit_workload(Trace(times, np.full(len(times), 50), np.full(len(times), 5)), profile_bin_s=600.0)
    assert fit.profile_rates_per_s[0] == pytest.approx(1.0, abs=4 * np.sqrt(600) / 600)
    assert fit.profile_rates_per_s[1] == pytest.approx(5.0, abs=4 * np.sqrt(3000) / 600)
    # Twice the traffic, with its time-of-day shape: a Poisson count per bin (SE sqrt(count)).
    t = generate_trace(workload_from_node(Node(fit.to_workload(scale=2.0, profile=True)), max_tokens=10 ** 6), 2)
    counts = np.histogram(t.arrival_s, bins=[0, 600, 1200])[0]
    expected = 2 * 600 * np.asarray(fit.profile_rates_per_s)
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected))


def test_trace_command_prints_and_writes_a_workload(tmp_path, capsys):
    path = tmp_path / "BurstGPT.csv"
    path.write_text(BURSTGPT)
    assert main(["trace", str(path), "--out", str(tmp_path / "w.yaml"), "--scale", "2"]) == 0
    text = capsys.readouterr().out
    assert "3 requests over 185.0 s" in text and "mean rate 0.01081/s" in text     # 2 gaps over 185 s
    assert "process: gamma" in (tmp_path / "w.yaml").read_text()
    assert main(["trace", str(tmp_path / "missing.csv")]) == 2
