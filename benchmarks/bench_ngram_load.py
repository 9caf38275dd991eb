"""N-gram speculation on a loaded server, against the one published figure of its slowdown.

Source: the vLLM team's blog post "How Speculative Decoding Boosts vLLM Performance by up to 2.8x"
(blog.vllm.ai/2024/10/17/spec-decode.html, 17 October 2024; vllm-project/vllm-project.github.io,
_posts/2024-10-17-spec-decode.md). Its two figures for n-gram (prompt lookup) speculation, both Llama-3-70B on
4 x H100 on CNN/DailyMail:

- low load: "up to 2.8x Speedup at QPS=1 Llama3-70B on CNN Dailymail with 4xH100 using n-grams";
- high load: "As high QPS, we see 1.4x slowdown Llama3-70B on ShareGPT with 4xH100, 1.8x slowdown Llama3-70B
  on CNN Dailymail with 4xH100" (the 1.4x is the draft-model run on ShareGPT).

The post gives neither the high QPS nor the draft length, the n-gram window or the lengths; the bench takes
what the post's own code shows (``num_speculative_tokens=5``), CNN/DailyMail's mean lengths (See, Liu and
Manning, ACL 2017, section 4: articles of 781 tokens, summaries of 56), vLLM's default ``max_num_seqs`` of the
time (256), speculation for every running sequence (vLLM speculates whatever the batch unless
``speculative_disable_by_batch_size`` is set) and no chunked prefill: vLLM's engine of 2024 refused speculation
with chunked prefill ("Speculative decoding and chunked prefill are currently mutually exclusive",
``SpeculativeConfig.maybe_create_spec_config`` in vllm/config.py) and left chunked prefill off for models of 8k
context, so prompts run in steps of their own (the simulator's prefill-first mode). The post does not name its
vLLM version: which of these held for its runs is an assumption. The per-token acceptance is not published
either: the bench finds the one at which the simulated QPS-1 latency speedup is the post's 2.8x (its low-load
point) and then runs the loaded server with it, so the high-load result is a prediction, not a fit.
Llama-3.1-70B stands in for Llama-3-70B (the same architecture; only the context window differs).

The engine of the post scored the drafts by batch expansion (``speculation.scorer: batch_expansion``): each
speculating sequence became k + 1 one-token decode sequences, each reading the sequence's whole KV cache.
vLLM's MQA scorer (vllm-project/vllm PR 8839, merged for v0.6.3) was turned off whenever the target ran
with CUDA graphs ("Disabling MQA scorer as the target model is not running in eager mode",
``SpecDecodeWorker.create_worker`` in vllm/spec_decode/spec_decode_worker.py), and the default runs with
them; PR 8839 also says the MQA scorer "does not support ngram because MQA scorer does not handle mixed
batches", and a user of v0.6.3.post2 reports "When I did not add the --enforce-eager parameter
(automatically using the batch expansion scorer)" (PR 9298, comment of 2024-11-06). The bench runs that
engine, and beside it the same n-gram speculation scored as one multi-query chunk per sequence (``mqa``,
what later engines do), at the acceptance found for the batch-expansion engine.

It prints: the acceptance found, the mean request latency of n-gram over plain decoding at rates from QPS 1
to past the plain server's offline capacity (the post's "slowdown" is this ratio at its high QPS), and the
offline throughput of each (every request waiting at once).

    .venv/bin/python benchmarks/bench_ngram_load.py       (about 2 minutes on 2 cores)
"""
from __future__ import annotations

import time

from llmsim.search.sustainable_rate import offline_rate
from llmsim.search.sweeps import scenario_at
from llmsim.sim.simulate import simulate

SOURCE = "vLLM blog 2024-10-17 spec-decode (Llama-3-70B, 4 x H100, CNN/DailyMail, n-gram)"
PUBLISHED_LOW_LOAD_SPEEDUP = 2.8        # latency, QPS 1
PUBLISHED_HIGH_LOAD_SLOWDOWN = 1.8      # latency, "high QPS"
PROMPT_TOKENS, OUTPUT_TOKENS = 781, 56  # CNN/DailyMail means (See et al. 2017)
K = 5                                   # the post's n-gram example: num_speculative_tokens=5
REQUESTS = 400


ERA_SCORER = "batch_expansion"           # vLLM V0 with CUDA graphs (see the module docstring)


def scenario(alpha: float | None, rate: float, scorer: str = ERA_SCORER) -> dict:
    """The post's deployment; n-gram speculation at per-token acceptance ``alpha`` scored by ``scorer``
    (``alpha`` None: plain decoding)."""
    spec = {} if alpha is None else {"speculation": {
        "draft": "ngram", "k": K, "scorer": scorer, "acceptance": {"alpha": alpha},
        "eligibility": {"min_concurrent_requests": 1}}}
    return {"name": "vllm-blog-ngram", "seed": 5, "model": "Llama-3.1-70B", "hardware": "H100-SXM",
            "deployment": {"replicas": 1, "tensor_parallel": 4},
            "engine": {"max_num_seqs": 256, "max_batch_tokens": 8192, "chunked_prefill": False},
            "workload": {"arrival": {"process": "poisson", "rate": rate}, "num_requests": REQUESTS,
                         "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}, **spec}


def mean_latency_s(alpha: float | None, rate: float, scorer: str = ERA_SCORER) -> float:
    requests = simulate(scenario_at(scenario(alpha, rate, scorer), {})).requests
    return float((requests["finish_s"] - requests["arrival_s"]).mean())


def acceptance_for_speedup(speedup: float, rate: float = 1.0) -> float:
    """The per-token acceptance at which n-gram's QPS-``rate`` latency speedup is ``speedup`` (bisection)."""
    plain = mean_latency_s(None, rate)
    lo, hi = 0.05, 0.99
    for _ in range(12):
        mid = (lo + hi) / 2
        if plain / mean_latency_s(mid, rate) < speedup:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> None:
    started = time.perf_counter()
    print(f"source: {SOURCE}")
    alpha = acceptance_for_speedup(PUBLISHED_LOW_LOAD_SPEEDUP)
    print(f"acceptance at which the QPS-1 latency speedup is the published {PUBLISHED_LOW_LOAD_SPEEDUP}x: "
          f"alpha = {alpha:.3f}")
    plain = offline_rate(scenario(None, 1.0), num_requests=3000)
    spec = offline_rate(scenario(alpha, 1.0), num_requests=3000)
    mqa = offline_rate(scenario(alpha, 1.0, "mqa"), num_requests=3000)
    for name, rate in (("plain", plain), ("n-gram, batch expansion", spec), ("n-gram, mqa", mqa)):
        print(f"offline, {name}: {rate.rate_per_s:.2f} req/s (batch {rate.mean_batch:.0f}, "
              f"step {rate.step_s * 1e3:.0f} ms)")
    print(f"offline, n-gram / plain: {spec.rate_per_s / plain.rate_per_s:.2f} (batch expansion), "
          f"{mqa.rate_per_s / plain.rate_per_s:.2f} (mqa)")
    print(f"{'QPS':>6} {'share of plain capacity':>23} {'plain latency':>13} {'n-gram latency':>14} "
          f"{'n-gram / plain':>14} {'mqa / plain':>11}")
    for share in (None, 0.25, 0.5, 0.75, 0.9, 1.0, 1.2, 2.0):
        rate = 1.0 if share is None else share * plain.rate_per_s
        latency_plain, latency_spec = mean_latency_s(None, rate), mean_latency_s(alpha, rate)
        latency_mqa = mean_latency_s(alpha, rate, "mqa")
        print(f"{rate:>6.2f} {rate / plain.rate_per_s:>23.2f} {latency_plain:>11.2f} s {latency_spec:>12.2f} s "
              f"{latency_spec / latency_plain:>14.2f} {latency_mqa / latency_plain:>11.2f}")
    print(f"published: {1 / PUBLISHED_LOW_LOAD_SPEEDUP:.2f} at QPS 1, {PUBLISHED_HIGH_LOAD_SLOWDOWN:.2f} at high QPS")
    print(f"\n{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
