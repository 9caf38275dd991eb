"""Every numeric flag of run, compare, sweep, recommend, report, plan, place, calibrate and validate is
range-checked as the command line is read, as a scenario's keys are.

One table: each flag with the values it allows among 0, -3, nan, inf, 1e308 and a word (most allow
none of them) and one typical value it must take. Every other value must stop the parser with exit
status 2 and a message naming the flag, before any file is read; the allowed ones parse to the
number they say. A guard keeps the table whole: every option of these commands that takes a value
is in the table or named as one that takes no number.
"""
from __future__ import annotations

import argparse
import math

import pytest

from llmsim.cli.main import build_parser

EDGE = ("0", "-3", "nan", "inf", "1e308", "many")

# command -> (the arguments it needs besides the flag, never read by the parser)
COMMANDS = {
    "run": ["scenario.yaml"],
    "compare": ["comparison.yaml"],
    "sweep": ["scenario.yaml", "--grid", "grid.yaml"],
    "recommend": ["scenario.yaml"],
    "report": ["scenario.yaml"],
    "plan": ["scenario.yaml", "--target-rate", "10"],
    "place": ["Llama-3.1-8B", "H100-SXM"],
    "calibrate": [],
    "validate": ["profile.yaml"],
}

# (command, flag, {edge value allowed: what it parses to}, (a typical value, what it parses to))
FLAGS = [
    ("run", "--seed", {"0": 0}, ("7", 7)),
    ("run", "--detect", {}, ("0.1", 0.1)),
    ("run", "--requests", {}, ("50", 50)),
    ("sweep", "--workers", {}, ("2", 2)),
    ("sweep", "--seeds", {}, ("3,7", "3,7")),
    ("recommend", "--seeds", {}, ("3", "3")),
    ("recommend", "--top", {}, ("5", 5)),
    ("recommend", "--workers", {}, ("4", 4)),
    ("recommend", "--class-timeouts", {}, ("25ms,1s", [0.025, 1.0])),
    ("report", "--target-rate", {}, ("20/s", 20.0)),
    ("report", "--growth", {}, ("150%", 1.5)),
    ("report", "--peak-to-mean", {}, ("1.2", 1.2)),
    ("report", "--seeds", {}, ("2", "2")),
    ("report", "--requests", {}, ("200", 200)),
    ("report", "--workers", {}, ("2", 2)),
    ("plan", "--target-rate", {}, ("2x", "2x")),
    ("plan", "--seeds", {}, ("2", "2")),
    ("plan", "--workers", {}, ("2", 2)),
    ("plan", "--max-replicas", {}, ("16", 16)),
    ("place", "--tp", {}, ("2", 2)),
    ("place", "--pp", {}, ("2", 2)),
    ("place", "--memory-utilization", {}, ("0.8", 0.8)),
    ("place", "--max-batch-tokens", {}, ("4096", 4096)),
    ("place", "--runtime-reserve-gb", {"0": 0.0}, ("2", 2.0)),
    ("place", "--context", {}, ("8192", [8192])),
    ("place", "--room-for", {}, ("4", 4)),
    ("place", "--ep", {"2": 2}, ("32", 32)),
    ("place", "--redundant-experts", {"0": 0}, ("32", 32)),
    ("calibrate", "--threads", {}, ("4", 4)),
    ("calibrate", "--seed", {"0": 0}, ("3", 3)),
    ("validate", "--threads", {}, ("4", 4)),
    ("validate", "--seed", {"0": 0}, ("3", 3)),
]

# Options that take a value that is not a number: paths, names, words from a list, flags for vLLM.
NOT_NUMBERS = {"--out", "--vllm-args", "--grid", "--engine", "--scheduler", "--latency", "--throughput",
               "--objective", "--search", "--trace", "--hardware", "--weight-dtype", "--kv-dtype", "--device",
               "--dtypes", "--transfer-to", "--from", "--from-measurements", "--operators", "--models",
               "--attention-backend", "--tag", "--gpu", "--base", "--plot", "--measurements", "--from-database"}


def parse(command: str, flag: str, value: str):
    return build_parser().parse_args([command, *COMMANDS[command], f"{flag}={value}"])


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


CASES = [(command, flag, value, allowed) for command, flag, allowed, _ in FLAGS for value in EDGE]


@pytest.mark.parametrize("command, flag, value, allowed", CASES,
                         ids=[f"{c}{f}={v}" for c, f, v, _ in CASES])
def test_each_numeric_flag_is_range_checked(command, flag, value, allowed, capsys):
    if value in allowed:
        parsed = getattr(parse(command, flag, value), dest(flag))
        assert parsed == allowed[value] and not isinstance(parsed, bool)
        return
    with pytest.raises(SystemExit) as stop:
        parse(command, flag, value)
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert f"argument {flag}" in message and repr(value) in message, message
    assert "Traceback" not in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("command, flag, typical", [(c, f, t) for c, f, _, t in FLAGS],
                         ids=[f"{c}{f}" for c, f, _, _ in FLAGS])
def test_each_numeric_flag_takes_a_typical_value(command, flag, typical):
    text, expected = typical
    parsed = getattr(parse(command, flag, text), dest(flag))
    if isinstance(expected, list) and expected and isinstance(expected[0], float):
        assert parsed == pytest.approx(expected)
    else:
        assert parsed == expected
    assert not (isinstance(parsed, float) and not math.isfinite(parsed))


def test_the_table_holds_every_flag_that_takes_a_value():
    """A new flag with a value on these commands must be added to the table (or to NOT_NUMBERS)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    tabled = {(command, flag) for command, flag, _, _ in FLAGS}
    missing = []
    for command in COMMANDS:
        for action in commands[command]._actions:
            if not action.option_strings or action.nargs == 0:          # positionals, switches, --help
                continue
            flag = max(action.option_strings, key=len)
            if (command, flag) not in tabled and flag not in NOT_NUMBERS:
                missing.append(f"{command} {flag}")
    assert missing == []
