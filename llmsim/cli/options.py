"""Command-line options that several commands share, read the same way by each.

Every flag with a value is checked as argparse reads it (:func:`integer_flag`,
:func:`number_flag`: finite, within a documented range; :func:`checked_flag`: a reader of
durations, rates, factors or seeds that raises ConfigError), and the parser (:class:`Parser`)
refuses a bad command line the way a bad file is refused: one paragraph on stderr naming the
flag, the value and what is allowed, exit status 2 (no usage dump, no traceback).

``--seeds`` (``sweep``, ``plan``, ``recommend``) is a count or a list: ``--seeds 3`` is three
seeds starting at the scenario's own (seed, seed + 1, seed + 2), ``--seeds 3,7,11`` those
three seeds (``--seeds 7,`` the one seed 7). Bad values are ConfigErrors (exit 2).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from collections.abc import Callable

from llmsim.config.limits import MAX_NUMBER, MAX_RUN_ENGINES, MAX_RUN_EVENTS, MAX_RUN_MEMORY_BYTES
from llmsim.config.reader import Node, load_yaml, range_text
from llmsim.errors import ConfigError

if TYPE_CHECKING:
    from llmsim.scenario.scenario import Scenario

SEEDS_HELP = ("N: N seeds starting at the scenario's seed (seed, seed + 1, ...); or a comma-separated list "
              "of seeds, e.g. 3,7,11 (one seed: 7,)")
_SEEDS_ALLOWED = ("a count from 1 to 1,000 (e.g. 3), or up to 1,000 distinct seeds >= 0 separated by commas "
                  "(e.g. 3,7,11 or 7,)")


T = TypeVar("T")
MAX_WORKERS = 1024          # parallel processes a command may start
MAX_SEEDS = 1000            # seeds a command may replicate every point over


class Parser(argparse.ArgumentParser):
    """argparse, refusing a bad command line in one paragraph with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"llmsim: command-line error in '{self.prog}': {message} (see '{self.prog} --help').\n")


def integer_flag(minimum: int | None = None, maximum: float = MAX_NUMBER) -> Callable[[str], int]:
    """An argparse ``type``: an integer within ``minimum``..``maximum``."""
    allowed = range_text("an integer", minimum, maximum)

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed} (got {text!r})") from None
        if (minimum is not None and value < minimum) or value > maximum:
            raise argparse.ArgumentTypeError(f"out of range (got {text!r}); allowed: {allowed}")
        return value
    return integer


def number_flag(minimum: float, maximum: float, exclusive_minimum: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within ``minimum``..``maximum``."""
    allowed = range_text("a number", minimum, maximum, exclusive_minimum)

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed} (got {text!r})") from None
        low = value <= minimum if exclusive_minimum else value < minimum
        if not math.isfinite(value) or low or value > maximum:
            raise argparse.ArgumentTypeError(f"out of range (got {text!r}); allowed: {allowed}")
        return value
    return number


def checked_flag(read: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from a reader that refuses bad text with a ConfigError (the reader a
    command would call later), so the flag is refused as the command line is read, by its name."""
    def flag(text: str) -> T:
        try:
            return read(text)
        except ConfigError as error:
            allowed = f"; allowed: {error.allowed}" if error.allowed else ""
            raise argparse.ArgumentTypeError(f"{error.message} (got {text!r}){allowed}") from None
    return flag


FORCE_HELP = ("run even when a run's estimated memory or event count is above the resource guard's limits "
              f"({MAX_RUN_MEMORY_BYTES / 2**30:g} GiB, {MAX_RUN_EVENTS:,} events, {MAX_RUN_ENGINES:,} engines)")
SEED = integer_flag(0)                          # seeds, as in a scenario's seed key
WORKERS = integer_flag(1, MAX_WORKERS)


def add_seeds_argument(parser, default: str | None = None, default_text: str = "the scenario's seed") -> None:
    parser.add_argument("--seeds", metavar="N|S1,S2,...", default=default, type=checked_flag(_seeds_text),
                        help=f"{SEEDS_HELP} (default: {default_text})")


def parse_seeds(text: str | None, scenario: str | Path | Scenario) -> list[int] | None:
    """The seeds ``--seeds`` names (None when not given); a count starts at ``scenario``'s seed
    (a Scenario, or a YAML file whose ``seed`` is read only then)."""
    if text is None:
        return None
    seeds = _read_seeds(str(text).strip())
    if isinstance(seeds, list):
        return seeds
    first = _yaml_seed(scenario) if isinstance(scenario, (str, Path)) else scenario.seed
    return list(range(first, first + seeds))


def _seeds_text(text: str) -> str:
    """``--seeds`` as argparse reads it: checked (:func:`_read_seeds`), kept as text (a count is
    resolved against the scenario's seed by :func:`parse_seeds`)."""
    _read_seeds(text.strip())
    return text


def _read_seeds(text: str) -> int | list[int]:
    """``--seeds``: a count (int), or the list of seeds; bad: ConfigError."""
    if "," in text:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        seeds = [_integer(part, text) for part in parts]
        if not seeds or min(seeds) < 0 or max(seeds) > MAX_NUMBER or len(set(seeds)) < len(seeds) \
                or len(seeds) > MAX_SEEDS:
            raise ConfigError("expected distinct seeds >= 0", key="--seeds", value=text, allowed=_SEEDS_ALLOWED)
        return seeds
    count = _integer(text, text)
    if count < 1:
        raise ConfigError("the count of seeds must be at least 1", key="--seeds", value=text, allowed=_SEEDS_ALLOWED)
    if count > MAX_SEEDS:
        raise ConfigError(f"more than {MAX_SEEDS:,} seeds", key="--seeds", value=text, allowed=_SEEDS_ALLOWED)
    return count


def _integer(part: str, text: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise ConfigError("cannot read this as seeds", key="--seeds", value=text, allowed=_SEEDS_ALLOWED) from None


def _yaml_seed(path: str | Path) -> int:
    """A scenario file's ``seed``, without validating the rest: a sweep's base file may leave
    keys to its grid."""
    from llmsim.scenario.scenario import read_seed      # not at import: the parser is built without it

    return read_seed(Node(load_yaml(path), file=str(path)))
