"""Plain-text rendering of a run summary, for the terminal."""
from __future__ import annotations

import math
import textwrap

from llmsim.config.policies import RolloutRole

WIDTH = 120                 # a terminal's columns: longer lines wrap under their label


def _ms(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1e3:,.1f}"


def _num(value: float, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def format_summary(summary: dict) -> str:
    lines = []
    req, lat, thr, slo, util, mem = (summary[k] for k in ("requests", "latency", "throughput", "slo",
                                                          "utilisation", "memory"))
    start, stop = summary["window_s"]
    scaling = summary.get("autoscaling")
    where = (f"{scaling['min_replicas']}-{scaling['max_replicas']} replicas of {scaling['devices_per_replica']} x"
             f" {summary['hardware']} (mean {_num(scaling['mean_replicas_in_window'], 2)} paid for)"
             if scaling else f"{summary['devices']} x {summary['hardware']}")
    lines.append(f"{summary['scenario']}: {summary['model']} on {where}"
                 f"  (seed {summary['seed']}, simulated {summary['simulated_s']:,.1f} s,"
                 f" steady state {start:,.1f}-{stop:,.1f} s)")
    stopped_by = summary.get("stopped_by", "completed")
    if stopped_by != "completed":
        limits = f" ({summary['stopped_on'].replace(',', ', ')})" if summary.get("stopped_on") else ""
        why = {"horizon": "the horizon", "interrupt": "Ctrl-C",
               "missed": f"its SLO targets being missed beyond recovery{limits}",
               "decided": "its SLO verdict being settled on a shorter window",
               }.get(stopped_by, f"a fault ({summary['fault']})")
        lines.append(f"{'INTERRUPTED' if summary['interrupted'] else 'STOPPED'} by {why} at "
                     f"{summary['simulated_s']:,.1f} s simulated: the figures below cover what was simulated.")
    lines.append("")
    lines.append(f"requests   arrived {req['arrived']:,}"
                 + (f" (not arrived {req['not_arrived']:,})" if req.get("not_arrived") else "")
                 + f"  finished {req['finished']:,}  "
                 f"rejected {req['rejected_timeout'] + req['rejected_too_long']:,} "
                 f"(timeout {req['rejected_timeout']:,}, too long {req['rejected_too_long']:,})  "
                 f"unfinished {req['unfinished_queued'] + req['unfinished_running']:,} "
                 f"(queued {req['unfinished_queued']:,}, running {req['unfinished_running']:,})  "
                 f"preemptions {req['preemptions']:,}")
    lines.append("")
    header = f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}"
    lines.append(header)
    lines.append("-" * len(header))
    names = {"queue_wait_s": "queue wait", "ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL (tokens)",
             "max_itl_s": "max ITL/req", "e2e_s": "end-to-end"}
    for key, label in names.items():
        d = lat[key]
        lines.append(f"{label:<16}{_ms(d['mean']):>10}{_ms(d['p50']):>10}{_ms(d['p95']):>10}{_ms(d['p99']):>10}")
    lines.append("")
    lines.append(f"throughput {_num(thr['requests_per_s'], 2)} req/s (offered {_num(thr['offered_requests_per_s'], 2)})"
                 f"   {_num(thr['output_tokens_per_s'], 0)} output tok/s"
                 f"   {_num(thr['total_tokens_per_s'], 0)} total tok/s"
                 f"   {_num(thr['output_tokens_per_s_per_device'], 0)} output tok/s/device")
    if slo["ttft_s"] is not None or slo["tpot_s"] is not None or slo["e2e_s"] is not None:
        limits = ", ".join(f"{name} <= {_ms(slo[key])} ms" for name, key in
                           (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")) if slo[key] is not None)
        lines.append(f"SLO        {limits}: attainment {_num(100 * slo['attainment'], 1)}%"
                     f" ({_attainment_interval(slo['attainment'], slo['attainment_stderr'])})")
        lines.append(f"goodput    {_num(slo['goodput_requests_per_s'], 2)} req/s meeting the SLO"
                     f"   {_num(slo['goodput_output_tokens_per_s'], 0)} output tok/s")
    if not summary["queue"]["steady"]:
        lines.append(f"           WARNING: TTFT rose by {_num(100 * summary['queue']['ttft_rise'], 0)}% of its"
                     f" {'limit' if slo['ttft_s'] is not None else 'mean'} across the window: not a steady state"
                     " (a load beyond capacity, or a window too short for the queue to settle)")
    lines.append(f"utilisation busy {_num(100 * util['busy_fraction'])}%   MFU {_num(100 * util['mfu'])}%"
                 f"   memory bandwidth {_num(100 * util['bandwidth_utilisation'])}%"
                 f"   mean batch {_num(util['mean_batch_size'])}"
                 f"   KV cache mean {_num(100 * util['kv_occupancy_mean'])}%"
                 f" max {_num(100 * util['kv_occupancy_max'])}%")
    eco = summary["economics"]
    lines.append(f"cost       {_num(eco['usd_per_hour'], 2)} USD/h   {_num(eco['usd_per_million_output_tokens'], 2)}"
                 f" USD per million output tokens   {_num(eco['kwh_per_million_output_tokens_at_tdp'], 2)}"
                 f" kWh per million output tokens (at TDP)")
    if scaling:
        lines.append(_autoscaling_line(scaling, summary["hardware"]))
    if "speculation" in summary:
        lines.append(_speculation_line(summary["speculation"]))
    if "kv_cache" in summary:
        lines.append(_kv_cache_line(summary["kv_cache"]))
    if "disaggregation" in summary:
        lines += _disaggregation_lines(summary["disaggregation"])
    draft = (f" + {mem['draft_devices_per_replica']} draft device(s)" if mem.get("draft_devices_per_replica")
             else "")
    experts = (f" x ep {mem['expert_parallel']} ({mem['experts_per_device']} experts per GPU)"
               if mem.get("expert_parallel", 1) > 1 else "")
    lines.append(f"placement  tp {mem['tensor_parallel']} x pp {mem['pipeline_parallel']}{experts}{draft}, weights in"
                 f" {mem['weights_in']}, KV cache in {mem['kv_cache_in']}")
    lines.append(f"memory     weights {_num(mem['weights_per_device_gb'])} GB/device,"
                 f" KV cache {_num(mem['kv_cache_per_device_gb'])} GB/device"
                 f" = {mem['kv_capacity_tokens_per_replica']:,} tokens/replica;"
                 f" queue mean {_num(summary['queue']['mean_length'], 2)} max {summary['queue']['max_length']}")
    if "classes" in summary:
        lines += ["", class_table(summary["classes"])]
    return "\n".join(_wrapped(line) for line in "\n".join(lines).split("\n"))


def _wrapped(line: str) -> str:
    """A line of at most WIDTH characters, or wrapped with its continuation under the text after the label."""
    if len(line) <= WIDTH:
        return line
    indent = " " * (len(line) - len(line[len(line.split(" ", 1)[0]):].lstrip()) if " " in line else 0)
    return textwrap.fill(line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def class_table(classes: dict) -> str:
    """Per traffic class: counts, p95 latencies (ms), throughput, goodput and its own SLO's attainment."""
    header = (f"{'class':<14}{'arrived':>8}{'finished':>9}{'rejected':>9}{'TTFT p95':>10}{'TPOT p95':>10}"
              f"{'E2E p95':>10}{'req/s':>8}{'goodput':>9}{'attain':>8}  SLO")
    lines = [header, "-" * len(header)]
    for name, c in classes.items():
        slo = c["slo"]
        lines.append(f"{name:<14}{c['arrived']:>8,}{c['finished']:>9,}{c['rejected']:>9,}{_ms(c['ttft_s']['p95']):>10}"
                     f"{_ms(c['tpot_s']['p95']):>10}{_ms(c['e2e_s']['p95']):>10}{_num(c['requests_per_s'], 2):>8}"
                     f"{_num(slo['goodput_requests_per_s'], 2):>9}{_num(100 * slo['attainment'], 1):>7}%"
                     f"  {'met' if slo['met'] else 'MISSED'}")
    return "\n".join(lines)


def _disaggregation_lines(split: dict) -> list[str]:
    """The layout and link, the mean TTFT's four parts, and each pool (utilisation and placement above are the
    decode pool's)."""
    parts = "  ".join(f"{label} {_ms(split[f'ttft_{name}_s']['mean'])}" for label, name in
                      (("queue", "queue"), ("prefill", "prefill"), ("transfer", "transfer"),
                       ("first decode", "first_decode")))
    lines = [f"disagg     {split['layout']} over {split['lanes']} x {split['link']}"
             f"{' (streaming)' if split['streaming'] else ''}, KV reserved {split['reservation'].replace('_', ' ')};"
             f" {split['transfers']:,} transfers, {_num(split['transfer_gb'], 1)} GB, mean"
             f" {_ms(split['transfer_s']['mean'])} ms, link busy {_num(100 * split['link_utilisation'])}%;"
             f" {split['aggregated_requests']:,} ran aggregated",
             f"           TTFT mean (ms): {parts}"]
    for name, pool in split["pools"].items():
        lines.append(f"           {name} pool {pool['replicas']} x {pool['hardware']} tp {pool['tensor_parallel']} x"
                     f" pp {pool['pipeline_parallel']}"
                     + (f" x ep {pool['expert_parallel']}" if pool.get('expert_parallel', 1) > 1 else "")
                     + f": busy {_num(100 * pool['busy_fraction'])}%,"
                     f" {_num(pool['usd_per_hour'], 2)} USD/h")
    return lines


def _autoscaling_line(scaling: dict, hardware: str) -> str:
    """The replica pool over the whole run: actions, replica-seconds paid and their price. The cost line
    above is the window's, from the replica-seconds paid in it."""
    return (f"autoscale  {scaling['min_replicas']}-{scaling['max_replicas']} replicas of"
            f" {scaling['devices_per_replica']} x {hardware}: {scaling['scale_ups']} started,"
            f" {scaling['scale_downs']} drained, at most {scaling['max_replicas_serving']} serving;"
            f" whole run {_num(scaling['replica_seconds'], 0)} replica-s paid (mean {_num(scaling['mean_replicas'], 2)}"
            f" replicas) = {_num(scaling['usd'], 2)} USD, {_num(scaling['usd_per_million_output_tokens'], 2)}"
            f" USD per million output tokens; cost, energy and tok/s/device above: the window's replica-seconds")


def _kv_cache_line(kv: dict) -> str:
    """Prefix hits and host-tier traffic; a warning where the host tier refused KV."""
    line = (f"kv cache   blocks of {kv['block_size']}: hit rate {_num(100 * kv['hit_rate_tokens'])}% of prompt tokens"
            f" ({_num(100 * kv['hit_rate_requests'])}% of requests), fragmentation"
            f" {_num(100 * kv['internal_fragmentation'])}%, {kv['evicted_blocks']:,} GPU evictions")
    moved = kv["offloaded_gb"] + kv["reloaded_gb"] + kv["swapped_out_gb"] + kv["swapped_in_gb"]
    if moved:
        line += (f"\n           host link: offloaded {_num(kv['offloaded_gb'])} GB,"
                 f" reloaded {_num(kv['reloaded_gb'])} GB,"
                 f" swapped out {_num(kv['swapped_out_gb'])} GB / in {_num(kv['swapped_in_gb'])} GB"
                 f" ({_num(kv['swap_resident_gb'])} GB still on the GPU); link busy {_num(kv['transfer_s'], 2)} s,"
                 f" iterations {_num(kv['transfer_stall_s'], 2)} s longer; host tier mean"
                 f" {_num(100 * kv['host_occupancy_mean'])}% max {_num(100 * kv['host_occupancy_max'])}%,"
                 f" {kv['host_evicted_blocks']:,} blocks evicted ({_num(kv['host_evicted_gb'])} GB)")
    if kv["offload_failed_blocks"] or kv["swap_failed_preemptions"]:
        line += (f"\n           WARNING: host memory full of swapped KV: {kv['offload_failed_blocks']:,} offloaded"
                 f" blocks dropped, {kv['swap_failed_preemptions']:,} swap preemptions recomputed instead")
    return line


def _times(ratio: float, above: str, below: str) -> str:
    """A ratio as a person says it: 2.5x faster, or 3.3x slower for 0.30 (never "0.30x faster"); one that
    rounds to 1.00 either way is the same."""
    if ratio is None or math.isnan(ratio) or ratio <= 0:
        return "-"
    if _num(max(ratio, 1 / ratio), 2) == "1.00":
        return "1.00x (the same)"
    return f"{_num(ratio, 2)}x {above}" if ratio >= 1 else f"{_num(1 / ratio, 2)}x {below}"


def _speculation_line(spec: dict) -> str:
    line = (f"speculate  {spec['draft']} ({spec['placement']}), {spec['policy']} k: mean k {_num(spec['mean_k'], 2)},"
            f" acceptance {_num(100 * spec['acceptance_rate'])}%, {_num(spec['tokens_per_verify_step'], 2)} tokens"
            f" per verify step, {_num(100 * spec['speculating_fraction'])}% of decode steps speculative,"
            f" draft {_num(100 * spec['draft_time_share'])}% of time")
    if spec.get("warning"):
        line += f"\n           WARNING: {spec['warning']}"
    speedup = spec.get("speedup_over_plain")
    if speedup:
        line += (f"\n           vs plain decoding on the same trace:"
                 f" TPOT {_times(speedup['tpot_mean'], 'faster', 'slower')},"
                 f" p50 end-to-end {_times(speedup['e2e_p50'], 'faster', 'slower')}, output tok/s"
                 f" {_times(speedup['output_tokens_per_s'], 'higher', 'lower')}")
    return line


def rollout_table(rollout: dict) -> str:
    """Per rollout group: its share and latencies, then each metric's difference from the control with
    its 95% interval and p-value, and how long a group like it must run to detect the change asked."""
    groups = rollout["groups"]
    header = f"{'group':<14}{'role':<9}{'share':>7}{'replicas':>9}{'requests':>9}{'TTFT p95':>10}{'TPOT p95':>10}" \
             f"{'E2E p95':>10}{'attain':>8}"
    lines = ["rollout (user-facing figures above: control and canaries; shadows served copies nobody saw)",
             header, "-" * len(header)]
    for name, g in groups.items():
        lat = g["latency"]
        lines.append(f"{name:<14}{g['role']:<9}{_num(100 * g['fraction'], 1):>6}%{g['replicas']:>9}{g['requests']:>9,}"
                     f"{_ms(lat['ttft_s']['p95']):>10}{_ms(lat['tpot_s']['p95']):>10}{_ms(lat['e2e_s']['p95']):>10}"
                     f"{_num(100 * g['slo']['attainment'], 1):>7}%")
    for name, g in groups.items():
        if "comparison" not in g:
            continue
        how = "paired on the requests it copied" if g["role"] == RolloutRole.SHADOW else "independent samples"
        lines += ["", f"{name} - control ({how}; ms, attainment in points); {rollout['method']}"]
        head = f"{'metric':<12}{'stat':<6}{'control':>10}{g['role']:>10}{'diff':>10}{'95% interval':>22}{'p':>9}  test"
        lines += [head, "-" * len(head)]
        for d in g["comparison"]:
            scale = (lambda v: _num(100 * v, 2)) if d["metric"] == "attainment" else _ms
            measured = math.isfinite(d["low"]) and math.isfinite(d["high"])
            interval = f"[{scale(d['low'])}, {scale(d['high'])}]" if measured else "n/a"
            p_value = f"{d['p_value']:>9.2g}" if measured else f"{'-':>9}"
            lines.append(f"{d['metric']:<12}{d['statistic']:<6}{scale(d['control']):>10}{scale(d['treatment']):>10}"
                         f"{scale(d['difference']):>10}{interval:>22}{p_value}  {d['test']}"
                         + ("  *" if d["significant"] else ""))
        change = 100 * rollout["change_to_detect"]
        for t in g["detection"]:
            lines.append(f"detect a {change:g}% change in mean {t['metric']}: {t['requests']:,.0f} {g['role']} requests"
                         f" = {t['seconds']:,.0f} s at its share"
                         f" (this run detects {_num(100 * t['detectable_now'], 1)}%)")
    verdicts = [g["verdict"] for g in groups.values() if "verdict" in g]
    if verdicts:           # last, so the printout ends in what it means
        lines += ["", *verdicts]
    return "\n".join(lines)


def _attainment_interval(attainment: float, stderr: float) -> str:
    """The 95% interval of the attainment, or why there is none: when every request in the window met the SLO
    (or none did) the batches do not vary, and a zero-width interval would claim a certainty the run lacks."""
    if stderr > 0:         # two significant figures where one decimal would print a zero-width interval
        half_width = 200 * stderr
        return f"+- {_num(half_width, 1) if half_width >= 0.05 else f'{half_width:.2g}'} at 95%"
    if attainment in (0.0, 1.0):
        return f"every request in the window {'met' if attainment == 1.0 else 'missed'} it: no interval"
    return "+- n/a: too few requests to batch"
