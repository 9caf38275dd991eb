"""``llmsim run`` and ``llmsim compare``: one scenario's summary, or variants side by side."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from llmsim.cli.render import format_summary
from llmsim.scenario.scenario import load_scenario
from llmsim.search.compare import compare
from llmsim.sim.simulate import simulate, speedup_over_plain


def add_parsers(sub) -> None:
    run = sub.add_parser("run", help="simulate one scenario and print its summary")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--out", help="output directory (default: runs/<scenario name>)")
    run.add_argument("--seed", type=int, help="override the scenario's seed")
    run.add_argument("--iterations", action="store_true", help="also write the per-iteration log")
    run.add_argument("--plot", action="store_true", help="also draw timeline.png (queue, batch, KV, latency)")
    run.add_argument("--no-baseline", action="store_true",
                     help="with speculation: skip the plain-decoding run on the same trace (no speedup figures)")
    run.set_defaults(func=_cmd_run)
    comp = sub.add_parser("compare", help="simulate the variants of a comparison file side by side")
    comp.add_argument("comparison", help="comparison YAML (base, variants, loads)")
    comp.add_argument("--out", help="also write the table as CSV here")
    comp.set_defaults(func=_cmd_compare)


def _cmd_run(args) -> int:
    scenario = load_scenario(args.scenario, seed=args.seed)
    result = simulate(scenario)
    summary = result.summary()
    if scenario.speculating and not args.no_baseline and not result.interrupted:
        summary["speculation"]["speedup_over_plain"] = speedup_over_plain(result)
    print(format_summary(summary))
    out = Path(args.out) if args.out else Path("runs") / scenario.name
    out.mkdir(parents=True, exist_ok=True)
    result.requests.to_csv(out / "requests.csv", index=False)
    (out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
    written = [out / "requests.csv", out / "summary.json"]
    if args.iterations:
        result.iterations.to_csv(out / "iterations.csv", index=False)
        written.append(out / "iterations.csv")
    if args.plot:
        from llmsim.analysis.plots import timeline
        written.append(timeline(result, out / "timeline.png"))
    print("\nwrote " + ", ".join(map(str, written)))
    return 130 if result.interrupted else 0


def _cmd_compare(args) -> int:
    table = compare(args.comparison)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:,.3g}".format):
        print(table.to_string(index=False))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False)
        print(f"\nwrote {args.out}")
    return 0


def _json_safe(value):
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
