"""Runs stopped before their end (horizon, Ctrl-C, a fault) report what was simulated.

Only requests that arrived have records and count as arrived; rates are over the simulated
window (warm-up to where the run stopped), not the planned arrival window; the summary says
what stopped the run and when. Ctrl-C is tested in-process (an observer raises
KeyboardInterrupt, as the signal would inside an engine) and once through ``llmsim run``.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from array import array
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import llmsim.search.sweeps as sweeps
from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.cli.outputs import write_file as WRITE_FILE
from llmsim.search.journal import Journal
from llmsim.search.sweeps import key_under, reusing_runs, run_key, run_points
from llmsim.sim.result import StopReason
from llmsim.sim.simulate import simulate_whole
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, REPO, make_scenario, merge

LONG = {"workload": {"arrival": {"rate": 10.0}, "num_requests": 100_000}, "simulation": {"warmup": "20 s"}}


def stop_after(iterations: int, error: BaseException):
    """An observer that raises ``error`` at the given iteration (as Ctrl-C would, inside an engine)."""
    seen = {"n": 0}

    def observer(engine, iteration):
        seen["n"] += 1
        if seen["n"] == iterations:
            raise error
    return observer, seen


def check_partial(result, stopped_by: str):
    """Counts, window and rates of a stopped run against its records."""
    summary = summarize(result).to_dict()
    records, end = result.requests, result.end_s
    assert summary["stopped_by"] == stopped_by and summary["simulated_s"] == end
    # Only requests that arrived: a prefix of the trace, every one by the end.
    assert len(records) < result.planned_requests
    assert (records["arrival_s"] <= end).all()
    assert (records["id"].to_numpy() == np.arange(len(records))).all()
    trace = generate_trace(result.scenario.workload, result.scenario.seed)
    assert len(records) == (trace.arrival_s <= end).sum()
    counts = summary["requests"]
    assert counts["arrived"] == len(records)
    assert counts["not_arrived"] == result.planned_requests - len(records)
    assert counts["arrived"] == (counts["finished"] + counts["rejected_timeout"] + counts["rejected_too_long"]
                                 + counts["unfinished_queued"] + counts["unfinished_running"])
    # The window ends where the simulation did; throughput is finished requests over it.
    start, stop = summary["window_s"]
    assert stop == end
    done = records[(records["status"] == "finished") & (records["finish_s"] > start) & (records["finish_s"] <= stop)]
    assert summary["throughput"]["requests_per_s"] == pytest.approx(len(done) / (stop - start))
    steady = records[records["arrival_s"] >= start]
    assert summary["throughput"]["offered_requests_per_s"] == pytest.approx(len(steady) / (stop - start))
    assert 0 <= summary["utilisation"]["busy_fraction"] <= 1
    return summary


def test_ctrl_c_keeps_what_was_simulated_and_returns_at_once():
    scenario = make_scenario(LONG)
    observer, seen = stop_after(4000, KeyboardInterrupt())
    result = simulate(scenario, observers=[observer])
    assert seen["n"] == 4000                  # no iteration ran after the interrupt
    assert result.interrupted and result.stopped_by == "interrupt" and result.fault is None
    summary = check_partial(result, "interrupt")
    assert summary["interrupted"]
    # About the offered 10 req/s, not 10 x (simulated time / planned window).
    assert summary["throughput"]["requests_per_s"] == pytest.approx(10, rel=0.3)
    assert summary["requests"]["finished"] > 0


def test_ctrl_c_before_the_warm_up_ends_measures_the_whole_simulated_time():
    observer, _ = stop_after(300, KeyboardInterrupt())
    result = simulate(make_scenario(LONG), observers=[observer])
    assert result.end_s < 20                                  # inside the 20 s warm-up
    summary = check_partial(result, "interrupt")
    assert summary["window_s"] == [0.0, result.end_s]


class _TrippedLog(array):
    """A change log whose ``trip``-th append (counted over every such log) delivers a real SIGINT first:
    Ctrl-C arriving after a change's time was logged and before its value was (where CI once caught it)."""
    appends = 0
    trip = 0

    def append(self, value) -> None:
        type(self).appends += 1
        if type(self).appends == type(self).trip:
            signal.raise_signal(signal.SIGINT)      # Python runs the handler before the next line
        super().append(value)


@pytest.fixture
def at_a_terminal():
    """SIGINT handled as in a foreground command (KeyboardInterrupt), whatever the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_real_ctrl_c_ends_the_run_between_two_steps_not_inside_one(monkeypatch, at_a_terminal):
    """Ctrl-C raises KeyboardInterrupt wherever the interpreter is: raised between a queue change's time and
    its value, it left the log one value short and the run's end failed building its queue series. The
    first Ctrl-C now ends the run before its next step, every log whole."""
    import llmsim.sim.request as request

    _TrippedLog.appends, _TrippedLog.trip = 0, 5000
    monkeypatch.setattr(request, "array", lambda code, *rest: (_TrippedLog if code == "q" else array)(code, *rest))
    result = simulate(make_scenario(LONG))
    assert _TrippedLog.appends >= 5000                 # the Ctrl-C was sent
    assert result.interrupted and result.stopped_by == "interrupt" and result.fault is None
    check_partial(result, "interrupt")
    assert len(result.queue_length) and result.queue_length.notna().all().all()


def test_a_second_real_ctrl_c_aborts_the_run(at_a_terminal):
    """Two Ctrl-Cs before the run reaches its next step: the second raises, for the caller to abort."""
    seen = {"n": 0}

    def twice(engine, iteration):
        seen["n"] += 1
        if seen["n"] == 3000:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        simulate(make_scenario(LONG), observers=[twice])
    assert seen["n"] == 3000


def test_ctrl_c_ignored_by_the_process_leaves_the_run_alone():
    """A pool's workers ignore SIGINT (the parent handles it): their runs carry on to the end."""
    seen = {"n": 0}

    def ctrl_c(engine, iteration):
        seen["n"] += 1
        if seen["n"] == 100:
            signal.raise_signal(signal.SIGINT)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = simulate(make_scenario({"workload": {"num_requests": 300}}), observers=[ctrl_c])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.stopped_by == "completed" and len(result.requests) == 300


def test_horizon_cut_run_counts_only_requests_that_arrived():
    result = simulate(make_scenario({**LONG, "workload": {"arrival": {"rate": 10.0}, "num_requests": 2000},
                                     "simulation": {"warmup": "20 s", "horizon": "100 s"}}))
    assert result.stopped_by == "horizon" and not result.interrupted
    summary = check_partial(result, "horizon")
    assert summary["simulated_s"] == pytest.approx(100.0)
    assert not summary["interrupted"] and summary["fault"] is None


def test_a_run_that_completes_says_so():
    result = simulate(make_scenario({"workload": {"num_requests": 200}}))
    summary = summarize(result).to_dict()
    assert summary["stopped_by"] == "completed" and not summary["interrupted"]
    assert summary["requests"]["not_arrived"] == 0 and len(result.requests) == 200


def test_a_fault_is_raised_with_what_was_simulated():
    observer, _ = stop_after(3000, RuntimeError("engine broke"))
    with pytest.raises(RuntimeError, match="engine broke") as caught:
        simulate(make_scenario(LONG), observers=[observer])
    partial = caught.value.partial_result
    assert partial.stopped_by == "fault" and partial.interrupted
    assert partial.fault == "RuntimeError: engine broke"
    summary = check_partial(partial, "fault")
    assert summary["fault"] == "RuntimeError: engine broke"
    assert any("partial_result" in note for note in caught.value.__notes__)


def test_a_search_run_stopped_by_ctrl_c_raises_rather_than_returning_half_a_run():
    """What the searches and the report simulate (their figures need whole runs)."""
    observer, seen = stop_after(200, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        simulate_whole(make_scenario(LONG), observers=[observer])
    assert seen["n"] == 200


def test_ctrl_c_during_the_baseline_is_not_swallowed(monkeypatch):
    from llmsim.search.speedup import speedup_over_plain
    from llmsim.sim import simulate as module

    spec = make_scenario({"workload": {"num_requests": 60},
                          "speculation": {"draft": "Llama-3.2-1B", "k": 3,
                                          "acceptance": {"process": "bernoulli", "alpha": 0.7}}})
    result = simulate(spec)
    monkeypatch.setattr(module, "simulate", lambda *args, **kwargs: replace(result, stopped_by=StopReason.INTERRUPT))
    with pytest.raises(KeyboardInterrupt):
        speedup_over_plain(result)



def test_ctrl_c_stops_a_comparison_instead_of_tabulating_a_half_run(monkeypatch, capsys):
    """A comparison row is a whole run: an interrupted one ends the command (130), it is not printed as a result."""
    from llmsim.sim import simulate as module

    result = simulate(make_scenario({"workload": {"num_requests": 60}}))
    monkeypatch.setattr(module, "simulate", lambda *args, **kwargs: replace(result, stopped_by=StopReason.INTERRUPT))
    assert main(["compare", str(REPO / "scenarios" / "comparisons" / "h100-vs-cs3.yaml")]) == 130
    captured = capsys.readouterr()
    assert "variant" not in captured.out and "interrupted" in captured.err

def _scenario_file(tmp_path, num_requests: int) -> str:
    data = yaml.safe_load((REPO / "scenarios" / "llama3-8b-h100-chat.yaml").read_text())
    data["workload"]["num_requests"] = num_requests
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_run_writes_a_fault_partial_result_then_raises(tmp_path, monkeypatch):
    import llmsim.cli.run as run

    observer, _ = stop_after(3000, RuntimeError("engine broke"))
    monkeypatch.setattr(run, "simulate", lambda scenario, observers=(), **options:
                        simulate(scenario, observers=[*observers, observer], **options))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="engine broke"):
        main(["run", _scenario_file(tmp_path, 20_000), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "fault" and summary["fault"] == "RuntimeError: engine broke"
    assert len(pd.read_csv(out / "requests.csv")) == summary["requests"]["arrived"]


def _start(tmp_path, num_requests: int):
    """``llmsim run`` of a long chat scenario, started: returns once its simulation is under way."""
    simulate(make_scenario({"workload": {"num_requests": 50}}))   # compiled kernels cached before the child starts
    out = tmp_path / "out"
    # Ctrl-C at a terminal reaches a foreground command whose SIGINT is Python's default handler. A test run
    # started in the background of a shell without job control (``cmd &`` in a script) ignores SIGINT, and
    # children inherit that: the child restores the handler a terminal would give it.
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                              "signal.default_int_handler); from llmsim.cli.main import main; sys.exit(main())",
                              "run", _scenario_file(tmp_path, num_requests), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(child, "simulating")
    return child, out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_for_cpu(child, seconds: float) -> None:
    """Wait until the child has spent ``seconds`` of CPU more: as far into its run on a loaded machine as on
    an idle one, where a wall-clock sleep may end before it has simulated anything."""
    start = cpu_seconds(child.pid)
    while cpu_seconds(child.pid) - start < seconds:
        assert child.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)


def wait_for_line(child, prefix: str) -> None:
    """Read the child's stderr up to a line starting with ``prefix`` (fails if it exits first)."""
    lines = []
    while not (lines and lines[-1].startswith(prefix)):
        line = child.stderr.readline()
        assert line, f"no line starting {prefix!r} on stderr: {lines}"
        lines.append(line)


@pytest.mark.slow
def test_ctrl_c_stops_llmsim_run_and_writes_what_was_simulated(tmp_path):
    """How soon it stops is a benchmark's question; here: it stops where it was interrupted (long
    before the 1,000,000 requests' end) and writes those requests' records and summary."""
    child, out = _start(tmp_path, 1_000_000)
    run_for_cpu(child, 2.0)            # well into the run loop: a few thousand simulated seconds
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=600)
    assert child.returncode == 130, stderr
    assert "INTERRUPTED by Ctrl-C" in stdout
    summary = json.loads((out / "summary.json").read_text())
    records = pd.read_csv(out / "requests.csv")
    assert summary["stopped_by"] == "interrupt" and summary["requests"]["arrived"] == len(records)
    assert summary["requests"]["not_arrived"] == 1_000_000 - len(records) > 0
    start, stop = summary["window_s"]
    assert stop == summary["simulated_s"]
    done = records[(records["status"] == "finished") & (records["finish_s"] > start) & (records["finish_s"] <= stop)]
    assert summary["throughput"]["requests_per_s"] == pytest.approx(len(done) / (stop - start))
    assert summary["throughput"]["requests_per_s"] == pytest.approx(16, rel=0.2)      # the offered rate


def test_a_second_ctrl_c_aborts_at_once(tmp_path, monkeypatch, capsys, at_a_terminal):
    """A first real Ctrl-C stops the run, whose records are then written; a second one, landing while
    requests.csv is written, ends the command there: the summary that would follow is neither written nor
    printed, and the file being written is discarded. Both signals are raised at those very points (a
    child signalled from outside lands wherever the machine's speed puts it: CI once saw the write finish
    first)."""
    import llmsim.cli.run as run

    seen = {"n": 0}

    def first_ctrl_c(engine, iteration):
        seen["n"] += 1
        if seen["n"] == 3000:
            signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(run, "simulate", lambda scenario, observers=(), **options:
                        simulate(scenario, observers=[*observers, first_ctrl_c], **options))
    written = []

    def write_file(path, write):
        def second_ctrl_c(partial):
            write(partial)                       # the records, all of them, under the temporary name
            written.append(partial)
            signal.raise_signal(signal.SIGINT)   # before it is renamed into place
        return WRITE_FILE(path, second_ctrl_c if path.name == "requests.csv" else write)
    monkeypatch.setattr(run, "write_file", write_file)
    out = tmp_path / "out"
    assert main(["run", _scenario_file(tmp_path, 20_000), "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert "interrupted at" in captured.err                          # the first one stopped the run
    assert written and not written[0].exists()                       # the second landed mid-write ...
    assert not (out / "requests.csv").exists() and not (out / "summary.json").exists()
    assert "INTERRUPTED by Ctrl-C" not in captured.out and not list(out.glob(".*partial*"))


# -- report and recommend: finished simulations are kept, and the same command resumes ------------

RUNS = {"workload": {"num_requests": 40}, "slo": {"ttft": "300 ms", "tpot": "40 ms"}}
POINTS = [{"workload.arrival.rate": rate} for rate in (2.0, 4.0, 8.0)]
SIMULATE_POINT = sweeps.simulate_point


def simulations(monkeypatch, stop_at: int | None = None, error: BaseException | None = None):
    """Count (by run key) the runs simulated; with ``stop_at``, raise ``error`` instead of that one
    (Ctrl-C arrives in the parent, with serial workers in the simulation itself)."""
    keys = []

    def counted(scenario, stop_when_missed=None, checkpoints=None):
        if stop_at is not None and len(keys) + 1 == stop_at:
            raise error if error is not None else KeyboardInterrupt()
        rule = stop_when_missed if checkpoints is None else (stop_when_missed, checkpoints)
        keys.append(key_under(run_key(scenario), rule))     # the journal's key
        return SIMULATE_POINT(scenario, stop_when_missed, checkpoints)

    monkeypatch.setattr(sweeps, "simulate_point", counted)
    return keys


def journal_keys(path) -> set[bytes]:
    return {bytes.fromhex(line.split(",")[0]) for line in path.read_text().splitlines()[1:]}


def test_a_journal_of_runs_gives_back_the_same_rows_and_simulates_nothing_again(tmp_path, monkeypatch):
    scenario, journal = make_scenario(RUNS), tmp_path / "runs.csv"
    fresh = run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    with reusing_runs(journal):
        first = run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    assert len(journal.read_text().splitlines()) == 1 + 6
    simulated = simulations(monkeypatch)
    with reusing_runs(journal):                     # a new command: the journal is its only memory
        again = run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    assert simulated == []
    pd.testing.assert_frame_equal(again, fresh)
    pd.testing.assert_frame_equal(first, fresh)


def test_ctrl_c_inside_a_journal_keeps_the_runs_finished(tmp_path, monkeypatch):
    scenario, journal = make_scenario(RUNS), tmp_path / "runs.csv"
    fresh = run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    kept = simulations(monkeypatch, stop_at=4)
    with pytest.raises(KeyboardInterrupt), reusing_runs(journal):
        run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    assert journal_keys(journal) == set(kept) and len(kept) == 3
    resumed = simulations(monkeypatch)
    with reusing_runs(journal):
        again = run_points(scenario, POINTS, seeds=[1, 2], workers=1)
    assert len(resumed) == 3 and not set(resumed) & set(kept)
    pd.testing.assert_frame_equal(again, fresh)


def recommend_args(tmp_path, out: bool = True) -> list[str]:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, {"workload": {"num_requests": 200, "arrival": {"rate": 10}},
                                                "slo": {"ttft": "300 ms", "tpot": "40 ms"}})))
    return ["recommend", str(path), "--seeds", "2", "--top", "1", "--workers", "1",
            *(["--out", str(tmp_path / "rec.csv")] if out else [])]


def interrupted_recommend(tmp_path, monkeypatch, capsys) -> tuple[Path, list[bytes]]:
    """``llmsim recommend --out`` stopped by Ctrl-C at its sixth simulation: its journal and the runs kept."""
    journal = tmp_path / "rec.csv.runs.csv"
    kept = simulations(monkeypatch, stop_at=6)
    assert main(recommend_args(tmp_path)) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"interrupted: the simulations finished are kept in {journal}" in err
    # every simulation finished is kept; beside them, rows a finished run served for (a run at a longer queue
    # timeout in which no request waited that long is the shorter timeout's run too, llmsim.search.sweeps)
    assert set(kept) <= journal_keys(journal) and len(kept) == 5
    assert not (tmp_path / "rec.csv").exists()
    return journal, kept


def test_ctrl_c_during_recommend_exits_130_keeping_the_simulations_finished(tmp_path, monkeypatch, capsys):
    interrupted_recommend(tmp_path, monkeypatch, capsys)


@pytest.mark.slow          # a whole recommendation
def test_the_same_recommend_command_resumes_after_ctrl_c(tmp_path, monkeypatch, capsys):
    journal, kept = interrupted_recommend(tmp_path, monkeypatch, capsys)
    journaled = journal_keys(journal)
    resumed = simulations(monkeypatch)
    assert main(recommend_args(tmp_path)) == 0
    assert not set(resumed) & journaled             # what was kept is not simulated again
    assert (tmp_path / "rec.csv").exists() and not journal.exists()
    assert not (tmp_path / "rec.csv.runs.csv.lock").exists()


def test_ctrl_c_during_recommend_without_out_says_nothing_is_kept(tmp_path, monkeypatch, capsys):
    simulations(monkeypatch, stop_at=2)
    assert main(recommend_args(tmp_path, out=False)) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nothing is kept (give --out" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scenario.yaml"]


@pytest.mark.slow          # a small report, in three sittings
def test_report_stopped_by_a_full_disk_then_ctrl_c_resumes_to_the_same_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["report", str(REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"), "--target-rate", "20",
            "--hardware", "H100-SXM", "--seeds", "2", "--requests", "100", "--workers", "1", "--out", str(out)]
    journal = out / "runs.csv"
    real_append, appended = Journal.append, []

    def fills_up(self, row):
        if len(appended) == 8:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        appended.append(row)
        return real_append(self, row)

    monkeypatch.setattr(Journal, "append", fills_up)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err
    assert f"the simulations finished are kept in {journal}" in err
    assert len(journal_keys(journal)) == 8 and not (out / "report.html").exists()
    monkeypatch.setattr(Journal, "append", real_append)
    kept = journal_keys(journal)
    second = simulations(monkeypatch, stop_at=10)
    assert main(argv) == 130
    assert "interrupted: the simulations finished are kept" in capsys.readouterr().err
    # Every run simulated is kept; so are runs found to be the same run as one simulated (a queue timeout
    # none of its requests waited for), under their own keys, without being simulated.
    assert kept | set(second) <= journal_keys(journal)
    kept = journal_keys(journal)
    third = simulations(monkeypatch)
    assert main(argv) == 0
    assert not set(third) & kept and not journal.exists()
    resumed = (out / "report.md").read_text()
    # The same report as one written in one sitting (its figures are files beside it, whose SVG
    # matplotlib stamps with the date and random ids); the command line it records is the same.
    monkeypatch.setattr(sweeps, "simulate_point", SIMULATE_POINT)
    assert main([*argv[:-1], str(tmp_path / "whole")]) == 0
    whole = (tmp_path / "whole" / "report.md").read_text()
    assert resumed.replace(str(out), "OUT") == whole.replace(str(tmp_path / "whole"), "OUT")
    def names(folder):
        return sorted(path.name for path in (folder / "figures").iterdir())
    assert names(out) == names(tmp_path / "whole") != []
