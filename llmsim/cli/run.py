"""``llmsim run`` and ``llmsim compare``: one scenario's summary, or variants side by side.

``llmsim run`` writes into ``--out``, or without it into ``runs/<name>`` under the current
folder, where ``<name>`` is the scenario's ``name`` made one safe folder name
(:func:`llmsim.cli.outputs.folder_name`: ``/abs/path`` becomes ``abs-path``, ``../../x``
becomes ``x``; an empty name, or one of only separators and dots, is exit 2 naming the key).
A folder that already holds a run's results is exit 2 before simulating, unless
``--overwrite``. The records and summary are written as soon as the simulation ends, before
the plain-decoding baseline (which adds its speedup to summary.json) and the plot.

Ctrl-C stops the simulation where it is; the requests that arrived by then are written and
summarised (exit 130). Ctrl-C during the baseline keeps the run's results without the
speedup (exit 130). A second Ctrl-C aborts at once (exit 130, files not yet renamed into place
are not written). A fault inside the simulation writes what was simulated, then is raised.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import yaml

from llmsim.analysis.bench_format import vllm_bench_result
from llmsim.analysis.canary import MIN_DETECTABLE_CHANGE
from llmsim.analysis.metrics import summarize, warmup_warning
from llmsim.analysis.sketch import RELATIVE_ACCURACY
from llmsim.analysis.streaming import STREAM_ABOVE_REQUESTS, RecordsWriter, StreamedRun, streamable
from llmsim.cli.options import FORCE_HELP, SEED, integer_flag, number_flag
from llmsim.cli.outputs import OVERWRITE_HELP, RUNS, folder_name, refuse_to_replace, write_file
from llmsim.cli.render import format_summary, rollout_table
from llmsim.config.policies import Batching, RolloutRole
from llmsim.errors import ConfigError
from llmsim.scenario.variants import with_requests
from llmsim.scenario.scenario import load_scenario
from llmsim.scenario.writer import to_mapping
from llmsim.search.compare import compare
from llmsim.sim.resources import check_run_size, estimate_run
from llmsim.search.rollout import rollout_summary, simulate_replications
from llmsim.search.speedup import speedup_over_plain
from llmsim.sim.simulate import simulate
from llmsim.sim.token_times import TokenTimes
from llmsim.workload.generate import generate_trace

# What a run may write; the last six with --bench-json, --parquet, a controller, a rollout, and a streamed run.
RUN_FILES = ("requests.csv", "iterations.csv", "summary.json", "timeline.png", "vllm_bench.json", "requests.parquet",
             "control.csv", "rollout.csv", "shadow.csv", "timeseries.csv")
SCENARIO_FILE = "scenario.yaml"          # --write-scenario


def configure_run(run) -> None:
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--out", help="output folder (default: runs/<scenario name>, the name made one safe folder "
                     "name: path separators, spaces and leading dots replaced)")
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    run.add_argument("--seed", type=SEED, help="override the scenario's seed (an integer >= 0)")
    run.add_argument("--requests", type=integer_flag(1), metavar="N",
                     help="simulate N requests: overrides workload.num_requests (a replayed trace: its first N; with "
                          "workload.duration, whichever ends first)")
    run.add_argument("--force", action="store_true", help=FORCE_HELP)
    run.add_argument("--vllm-args", metavar="FLAGS",
                     help='vLLM serve flags, e.g. "--max-num-seqs 256 --max-num-batched-tokens 8192 -tp 2": mapped '
                          "to llmsim's settings; flags llmsim does not model are listed")
    run.add_argument("--iterations", action="store_true", help="also write the per-iteration log")
    run.add_argument("--write-scenario", action="store_true",
                     help=f"also write {SCENARIO_FILE}: the scenario as simulated (--seed, --requests and --vllm-args "
                          "applied, every setting resolved), which llmsim run reads again")
    run.add_argument("--plot", action="store_true", help="also draw timeline.png (queue, batch, KV, latency)")
    run.add_argument("--bench-json", action="store_true",
                     help="also write vllm_bench.json: the run in the JSON of `vllm bench serve` (its field names), "
                          "to compare with a measured run by `llmsim diff`")
    run.add_argument("--bench-detailed", action="store_true",
                     help="write vllm_bench.json with vLLM's --save-detailed lists too: every finished request's "
                          "inter-token gaps (itls) and errors (large; not with static batching)")
    run.add_argument("--parquet", action="store_true",
                     help="also write the per-request records as requests.parquet (needs pyarrow: "
                          "pip install 'llmsim[parquet]')")
    run.add_argument("--detect", type=number_flag(MIN_DETECTABLE_CHANGE, 10.0), default=0.05, metavar="FRACTION",
                     help="with a rollout: the relative change in a mean whose detection time is reported, "
                          f"{MIN_DETECTABLE_CHANGE:g} to 10 (default 0.05: 5%%)")
    run.add_argument("--no-baseline", action="store_true",
                     help="with speculation: skip the plain-decoding run on the same trace (no speedup figures)")
    run.set_defaults(func=_cmd_run)


def configure_compare(comp) -> None:
    comp.add_argument("comparison", help="comparison YAML (base, variants, loads)")
    comp.add_argument("--out", help="also write the table as CSV here")
    comp.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    comp.add_argument("--force", action="store_true", help=FORCE_HELP)
    comp.set_defaults(func=_cmd_compare)


def _cmd_run(args) -> int:
    if args.parquet:
        require_parquet()
    scenario = load_scenario(args.scenario, seed=args.seed, vllm_args=args.vllm_args)
    if args.requests is not None:
        scenario = with_requests(scenario, args.requests)
    for note in scenario.vllm_notes:
        print(f"vLLM flag {note}", file=sys.stderr)
    if scenario.workload.trace is not None or scenario.workload.dataset is not None:
        print(f"replaying {trace_description(scenario)}", file=sys.stderr)
    out = Path(args.out) if args.out else RUNS / folder_name(scenario.name, "name", scenario.path)
    refuse_to_replace([out / name for name in (*RUN_FILES, *([SCENARIO_FILE] if args.write_scenario else []))],
                      args.overwrite)
    streamed = streamable(scenario) and estimate_run(scenario).requests > STREAM_ABOVE_REQUESTS
    check_run_size(scenario, force=args.force, streamed=streamed)
    if args.write_scenario:
        text = yaml.safe_dump(to_mapping(scenario), sort_keys=False)
        write_file(out / SCENARIO_FILE, lambda path: path.write_text(text))
    if args.bench_detailed and scenario.engine.batching is Batching.STATIC:
        raise ConfigError("per-request inter-token gaps are recorded for continuous batching only",
                          key="--bench-detailed", value=True,
                          allowed="a scenario with continuous batching, or --bench-json")
    if args.bench_detailed and scenario.rollout is not None:
        raise ConfigError("per-request inter-token gaps are not recorded across a rollout's groups",
                          key="--bench-detailed", value=True,
                          allowed="--bench-json (the users' requests, without the per-token lists), or the "
                                  "scenario without its rollout: section")
    token_times = TokenTimes() if args.bench_detailed else None
    print(f"simulating {scenario.name} (Ctrl-C stops it and writes what was simulated)", file=sys.stderr, flush=True)
    if scenario.rollout is not None:
        return _run_rollout(scenario, out, args)
    if streamed:
        return _run_streamed(scenario, out, args)
    try:
        try:
            observers = [token_times] if token_times is not None else []
            result = simulate(scenario, observers=observers, force=True)      # its size checked above
        except Exception as fault:
            partial = getattr(fault, "partial_result", None)
            if partial is not None:
                _write_and_print(partial, out, args, token_times)
            raise
        if result.interrupted:
            print(f"interrupted at {result.end_s:,.1f} s simulated: writing what was simulated "
                  "(Ctrl-C again aborts)", file=sys.stderr, flush=True)
        return _write_and_print(result, out, args, token_times)
    except KeyboardInterrupt:     # before the simulation loop, a second Ctrl-C, or one during the plot
        print("llmsim: interrupted", file=sys.stderr)
        return 130


def _write_and_print(result, out: Path, args, token_times: TokenTimes | None = None) -> int:
    """Write the run's files (records and summary first), print its summary; the exit status.
    ``token_times``: the run's per-request token times, for ``--bench-detailed``."""
    scenario = result.scenario
    summary = summarize(result).to_dict()
    _warn_of_warmup(result)
    if scenario.vllm_notes:
        summary["vllm_flags_not_modelled"] = list(scenario.vllm_notes)
    if scenario.workload.trace is not None or scenario.workload.dataset is not None:
        summary["trace"] = trace_description(scenario)
    written = [write_file(out / "requests.csv", lambda path: result.requests.to_csv(path, index=False))]
    if result.control is not None:            # the adaptive controller's decisions
        written.append(write_file(out / "control.csv", lambda path: result.control.to_csv(path, index=False)))
    written.append(_write_summary(out / "summary.json", summary))
    itls = token_times.itls(result.requests["id"]) if token_times is not None else None
    written += _optional_files(result, result.iterations, out, args, itls)
    if scenario.speculating and not args.no_baseline and not result.interrupted:
        try:
            summary["speculation"]["speedup_over_plain"] = speedup_over_plain(result, summary)
        except KeyboardInterrupt:             # the run's own results are written: show them, without the speedup
            print(format_summary(summary))
            print("\ninterrupted during the plain-decoding baseline: no speedup figures; wrote "
                  + ", ".join(map(str, written)))
            return 130
        _write_summary(out / "summary.json", summary)
    print(format_summary(summary))
    if args.plot:
        from llmsim.analysis.plots import timeline
        written.append(write_file(out / "timeline.png", lambda path: timeline(result, path)))
    print("\nwrote " + ", ".join(map(str, written)))
    return 130 if result.interrupted else 0


def _run_streamed(scenario, out: Path, args) -> int:
    """A run too long to keep whole (more than STREAM_ABOVE_REQUESTS requests): its records written
    and summed as it goes (:mod:`llmsim.analysis.streaming`), the percentiles from a quantile sketch."""
    for flag, given in (("--iterations", args.iterations), ("--bench-json", args.bench_json),
                        ("--bench-detailed", args.bench_detailed), ("--plot", args.plot)):
        if given:
            raise ConfigError(f"a run of more than {STREAM_ABOVE_REQUESTS:,} requests is streamed to disk, and "
                              f"{flag} needs every record or iteration kept", key=flag, value=True,
                              allowed=f"--requests {STREAM_ABOVE_REQUESTS:,} or fewer, or the streamed run's "
                                      "requests.csv and timeseries.csv")
    print(f"more than {STREAM_ABOVE_REQUESTS:,} requests: streaming the records to disk; percentiles from a "
          f"quantile sketch (within {100 * RELATIVE_ACCURACY:g}% of the exact values)", file=sys.stderr, flush=True)
    files = ["requests.csv"] + (["requests.parquet"] if args.parquet else [])
    outcome: dict = {}

    def run(partials: list[Path]) -> None:
        stream = StreamedRun([RecordsWriter(path) for path in partials])
        try:
            outcome["result"] = simulate(scenario, force=True, stream=stream)
        except Exception as fault:          # what was simulated is written, then the fault is raised
            partial = getattr(fault, "partial_result", None)
            if partial is None:
                raise
            outcome["result"], outcome["fault"] = partial, fault
        outcome["stream"] = stream

    def into(names: list[str], partials: list[Path]) -> None:
        if not names:
            return run(partials)
        write_file(out / names[0], lambda partial: into(names[1:], partials + [partial]))

    try:
        into(files, [])
        result, stream = outcome["result"], outcome["stream"]
        if result.interrupted:
            print(f"interrupted at {result.end_s:,.1f} s simulated: wrote what was simulated", file=sys.stderr)
        summary = stream.summary(result).to_dict()
        _warn_of_warmup(result)
        if scenario.vllm_notes:
            summary["vllm_flags_not_modelled"] = list(scenario.vllm_notes)
        if scenario.workload.trace is not None or scenario.workload.dataset is not None:
            summary["trace"] = trace_description(scenario)
        written = [out / name for name in files]
        written.append(_write_summary(out / "summary.json", summary))
        series = stream.series.frame()
        written.append(write_file(out / "timeseries.csv", lambda path: series.to_csv(path, index=False)))
        for stale in ("iterations.csv", "vllm_bench.json", "timeline.png", "control.csv") + (
                () if args.parquet else ("requests.parquet",)):
            (out / stale).unlink(missing_ok=True)
        print(format_summary(summary))
        if scenario.speculating and not args.no_baseline:
            print("\nno plain-decoding baseline for a streamed run (no speedup figures): run the scenario "
                  "without speculation to compare", file=sys.stderr)
        print("\nwrote " + ", ".join(map(str, written)))
    except KeyboardInterrupt:
        print("llmsim: interrupted", file=sys.stderr)
        return 130
    if "fault" in outcome:
        raise outcome["fault"]
    return 130 if result.interrupted else 0


def _optional_files(result, iterations: pd.DataFrame, out: Path, args, itls: list | None = None) -> list[Path]:
    """The files asked for by --iterations, --bench-json and --parquet (the records, the benchmark JSON:
    of ``result``), written; an earlier run's optional files not asked for this time are removed
    (--overwrite: none is left beside this run's records; the plot is drawn last, after the summary)."""
    written = []
    if args.iterations:
        written.append(write_file(out / "iterations.csv", lambda path: iterations.to_csv(path, index=False)))
    if args.bench_json or args.bench_detailed:
        written.append(_write_summary(out / "vllm_bench.json", vllm_bench_result(result, itls)))
    if args.parquet:
        written.append(write_file(out / "requests.parquet", lambda path: result.requests.to_parquet(path, index=False)))
    optional = {"iterations.csv": args.iterations, "vllm_bench.json": args.bench_json or args.bench_detailed,
                "requests.parquet": args.parquet, "timeline.png": False, "control.csv": result.control is not None,
                "timeseries.csv": False}
    for stale in (name for name, wanted in optional.items() if not wanted):
        (out / stale).unlink(missing_ok=True)
    return written


def _run_rollout(scenario, out: Path, args) -> int:
    """A canary or shadow rollout: the user-facing summary, then each group against the control. The
    optional files are the users' (control and canaries; --iterations: every group's, shadows too, with
    a ``group`` column) and the plot is the users' timeline."""
    result, *others = simulate_replications(scenario, force=True)     # one run's size checked by the caller
    interrupted = result.interrupted or any(run.interrupted for run in others)
    summary = summarize(result.user).to_dict()
    _warn_of_warmup(result.user)
    # a replication cut short by Ctrl-C is left out: its window is not the others'
    summary["rollout"] = rollout_summary(result, args.detect, [run for run in others if not run.interrupted])
    users = result.user.requests
    written = [write_file(out / "requests.csv", lambda path: users.to_csv(path, index=False))]
    shadows = [group.requests for name, group in result.groups.items() if result.roles[name] is RolloutRole.SHADOW]
    if shadows:
        written.append(write_file(out / "shadow.csv",
                                  lambda path: pd.concat(shadows, ignore_index=True).to_csv(path, index=False)))
    rows = [{"group": name, **d} for name, g in summary["rollout"]["groups"].items() for d in g.get("comparison", [])]
    written.append(write_file(out / "rollout.csv", lambda path: pd.DataFrame(rows).to_csv(path, index=False)))
    written.append(_write_summary(out / "summary.json", summary))
    iterations = pd.concat([group.iterations.assign(group=name) for name, group in result.groups.items()],
                           ignore_index=True)
    written += _optional_files(result.user, iterations, out, args)
    print(format_summary(summary))
    if args.plot:
        from llmsim.analysis.plots import timeline
        written.append(write_file(out / "timeline.png", lambda path: timeline(result.user, path)))
    print("\nwrote " + ", ".join(map(str, written)))
    print("\n" + rollout_table(summary["rollout"]))          # ends in each group's verdict
    return 130 if interrupted else 0


def _warn_of_warmup(result) -> None:
    warning = warmup_warning(result)
    if warning:
        print(f"llmsim: warning: {warning}", file=sys.stderr)


def _write_summary(path: Path, summary: dict) -> Path:
    return write_file(path, lambda partial: partial.write_text(json.dumps(_json_safe(summary), indent=2) + "\n"))


def trace_description(scenario) -> str:
    """Which requests of which trace a replay covers (file, window, filters, sampling, time scale), or
    which dataset gives the lengths."""
    trace = generate_trace(scenario.workload, scenario.seed)
    return f"{trace.description}: {len(trace):,} requests"


def require_parquet() -> None:
    """--parquet needs pyarrow (the optional extra ``parquet``): say so before simulating."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError("writing Parquet needs the pyarrow package", key="--parquet", has_value=False,
                          allowed="pip install 'llmsim[parquet]', or the CSV records alone") from None


def _cmd_compare(args) -> int:
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    table = compare(args.comparison, force=args.force)
    if args.out:
        write_file(Path(args.out), lambda path: table.to_csv(path, index=False))
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:,.3g}".format):
        print(table.to_string(index=False))
    if args.out:
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
