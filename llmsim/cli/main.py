"""The ``llmsim`` command: builds the parser from each subcommand's module and runs one.

Every subcommand is a thin wrapper over the Python API: it reads its arguments, calls one
function that returns values (a summary, a DataFrame, a record), prints them and writes
files. Bad input is a :class:`~llmsim.errors.ConfigError`: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from llmsim.cli.options import Parser
from llmsim.errors import ConfigError, Stopped

# Each command: the module of llmsim.cli that configures its parser and runs it, and its one-line help.
# A command's module (and the numerical libraries it needs) is imported only when that command is run or
# asked for its help, so `llmsim --help` and a mistyped command answer at once.
COMMANDS = {
    "run": ("run", "simulate one scenario and print its summary"),
    "compare": ("run", "simulate the variants of a comparison file side by side"),
    "sweep": ("sweep", "simulate every combination of a grid of settings; frontier and plot"),
    "place": ("catalog", "how many devices a model needs and how much KV cache is left"),
    "calibrate": ("calibrate", "fit the cost model to a torch decode step on this device"),
    "validate": ("calibrate", "compare a calibrated profile with held-out torch decode steps"),
    "plan": ("plan", "fewest replicas of each candidate chip that meet the SLO at a rate"),
    "recommend": ("recommend", "search k, max batch tokens and queue timeout for goodput under the SLO"),
    "report": ("report", "capacity-planning report (HTML + Markdown): cheapest layout per chip, settings, headroom, "
                         "N+1, peak sizing, sensitivity, monitoring view"),
    "models": ("catalog", "list the model catalog"),
    "hardware": ("catalog", "list the hardware profiles"),
    "diff": ("diff", "per-metric errors between a measured and a simulated `vllm bench serve` JSON"),
    "trace": ("trace", "describe a request trace and fit a synthetic workload to it"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` a command's name, the parser with just that command's
    arguments configured (the others are listed with their help)."""
    parser = Parser(prog="llmsim", description="Simulate and plan LLM inference serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        command.set_defaults(command_parser=command)
        if only is None or name == only:
            configure = getattr(importlib.import_module(f"llmsim.cli.{module}"), f"configure_{name}")
            configure(command)
    return parser


# A domain function's error names the parameter it was given (``target_rate_per_s``); on the command line the
# same value came from a flag (``--target-rate``), found by the parameter's name less its unit suffix.
UNIT_SUFFIXES = ("_per_s", "_s")


def as_flag(command: argparse.ArgumentParser, key: str) -> str:
    """The long flag of ``command`` whose value is the parameter ``key``, or ``key`` when none is."""
    flags = {action.dest: next(o for o in reversed(action.option_strings) if o.startswith("--"))
             for action in command._actions if any(o.startswith("--") for o in action.option_strings)}
    for name in (key, *(key.removesuffix(suffix) for suffix in UNIT_SUFFIXES if key.endswith(suffix))):
        if name in flags:
            return flags[name]
    return key


def _command(argv: list[str]) -> str | None:
    """The command named on the command line (its first word that is not an option), if any."""
    words = [word for word in argv if not word.startswith("-")]
    return words[0] if words and words[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(only=_command(argv) or "").parse_args(argv)
    except SystemExit as stop:          # --help, or a bad command line (already explained, exit 2)
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1   # as sys.exit reads it
    try:
        return args.func(args)
    except ConfigError as error:
        if error.file is None and error.key is not None:      # a flag's value, refused by the function it feeds
            error.key = as_flag(args.command_parser, error.key)
        print(f"llmsim: {error}", file=sys.stderr)
        return 2
    except Stopped as stop:         # Ctrl-C or a full disk in a command that keeps its finished work
        print(f"\nllmsim: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:        # Ctrl-C in a command with nothing finished to keep (or while importing)
        print("\nllmsim: interrupted; files already written in full are kept", file=sys.stderr)
        return 130
    except BrokenPipeError:          # output piped into head or less, which closed early
        return 0
    except OSError as error:         # the disk filled, a folder vanished or became read-only mid-run
        where = f"cannot write or read {error.filename}: " if error.filename else "the operating system refused: "
        print(f"llmsim: {where}{error.strerror or error}; files already written in full are kept (a file is "
              "renamed into place only when complete)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
