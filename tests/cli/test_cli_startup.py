"""The command line builds only the parser of the command being run: ``llmsim --help`` loads no
numerical library, and each command's parser is the same whether built alone or with all the others."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from llmsim.cli.main import COMMANDS, build_parser

HEAVY = ("numpy", "pandas", "scipy", "numba", "matplotlib", "simpy")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices


def _arguments(parser: argparse.ArgumentParser) -> list[tuple]:
    return [(tuple(a.option_strings), a.dest, a.default, a.nargs, a.help) for a in parser._actions]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_built_alone_has_the_arguments_of_the_whole_parser(name):
    whole, alone = _subparsers(build_parser())[name], _subparsers(build_parser(only=name))[name]
    assert _arguments(alone) == _arguments(whole)
    assert alone.get_default("func") is whole.get_default("func") is not None


def test_the_top_level_help_lists_every_command_and_loads_no_numerical_library():
    code = ("import sys\nfrom llmsim.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint('LOADED', *sorted(m for m in " + repr(HEAVY) + " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in COMMANDS)
    assert out.strip().splitlines()[-1].split() == ["LOADED"]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_argument_has_help_text(name):
    command = _subparsers(build_parser(only=name))[name]
    missing = [a.option_strings or a.dest for a in command._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == []
