"""Trace readers and the ``trace`` command on hostile input: devices and FIFOs, values of the wrong
type, flags at the edge of their range, and property-based input for every format's reader.

Each fault reported against the readers is reproduced first. Those that hung or asked for
gigabytes on the old code are checked so that they cannot hang here: the error must come before
anything is read or allocated (a subprocess with a timeout, or a tracemalloc peak far below what
reading the file would take).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.cli.main import main
from llmsim.config import tables
from llmsim.config.limits import MAX_CHARS_PER_TOKEN, MAX_QUANTITY, MAX_TRACE_TOKENS, MIN_CHARS_PER_TOKEN
from llmsim.config.reader import Node, open_file
from llmsim.errors import ConfigError
from llmsim.workload import trace_formats
from llmsim.workload.trace_fit import MAX_PROFILE_BINS
from llmsim.workload.trace_formats import CSV_COLUMNS, read_csv_trace, read_mooncake, read_sharegpt, read_trace
from llmsim.workload.workload import workload_from_node

from tests.helpers import mutated_bytes

MOONCAKE_LINE = {"timestamp": 0, "input_length": 512, "output_length": 16, "hash_ids": [1, 2]}


def write_lines(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def llmsim_csv(path: Path, times, prompt=100, output=10, extra: str = "") -> Path:
    header = "arrival_s,prompt_tokens,output_tokens" + (",class" if extra else "")
    rows = "".join(f"{float(t)!r},{prompt},{output}" + (f",{extra}" if extra else "") + "\n" for t in times)
    path.write_text(header + "\n" + rows)
    return path


def cli(argv, capsys) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.err


# Run in a child process, so that a reader that hangs (as these did) fails the test at the timeout
# instead of stopping the run: each case prints its exit status and the error.
DEVICE_CASES = """
import contextlib, io, json, sys
from pathlib import Path
from llmsim.cli.main import main
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.workload.trace_formats import read_sharegpt, read_trace
fifo, dataset = sys.argv[1:3]
results = {}
for name, argv in [("zero-mooncake", ["trace", "/dev/zero", "--format", "mooncake"]),
                   ("zero-azure", ["trace", "/dev/zero", "--format", "azure"]),
                   ("zero-auto", ["trace", "/dev/zero"]),
                   ("fifo", ["trace", fifo, "--format", "llmsim"])]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        results[name] = [main(argv), err.getvalue()]
try:                                # as report --trace and a scenario's trace path read it
    read_trace(Path("/dev/zero"), Node({"path": "/dev/zero"}), "path", "mooncake")
    results["read_trace"] = [0, ""]
except ConfigError as error:
    results["read_trace"] = [2, str(error)]
try:
    read_sharegpt(Path(dataset), Node({}), Path("/dev/zero"), None)
    results["tokenizer"] = [0, ""]
except ConfigError as error:
    results["tokenizer"] = [2, str(error)]
print(json.dumps(results))
"""


def test_devices_and_fifos_are_refused_without_reading_them(tmp_path):
    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    dataset = write_lines(tmp_path / "data.jsonl", [{"prompt": "hello", "output_tokens": 5}])
    done = subprocess.run([sys.executable, "-c", DEVICE_CASES, str(fifo), str(dataset)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    if importlib.util.find_spec("tokenizers") is None:       # without the package, that is what is said
        assert "needs the tokenizers package" in results.pop("tokenizer")[1]
    assert len(results) >= 5
    for name, (status, error) in results.items():
        path = str(fifo) if name == "fifo" else "/dev/zero"
        assert status == 2 and path in error and "not a regular file" in error, (name, error)


def test_a_sparse_file_over_the_cap_is_refused_before_it_is_hashed_or_read(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as file:                  # sparse: 600 MiB long, nothing on disk
        file.truncate(600 * 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="larger than the 512 MiB") as raised:
            read_trace(path, Node({"path": str(path)}), "path", "mooncake")
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert raised.value.file == str(path)
    assert peak_bytes < 16 * 2**20          # reading it would hold 512 MiB


def test_open_file_refuses_devices_and_folders(tmp_path):
    for path, fragment in (("/dev/zero", "not a regular file"), (tmp_path, "is a folder"),
                           (tmp_path / "none", "file not found")):
        with pytest.raises(ConfigError, match=fragment):
            open_file(path, 100)


# -- Mooncake: no string or boolean taken for a number -----------------------------------------------

@pytest.mark.parametrize("field, value", [("input_length", "512"), ("output_length", True),
                                          ("timestamp", "1000"), ("input_length", False),
                                          ("output_length", [16]), ("timestamp", None)])
def test_mooncake_values_of_the_wrong_type_are_refused(tmp_path, field, value):
    path = write_lines(tmp_path / "trace.jsonl", [MOONCAKE_LINE, {**MOONCAKE_LINE, "timestamp": 5, field: value}])
    with pytest.raises(ConfigError) as raised:
        read_mooncake(path)
    error = raised.value
    assert error.file == str(path) and error.key == f"line 2, column {field}" and error.value == value


@pytest.mark.parametrize("hash_ids", [{}, "12", [1, "2"], [True], None])
def test_mooncake_hash_ids_must_be_a_list_of_integers(tmp_path, hash_ids):
    path = write_lines(tmp_path / "trace.jsonl", [{**MOONCAKE_LINE, "hash_ids": hash_ids}])
    with pytest.raises(ConfigError) as raised:
        read_mooncake(path)
    assert raised.value.key == "line 1, column hash_ids" and raised.value.value == hash_ids


def test_integers_past_pythons_digit_limit_are_an_error_naming_the_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(MOONCAKE_LINE) + "\n" + '{"timestamp": 1' + "0" * 5000 + "}\n")
    with pytest.raises(ConfigError) as raised:
        read_mooncake(path)
    assert raised.value.key.startswith("line 2, column")
    dataset = tmp_path / "data.json"
    dataset.write_text('[{"prompt": "a", "output_tokens": 1' + "0" * 5000 + "}]")
    with pytest.raises(ConfigError) as raised:
        read_sharegpt(dataset, Node({}), None, 4.0)
    assert raised.value.file == str(dataset)


def test_row_counts_are_bounded_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "MAX_TABLE_ROWS", 3)
    monkeypatch.setattr(trace_formats, "MAX_TABLE_ROWS", 3)
    csv = llmsim_csv(tmp_path / "trace.csv", [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="5 lines, more than the 3 rows"):
        read_csv_trace(csv, Node({"path": str(csv)}, file="s.yaml"), "path", "llmsim")
    lines = write_lines(tmp_path / "trace.jsonl", [{**MOONCAKE_LINE, "timestamp": t} for t in range(4)])
    with pytest.raises(ConfigError, match="4 lines, more than the 3"):
        read_mooncake(lines)


def test_json_objects_and_lists_are_bounded_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_formats, "MAX_JSON_CONTAINERS", 5)
    one_line = tmp_path / "data.jsonl"          # one line: the row bound alone would let it through
    one_line.write_text(json.dumps({"prompt": "a", "output_tokens": 1, "x": [{}, {}, {}, {}, {}]}) + "\n")
    as_list = tmp_path / "data.json"
    as_list.write_text(json.dumps([{"prompt": "a", "output_tokens": 1}] * 6))
    for path in (one_line, as_list):
        with pytest.raises(ConfigError, match=r"has 7 '\{' and '\[' characters") as raised:   # 7 in each file
            read_sharegpt(path, Node({}), None, 4.0)
        assert raised.value.file == str(path)
    lines = write_lines(tmp_path / "trace.jsonl", [MOONCAKE_LINE] * 3)       # 2 a line
    with pytest.raises(ConfigError, match=r"has 6 '\{' and"):
        read_mooncake(lines)


# -- llmsim trace: flags at the edge, one-instant traces ----------------------------------------------

@pytest.mark.parametrize("span_s, bin_s", [(10.0, 1e-6), (10.0, 1e-12), (1e9, 1.0), (1e9, 1e-3)])
def test_profile_bins_are_bounded_before_allocating(tmp_path, capsys, span_s, bin_s):
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, span_s / 2, span_s])
    status, err = cli(["trace", path, "--bin", repr(bin_s)], capsys)
    assert status == 2 and "'--bin'" in err and f"(got {bin_s!r})" in err
    assert f"a bin of at least {span_s / MAX_PROFILE_BINS:.6g} s" in err


def test_the_smallest_bin_allowed_fits(tmp_path, capsys):
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, 5.0, 10.0])
    status, out = main(["trace", str(path), "--bin", repr(10.0 / MAX_PROFILE_BINS)]), capsys.readouterr().out
    assert status == 0 and "3 requests over 10.0 s" in out


@pytest.mark.parametrize("flag, value", [("--bin", "nan"), ("--bin", "-1"), ("--bin", "0"), ("--bin", "1e10"),
                                         ("--scale", "0"), ("--scale", "inf"), ("--scale", "1e308"),
                                         ("--scale", "-2")])
def test_numeric_flags_are_range_checked_at_the_edge(tmp_path, capsys, flag, value):
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, 1.0, 2.0])
    status, err = cli(["trace", path, flag, value], capsys)
    assert status == 2 and f"argument {flag}: out of range (got '{value}')" in err


@pytest.mark.parametrize("scale", ["1e-320", "1e-300", "1e9"])
def test_scale_must_leave_rates_a_scenario_takes(tmp_path, capsys, scale):
    # 3 requests over 2 s: a mean rate of 1/s; the 1e9 s window needs at least 3e-9/s, rates stop at 1e9/s.
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, 1.0, 2.0])
    status, err = cli(["trace", path, "--scale", scale, "--out", tmp_path / "w.yaml"], capsys)
    assert status == 2 and "'--scale'" in err and "a factor from 3e-09 to" in err
    assert not (tmp_path / "w.yaml").exists()


def test_a_scaled_workload_within_range_reads_back_as_a_scenario(tmp_path, capsys):
    import yaml
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, 1.0, 2.0, 4.0])
    for profile in ([], ["--profile"]):
        out = tmp_path / f"w{len(profile)}.yaml"
        assert main(["trace", str(path), "--scale", "6e-9", "--bin", "1", "--out", str(out), *profile]) == 0
        workload = yaml.safe_load(out.read_text())["workload"]
        workload_from_node(Node(workload, file=str(out)), max_tokens=100000)     # a ConfigError fails the test


def test_identical_timestamps_have_no_rate_to_fit(tmp_path, capsys):
    path = llmsim_csv(tmp_path / "trace.csv", [5.0, 5.0, 5.0])
    status, err = cli(["trace", path], capsys)
    assert status == 2 and "all 3 requests arrive at the same time" in err and str(path) in err


# -- scenarios replaying a trace: sample, rate, datasets ---------------------------------------------

def replay_node(path: Path, **arrival) -> Node:
    return Node({"arrival": {"process": "trace", "path": str(path), **arrival}}, file="scenario.yaml")


def test_a_sample_that_keeps_no_request_is_refused(tmp_path):
    path = llmsim_csv(tmp_path / "trace.csv", np.arange(100.0))
    with pytest.raises(ConfigError) as raised:
        workload_from_node(replay_node(path, sample=1e-9), max_tokens=100000)
    assert raised.value.key == "arrival.sample" and raised.value.value == 1e-9 and "> 0.005" in raised.value.allowed
    workload_from_node(replay_node(path, sample=0.006), max_tokens=100000)   # keeps round(0.6) = 1 request


def test_a_rate_cannot_rescale_requests_that_arrive_at_one_instant(tmp_path):
    path = llmsim_csv(tmp_path / "trace.csv", [3.0, 3.0, 3.0])
    with pytest.raises(ConfigError) as raised:
        workload_from_node(replay_node(path, rate="5/s"), max_tokens=100000)
    assert raised.value.key == "arrival.rate" and raised.value.value == "5/s"
    workload_from_node(replay_node(path), max_tokens=100000)                  # as a burst, it replays


@pytest.mark.parametrize("chars", [1e-300, 0.1, 1e6])
def test_chars_per_token_is_bounded(tmp_path, chars):
    path = write_lines(tmp_path / "data.jsonl", [{"prompt": "hello there", "completion": "hi"}])
    node = Node({"arrival": {"process": "poisson", "rate": 1}, "num_requests": 5,
                 "dataset": {"path": str(path), "chars_per_token": chars}}, file="scenario.yaml")
    with pytest.raises(ConfigError) as raised:
        workload_from_node(node, max_tokens=100000)
    assert raised.value.key == "dataset.chars_per_token" and raised.value.value == chars
    assert f"{MIN_CHARS_PER_TOKEN:g}" in raised.value.allowed and f"{MAX_CHARS_PER_TOKEN:g}" in raised.value.allowed


def test_a_counted_length_over_the_token_limit_names_its_entry(tmp_path):
    long_prompt = "x" * (MAX_TRACE_TOKENS + 1)          # one token a character
    path = write_lines(tmp_path / "data.jsonl", [{"prompt": "a", "completion": "b"},
                                                 {"prompt": long_prompt, "completion": "b"}])
    with pytest.raises(ConfigError) as raised:
        read_sharegpt(path, Node({}), None, 1.0)
    assert raised.value.key == "line 2" and f"{MAX_TRACE_TOKENS + 1:,}" in str(raised.value)


@pytest.mark.parametrize("fmt, text", [
    ("burstgpt", "Timestamp,Request tokens,Response tokens\n0,5,0\n1,5,0\n"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,0\n"),
])
def test_a_trace_whose_every_request_generated_nothing_is_refused(tmp_path, fmt, text):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match="0 output tokens: none is left") as raised:
        read_csv_trace(path, Node({"path": str(path)}), "path", fmt)
    assert raised.value.file == str(path)


def test_a_class_column_in_an_llmsim_trace_is_read_as_the_docs_say(tmp_path):
    path = llmsim_csv(tmp_path / "trace.csv", [0.0, 1.0], extra="interactive")
    trace = read_trace(path, Node({"path": str(path)}), "path")
    assert list(trace.class_label) == ["interactive", "interactive"]


# -- property-based: every reader ends in a trace or a ConfigError naming the file ---------------------

QUICK_EXAMPLES = 25
SLOW_EXAMPLES = 2000

VALID = {
    "llmsim": "arrival_s,prompt_tokens,output_tokens,session_id,class\n0,100,10,1,a\n0.5,200,20,1,b\n2.25,50,5,2,a\n",
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,4808,10\n"
             "2023-11-16 18:15:50.9951690,3180,8\n2024-05-10 00:00:00+00:00,110,0\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,"
                "Conversation log\n45,ChatGPT,1087,0,1087,Conversation log\n118,GPT-4,417,276,693,API log\n",
    "mooncake": "".join(json.dumps({"timestamp": t, "input_length": 100 + t, "output_length": 3,
                                    "hash_ids": [t]}) + "\n" for t in (0, 10, 25)),
    "sharegpt": json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
                            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                            {"prompt": "p", "output_tokens": 7}, {"prompt": "p", "completion": "c"}]),
}

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**30, max_value=10**30),
              st.floats(allow_subnormal=False), st.text(max_size=8),
              st.sampled_from([10**400, 2**53 + 1, "512", "1e3", "NaN", 1e-300])),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length",
                                                                "hash_ids", "prompt", "completion", "output_tokens",
                                                                "conversations", "messages", "from", "value", "role",
                                                                "content", "x"]), children, max_size=5)),
    max_leaves=12)

cells = st.one_of(st.sampled_from(["0", "1", "-1", "1.5", "1e30", "1e400", "inf", "nan", "", "x", "true", "0x10",
                                   "2023-11-16 18:15:46", "99999999999999999999999", '"5"', "１２", " 7 "]),
                  st.integers(-5, 10**8).map(str), st.floats(allow_subnormal=False).map(repr))


@st.composite
def csv_texts(draw, fmt: str) -> str:
    columns = list(CSV_COLUMNS[fmt]) + draw(st.lists(st.sampled_from(["class", "session_id", "Model", "Log Type",
                                                                       "x"]), max_size=2, unique=True))
    columns = draw(st.permutations(columns))
    if draw(st.integers(0, 5)) == 0:
        columns = columns[:-1]
    rows = draw(st.lists(st.lists(cells, min_size=len(columns), max_size=len(columns)), max_size=8))
    return "\n".join([",".join(columns)] + [",".join(row) for row in rows]) + "\n"


@st.composite
def mutated(draw, text: str) -> bytes:
    """A valid file with a few bytes deleted, replaced or inserted."""
    return mutated_bytes(draw, text.encode(), b'0123456789-.,:"[]{}\n eE\x00\xff')


def file_contents(fmt: str):
    json_lines = st.lists(json_values, max_size=6).map(lambda rows: "".join(json.dumps(r) + "\n" for r in rows))
    if fmt == "mooncake":
        structured = json_lines
    elif fmt == "sharegpt":
        structured = st.one_of(json_values.map(lambda v: json.dumps(v if isinstance(v, list) else [v])), json_lines)
    else:
        structured = csv_texts(fmt)
    return st.one_of(st.binary(max_size=200), structured, mutated(VALID[fmt]), st.just(VALID[fmt]))


def read_any(fmt: str, path: Path):
    if fmt == "mooncake":
        return read_mooncake(path)
    if fmt == "sharegpt":
        return read_sharegpt(path, Node({}), None, 4.0)
    return read_csv_trace(path, Node({"path": str(path)}, file="scenario.yaml"), "path", fmt)


def check_reader(fmt: str, path: Path, content) -> None:
    """A trace that can be simulated, or a ConfigError that names the file (and the line and value)."""
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    try:
        trace = read_any(fmt, path)
    except ConfigError as error:
        assert str(path) in str(error), str(error)
        if error.key is not None and error.key.startswith("line"):
            assert error.file == str(path) and error.has_value, str(error)
        return
    arrival = trace.arrival_s
    assert len(trace) >= 1 and np.isfinite(arrival).all() and (np.diff(arrival) >= 0).all()
    assert arrival.min() >= 0 and arrival.max() <= MAX_QUANTITY["duration"]
    for tokens in (trace.prompt_tokens, trace.output_tokens):
        assert tokens.dtype == np.int64 and tokens.min() >= 1 and tokens.max() <= MAX_TRACE_TOKENS


def property_test(fmt: str, examples: int, tmp_path: Path) -> None:
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(content=file_contents(fmt))
    def check(content):
        check_reader(fmt, tmp_path / f"trace.{fmt}", content)

    check()


@pytest.mark.parametrize("fmt", list(VALID))
def test_every_reader_ends_in_a_trace_or_a_config_error(tmp_path, fmt):
    property_test(fmt, QUICK_EXAMPLES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(VALID))
def test_every_reader_ends_in_a_trace_or_a_config_error_2000_examples(tmp_path, fmt):
    property_test(fmt, SLOW_EXAMPLES, tmp_path)
