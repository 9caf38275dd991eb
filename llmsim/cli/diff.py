"""``llmsim diff MEASURED.json SIMULATED.json``: per-metric errors between two `vllm bench serve` results.

MEASURED is the JSON a real ``vllm bench serve --save-result`` wrote; SIMULATED the
``vllm_bench.json`` of ``llmsim run --bench-json`` (either may be any file with those
field names). Each metric both carry is printed with its relative error.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from llmsim.analysis.bench_format import DIFF_FIELDS, diff_metrics, read_bench_json
from llmsim.cli.outputs import OVERWRITE_HELP, refuse_to_replace, write_file
from llmsim.errors import ConfigError


def configure_diff(diff) -> None:
    diff.add_argument("measured", help="a `vllm bench serve --save-result` JSON")
    diff.add_argument("simulated", help="the vllm_bench.json of `llmsim run --bench-json`")
    diff.add_argument("--out", help="also write the table as CSV here")
    diff.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    diff.set_defaults(func=_cmd_diff)


def _cmd_diff(args) -> int:
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    table = diff_metrics(read_bench_json(args.measured), read_bench_json(args.simulated))
    if table.empty:
        raise ConfigError("the two files share no metric to compare", file=args.simulated, has_value=False,
                          allowed="`vllm bench serve` result fields: " + ", ".join(DIFF_FIELDS))
    if args.out:
        write_file(Path(args.out), lambda path: table.to_csv(path, index=False))
    with pd.option_context("display.width", 200, "display.float_format", "{:,.4g}".format):
        print(table.to_string(index=False))
    errors = table["error_pct"].abs().dropna()       # a measured 0 has no relative error
    if errors.empty:
        print(f"\n{len(table)} metrics; no relative error: every measured value is 0")
    else:
        print(f"\n{len(table)} metrics; median |error| {errors.median():.1f}%, largest {errors.max():.1f}% "
              f"({table.loc[errors.idxmax(), 'metric']})")
    if args.out:
        print(f"wrote {args.out}")
    return 0
