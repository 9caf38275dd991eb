"""The ``llmsim`` command: builds the parser from each subcommand's module and runs one.

Every subcommand is a thin wrapper over the Python API: it reads its arguments, calls one
function that returns values (a summary, a DataFrame, a record), prints them and writes
files. Bad input is a :class:`~llmsim.errors.ConfigError`: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys

from llmsim.cli import calibrate, catalog, diff, plan, recommend, report, run, sweep, trace
from llmsim.cli.options import Parser
from llmsim.cli.outputs import Stopped
from llmsim.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="llmsim", description="Simulate and plan LLM inference serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parsers(sub)                 # run, compare
    sweep.add_parser(sub)
    catalog.add_parser_place(sub)
    calibrate.add_parsers(sub)           # calibrate, validate
    plan.add_parser(sub)
    recommend.add_parser(sub)
    report.add_parser(sub)
    catalog.add_parsers_listing(sub)     # models, hardware
    diff.add_parser(sub)
    trace.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:          # --help, or a bad command line (already explained, exit 2)
        return stop.code
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"llmsim: {error}", file=sys.stderr)
        return 2
    except Stopped as stop:         # Ctrl-C or a full disk in a command that keeps its finished work
        print(f"\nllmsim: {stop}", file=sys.stderr)
        return stop.status
    except BrokenPipeError:          # output piped into head or less, which closed early
        return 0
    except OSError as error:         # the disk filled, a folder vanished or became read-only mid-run
        where = f"cannot write or read {error.filename}: " if error.filename else "the operating system refused: "
        print(f"llmsim: {where}{error.strerror or error}; files already written in full are kept (a file is "
              "renamed into place only when complete)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
