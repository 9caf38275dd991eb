"""The `vllm bench serve` JSON reader (``llmsim diff``) on hostile input: each reported fault
reproduced, then property-based files (arbitrary bytes, arbitrary JSON trees, mutations of a
valid result) that must end in a checked result or a ConfigError naming the file."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.analysis.bench_format import DIFF_FIELDS, diff_metrics, read_bench_json
from llmsim.cli.main import main
from llmsim.config.limits import MAX_NUMBER
from llmsim.errors import ConfigError

from tests.helpers import mutated_bytes

VALID = {"backend": "vllm", "completed": 100, "duration": 25.0, "request_throughput": 4.0, "request_goodput": None,
         "mean_ttft_ms": 50.0, "p99_itl_ms": 12.5, "mean_tpot_ms": float("nan"), "itls": [[0.01, 0.02], [0.03]]}


def write(tmp_path, data, name="bench.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def diff(capsys, *paths) -> tuple[int, str, str]:
    status = main(["diff", *map(str, paths)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_400_digit_integer_is_an_error_naming_the_field(tmp_path, capsys):
    path = write(tmp_path, '{"completed": 1' + "0" * 400 + ', "duration": 5}')
    status, _, err = diff(capsys, path, write(tmp_path, VALID, "sim.json"))
    assert status == 2 and str(path) in err and "'completed'" in err and "Traceback" not in err


def test_all_zero_metrics_have_no_relative_error(tmp_path, capsys):
    zeros = write(tmp_path, {"completed": 0, "duration": 0.0, "mean_ttft_ms": 0.0})
    status, out, _ = diff(capsys, zeros, zeros)
    assert status == 0 and "3 metrics; no relative error: every measured value is 0" in out


def test_some_zero_metrics_leave_the_others_summarised(tmp_path, capsys):
    measured = write(tmp_path, {"completed": 0, "mean_ttft_ms": 50.0}, "m.json")
    simulated = write(tmp_path, {"completed": 3, "mean_ttft_ms": 60.0}, "s.json")
    status, out, _ = diff(capsys, measured, simulated)
    assert status == 0 and "median |error| 20.0%, largest 20.0% (mean_ttft_ms)" in out


def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path, capsys):
    path = write(tmp_path, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    status, _, err = diff(capsys, path, path)
    assert status == 2 and "nested more than 64 levels" in err and str(path) in err


def test_dev_zero_is_refused_without_reading_it():
    # A child process: the old reader read /dev/zero until memory ran out.
    done = subprocess.run([sys.executable, "-m", "llmsim.cli.main", "diff", "/dev/zero", "/dev/zero"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "/dev/zero" in done.stderr and "not a regular file" in done.stderr


@pytest.mark.parametrize("value", [True, "5", [5], {"v": 5}, -1, -math.inf, 2**53 + 1, 1e300])
def test_field_values_are_strictly_typed(tmp_path, value):
    path = write(tmp_path, {"completed": value})
    with pytest.raises(ConfigError) as raised:
        read_bench_json(path)
    assert raised.value.file == str(path) and raised.value.key == "completed" and raised.value.value == value


def test_an_integer_past_pythons_digit_limit_is_an_error(tmp_path):
    path = write(tmp_path, '{"completed": 1' + "0" * 5000 + "}")
    with pytest.raises(ConfigError, match="not valid JSON") as raised:
        read_bench_json(path)
    assert raised.value.file == str(path)


def test_null_nan_and_infinity_are_kept_and_left_out_of_the_diff(tmp_path):
    data = read_bench_json(write(tmp_path, {**VALID, "duration": float("inf")}))
    table = diff_metrics(data, data)
    assert list(table["metric"]) == ["completed", "request_throughput", "mean_ttft_ms", "p99_itl_ms"]


# -- property-based ------------------------------------------------------------------------------

QUICK_EXAMPLES = 25
SLOW_EXAMPLES = 2000

leaves = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**30, max_value=10**30),
                   st.floats(allow_subnormal=False), st.text(max_size=6),
                   st.sampled_from([10**400, 2**53 + 1, "inf", "NaN", 1e-300, -0.0]))
trees = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.sampled_from([*DIFF_FIELDS[:8], "itls", "x"]), children,
                                                     max_size=6)), max_leaves=16)
objects = st.dictionaries(st.sampled_from([*DIFF_FIELDS, "itls", "backend"]), trees, max_size=8)


@st.composite
def mutated(draw) -> bytes:
    return mutated_bytes(draw, json.dumps(VALID).encode(), b'0123456789-.,:"[]{}eE \x00\xff')


contents = st.one_of(st.binary(max_size=200), trees.map(json.dumps), objects.map(json.dumps), mutated())


def check_reader(path, content) -> None:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    try:
        data = read_bench_json(path)
    except ConfigError as error:
        assert error.file == str(path), str(error)
        return
    assert isinstance(data, dict)
    for field in DIFF_FIELDS:
        value = data.get(field)
        assert value is None or (type(value) in (int, float) and (math.isnan(value) or value == math.inf
                                                                  or 0 <= value <= MAX_NUMBER)), (field, value)
    table = diff_metrics(data, data)
    assert (table["difference"] == 0).all()


def property_test(examples: int, tmp_path) -> None:
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(content=contents)
    def check(content):
        check_reader(tmp_path / "bench.json", content)

    check()


def test_the_reader_ends_in_a_result_or_a_config_error(tmp_path):
    property_test(QUICK_EXAMPLES, tmp_path)


@pytest.mark.slow
def test_the_reader_ends_in_a_result_or_a_config_error_2000_examples(tmp_path):
    property_test(SLOW_EXAMPLES, tmp_path)
