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
from llmsim.search.layout import MAX_PIPELINE_PARALLEL, MAX_TENSOR_PARALLEL, plan
from llmsim.search.plan import MAX_REPLICAS, check_rate


MAX_PLAN_REPLICAS = 10_000      # replicas a plan may try: 10,000 engines take ~30 s and 400 MB to build


def configure_plan(parser) -> None:
    parser.add_argument("scenario", help="scenario YAML file (its slo: section sets the targets)")
    parser.add_argument("--target-rate", required=True, type=checked_flag(_target_rate_text),
                        help="requests per second to serve (e.g. 40 or '40/s'), "
                        "or a multiple of the scenario's own rate ('2x': this traffic, a replayed trace's too, twice)")
    parser.add_argument("--hardware", nargs="+", help="candidate hardware profiles (default: the scenario's "
                        "plan.hardware list, else its own hardware)")
    add_seeds_argument(parser)          # every seed must meet the targets
    parser.add_argument("--workers", type=WORKERS, help="parallel simulations (default: all cores)")
    parser.add_argument("--max-replicas", type=integer_flag(1, MAX_PLAN_REPLICAS), default=MAX_REPLICAS,
                        help=f"give up above this many (default {MAX_REPLICAS}, at most {MAX_PLAN_REPLICAS:,})")
    parser.add_argument("--keep-layout", action="store_true",
                        help="keep the scenario's tensor x pipeline parallel layout (other chips: the fewest devices "
                             "that hold the model) instead of searching each chip's layouts for the cheapest "
                             f"(tp up to {MAX_TENSOR_PARALLEL} x pp up to {MAX_PIPELINE_PARALLEL}, the default)")
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
        return parse_rate(str(factor * load_scenario(scenario_path).workload.rate_per_s))
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


# The columns printed (a terminal's width), as (column, header, scale); --out writes them all.
SHOWN = (("hardware", "hardware", 1), ("placement", "layout", 1), ("replicas", "replicas", 1),
         ("devices", "devices", 1), ("ttft_p95_s", "TTFT p95 ms", 1e3), ("tpot_p95_s", "TPOT p95 ms", 1e3),
         ("slo_attainment", "attainment", 1), ("output_tokens_per_s", "output tok/s", 1),
         ("usd_per_hour", "USD/h", 1), ("usd_per_million_output_tokens", "USD/M tok", 1))


def _shown(table: pd.DataFrame) -> str:
    """The plan's table as a person reads it: a few columns, latencies in ms, at most 120 characters wide."""
    shown = pd.DataFrame({header: table[column] * scale if scale != 1 else table[column]
                          for column, header, scale in SHOWN if column in table})
    return shown.to_string(index=False, float_format=lambda v: f"{v:,.4g}")


def _cmd_plan(args) -> int:
    rate = target_rate(args.target_rate, args.scenario)
    seeds = parse_seeds(args.seeds, args.scenario)
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    with Bar("plan", "simulation") as progress:
        table = plan(args.scenario, rate, args.hardware, seeds=seeds, workers=args.workers,
                     max_replicas=args.max_replicas, keep_layout=args.keep_layout, progress=progress)
    if args.out:            # the table first: printing can fail (a closed pipe)
        write_file(Path(args.out), lambda path: table.to_csv(path, index=False))
    print(f"target {rate:g} requests/s" + (f", replaying {table['replayed'].iloc[0]}" if "replayed" in table
                                           else "") + ":")
    print("layout: the scenario's (--keep-layout)" if args.keep_layout else
          f"layout: each chip's cheapest, tp up to {MAX_TENSOR_PARALLEL} x pp up to {MAX_PIPELINE_PARALLEL} searched"
          " (--keep-layout keeps the scenario's)")
    print(_shown(table))
    notes = [f"  {row.hardware}: {row.note}" for row in table.itertuples() if isinstance(row.note, str) and row.note]
    if notes:
        print("\n".join(["notes:", *notes]))
    if not args.out:
        print("(every column, the analytic bounds and the simulation windows among them: --out FILE.csv)")
    if args.out:
        print(f"\nwrote {args.out}")
    if table["replicas"].isna().all():
        reasons = "; ".join(f"{row.hardware}: {row.note}" for row in table.itertuples())
        raise ConfigError(f"no candidate meets the SLO targets at {rate:g} requests/s ({reasons})",
                          key="--target-rate", value=args.target_rate,
                          allowed="a lower rate, more --max-replicas, other --hardware, or looser SLOs")
    return 0
