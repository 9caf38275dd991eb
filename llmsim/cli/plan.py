"""``llmsim plan``: the fewest replicas of each candidate chip that meet the SLO at a rate."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from llmsim.cli.options import WORKERS, add_seeds_argument, checked_flag, integer_flag, parse_seeds
from llmsim.cli.outputs import OVERWRITE_HELP, refuse_to_replace, write_file
from llmsim.cli.progress import Bar
from llmsim.config.limits import MAX_QUANTITY
from llmsim.config.units import UnitError, parse_quantity
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import load_scenario
from llmsim.search.plan import MAX_REPLICAS, check_rate, plan


MAX_PLAN_REPLICAS = 10_000      # replicas a plan may try: 10,000 engines take ~30 s and 400 MB to build


def configure_plan(parser) -> None:
    parser.add_argument("scenario", help="scenario YAML file (its slo: section sets the targets)")
    parser.add_argument("--target-rate", required=True, type=checked_flag(_target_rate_text), help="requests per second to serve (e.g. 40 or '40/s'), "
                        "or a multiple of the scenario's own rate ('2x': this traffic, a replayed trace's too, twice)")
    parser.add_argument("--hardware", nargs="+", help="candidate hardware profiles (default: the scenario's "
                        "plan.hardware list, else its own hardware)")
    add_seeds_argument(parser)          # every seed must meet the targets
    parser.add_argument("--workers", type=WORKERS, help="parallel simulations (default: all cores)")
    parser.add_argument("--max-replicas", type=integer_flag(1, MAX_PLAN_REPLICAS), default=MAX_REPLICAS,
                        help=f"give up above this many (default {MAX_REPLICAS}, at most {MAX_PLAN_REPLICAS:,})")
    parser.add_argument("--out", help="also write the table as CSV here")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.set_defaults(func=_cmd_plan)


def parse_rate(text: str, option: str = "--target-rate") -> float:
    """A rate from the command line ('20', '20/s', '1200 req/min'); bad or non-positive: ConfigError."""
    try:
        value = parse_quantity(text if not _is_number(text) else float(text), "rate")
    except UnitError as error:
        raise ConfigError("cannot read this as a rate", key=option, value=text, allowed=error.allowed) from None
    if value > MAX_QUANTITY["rate"]:
        raise ConfigError("value out of range", key=option, value=text,
                          allowed=f"a rate <= {MAX_QUANTITY['rate']:g} requests/s")
    return check_rate(value, option)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def target_rate(text: str, scenario_path: str) -> float:
    """``--target-rate``: a rate, or ``FACTORx``, that multiple of the scenario's own rate."""
    factor = _factor(text)
    if factor is not None:
        return parse_rate(str(factor * load_scenario(scenario_path).workload.arrival.rate_per_s))
    return parse_rate(text)


def _factor(text: str) -> float | None:
    """``FACTORx``'s factor, read and checked as a rate is (None: not that form)."""
    if isinstance(text, str) and text.strip().lower().endswith("x") and _is_number(text.strip()[:-1]):
        return parse_rate(text.strip()[:-1])
    return None


def _target_rate_text(text: str) -> str:
    """``--target-rate`` as argparse reads it: checked, kept as text (a factor needs the scenario's rate)."""
    if _factor(text) is None:
        parse_rate(text)
    return text


def _cmd_plan(args) -> int:
    rate = target_rate(args.target_rate, args.scenario)
    seeds = parse_seeds(args.seeds, args.scenario)
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    with Bar("plan", "simulation") as progress:
        table = plan(args.scenario, rate, args.hardware, seeds=seeds, workers=args.workers,
                     max_replicas=args.max_replicas, progress=progress)
    if args.out:            # the table first: printing can fail (a closed pipe)
        write_file(Path(args.out), lambda path: table.to_csv(path, index=False))
    shown = table.drop(columns=[c for c in ("kwh_per_million_output_tokens", "replayed") if c in table])
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.float_format", "{:,.4g}".format):
        print(f"target {rate:g} requests/s" + (f", replaying {table['replayed'].iloc[0]}" if "replayed" in table
                                               else "") + ":")
        print(shown.to_string(index=False))
    if args.out:
        print(f"\nwrote {args.out}")
    if table["replicas"].isna().all():
        reasons = "; ".join(f"{row.hardware}: {row.note}" for row in table.itertuples())
        raise ConfigError(f"no candidate meets the SLO targets at {rate:g} requests/s ({reasons})",
                          key="--target-rate", value=args.target_rate,
                          allowed="a lower rate, more --max-replicas, other --hardware, or looser SLOs")
    return 0
