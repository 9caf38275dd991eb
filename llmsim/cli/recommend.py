"""``llmsim recommend``: draft length k, max batch tokens and queue timeouts (with traffic classes the
scheduling policy and each class's timeout) for goodput under the SLO."""
from __future__ import annotations

import math
from pathlib import Path

from llmsim.analysis.names import CLASSES, SLO_ATTAINMENT, TPOT_P95, TTFT_P95, TTFT_P99
from llmsim.cli.plan import print_comparison
from llmsim.cli.options import WORKERS, add_seeds_argument, checked_flag, integer_flag, parse_seeds
from llmsim.cli.outputs import OVERWRITE_HELP, keeping_runs, refuse_to_replace, write_file
from llmsim.cli.progress import Bar
from llmsim.scenario.scenario import Scenario
from llmsim.search.plan import as_scenario, replay_description
from llmsim.config.policies import Objective, SearchScope
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.search.recommend import (CLASS_SWEEPS, CLASS_TIMEOUTS_S, OFF, SEEDS, TOP,
                                     Recommendation, batch_token_rule, plus_minus as _pm, recommend,
                                     batch_tokens_held, timeout_text)

MAX_TOP = 100               # analytic best settings simulated, at most



def _ms(value_s: float, ci_s: float) -> str:
    return f"{value_s * 1000:.1f} ms" + ("" if math.isnan(ci_s) else f" +- {ci_s * 1000:.1f}")

def configure_recommend(parser) -> None:
    parser.add_argument("scenario", help="scenario YAML file (its slo: section sets the targets)")
    parser.add_argument("--objective", default=Objective.GOODPUT,
                        help=f"{' or '.join(Objective.names())} (default {Objective.GOODPUT})")
    add_seeds_argument(parser, default=str(SEEDS), default_text=str(SEEDS))   # >= 2: CIs across seeds
    parser.add_argument("--top", type=integer_flag(1, MAX_TOP), default=TOP,
                        help=f"analytic best settings to simulate (default {TOP}, at most {MAX_TOP})")
    parser.add_argument("--search", default=SearchScope.ALL,
                        help="all (default), or classes: only the scheduling policy and each traffic class's "
                             "queue timeout, the scenario's other settings kept (and the baseline)")
    parser.add_argument("--class-timeouts", metavar="T1,T2,...", type=checked_flag(_durations),
                        help="traffic classes: the queue timeouts tried for each class besides its own, durations "
                             "separated by commas (default " + ",".join(f"{t * 1000:g}ms" for t in CLASS_TIMEOUTS_S)
                             + ")")
    parser.add_argument("--workers", type=WORKERS, help="parallel simulations (default: all cores)")
    parser.add_argument("--no-drafts", action="store_true",
                        help="speculating scenarios: skip choosing the draft and tuning eligibility")
    parser.add_argument("--out", help="also write every simulated setting as CSV here; until it is written, each "
                        "finished simulation is kept in OUT.runs.csv, so a rerun after Ctrl-C (exit 130) or a full "
                        "disk resumes")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.set_defaults(func=_cmd_recommend)


def runs_journal(out: Path) -> Path:
    """Where ``--out FILE`` keeps the simulations finished until FILE is written: FILE.runs.csv."""
    return out.with_name(out.name + ".runs.csv")


def format_recommendation(rec: Recommendation, scenario: Scenario) -> str:
    """The recommendation as a person reads it: settings, predicted metrics with CIs, the gain."""
    best, row = rec.best, rec.table.iloc[0]
    at_rate = rec.at_scenario_rate.set_index("setting")
    default_row = rec.defaults.iloc[0]
    mine, default = at_rate.loc[best.label], at_rate.loc[default_row["config"].label]
    seeds = len(row["per_seed_rates"])
    targets = _targets_text(scenario.slo.targets())
    rule = batch_token_rule(scenario)
    goodput = rec.objective is Objective.GOODPUT
    if scenario.workload.classes:               # each class's own targets
        targets = "; ".join(f"{name}: {_targets_text(scenario.slo.for_class(name).targets())}"
                            for name in scenario.workload.class_names)
    replications = (f"{seeds} seeds, 95% CIs across them" if seeds > 1 else
                    "one replication: the trace is replayed as it is, so every seed would run the same requests "
                    "and no confidence interval is available (sample: in its transforms draws different ones)")
    held = batch_tokens_held(scenario)
    lines = [f"recommended settings for {scenario.name} ({targets}; {rec.objective}; {replications}):",
             f"  speculation        {best.k}",
             *([f"  draft              {best.draft.label}"] if best.draft is not None and best.k != OFF else []),
             *([f"  eligibility        min_sequence_tokens {best.eligibility[0]}, min_concurrent_requests "
                f"{best.eligibility[1]}"] if best.eligibility is not None and best.k != OFF else []),
             *([f"  expert_parallel    {rec.experts.chosen}"] if rec.experts is not None else []),
             f"  max_batch_tokens   {best.max_batch_tokens}"
             + ("" if held is None else f" (the scenario's, not searched: {held})"),
             "  queue_timeout      "
             + ("none" if best.queue_timeout_s is None else f"{best.queue_timeout_s * 1000:g} ms"),
             *([f"  block_size         {row['block_size']}"] if scenario.engine.prefix_caching else []),
             *([f"  idle_timeout       {row['idle_timeout_s']:g} s (CPU offload)"]
               if scenario.engine.cpu_offload is not None else []),
             *([f"  scheduling_policy  {row['scheduling_policy']}",
                "  class timeouts     "
                + ", ".join(f"{name} {timeout_text(t)}" for name, t in row["class_timeouts"].items())]
               if scenario.workload.classes else []),
             f"  goodput            {row['max_rate_per_s']:.3g}{_pm(row['max_rate_per_s.ci95'])} req/s at the SLO "
             f"(analytic estimate {row['analytic_rate_per_s']:.3g})",
             f"  cost               ${row['usd_per_million_output_tokens']:.3g} per million output tokens at that rate",
             f"  at {scenario.workload.rate_per_s:g} req/s     "
             f"P95 TTFT {_ms(mine[TTFT_P95], mine[f'{TTFT_P95}.ci95'])}, "
             f"P95 TPOT {_ms(mine[TPOT_P95], mine[f'{TPOT_P95}.ci95'])}, "
             f"P99 TTFT {_ms(mine[TTFT_P99], mine[f'{TTFT_P99}.ci95'])}, "
             f"attainment {100 * mine[SLO_ATTAINMENT]:.1f}%",
             ("the scenario's own settings: " if rec.search is SearchScope.CLASSES else
              "rule-of-thumb defaults (best of timeouts 50/200/1000 ms): ") + _setting_text(default_row, scenario),
             f"  goodput            {default_row['max_rate_per_s']:.3g}"
             f"{_pm(default_row['max_rate_per_s.ci95'])} req/s; "
             f"${default_row['usd_per_million_output_tokens']:.3g} per million output tokens",
             f"  at {scenario.workload.rate_per_s:g} req/s     "
             f"P95 TTFT {_ms(default[TTFT_P95], default[f'{TTFT_P95}.ci95'])}, "
             f"P95 TPOT {_ms(default[TPOT_P95], default[f'{TPOT_P95}.ci95'])}",
             (f"max_batch_tokens rule: {rule.text()}; searched {best.max_batch_tokens} "
              f"({rule.tokens / best.max_batch_tokens:.2g}x the rule's budget)" if held is None
              else f"max_batch_tokens not searched: {held}"),
             f"the recommendation {'raises goodput' if goodput else 'cuts cost'} by "
             f"{100 * rec.improvement:+.1f}%" + (f" (+- {100 * rec.improvement_ci95:.1f}% across seeds, paired, at "
                                                 "least the bisection's resolution)" if goodput
                                                 and not math.isnan(rec.improvement_ci95) else "")
             + f": {rec.gain_verdict}",
             *(_policies_text(rec, scenario) if rec.policies is not None else []),
             f"searched {len(rec.analytic)} settings analytically, "
             + (f"screened {len(rec.classes.screened)} policy and class-timeout combinations, " if rec.classes else "")
             + f"simulated the goodput of {len(rec.table)}, in {rec.runtime_s:.0f} s"]
    return "\n".join(lines)


def _setting_text(row, scenario: Scenario) -> str:
    """A simulated setting's label, with the scheduling policy and class timeouts it ran with when it kept the
    scenario's own (a label names only what the setting changes)."""
    config = row["config"]
    if not scenario.workload.classes or config.policy is not None:
        return config.label
    return (f"{config.label}, policy {row['scheduling_policy']}, class timeouts "
            + ", ".join(f"{name} {timeout_text(t)}" for name, t in row["class_timeouts"].items()))


def _policies_text(rec: Recommendation, scenario: Scenario) -> list[str]:
    """Why this policy: each policy with its best class timeouts, goodput and each class's attainment at
    the scenario's rate, and the target it falls shortest of."""
    search, names, policies = rec.classes, scenario.workload.class_names, rec.policies
    assert search is not None and policies is not None       # printed only for the classes search
    ladder = "/".join(f"{t * 1000:g}" for t in search.timeouts_s)
    lines = [f"each scheduling policy with its best class timeouts (coordinate descent over {', '.join(names)}, "
             f"{ladder} ms and each class's own, up to {CLASS_SWEEPS} sweeps; {search.sweeps} run; every candidate "
             f"screened at {search.probe_rate_per_s:.3g} req/s on the same requests), best first; attainment at "
             f"{scenario.workload.rate_per_s:g} req/s per class ({' / '.join(names)}):"]
    width = max(len(p) for p in policies["scheduling_policy"])
    for _, entry in policies.iterrows():
        timeouts = "/".join("none" if t is None else f"{t * 1000:g}" for t in entry["class_timeouts"].values())
        attainment = " / ".join(f"{100 * entry[f'{CLASSES}.{name}.{SLO_ATTAINMENT}']:.1f}%" for name in names)
        verdict = "meets every class's targets" if entry["meets_scenario_rate"] else "misses"
        lines.append(f"  {entry['scheduling_policy']:<{width}}  timeouts {timeouts} ms  goodput "
                     f"{entry['max_rate_per_s']:.3g}{_pm(entry['max_rate_per_s.ci95'])} req/s  {attainment}  "
                     f"{verdict}; tightest {entry['worst_check']} {100 * entry['worst_margin']:+.1f} points")
    return lines


def _durations(text: str) -> list[float]:
    """``--class-timeouts``: durations separated by commas (``25ms,200ms,1s``), in seconds, each read
    as a scenario's ``queue_timeout`` is (> 0, at most the longest duration)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ConfigError("no queue timeout given", key="--class-timeouts", value=text,
                          allowed="durations separated by commas, e.g. 25ms,200ms,1s")
    return [Node({"--class-timeouts": part}).quantity("--class-timeouts", "duration") for part in parts]


def _targets_text(targets: dict) -> str:
    return ", ".join(f"P{p:g} {m.upper()} <= {limit * 1000:g} ms" for m, (limit, p) in targets.items()) or "none"


def _cmd_recommend(args) -> int:
    scenario = as_scenario(args.scenario)
    seeds = parse_seeds(args.seeds, scenario)
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    # With --out, each simulation is kept beside it as it finishes: Ctrl-C or a full disk is resumable.
    with keeping_runs(runs_journal(Path(args.out)) if args.out else None, "recommendation"):
        with Bar("recommend", " simulations", open_ended=True) as progress:
            rec = recommend(scenario, objective=args.objective,
                            seeds=SEEDS if seeds is None else seeds, top=args.top, workers=args.workers,
                            progress=progress, drafts=not args.no_drafts, search=args.search,
                            class_timeouts_s=args.class_timeouts or CLASS_TIMEOUTS_S)
        if args.out:            # the table first: printing can fail (a closed pipe)
            write_file(Path(args.out), lambda path: rec.table.drop(columns=["config"]).to_csv(path, index=False))
    if scenario.workload.trace is not None:          # which traffic the rates below rescale
        print(f"replaying {replay_description(scenario, scenario.workload.rate_per_s)}; its rate is the "
              "trace's time scale")
    print(format_recommendation(rec, scenario))
    if rec.experts is not None:
        print(rec.experts.text())
    if rec.drafts is not None:
        print(rec.drafts.text())
    if scenario.disaggregation is not None:          # the engine settings above are the disaggregated pools'
        print_comparison(args.scenario, scenario.workload.rate_per_s, None)
    if args.out:
        print(f"wrote {args.out}")
    return 0
