"""Command-line options that several commands share, read the same way by each.

``--seeds`` (``sweep``, ``plan``, ``recommend``) is a count or a list: ``--seeds 3`` is three
seeds starting at the scenario's own (seed, seed + 1, seed + 2), ``--seeds 3,7,11`` those
three seeds (``--seeds 7,`` the one seed 7). Bad values are ConfigErrors (exit 2).
"""
from __future__ import annotations

from pathlib import Path

from llmsim.config.reader import Node, load_yaml
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario, read_seed

SEEDS_HELP = ("N: N seeds starting at the scenario's seed (seed, seed + 1, ...); or a comma-separated list "
              "of seeds, e.g. 3,7,11 (one seed: 7,)")
_SEEDS_ALLOWED = "a count >= 1 (e.g. 3), or distinct seeds >= 0 separated by commas (e.g. 3,7,11 or 7,)"


def add_seeds_argument(parser, default: str | None = None, default_text: str = "the scenario's seed") -> None:
    parser.add_argument("--seeds", metavar="N|S1,S2,...", default=default,
                        help=f"{SEEDS_HELP} (default: {default_text})")


def parse_seeds(text: str | None, scenario: str | Path | Scenario) -> list[int] | None:
    """The seeds ``--seeds`` names (None when not given); a count starts at ``scenario``'s seed
    (a Scenario, or a YAML file whose ``seed`` is read only then)."""
    if text is None:
        return None
    text = str(text).strip()
    if "," in text:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        seeds = [_integer(part, text) for part in parts]
        if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
            raise ConfigError("expected distinct seeds >= 0", key="--seeds", value=text, allowed=_SEEDS_ALLOWED)
        return seeds
    count = _integer(text, text)
    if count < 1:
        raise ConfigError("the count of seeds must be at least 1", key="--seeds", value=text, allowed=_SEEDS_ALLOWED)
    first = scenario.seed if isinstance(scenario, Scenario) else _yaml_seed(scenario)
    return list(range(first, first + count))


def _integer(part: str, text: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise ConfigError("cannot read this as seeds", key="--seeds", value=text, allowed=_SEEDS_ALLOWED) from None


def _yaml_seed(path: str | Path) -> int:
    """A scenario file's ``seed``, without validating the rest: a sweep's base file may leave
    keys to its grid."""
    return read_seed(Node(load_yaml(path), file=str(path)))
