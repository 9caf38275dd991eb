"""Each kind of hostile input from issue 17 gets exit 2 and one clear paragraph (or runs, when it is
in fact valid); the limits hold exactly where the README says; the resource guard's estimate is
an upper bound of what a run measures. Through the command line in this process, for speed."""
from __future__ import annotations

import errno
import json
import tracemalloc

import pytest
import yaml

from llmsim.cli.main import main
from llmsim.config import limits
from llmsim.config.reader import load_yaml
from llmsim.errors import ConfigError
from llmsim.search import executors, journal
from llmsim.sim import resources

from tests.helpers import BASE, REPO, merge, make_scenario, simulate_checked

SMALL = {"workload": {"num_requests": 30, "arrival": {"rate": 20.0}}}


def write(tmp_path, data, name="scenario.yaml"):
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def refused(capsys, argv, *fragments):
    """``argv`` exits 2 with one paragraph on stderr holding every fragment (after a progress bar, if any)."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    paragraph = err.splitlines()[-1]
    assert "Traceback" not in err and paragraph.startswith("llmsim: ") and err.endswith(paragraph + "\n"), err
    for fragment in fragments:
        assert fragment in paragraph, (fragment, err)
    return paragraph


def scenario(tmp_path, overrides=None, name="scenario.yaml"):
    return write(tmp_path, merge(merge(BASE, SMALL), overrides or {}), name)


def run(tmp_path, path, *flags):
    return ["run", path, "--out", tmp_path / "out", *flags]


# -- numbers too large, sizes that allocate gigabytes ------------------------------------------

@pytest.mark.parametrize("overrides, fragments", [
    ({"workload": {"num_requests": 10**400}}, ["workload.num_requests", "out of range", "9.0072e+15",
                                                "...(241 characters)..."]),
    ({"workload": {"arrival": {"rate": 10**400}}}, ["workload.arrival.rate", "cannot read this as a rate"]),
    ({"engine": {"max_num_seqs": float("nan")}}, ["engine.max_num_seqs", "expected an integer"]),
    ({"workload": {"duration": "876600 h", "num_requests": None}}, ["workload.duration", "<= 1e+09"]),
    ({"simulation": {"horizon": 1e300}}, ["simulation.horizon", "<= 1e+09"]),
    ({"workload": {"arrival": {"process": "gamma", "cv": 0}}}, ["workload.arrival.cv", ">= 0.001 and <= 100"]),
])
def test_numbers_beyond_their_documented_range_are_refused_at_the_edge(tmp_path, capsys, overrides, fragments):
    refused(capsys, run(tmp_path, scenario(tmp_path, overrides)), *fragments)


@pytest.mark.parametrize("overrides, fragments", [
    ({"workload": {"num_requests": 10**9, "arrival": {"rate": 1e6}}}, ["1,000,000,000 requests", "GiB", "--force"]),
    ({"deployment": {"replicas": 100_000}}, ["100,000 engines", "GiB", "--force"]),
])
def test_a_run_too_large_is_refused_with_its_estimate_before_anything_is_drawn(tmp_path, capsys, overrides,
                                                                               fragments):
    refused(capsys, run(tmp_path, scenario(tmp_path, overrides)), "too large", *fragments)
    assert not (tmp_path / "out").exists()


def test_force_runs_what_the_guard_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(resources, "MAX_RUN_EVENTS", 100)        # the 30-request scenario is above it
    path = scenario(tmp_path)
    refused(capsys, run(tmp_path, path), "100 events", "--force")
    assert main([str(a) for a in run(tmp_path, path, "--force")]) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["requests"]["arrived"] == 30


@pytest.mark.parametrize("overrides", [
    {},                                                                          # light load, small batches
    {"workload": {"arrival": {"rate": 60.0}, "num_requests": 400}},              # heavy load, large batches
    {"deployment": {"replicas": 3}, "engine": {"batching": "static", "max_num_seqs": 8}},
])
def test_the_estimate_bounds_what_a_run_measures(overrides):
    scenario = make_scenario(merge(SMALL, overrides))
    estimate = resources.estimate_run(scenario)
    # Two runs first: what a process pays once (compiling a kernel on a cold numba cache, lazy imports) is not the
    # run's, and the estimate bounds what a run holds. The first run fills the cost model's memo; the second takes
    # the compiled steps its hits lead to (first compiled there); a third runs as the second.
    for _ in range(2):
        simulate_checked(scenario)
    tracemalloc.start()
    try:
        result = simulate_checked(scenario)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(result.requests) <= estimate.requests
    assert len(result.iterations) <= estimate.iterations
    assert peak <= estimate.memory_bytes, (peak, estimate)


# -- files: encodings, sizes, folders, nesting, aliases ----------------------------------------

@pytest.mark.parametrize("content, fragment", [
    (bytes(range(256)), "binary"),
    ("name: café\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 on line 1"),
    ("name: x\n".encode("utf-16"), "UTF-16 or UTF-32"),
    (b"a: " + b"[" * 5000 + b"]" * 5000, "nested more than 64 levels"),
    ("".join(" " * i + f"k{i}:\n" for i in range(100)).encode(), "nested more than 64 levels"),
])
def test_files_that_are_not_utf8_yaml_of_sane_shape_are_refused(tmp_path, capsys, content, fragment):
    refused(capsys, run(tmp_path, write(tmp_path, content)), fragment)


def test_a_folder_or_an_endless_device_is_not_read(tmp_path, capsys):
    refused(capsys, run(tmp_path, tmp_path), "is a folder")
    refused(capsys, run(tmp_path, "/dev/zero"), "is not a regular file")


def test_alias_expansion_is_capped_before_objects_are_built(tmp_path, capsys):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]    # 10**9 values
    refused(capsys, run(tmp_path, write(tmp_path, "\n".join(lines) + "\n")), "more than 200,000 values")
    refused(capsys, run(tmp_path, write(tmp_path, "a: &a [*a]\n")), "levels deep once its aliases")


def test_the_yaml_limits_hold_exactly(tmp_path):
    depth = limits.MAX_YAML_DEPTH
    assert load_yaml(write(tmp_path, "[" * depth + "]" * depth)) is not None
    with pytest.raises(ConfigError, match="nested more than"):
        load_yaml(write(tmp_path, "[" * (depth + 1) + "]" * (depth + 1)))
    # 1 mapping + 2 keys + a (1 + 999) + b (1 + 199 x 1,000) = 200,003 values once expanded; 198 uses: 199,003
    ok = "a: &a [" + ", ".join(["x"] * 999) + "]\nb: [" + ", ".join(["*a"] * 198) + "]\n"
    assert len(load_yaml(write(tmp_path, ok))["b"]) == 198
    with pytest.raises(ConfigError, match="200,000 values"):
        load_yaml(write(tmp_path, ok.replace("*a]", "*a, *a]")))
    uses = "a: &a 1\nb: [" + ", ".join(["*a"] * (limits.MAX_YAML_ALIASES + 1)) + "]\n"
    with pytest.raises(ConfigError, match="more than 1,000 aliases"):
        load_yaml(write(tmp_path, uses))
    assert load_yaml(write(tmp_path, "\ufeffname: x\n")) == {"name": "x"}  # a UTF-8 byte-order mark is fine


# -- output folders and seeds --------------------------------------------------------------------

def test_an_out_folder_that_cannot_be_written_is_refused_before_running(tmp_path, capsys):
    path = scenario(tmp_path)
    (tmp_path / "file").write_text("x")
    refused(capsys, ["run", path, "--out", tmp_path / "file" / "inside"], "is a file, not a folder")
    refused(capsys, ["run", path, "--out", "/proc/llmsim-out"], "cannot write into /proc")
    refused(capsys, ["run", path, "--out", tmp_path / "new" / ("x" * 300)], "--out", "longer than the")
    refused(capsys, ["sweep", path, "--grid", write(tmp_path, {"engine.max_num_seqs": [8]}, "grid.yaml"),
                     "--out", tmp_path / "file"], "is a file, not a folder")


@pytest.mark.parametrize("flags, fragment", [
    (["--seed", "-3"], "argument --seed: out of range (got '-3')"),
    (["--seed", "1.5"], "expected an integer >= 0"),
    (["--out", "bad\x00name"], "embedded null byte"),
])
def test_bad_run_flags_are_one_paragraph(tmp_path, capsys, flags, fragment):
    refused(capsys, run(tmp_path, scenario(tmp_path), *flags), fragment)


# -- llmsim place ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, fragment", [
    (["--tp", "-2"], "argument --tp: out of range"),
    (["--tp", "3"], "must divide Llama-3.1-8B's 32 attention heads"),
    (["--pp", "33"], "cannot exceed Llama-3.1-8B's 32 layers"),
    (["--context", "0"], "argument --context: out of range"),
    (["--context", "200000"], "longer than Llama-3.1-8B's context"),
    (["--weight-dtype", "fp5"], "invalid choice: 'fp5'"),
    (["--memory-utilization", "-0.5"], "a number > 0 and <= 1"),
    (["--runtime-reserve-gb", "nan"], "argument --runtime-reserve-gb"),
])
def test_place_flags_are_checked(capsys, flags, fragment):
    refused(capsys, ["place", "Llama-3.1-8B", "H100-SXM", *flags], fragment)


def test_place_reports_by_default_only_the_contexts_the_model_holds(capsys):
    assert main(["place", "Llama-2-7B", "H100-SXM"]) == 0             # a 4,096-token context
    out = capsys.readouterr().out
    assert "of 2,048 tokens" in out and "8,192" not in out and "32,768" not in out


# -- traces ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, fragment", [
    ("inf,10,10", "'line 2, column arrival_s': not a valid value (got 'inf')"),
    ("0,1e30,10", "'line 2, column prompt_tokens': not a valid value (got '1e30')"),
    ("0,10,2.5", "'line 2, column output_tokens'"),
    ("2e9,10,10", "<= 1e+09"),
])
def test_trace_values_are_finite_and_within_range(tmp_path, capsys, rows, fragment):
    trace = write(tmp_path, f"arrival_s,prompt_tokens,output_tokens\n{rows}\n1,5,5\n", "trace.csv")
    data = merge(BASE, {})
    data["workload"] = {"arrival": {"process": "trace", "path": str(trace)}}
    refused(capsys, run(tmp_path, write(tmp_path, data)), str(trace), fragment)


def test_the_report_trace_reader_checks_the_same(tmp_path, capsys):
    """``llmsim report --trace`` reads traces as the scenarios do (every format, the same checks)."""
    path = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,1e30,5\n", "trace.csv")
    assert main(["report", str(REPO / "scenarios" / "llama3-8b-h100-chat.yaml"), "--trace", str(path),
                 "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "trace.csv" in error and "line 2, column prompt_tokens" in error and "1e30" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, content, fragment", [
    ("trace.jsonl", '{"timestamp": 1e30, "input_length": 5, "output_length": 5}\n', "line 1, column timestamp"),
    ("trace.jsonl", '{"timestamp": 0, "input_length": 1' + "0" * 400 + ', "output_length": 5}\n',
     "line 1, column input_length"),
    ("trace.csv", "Timestamp,Request tokens,Response tokens\n0,5,1e30\n", "column Response tokens"),
    ("/dev/zero", None, "is not a regular file"),           # refused before a byte is read
])
def test_every_trace_format_goes_through_the_front_door(tmp_path, capsys, name, content, fragment):
    path = write(tmp_path, content, name) if content is not None else name
    data = merge(BASE, {})
    data["workload"] = {"arrival": {"process": "trace", "path": str(path)}}
    refused(capsys, run(tmp_path, write(tmp_path, data)), fragment)


# -- comparisons ------------------------------------------------------------------------------------

@pytest.mark.parametrize("loads, fragment", [
    ({"x": {"rate": 5, "bogus": 1}}, "loads.x.bogus"),
    ({"x": "5 parsecs"}, "loads.x"),
    ({"x": {"rate": "5 parsecs"}}, "loads.x.rate"),
])
def test_comparison_loads_are_checked(tmp_path, capsys, loads, fragment):
    comparison = {"base": merge(BASE, SMALL), "variants": {"a": {}}, "loads": loads}
    refused(capsys, ["compare", write(tmp_path, comparison)], fragment)


# -- searches and sweeps: their flags, an unreachable scheduler, a full disk, a killed worker -------

def test_a_seed_count_that_would_make_a_hundred_million_runs_is_refused(tmp_path, capsys):
    grid = write(tmp_path, {"engine.max_num_seqs": [16]}, "grid.yaml")
    refused(capsys, ["sweep", scenario(tmp_path), "--grid", grid, "--seeds", "100000000"], "more than 1,000 seeds")


@pytest.mark.parametrize("flags, fragment", [
    (["--target-rate", "1e12"], "--target-rate"),
    (["--target-rate", "5", "--max-replicas", "100000000"], "argument --max-replicas: out of range"),
    (["--target-rate", "5", "--workers", "0"], "argument --workers: out of range"),
])
def test_plan_flags_are_checked_before_searching(tmp_path, capsys, flags, fragment):
    refused(capsys, ["plan", scenario(tmp_path), *flags], fragment)


@pytest.mark.slow          # imports distributed and waits for the timeout
def test_an_unreachable_scheduler_is_a_clear_error_after_a_short_wait(tmp_path, capsys, monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(executors, "SCHEDULER_TIMEOUT_S", 1.0)
    refused(capsys, ["sweep", scenario(tmp_path), "--grid", write(tmp_path, {"engine.max_num_seqs": [8]}, "g.yaml"),
                     "--out", tmp_path / "sweep", "--engine", "dask", "--scheduler", "tcp://127.0.0.1:1"],
            "--scheduler", "cannot reach a Dask scheduler there within 1 s")


@pytest.mark.slow          # two sweeps of three points
def test_a_full_disk_stops_the_sweep_keeping_finished_points(tmp_path, capsys, monkeypatch):
    grid = write(tmp_path, {"workload.arrival.rate": [10.0, 20.0, 40.0]}, "grid.yaml")
    argv = ["sweep", scenario(tmp_path), "--grid", grid, "--out", tmp_path / "sweep", "--workers", "1"]
    real, appended = journal.Journal.append, []

    def fills_up(self, row):
        if len(appended) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        appended.append(row)
        return real(self, row)

    monkeypatch.setattr(journal.Journal, "append", fills_up)
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err and "kept in" in err
    monkeypatch.setattr(journal.Journal, "append", real)
    assert main([str(a) for a in argv]) == 0              # resumes: only the third point is simulated
    assert len(appended) == 2
    rows = (tmp_path / "sweep" / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 3


@pytest.mark.slow
def test_a_killed_worker_fails_its_points_and_keeps_the_rest(tmp_path, capsys, monkeypatch):
    import os
    import signal
    from llmsim.search import sweeps

    real = sweeps.simulate_point

    def dies_at_40(scenario, stop_when_missed=None):
        if scenario.workload.arrival.rate_per_s == 40.0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(scenario, stop_when_missed)

    monkeypatch.setattr(sweeps, "simulate_point", dies_at_40)      # workers are forked: they see it
    grid = write(tmp_path, {"workload.arrival.rate": [10.0, 40.0]}, "grid.yaml")
    status = main([str(a) for a in ["sweep", scenario(tmp_path), "--grid", grid, "--out", tmp_path / "sweep",
                                    "--workers", "2"]])
    captured = capsys.readouterr()
    assert status == 1 and "Traceback" not in captured.err
    assert "failed: workload.arrival.rate=40.0" in captured.out and "terminated abruptly" in captured.out
    monkeypatch.setattr(sweeps, "simulate_point", real)
    assert main([str(a) for a in ["sweep", scenario(tmp_path), "--grid", grid, "--out", tmp_path / "sweep",
                                  "--workers", "2"]]) == 0         # the failed point is simulated again


# -- the invariants observer catches a broken engine ---------------------------------------------------

def test_the_invariant_checker_stops_a_run_whose_kv_accounting_breaks(monkeypatch):
    from llmsim.sim.invariants import InvariantError
    from llmsim.sim.kvcache import KVCache

    real = KVCache.allocate

    def leaky(self, blocks):            # a bug: one block more taken from the pool than recorded
        real(self, blocks)
        self.free_blocks -= 1

    monkeypatch.setattr(KVCache, "allocate", leaky)
    with pytest.raises(InvariantError, match="blocks allocated") as caught:
        simulate_checked(make_scenario(SMALL))
    assert caught.value.partial_result.stopped_by == "fault"
