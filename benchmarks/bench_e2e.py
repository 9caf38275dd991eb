"""Whole offline runs against published end-to-end throughput (a held-out check: nothing here is fitted to them).

Source: NVIDIA TensorRT-LLM's performance overview (github.com/NVIDIA/TensorRT-LLM, docs/source/performance/
perf-overview.md at commit 00f37686aa854010d68bcbd0f4ab000221541ca6, the v1.0 tables): ``trtllm-bench throughput``,
every request queued at once, fixed input/output lengths (``--input-stdev=0 --output-stdev=0``), ModelOpt FP8
checkpoints (nvidia/Llama-3.1-8B-Instruct-FP8, nvidia/Llama-3.3-70B-Instruct-FP8: Llama 3.1 70B's architecture,
nvidia/Llama-3.1-405B-Instruct-FP8), the PyTorch backend with CUDA graphs up to 8,192 sequences, KV cache at up to
95% of free memory; DGX H100 (80 GB) and DGX H200 (141 GB). The metric is total output tokens per second.

KV cache: FP8. The source does not state it; TensorRT-LLM's PyTorch backend takes the cache dtype from the
checkpoint's ``hf_quant_config.json`` (``kv_cache_quant_algo``, adopted when the run sets none:
``tensorrt_llm/_torch/model_config.py``), and NVIDIA lists nvidia/Llama-3.1-8B-Instruct-FP8 among the checkpoints
with a quantized KV cache (NVIDIA/TensorRT-LLM issue 4329); its accuracy tests of ModelOpt FP8 checkpoints assert an FP8
cache without asking for one (Mixtral-8x7B-FP8).

Scheduling, TensorRT-LLM's defaults (the perf overview sets none of these): admission GUARANTEED_NO_EVICT, each
request's prompt and output reserved in the KV cache up front and nothing preempted
(nvidia.github.io/TensorRT-LLM/performance/performance-tuning-guide/useful-runtime-flags.html: "GUARANTEED_NO_EVICT
(default)"); in-flight batching, context and generation requests in one step up to its token budget (the scheduler's
MicroBatchScheduler returns both for the same step, nvidia.github.io/TensorRT-LLM/torch/scheduler.html; chunked
prefill is off by default, TorchLlmArgs ``enable_chunked_prefill: bool = False``): the simulator's chunked prefill
is the closest of its modes (its prefill-first mode runs prompts in steps of their own), differing where a prompt
meets the budget's edge, which TensorRT-LLM holds back to the next step and the simulator splits. The PyTorch
backend overlaps each step's CPU work with the next step on the GPU by default
(nvidia.github.io/TensorRT-LLM/features/overlap-scheduler.html: "Enabled by default"): ``engine.async_scheduling``.
The batch limit and the token budget of each cell are the ones trtllm-bench derives from the lengths and the KV
memory where the run names neither (:func:`trtllm_bench_limits`): 2,048 tokens a step in the decode-heavy cells.

The simulator runs the same: the model with FP8 weights and cache, TensorRT-LLM's kernel terms and fusions
(``engine.kernels: trtllm``; ``kernel_terms.STREAM_FUSION``), the published tensor-parallel size, the same lengths,
every request waiting at time 0; the rate is measured on the saturated engine after its ramp-up
(:func:`llmsim.search.sustainable_rate.offline_rate`). The published figure is timed over the whole run instead
(trtllm-bench: total output tokens over the first request's start to the last one's end, ramp-up and tail included),
so each cell is also run as published, its ``$num_requests`` requests at once (:data:`PUBLISHED_REQUESTS`), and timed
so (:func:`whole_run_rate`). Prints simulated (steady and whole-run) and published tokens/s per cell, their ratios,
and the H100/H200 ratio of each (model, lengths) both ways.

    .venv/bin/python benchmarks/bench_e2e.py [--quick] [--breakdown]
        (a few minutes on 2 cores; --quick: one length pair; --breakdown: where each cell's mean step goes)

``--breakdown`` prints, per cell, ``CostModel.breakdown`` of the measured window's mean step (its mean decoding
sequences at the mean context of the run, ISL + OSL / 2, and its mean prompt tokens as one chunk): the operator
groups that set a missed cell's time.
"""
from __future__ import annotations

import argparse
import math
import time

from llmsim.catalog.hardware import lookup_hardware
from llmsim.catalog.models import lookup_model, model_catalog
from llmsim.cost.roofline import CostModel
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.search.sustainable_rate import OfflineRate, offline_rate, whole_run_output_rate
from llmsim.search.sweeps import scenario_at

SOURCE = ("TensorRT-LLM perf-overview.md @00f37686 (trtllm-bench throughput, FP8 weights and KV cache, "
          "total output tokens/s)")
# (model, GPU, TP, ISL, OSL) -> published total output tokens/s.
PUBLISHED = {
    ("Llama-3.1-8B", "H100-SXM", 1, 128, 2048): 22714, ("Llama-3.1-8B", "H200", 1, 128, 2048): 26221,
    ("Llama-3.1-8B", "H100-SXM", 1, 1000, 1000): 15220, ("Llama-3.1-8B", "H200", 1, 1000, 1000): 17744,
    ("Llama-3.1-8B", "H100-SXM", 1, 2048, 128): 3450, ("Llama-3.1-8B", "H200", 1, 2048, 128): 3538,
    ("Llama-3.1-70B", "H100-SXM", 2, 128, 2048): 6651, ("Llama-3.1-70B", "H200", 1, 128, 2048): 4336,
    ("Llama-3.1-70B", "H100-SXM", 2, 1000, 1000): 4205, ("Llama-3.1-70B", "H200", 1, 1000, 1000): 2909,
    ("Llama-3.1-70B", "H100-SXM", 2, 2048, 128): 762, ("Llama-3.1-70B", "H200", 1, 2048, 128): 442,
    ("Llama-3.1-405B", "H100-SXM", 8, 128, 2048): 4340, ("Llama-3.1-405B", "H200", 8, 128, 2048): 5348,
    ("Llama-3.1-405B", "H100-SXM", 8, 1000, 1000): 2919, ("Llama-3.1-405B", "H200", 8, 1000, 1000): 3330,
    ("Llama-3.1-405B", "H100-SXM", 8, 2048, 128): 453, ("Llama-3.1-405B", "H200", 8, 2048, 128): 456,
}
KV_CACHE_FRACTION = 0.95     # the perf overview's --kv_cache_free_gpu_mem_fraction
# The perf overview's $num_requests by (ISL, OSL): the requests of each published run, which its throughput is timed
# over from the first request's start to the last one's end (trtllm-bench's reporting).
PUBLISHED_REQUESTS = {(128, 2048): 3000, (1000, 1000): 3000, (2048, 128): 3000}


def trtllm_bench_limits(model: str, gpu: str, tp: int, isl: int, osl: int) -> tuple[int, int]:
    """The maximum batch size and tokens per step trtllm-bench sets where the run names neither (the perf overview
    names neither): ``calc_engine_setting`` and ``finetune_setting`` of ``tensorrt_llm/bench/build/tuning.py``
    (NVIDIA/TensorRT-LLM; FP8 is among its tuned quantizations). The requests its KV estimate holds at ISL + OSL
    tokens each (NVML's total memory of the TP GPUs less the FP8 weights, x the KV fraction, over the FP8 KV bytes of a
    token with at least one KV head per GPU), capped at 4,096; the batch rounded up to 32s, 128s or 256s (at least 64),
    the tokens per step ``batch x (1 + ISL / OSL)`` (at most 32,768) rounded up to 256s, 512s or 1,024s (at least
    2,048). Its tokens per step count every token of a step, context and generation, as ``max_batch_tokens`` does."""
    spec, memory_bytes = lookup_model(model, model_catalog()), lookup_hardware(gpu).memory_capacity_bytes
    gib = 2.0 ** 30
    token_gib = 2 * spec.num_layers * max(tp, spec.num_kv_heads) * spec.head_dim * 1.0 / gib
    cache_gib = (memory_bytes / gib * tp - spec.param_count * 1.0 / gib) * KV_CACHE_FRACTION
    batch = min(cache_gib / (token_gib * (isl + osl)), 4096)
    tokens = min(batch * (1 + isl / osl), 32768)
    step = 32 if batch < 256 else 128 if batch < 1024 else 256
    max_batch = max(64, step * math.ceil(batch / step))
    step = 256 if tokens < 4096 else 512 if tokens < 8192 else 1024
    return max_batch, max(2048, step * math.ceil(tokens / step))


def scenario(model: str, gpu: str, tp: int, isl: int, osl: int) -> dict:
    max_num_seqs, max_batch_tokens = trtllm_bench_limits(model, gpu, tp, isl, osl)
    return {"name": f"e2e-{model}-{gpu}-tp{tp}-{isl}-{osl}", "seed": 5,
            "model": {"base": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}, "hardware": gpu,
            "deployment": {"replicas": 1, "tensor_parallel": tp},
            "engine": {"kernels": "trtllm", "max_num_seqs": max_num_seqs, "max_batch_tokens": max_batch_tokens,
                       "chunked_prefill": True, "admission": "guaranteed_no_evict",
                       "memory_utilization": KV_CACHE_FRACTION,
                       "async_scheduling": True},
            "workload": {"arrival": {"process": "poisson", "rate": 10}, "num_requests": 1000,
                         "prompt_tokens": isl, "output_tokens": osl}}


def simulated_rate(model: str, gpu: str, tp: int, isl: int, osl: int) -> OfflineRate:
    return offline_rate(scenario(model, gpu, tp, isl, osl),
                        num_requests=5 * trtllm_bench_limits(model, gpu, tp, isl, osl)[0])


def whole_run_rate(model: str, gpu: str, tp: int, isl: int, osl: int) -> float:
    """Output tokens/s of the published run's whole span: its requests all queued at once, ramp-up and tail included,
    as trtllm-bench times it (:func:`llmsim.search.sustainable_rate.whole_run_output_rate`)."""
    return whole_run_output_rate(scenario(model, gpu, tp, isl, osl), PUBLISHED_REQUESTS[isl, osl])


def print_breakdown(key: tuple, rate: OfflineRate) -> None:
    """The mean step of the cell's measured window, operator by operator (see the module docstring)."""
    model, gpu, tp, isl, osl = key
    cost: CostModel = ResolvedDeployment.of(scenario_at(scenario(*key), {})).cost
    decoding = round(rate.mean_batch)
    # Prompt tokens per step: the window's output tokens per step are its decoding sequences (one each), and every
    # finished request brought ISL prompt tokens for OSL output tokens.
    chunk = round(decoding * isl / osl)
    rows = cost.breakdown(cost.features([chunk], [0], [isl + osl / 2] * decoding, prefill_logits=0))
    rows = rows[rows["time_s"] > 0]
    total_ms = rows["time_s"].sum() * 1e3
    parts = ", ".join(f"{row.operator} {row.time_s * 1e3:.1f}" for row in rows.itertuples())
    print(f"    step at {decoding} decoding + {chunk} prompt tokens: {total_ms:.1f} ms "
          f"(measured mean {rate.step_s * 1e3:.1f} ms; overhead+communication holds the CPU part the overlap "
          f"scheduler hides): {parts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 1000/1000 cells only")
    parser.add_argument("--breakdown", action="store_true", help="each cell's mean step, operator by operator (ms)")
    args = parser.parse_args()
    started = time.perf_counter()
    cells = {key: value for key, value in PUBLISHED.items() if not args.quick or key[3:] == (1000, 1000)}
    simulated, whole = {}, {}
    print(f"source: {SOURCE}")
    print("steady: the saturated engine after its ramp-up; whole run: the published run's requests "
          "(perf overview's $num_requests) from the first start to the last finish, as trtllm-bench times it")
    print(f"{'model':<15} {'GPU':<9} {'TP':>2} {'ISL/OSL':>9} {'published':>10} {'steady':>10} {'sim/pub':>8} "
          f"{'whole run':>10} {'sim/pub':>8}")
    for key, published in cells.items():
        rate = simulated_rate(*key)
        simulated[key] = rate.output_tokens_per_s
        whole[key] = whole_run_rate(*key)
        model, gpu, tp, isl, osl = key
        print(f"{model:<15} {gpu:<9} {tp:>2} {f'{isl}/{osl}':>9} {published:>10,} {simulated[key]:>10,.0f} "
              f"{simulated[key] / published:>8.2f} {whole[key]:>10,.0f} {whole[key] / published:>8.2f}", flush=True)
        if args.breakdown:
            print_breakdown(key, rate)
    print("\nH100/H200 throughput per GPU (published TP sizes differ for 70B: per GPU compares them)")
    print(f"{'model':<15} {'ISL/OSL':>9} {'published':>10} {'steady':>10} {'sim/pub':>8} {'whole run':>10} "
          f"{'sim/pub':>8}")
    for (model, gpu, tp, isl, osl) in cells:
        if gpu != "H100-SXM":
            continue
        other = next((key for key in cells if key[0] == model and key[1] == "H200" and key[3:] == (isl, osl)), None)
        if other is None:
            continue
        h100 = (model, gpu, tp, isl, osl)
        published_ratio = (PUBLISHED[h100] / tp) / (PUBLISHED[other] / other[2])
        ratio = (simulated[h100] / tp) / (simulated[other] / other[2])
        whole_ratio = (whole[h100] / tp) / (whole[other] / other[2])
        print(f"{model:<15} {f'{isl}/{osl}':>9} {published_ratio:>10.2f} {ratio:>10.2f} "
              f"{ratio / published_ratio:>8.3f} {whole_ratio:>10.2f} {whole_ratio / published_ratio:>8.3f}")
    print(f"\n{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
