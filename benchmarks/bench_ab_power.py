"""How often the canary comparison sees a slower replica: its level (A/A) and power against 2, 5, 10%.

Two one-replica groups split Poisson traffic half and half (``rollout:`` with a canary at fraction
0.5); the canary runs on a copy of the H100 profile priced by its roofline (kernel terms left out) whose
efficiencies are divided and whose per-step and per-layer overheads are multiplied by ``1 + slowdown``,
so every step it takes lasts ``1 + slowdown`` times as long. The control runs on the same roofline
profile unchanged (slowdown 0: an A/A study). For each slowdown and seed the comparison of
:func:`llmsim.analysis.canary.compare_independent` is made over the measurement window; the table gives,
per metric, the share of seeds whose 95% interval excludes 0 (at slowdown 0, the false-positive rate,
nominally 5%; above it, the power), and in brackets the share of seeds with no interval (too few
requests for the run's correlation time). The realised TPOT ratio of the canary over the control is
printed as a check on the injected slowdown.

With ``--replications R`` (2 or more) each seed runs the rollout R times on seeds ``seed R .. seed R + R - 1``
(``rollout.replications``) and compares by :func:`llmsim.analysis.canary.compare_replications`: Student's t
across the runs, every figure with an interval.

    .venv/bin/python benchmarks/bench_ab_power.py [--seeds 30] [--requests 1200] [--replications 5]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from llmsim.analysis.canary import compare_independent, compare_replications, measured
from llmsim.config.reader import Node
from llmsim.config.units import parse_quantity
from llmsim.scenario.scenario import scenario_from_node
from llmsim.search.rollout import simulate_replications

REPO = Path(__file__).resolve().parent.parent
SLOWDOWNS = (0.0, 0.02, 0.05, 0.10)
ROWS = (("ttft_s", "mean"), ("tpot_s", "mean"), ("tpot_s", "p95"), ("e2e_s", "mean"), ("e2e_s", "p50"),
        ("e2e_s", "p95"))


def slowed_profile(folder: Path, slowdown: float) -> Path:
    """The H100 profile priced by its roofline, every step ``1 + slowdown`` times as long."""
    document = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm.yaml").read_text())
    document = {key: value for key, value in document.items() if key not in ("kernels", "calibration")}
    document["name"] = f"H100-roofline-slow{slowdown:g}"
    document["aliases"] = []
    for name in ("compute", "attention", "memory_bandwidth"):
        document["efficiency"][name]["value"] /= 1 + slowdown
    for name in ("per_step", "per_layer"):
        seconds = parse_quantity(document["overhead"][name]["value"], "duration")
        document["overhead"][name]["value"] = f"{seconds * (1 + slowdown) * 1e6!r} us"
    path = folder / f"slow{slowdown:g}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def scenario(folder: Path, control: Path, canary: Path, requests: int, rate: float, replications: int):
    data = {"name": "ab-power", "seed": 0, "model": "Llama-3.1-8B", "hardware": str(control),
            "engine": {"max_num_seqs": 16, "max_model_len": 16384},
            "workload": {"num_requests": requests, "arrival": {"process": "poisson", "rate": rate},
                         "prompt_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.8, "max": 4096},
                         "output_tokens": {"distribution": "lognormal", "mean": 16, "sigma": 0.8, "max": 1024}},
            "rollout": {"replications": replications,
                        "groups": {"canary": {"role": "canary", "fraction": 0.5, "replicas": 1,
                                              "hardware": str(canary)}}}}
    return scenario_from_node(Node(data, file="<bench_ab_power>", base_dir=folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--rate", type=float, default=40.0, help="total requests/s (half to each group)")
    parser.add_argument("--replications", type=int, default=1, help="runs per seed (2+: t across the runs)")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = slowed_profile(folder, 0.0)
        table: dict[float, dict] = {}
        for slowdown in SLOWDOWNS:
            built = scenario(folder, base, slowed_profile(folder, slowdown), args.requests, args.rate,
                             args.replications)
            hits: dict[tuple[str, str], list[float]] = {row: [] for row in ROWS}
            ratios = []
            for seed in range(args.seeds):
                runs = []
                for result in simulate_replications(built.with_seed(seed * args.replications)):
                    start, stop = result.user.warmup_s, result.user.arrival_window_s
                    runs.append((measured(result.records("control"), start, stop),
                                 measured(result.records("canary"), start, stop)))
                    ratios.append(runs[-1][1]["tpot_s"].mean() / runs[-1][0]["tpot_s"].mean())
                for d in compare_replications(runs) if len(runs) > 1 else compare_independent(*runs[0]):
                    if (d.metric, d.statistic) in hits:
                        hits[(d.metric, d.statistic)].append(float(d.significant) if d.has_interval else np.nan)
            table[slowdown] = {"hits": hits, "ratio": float(np.mean(ratios))}
    method = (f"t across {args.replications} replications" if args.replications > 1
              else "batch means within one run")
    print(f"{args.seeds} seeds per column, {args.replications} x {args.requests} requests at {args.rate:g}/s split "
          f"50/50 over two one-replica groups, {method}; share of seeds significant at 5% (no interval)")
    print(f"{'metric':<12}" + "".join(f"{'slower ' + format(s, '.0%'):>18}" for s in SLOWDOWNS))
    for row in ROWS:
        cells = []
        for slowdown in SLOWDOWNS:
            values = np.array(table[slowdown]["hits"][row])
            missing = np.isnan(values).mean()
            cells.append(f"{np.nanmean(values):.0%} ({missing:.0%})" if missing < 1 else "n/a")
        print(f"{row[0].removesuffix('_s').upper() + ' ' + row[1]:<12}" + "".join(f"{c:>18}" for c in cells))
    print(f"{'TPOT ratio':<12}" + "".join(f"{table[s]['ratio']:>18.3f}" for s in SLOWDOWNS))
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
