"""The command line: runs that work, and bad input that gets one clear paragraph and exit status 2."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import llmsim
from llmsim.cli.main import main

from tests.helpers import BASE, REPO, merge

CLI = [sys.executable, "-m", "llmsim.cli.main"]


def write(tmp_path: Path, data, name="scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def run_cli(*args, cwd=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_run_prints_a_summary_and_writes_records(tmp_path):
    out = tmp_path / "out"
    done = run_cli("run", REPO / "scenarios" / "llama3-8b-h100-chat.yaml", "--out", out, "--seed", 5)
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout and "goodput" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 5
    records = (out / "requests.csv").read_text().splitlines()
    assert len(records) == summary["requests"]["arrived"] + 1


@pytest.mark.slow
def test_catalog_listings():
    models = run_cli("models")
    assert models.returncode == 0 and "Llama-3.1-70B" in models.stdout and "70.554" in models.stdout
    hardware = run_cli("hardware")
    assert hardware.returncode == 0
    for name in ("A100-80GB", "H100-SXM", "H200", "B200", "MI300X", "GH200", "GB200"):
        assert name in hardware.stdout


BAD = {
    "unknown top-level key": ({"workloud": {}}, ["workloud", "did you mean 'workload'"]),
    "unknown nested key": ({"engine": {"max_num_seq": 8}}, ["engine.max_num_seq", "did you mean 'max_num_seqs'"]),
    "wrong type": ({"engine": {"max_num_seqs": "lots"}}, ["engine.max_num_seqs", "'lots'", "integer"]),
    "wrong unit": ({"engine": {"queue_timeout": "3 parsecs"}}, ["engine.queue_timeout", "duration"]),
    "negative rate": ({"workload": {"arrival": {"rate": -5}}}, ["workload.arrival.rate", "-5", "> 0"]),
    "zero rate": ({"workload": {"arrival": {"rate": "0/s"}}}, ["workload.arrival.rate", "> 0"]),
    "rate with a size unit": ({"workload": {"arrival": {"rate": "5 GB"}}}, ["workload.arrival.rate", "rate"]),
    "unparseable SLO": ({"slo": {"ttft": "fast"}}, ["slo.ttft", "'fast'", "duration"]),
    "unknown SLO": ({"slo": {"tbt": "50 ms"}}, ["slo.tbt", "did you mean"]),
    "model does not fit": ({"model": "Llama-3.1-70B"}, ["does not fit", "tensor_parallel", "GB"]),
    "unknown model": ({"model": "Llama-3.1-7B"}, ["model", "did you mean", "'Llama-3.1-8B'"]),
    "unknown hardware": ({"hardware": "H1OO"}, ["hardware", "H100-SXM"]),
    "bad choice": ({"engine": {"batching": "dynamic"}}, ["engine.batching", "continuous, static"]),
    "tp not dividing heads": ({"deployment": {"tensor_parallel": 3}}, ["tensor_parallel", "divide"]),
    "budget below slots": ({"engine": {"max_num_seqs": 512, "max_batch_tokens": 256}}, ["max_batch_tokens"]),
    "utilisation above 1": ({"engine": {"memory_utilization": 1.5}}, ["memory_utilization", "<= 1"]),
    "missing trace file": ({"workload": {"arrival": {"process": "trace", "path": "nope.csv"},
                                         "prompt_tokens": None, "output_tokens": None}},
                           ["workload.arrival.path", "not found"]),
    "bad length distribution": ({"workload": {"prompt_tokens": {"distribution": "normal", "mean": 5}}},
                                ["workload.prompt_tokens.distribution", "lognormal"]),
    "min above max": ({"workload": {"output_tokens": {"distribution": "fixed", "value": 5, "min": 10, "max": 8}}},
                      ["workload.output_tokens.min"]),
    "clipping moves the mean": ({"workload": {"prompt_tokens": {"distribution": "lognormal", "mean": 1024,
                                                                "sigma": 50}}},
                                ["workload.prompt_tokens", "becomes 1 ", "10% allowed"]),
    "rate too low to resolve latencies": ({"workload": {"arrival": {"rate": "1e-300/s"}}},
                                          ["workload.arrival.rate", "1e-300/s", "at least 1e-06/s"]),
    "KV cache below one longest request": ({"engine": {"memory_utilization": 0.23}},
                                           ["engine.max_model_len", "11,136 tokens", "16,384", "memory_utilization"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_paragraph(tmp_path, case, capsys):
    overrides, expected = BAD[case]
    data = merge(BASE, overrides)
    if case == "missing trace file":
        del data["workload"]["prompt_tokens"], data["workload"]["output_tokens"]
    path = write(tmp_path, data)
    assert main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.slow
def test_bad_input_from_a_real_process_has_no_traceback(tmp_path):
    path = write(tmp_path, "model: [unclosed\n")
    done = run_cli("run", path)
    assert done.returncode == 2
    assert "not valid YAML at line 2" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_cli("run", tmp_path / "missing.yaml")
    assert done.returncode == 2 and "file not found" in done.stderr


def test_yaml_is_read_safely(tmp_path):
    path = write(tmp_path, "name: !!python/object/apply:os.system ['echo hacked']\n")
    done = run_cli("run", path)
    assert done.returncode == 2 and "hacked" not in done.stdout


def test_overload_runs_to_the_horizon_and_reports_the_queue(tmp_path):
    data = merge(BASE, {"workload": {"arrival": {"rate": 500.0}, "num_requests": 3000},
                        "simulation": {"horizon": "10 s"}})
    done = run_cli("run", write(tmp_path, data), "--out", tmp_path / "o")
    assert done.returncode == 0, done.stderr
    assert "unfinished" in done.stdout
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests"]["unfinished_queued"] > 0


def test_only_the_command_line_prints_or_parses_arguments():
    """Searches, calibration and the simulator return values; every print and argparse parser is in cli/."""
    package = Path(llmsim.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            printing = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
            parsing = (isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names)
                       or isinstance(node, ast.ImportFrom) and node.module == "argparse")
            if printing or parsing:
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders



def test_ctrl_c_outside_a_run_that_keeps_its_work_exits_130_in_one_line(monkeypatch, capsys):
    """Ctrl-C while a command imports or prepares (before any journal or partial result exists) is one line
    and exit status 130, as a shell reports SIGINT, not a KeyboardInterrupt traceback."""
    import llmsim.cli.catalog as catalog

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(catalog, "_cmd_models", interrupted)
    assert main(["models"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "llmsim: interrupted; files already written in full are kept"


def test_a_function_names_its_parameter_and_the_command_line_names_the_flag(tmp_path, capsys):
    """Domain functions raise with their parameter's name (``ratios``, ``target_rate_per_s``); the command
    line reports the flag that value came from, found by the parameter's name less its unit suffix."""
    from llmsim.cli.main import as_flag, build_parser

    report = build_parser(only="report")._subparsers._group_actions[0].choices["report"]
    assert as_flag(report, "target_rate_per_s") == "--target-rate"
    assert as_flag(report, "seeds") == "--seeds" and as_flag(report, "peak_to_mean") == "--peak-to-mean"
    assert as_flag(report, "workload.arrival.rate") == "workload.arrival.rate"      # a scenario key stays one
    from llmsim.errors import ConfigError
    from llmsim.search.layout import plan
    with pytest.raises(ConfigError) as error:
        plan(REPO / "scenarios" / "llama3-8b-h100-chat.yaml", 1.0, ["NoSuchChip"])
    assert error.value.key == "hardware"
    assert main(["plan", str(REPO / "scenarios" / "llama3-8b-h100-chat.yaml"), "--target-rate", "1",
                 "--hardware", "NoSuchChip"]) == 2
    assert "at key '--hardware'" in capsys.readouterr().err
