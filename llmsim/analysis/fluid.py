"""The analytic fast path: a fluid approximation of continuous batching, in about a millisecond.

Used to prune searches (``llmsim plan``, ``llmsim recommend``) before simulating, and
checked against the simulator in ``tests/analysis/test_analytic.py``.

The model, for one engine (a replica runs ``pp`` of them, one per pipeline micro-batch)
fed a Poisson stream of ``lambda`` requests per second:

1. **Fluid steps.** In steady state the mean iteration lasts ``tau``. By Little's law
   the engine holds ``B = lambda * tau * D`` decoding sequences (``D`` = decode steps
   per request: ``E[O - 1]``, fewer when speculating, see :mod:`llmsim.analysis.fluid_k`; a
   draft tree's verify pass prices every node and holds KV for it while it runs),
   so every iteration carries ``lambda * tau`` requests' worth of decode work ``w``
   (tokens, KV read by every decode or verify step, ...). The prompts it carries are
   those that arrived during the previous one: a Poisson number of them, their lengths
   at the workload's quantiles, capped by the token budget the decoders leave (what
   the cap holds back is spread over all steps). ``tau`` solves
   ``tau = E[t(one + lambda tau w + prompts)]``, ``t`` the
   :class:`~llmsim.cost.roofline.CostModel` (and the draft's sequential steps); the right
   side increases with ``tau``, and Newton's method from ``tau = 0`` (with bisection
   as a safeguard) finds the least fixed point. None, or one beyond twice
   ``max_num_seqs``, means the load is beyond what the hardware can carry.
2. **Capacity.** The load also has to fit the engine's limits: the requests in the
   batch (``a = lambda * time holding a slot``) below ``max_num_seqs`` and below what
   the KV cache holds (KV tokens / the mean KV of a running request, blocks rounded
   up), and the prompt tokens below the token budget the decoders leave. The capacity
   is the largest rate that satisfies all of it.
3. **Latency.** TPOT is ``tau`` times the mean over requests of steps per output
   token. TTFT is the rest of the iteration in progress when the request arrives
   (``E[t^2] / 2 E[t]`` over the step-time distribution, when the engine is busy, busy
   with probability ``1 - exp(-N)``: below capacity the requests in the system are
   close to an M/G/infinity population, Poisson with mean ``N``), plus the
   iteration(s) that compute its prompt (priced per prompt length over the workload's
   length quantiles), plus two queueing waits: M/G/1 (Pollaczek-Khinchine) for prompts
   sharing the prefill token budget, a prompt holding it for its share of the budget times the steps
   that carry it (a step with prefill, not the mean step), and M/G/c (Erlang C with the Allen-Cunneen
   correction) for a batch slot, ``c`` being the slot or KV limit of the replica (its pipeline engines
   share one queue and KV cache, so their slots are one pool). A TTFT percentile is read
   over the prompt length quantiles (the prompt's own prefill sets most of the spread; the waits
   and the residual step at their means).

What it leaves out, and so where it errs: the spread of contexts and draft lengths
within a batch and the burstiness of admission behind a small token budget (the cost
is convex in them, so by Jensen the model's steps are a little short), the speculative
eligibility rules (batches of one, sequences shorter than ``min_sequence_tokens``),
preemption, queue timeouts, the router's imbalance between replicas, and non-Poisson
arrivals (the queueing terms assume Poisson). Static batching is not modelled.
``tests/analysis/test_analytic.py`` bounds the error against the simulator and
``benchmarks/bench_analytic.py`` measures it; docs/accuracy/fluid-model.md quotes it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache

import numpy as np
import pandas as pd
from scipy import special

from llmsim.config.policies import Batching, Scorer
from llmsim.cost.roofline import CostModel
from llmsim.errors import ConfigError
from llmsim.cost.features import (attention_pairs, batch_rows, chunk_pairs, decode_seqs_of, expanded_verify,
                                  set_iterations, tokens_of, windowed_context_sum)
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import Scenario
from llmsim.speculation.policies import POLICIES, AdaptiveK, StaticK
from llmsim.analysis.fluid_k import KMix, adaptive_mix, static_mix, steps_to_emit
from llmsim.speculation.proposers import tree_tokens, tree_verify_pairs
from llmsim.workload.lengths import LAWS_REMEMBERED, LengthDistribution
from llmsim.workload.trace import Trace
from llmsim.workload.generate import generate_trace

PROMPT_QUANTILES = 64          # prompt lengths at which the prefill step is priced for TTFT
STEP_QUANTILES = 16            # prompt lengths in the step-time solve
MAX_PROMPTS_PER_STEP = 24      # Poisson counts of prompts arriving during one step: 0..this
SOLVER_STEPS = 60


class Stage(Enum):
    """What a disaggregated pool's engines do of each request (:mod:`llmsim.analysis.fluid_disaggregated`):
    ``PREFILL`` computes the prompt and hands the request over (no decode work; it holds its prompt's KV
    slot while it computes); ``DECODE`` takes it with every prompt token's KV but the last, whose one-token
    step, over the whole prompt's keys, gives the first output token, and decodes the rest."""
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class _Work:
    """One average request's decode work at draft length k (see the module docstring)."""
    k: float                     # mean draft length per step
    tpot_factor: float           # mean over requests of 1 / (tokens per step): TPOT = tau * this
    decode: np.ndarray           # target feature totals of the decode (or verify) steps
    draft: np.ndarray | None     # draft feature totals of its decode steps
    decode_steps: float          # D
    kv_token_steps: float        # KV tokens held, summed over the request's decode steps
    k_cdf: np.ndarray            # P(a step's k <= j), j = 0..k_max


@dataclass(frozen=True)
class _Lengths:
    """What the model reads of the requests' lengths, over those that fit the engine (prompt + output
    within the smaller of ``max_model_len`` and the KV cache): the means, the prompts' attention pairs and
    quantile grids, and the per-request decode work. ``decode`` holds decode lengths (output - 1) with
    ``decode_weight`` their probabilities, or None for a sample's requests (equally likely)."""
    mean_prompt: float
    mean_output: float
    prompt_second_moment: float
    pairs_per_token: float
    step_grid: tuple[np.ndarray, np.ndarray]     # (prompt, its attention pairs) at STEP_QUANTILES quantiles
    ttft_grid: tuple[np.ndarray, np.ndarray]     # the same at PROMPT_QUANTILES
    decode: np.ndarray
    decode_weight: np.ndarray | None
    decode_cv2: float
    mean_decode_kv: float      # E[sum over the decode steps of the context each reads], sum_{c=P+1}^{P+O-1} visible(c)
    mean_kv_held: float        # E[KV tokens held, summed over the decode steps]: context rounded up to blocks

    def mean_over_requests(self, values: np.ndarray, where: np.ndarray | None = None) -> float:
        """The mean over requests (the last axis indexes ``decode``, cut to ``where``) of ``values``."""
        if self.decode_weight is None:
            return float(values.mean())
        weight = self.decode_weight if where is None else self.decode_weight[where]
        return float((values @ weight).mean() / weight.sum())


def has_length_law(workload) -> bool:
    """Whether the workload draws every request's prompt and output independently from length laws of its
    own (then the fluid model reads those laws, not a sample: see :func:`_law_lengths`)."""
    return (workload.trace is None and workload.dataset is None and workload.sessions is None
            and not workload.classes and workload.prompt_tokens is not None and workload.output_tokens is not None)


def _too_long(scenario: Scenario) -> ConfigError:
    return ConfigError("no request of the workload fits the engine (all are too long)",
                       key="workload", has_value=False, file=scenario.path)


def _sample_lengths(scenario: Scenario, limit: int, trace: Trace | None) -> _Lengths:
    """The lengths of the scenario's requests: ``trace``, else the trace its seed generates."""
    if trace is None:
        trace = generate_trace(scenario.workload, scenario.seed)
    keep = (trace.prompt_tokens + trace.output_tokens) <= limit
    prompt = trace.prompt_tokens[keep].astype(float)
    output = trace.output_tokens[keep].astype(float)
    if len(prompt) == 0:
        raise _too_long(scenario)
    model, block = scenario.model, scenario.engine.block_size
    pairs = chunk_pairs(prompt, 0.0, model.sliding_window, model.local_attention_share)
    order = np.argsort(prompt)

    def grid(n):
        index = ((np.arange(n) + 0.5) / n * len(prompt)).astype(int)
        return prompt[order][index], pairs[order][index]
    decode = output - 1.0
    return _Lengths(
        mean_prompt=float(prompt.mean()), mean_output=float(output.mean()),
        prompt_second_moment=float((prompt ** 2).mean()), pairs_per_token=float(pairs.mean() / prompt.mean()),
        step_grid=grid(STEP_QUANTILES), ttft_grid=grid(PROMPT_QUANTILES), decode=decode, decode_weight=None,
        decode_cv2=float(decode.var() / max(decode.mean(), 1e-12) ** 2),
        mean_decode_kv=float(windowed_context_sum(prompt + 1, prompt + decode, model.sliding_window,
                                                  model.local_attention_share).mean()),
        mean_kv_held=float((decode * (prompt + (decode + 1) / 2 + block / 2)).mean()))


def _cached_prompts(lengths: _Lengths, scenario: Scenario) -> _Lengths:
    """``lengths`` as a decode pool sees them (:attr:`Stage.DECODE`): each prompt arrives computed but for its
    last token, so the prefill a step carries is one token a request attending to the whole prompt's keys; the
    decode work and the KV held (the prompt's included) are the request's own."""
    model = scenario.model

    def one_token(grid: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        prompt = grid[0]
        return np.ones_like(prompt), chunk_pairs(np.ones_like(prompt), prompt - 1.0, model.sliding_window,
                                                 model.local_attention_share)
    ttft_grid = one_token(lengths.ttft_grid)
    return replace(lengths, mean_prompt=1.0, prompt_second_moment=1.0, pairs_per_token=float(ttft_grid[1].mean()),
                   step_grid=one_token(lengths.step_grid), ttft_grid=ttft_grid)


def _law_lengths(scenario: Scenario, limit: int) -> _Lengths:
    """The same statistics from the workload's length laws, exactly (:meth:`LengthDistribution.probabilities`):
    prompt P and output O independent, cut to P + O <= ``limit``. They do not depend on the request count
    or the seed, so neither does the model (nor the windows a search measures over).

    They are remembered by what they read (:func:`_law_statistics`): a search builds a fluid model for every
    setting it scores and every window it sizes (a disaggregated one, two), and the sums over every
    (prompt, output) pair of long laws took tens of ms each time."""
    workload, model = scenario.workload, scenario.model
    # Called where has_length_law(workload): both laws are set.
    assert workload.prompt_tokens is not None and workload.output_tokens is not None
    lengths = _law_statistics(workload.prompt_tokens, workload.output_tokens, limit, model.sliding_window,
                              model.local_attention_share, scenario.engine.block_size)
    if lengths is None:
        raise _too_long(scenario)
    return lengths


@lru_cache(maxsize=LAWS_REMEMBERED)
def _law_statistics(prompt_law: LengthDistribution, output_law: LengthDistribution, limit: int,
                    window: int | None, local_share: float, block: int) -> _Lengths | None:
    """:func:`_law_lengths` (None: no request fits), shared: its arrays are read-only.

    The joint terms are sums over the output's lengths y of the prompt law's partial sums up to
    ``limit - y``: with D = y - 1, the decode steps read sum_{c=x+1}^{x+D} visible(c), which is
    D x + D (D + 1) / 2 when no layer slides; on a layer with window W it is that while x <= W - 1 - D,
    D W from x = W - 1 on, and (W^2 - W - x^2 - x) / 2 + W (D - W + 1) + W x between: a quadratic in x
    on each piece, summed with the partial sums of p(x) x^k, k = 0, 1, 2."""
    x, p = prompt_law.probabilities()
    y, q = output_law.probabilities()
    x, y = x.astype(float), y.astype(float)

    def partial(lengths, probabilities, power):
        """t -> sum of probabilities * lengths ** power over lengths <= t (lengths ascending)."""
        sums = np.concatenate([[0.0], np.cumsum(probabilities * lengths ** power)])
        return lambda t: sums[np.searchsorted(lengths, t, side="right")]
    prompt_weight = p * partial(y, q, 0)(limit - x)           # the prompt's law among the requests that fit
    fits = float(prompt_weight.sum())
    if fits <= 0:
        return None
    prompt_weight /= fits
    output_weight = q * partial(x, p, 0)(limit - y) / fits
    mean_prompt, mean_output = float(prompt_weight @ x), float(output_weight @ y)
    pairs = chunk_pairs(x, 0.0, window, local_share)
    cdf = np.cumsum(prompt_weight)

    def grid(n):
        index = np.minimum(np.searchsorted(cdf, (np.arange(n) + 0.5) / n, side="right"), len(x) - 1)
        return x[index], pairs[index]
    decode = y - 1.0
    mean_decode = mean_output - 1.0
    s0, s1, s2 = (partial(x, p, k) for k in range(3))
    top = limit - y                                           # the longest prompt that fits with each output
    full = decode * s1(top) + decode * (decode + 1) / 2 * s0(top)
    if window:
        w = float(window)
        a = np.minimum(top, w - 1 - decode)                   # x <= a: no step reaches the window
        b = np.maximum(np.minimum(top, w - 2), a)             # a < x <= b: the later steps do; x > b: all do
        between = [s(b) - s(a) for s in (s0, s1, s2)]
        capped = (decode * s1(a) + decode * (decode + 1) / 2 * s0(a)
                  + ((w * w - w) / 2 + w * (decode - w + 1)) * between[0] + w * between[1]
                  - (between[2] + between[1]) / 2
                  + decode * w * (s0(top) - s0(b)))
        context = full - local_share * (full - capped)
    else:
        context = full
    held = decode * s1(top) + decode * ((decode + 1) / 2 + block / 2) * s0(top)
    step_grid, ttft_grid = grid(STEP_QUANTILES), grid(PROMPT_QUANTILES)
    for shared in (*step_grid, *ttft_grid, decode, output_weight):
        shared.flags.writeable = False
    return _Lengths(
        mean_prompt=mean_prompt, mean_output=mean_output, prompt_second_moment=float(prompt_weight @ x ** 2),
        pairs_per_token=float(prompt_weight @ pairs) / mean_prompt, step_grid=step_grid,
        ttft_grid=ttft_grid, decode=decode, decode_weight=output_weight,
        decode_cv2=float(output_weight @ (decode - mean_decode) ** 2) / max(mean_decode, 1e-12) ** 2,
        mean_decode_kv=float(q @ context) / fits, mean_kv_held=float(q @ held) / fits)


class FluidModel:
    """The fluid approximation of one scenario (see the module docstring).

    Built once per scenario; :meth:`evaluate` then takes arrival rates, one or an array of them,
    and returns one row per rate. The length statistics come from ``trace``'s requests when one is
    given (a like-for-like comparison with a simulation of them), else from the workload's length
    laws, exactly, where it draws prompt and output independently from laws of its own
    (:func:`has_length_law`; the request count and seed then change nothing), else from the trace
    the scenario's seed generates (replayed traces, datasets, sessions, traffic classes). ``stage``: only one
    pool's part of each request, in a disaggregated deployment (:class:`Stage`; the scenario is then the pool's,
    :meth:`~llmsim.scenario.scenario.Scenario.pool`).
    """

    def __init__(self, scenario: Scenario, trace: Trace | None = None, stage: Stage | None = None):
        if scenario.engine.batching is not Batching.CONTINUOUS:
            raise ConfigError("the analytic path models continuous batching only", key="engine.batching",
                              value=scenario.engine.batching, allowed="continuous (or simulate)",
                              file=scenario.path)
        self.scenario = scenario
        eng = scenario.engine
        resolved = ResolvedDeployment.of(scenario)
        placement = resolved.memory
        self.cost = resolved.cost
        self.engines = resolved.replicas * resolved.engines_per_replica
        self.engines_per_replica = resolved.engines_per_replica
        spec = scenario.speculation if scenario.speculating else None
        self.draft_cost, self.separate = resolved.draft_cost, resolved.draft_separate
        self.handoff_s = resolved.handoff_s
        # Medusa heads and n-gram lookups run once a step, whatever k; the others once per drafted token.
        self.draft_once = spec is not None and not spec.proposer.sequential
        self.branching = spec.proposer.branching if spec is not None else 1
        self.expanded = spec is not None and spec.scorer is Scorer.BATCH_EXPANSION
        self.max_seqs = resolved.engine.max_num_seqs
        self.max_tokens = eng.max_batch_tokens
        self.kv_tokens = resolved.kv_tokens_per_engine

        limit = min(scenario.max_model_len, placement.kv_capacity_tokens)
        lengths = (_law_lengths(scenario, limit) if trace is None and has_length_law(scenario.workload)
                   else _sample_lengths(scenario, limit, trace))
        self.request_prompt = lengths.mean_prompt            # the whole prompt, whatever the stage computes of it
        if stage is Stage.DECODE:
            lengths = _cached_prompts(lengths, scenario)
        self.mean_prompt, self.mean_output = lengths.mean_prompt, lengths.mean_output
        self.prompt_second_moment = lengths.prompt_second_moment
        self.mean_decode = self.mean_output - 1.0
        self.pairs_per_token = lengths.pairs_per_token
        # Prompt lengths (and their attention pairs) at midpoint quantiles: a coarse grid for the
        # step-time solve, a fine one for TTFT.
        self.grid_prompt, self.grid_pairs = lengths.step_grid
        self.ttft_prompt, self.ttft_pairs = lengths.ttft_grid
        self._lengths = lengths
        self.decode_cv2 = lengths.decode_cv2                  # slot time is ~ decode length
        self.spec = spec
        self.works = [self._work(mix) for mix in self._mixes(spec)]
        if stage is Stage.PREFILL:
            # No decode work; the time a request holds its slot is its prefill's, which goes with the prompt.
            self.works = [_Work(0.0, 1.0, np.zeros_like(self.works[0].decode), None, 0.0, 0.0, np.ones(1))]
            self.decode_cv2 = self.prompt_second_moment / self.mean_prompt ** 2 - 1.0
        self._counts = np.arange(MAX_PROMPTS_PER_STEP + 1, dtype=float)

    def _mixes(self, spec) -> list[KMix | None]:
        """The k occupancy of the scenario's policy; the goodput policy's candidates (one per k)."""
        if spec is None:
            return [None]
        policy, rule = spec.policy, POLICIES[spec.policy.policy]
        if rule is StaticK:
            return [static_mix(spec.acceptance, policy.k, policy.k_max, self.branching)]
        if rule is AdaptiveK:
            return [adaptive_mix(spec, self.mean_decode)]
        return [static_mix(spec.acceptance, k, policy.k_max, self.branching) for k in range(policy.k_max + 1)]

    def _work(self, mix: KMix | None) -> _Work:
        """Per-request decode feature totals when steps run at the k occupancy ``mix`` (None: plain)."""
        lengths = self._lengths
        decode = lengths.decode
        if mix is None:
            steps, tpot_factor = self.mean_decode, 1.0
        else:
            assert self.spec is not None        # a k occupancy comes from the speculation config (_mixes)
            # Steps per request by class (its k occupancy over the per-k step counts); TPOT is a
            # per-request mean of steps / tokens over requests with decode tokens.
            per_k = steps_to_emit(self.spec.acceptance, mix.tokens.shape[1] - 1, decode.astype(int), self.branching)
            by_class = np.einsum("ck,ckn->cn", mix.occupancy, per_k)
            steps = lengths.mean_over_requests(by_class)
            tpot_factor = lengths.mean_over_requests(by_class[:, decode > 0] / decode[decode > 0], decode > 0)
        steps_per_token = steps / self.mean_decode
        context_sum = lengths.mean_decode_kv * steps_per_token   # over the steps, context + 1
        weights = np.array([1.0]) if mix is None else mix.step_weights()
        k = np.arange(len(weights))
        plain, spec_w = weights[0], weights * (k > 0)
        # Totals over the request's steps (spread over iterations later, see _rows). A verify
        # step at k is a k + 1 position chunk over the context (a tree: the root and its
        # sum_j b^j nodes, each over the context and its ancestors), every position giving logits.
        b = self.branching
        nodes = tree_tokens(k, b)
        t = (nodes + 1) * (k > 0)
        verify_tokens = spec_w @ t * steps
        verify_pairs = spec_w @ tree_verify_pairs(k, b, context_sum, steps)
        verify_kv, seqs, decode_kv = spec_w @ (context_sum + t * steps), plain * steps, plain * context_sum
        if self.expanded:
            verify_tokens, verify_pairs, verify_kv, seqs, decode_kv = expanded_verify.py_func(
                verify_tokens, verify_pairs, seqs, decode_kv)
        target = batch_rows(verify_tokens, verify_pairs, verify_kv, verify_tokens, seqs, decode_kv, iterations=0.0)
        mean_k = float(weights @ k)
        draft = None
        if self.draft_cost is not None and mean_k > 0:
            # Draft step j runs the sequences with k > j, over context + j + 1; in a tree it expands
            # the b^j nodes of level j (a sequential draft; Medusa and lookups run once, unchanged):
            # b^j - 1 queries beyond the chain's one, as prefill tokens over the same keys.
            draft = batch_rows(decode_seqs=mean_k * steps,
                               decode_kv_read=weights @ attention_pairs(k, context_sum, steps), iterations=0.0)
            if b > 1 and not self.draft_once:
                above = np.maximum(k - 1, 0)                      # the deepest level a draft step expands
                expanded = (tree_tokens(above, b) + 1 - k) * (k > 0)
                pairs = (tree_verify_pairs(above, b, context_sum, steps) - attention_pairs(k, context_sum, steps)) \
                    * (k > 0)
                draft += batch_rows(weights @ expanded * steps, weights @ pairs, 0.0, weights @ expanded * steps,
                                    iterations=0.0)
        # KV held: the context, and while a step runs every position it verifies.
        kv = (lengths.mean_kv_held + float(weights @ nodes) * self.mean_decode) * steps_per_token
        return _Work(mean_k, tpot_factor, target, draft, steps, kv, np.cumsum(weights))

    # -- the step-time fixed point ------------------------------------------------------------------
    @staticmethod
    def _rows(per_step: np.ndarray, cost: CostModel, iterations: float = 1.0) -> np.ndarray:
        """Feature rows ``iterations * one + per_step`` (MoE expert counts per iteration)."""
        return set_iterations(per_step.copy(), iterations, cost.model)

    def _prefill_rows(self, tokens: np.ndarray, pairs: np.ndarray, logits: np.ndarray,
                      longest: np.ndarray) -> np.ndarray:
        """Prefill of ``tokens`` fresh prompt positions whose longest query sees ``longest`` keys, to be added to a
        step's rows (see _rows). The tile padding is the causal diagonal's, ``(t - 1) / 2`` pairs a token for tiles
        of ``t`` (each diagonal tile computes ``t^2`` pairs for ``t (t + 1) / 2``), and the query tiles' fixed cost,
        ``query_tile_pairs / t`` a token (the chunks' last partial tiles are not counted)."""
        tile = self.cost.prefill_tile_tokens
        padding = tokens * ((tile - 1) / 2 + self.cost.prefill_query_tile_pairs / tile) if tile else 0.0
        return batch_rows(tokens, pairs, tokens, logits, iterations=0.0, prefill_tile_padding=padding,
                          prefill_longest_keys=longest)

    def _steps(self, lam: np.ndarray, tau: np.ndarray, work: _Work):
        """Iteration times over the distribution of prefill a step carries, with their weights.

        The prompts arriving during a step are Poisson(lambda tau); n of them at prompt
        quantile q carry n E[P] + sqrt(n) (P_q - E[P]) tokens (exact for n = 1, the
        central-limit scaling beyond), capped by the token budget left by the decoders.
        Prefill held back by the cap is spread over every step (so that all of it is
        computed: lambda tau E[P] tokens per step on average). Returns (times, weights), both
        of shape (rates, counts, quantiles).
        """
        load = (lam * tau)[:, None, None]
        most = float(load.max(initial=0.0))
        n = self._counts[:int(min(most + 6 * math.sqrt(most) + 4, MAX_PROMPTS_PER_STEP)) + 1][None, :, None]
        weights = np.exp(special.xlogy(n, load) - load - special.gammaln(n + 1))
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-300) / len(self.grid_prompt)
        root = np.sqrt(n)
        p, pp = self.grid_prompt[None, None, :], self.grid_pairs[None, None, :]
        tokens = np.maximum(n * self.mean_prompt + root * (p - self.mean_prompt), 0.0)
        pairs = np.maximum(n * self.pairs_per_token * self.mean_prompt + root * (pp - self.pairs_per_token
                                                                                  * self.mean_prompt), 0.0)
        room = np.maximum(self.max_tokens - load * tokens_of(work.decode), 1.0)
        taken = np.minimum(tokens, room)
        held_back = np.maximum(load * self.mean_prompt - (weights * taken).sum(axis=(1, 2), keepdims=True), 0.0)
        chunk = np.minimum(taken + held_back, room)
        chunk_pairs = np.where(tokens > 0, pairs * chunk / np.maximum(tokens, 1e-12), chunk * self.pairs_per_token)
        # The longest query: a whole prompt's last (the prompt fits the step), else a chunk of it half way through
        # on average; held-back prefill alone: the chunk's own.
        longest = np.where(n > 0, np.where(p <= chunk, p, (chunk + p) / 2), chunk)
        prefill = self._prefill_rows(chunk, chunk_pairs, np.minimum(n, chunk), longest)
        times = self._iteration_time(load + 0 * tokens, prefill, work)
        return times, weights

    def _iteration_time(self, load: np.ndarray, prefill: np.ndarray, work: _Work) -> np.ndarray:
        """One iteration carrying ``load`` requests' decode work and the ``prefill`` rows, draft included.

        The draft runs as many sequential steps as the largest k in the batch: with B
        sequences drawing k independently, E[max k] = sum_j (1 - P(k <= j)^B).
        """
        verify = self.cost.iteration(self._rows(load[..., None] * work.decode + prefill, self.cost))[0]
        if work.draft is None:
            return verify
        draft_cost = self.draft_cost
        assert draft_cost is not None           # work.draft exists only with a draft cost model (_work)
        # The draft's step count and its decode rows depend on the load alone, which takes a few values
        # across the grid of prefill a step carries (one per rate): each is priced once, element for element
        # the same arithmetic, and spread back over the grid.
        # (Shaped (values, 1): a batch of rows, priced as the grid's are, not one by one.)
        loads, at = np.unique(load, return_inverse=True)
        loads, at = loads[:, None], at.reshape(load.shape)
        batch = np.maximum(loads * work.decode_steps, 1.0)
        steps = (1.0 - work.k_cdf[:-1] ** batch[..., None]).sum(axis=-1)
        steps = np.maximum(steps, 1.0)
        per = loads[..., None] * work.draft / steps[..., None]
        if self.draft_once:
            draft = self._draft_once(self._rows(per, draft_cost))[at, 0]
        else:
            first = draft_cost.iteration(self._rows(per[at, 0] + prefill, draft_cost))[0]
            draft = first + (draft_cost.iteration(self._rows(per, draft_cost))[0] * (steps - 1))[at, 0]
        return np.maximum(verify, draft) + self.handoff_s if self.separate else verify + draft

    def _draft_once(self, rows: np.ndarray) -> np.ndarray:
        """Medusa's heads or a lookup, once a step over the speculating sequences of the rows.

        A step that decodes carries at least one sequence, so the pass is priced over at least one
        (as the target's weights are read every step, however light the load). Priced at the
        fluid's fractional batch instead, Medusa's weight read would jump from nothing at zero
        load to all of it just above, and the step-time solve, seeing an infinite slope at
        tau = 0, would call every load unstable.
        """
        decode_seqs = decode_seqs_of(rows)
        decode_seqs[...] = np.maximum(decode_seqs, 1.0)
        assert self.draft_cost is not None      # a draft pass is priced only with a draft cost model
        return self.draft_cost.iteration(rows)[0]

    def _mean_step(self, lam: np.ndarray, tau: np.ndarray, work: _Work) -> np.ndarray:
        times, weights = self._steps(lam, tau, work)
        return (times * weights).sum(axis=(1, 2))

    def _solve(self, lam: np.ndarray, work: _Work, give_up_s: np.ndarray | None = None) -> np.ndarray:
        """The least tau = E[step time | lambda, tau], or inf where none is below saturation.

        g(tau) = E[step time] increases with tau and is close to convex (a sum of maxima
        of linear terms, smoothed by the Poisson mixture). From tau = g(0) > 0, where g >= tau,
        Newton steps climb to the least fixed point, from either side of it within the
        bracket found so far, and bisection takes over should a step leave the bracket.
        Where g' >= 1 while g > tau (an MoE model's g is concave where its first tokens touch
        whole experts) the step is tau <- g(tau) instead, and past the tau at which the batch
        would hold twice max_num_seqs the engine is saturated whatever the cost model says: inf.
        Only the rates not yet settled are computed each step. A rate whose bracket's lower end passes
        ``give_up_s`` (per rate) is given up as inf: its least fixed point lies above (see :meth:`evaluate`).
        """
        limit = 2 * self.max_seqs / np.maximum(lam * work.decode_steps, 1e-300)
        give_up = np.full_like(lam, np.inf) if give_up_s is None else give_up_s
        # Start from g(0), which the least fixed point cannot be below (g increases): at tau = 0 itself the
        # slope of an MoE model's g is steep (the first tokens touch whole experts), and the test below
        # would take that for a load that outruns the hardware.
        tau = self._mean_step(lam, np.zeros_like(lam), work)
        if np.all((tau > limit) | (tau > give_up)):
            # Every rate is given up at the loop's first step whatever g(tau) shows there (its bracket's lower end
            # is g(0)): inf, without pricing that step.
            return np.full_like(lam, np.inf)
        low, high = tau.copy(), np.full_like(lam, np.inf)
        climbed = np.zeros(len(lam), dtype=bool)
        active = np.arange(len(lam))
        for _ in range(SOLVER_STEPS):
            if not len(active):
                break
            rates, t = lam[active], tau[active]
            g = self._mean_step(rates, t, work)
            h = g - t
            eps = 1e-6 * np.maximum(t, 1e-6)
            slope = (self._mean_step(rates, t + eps, work) - g) / eps
            above = h > 0
            low[active] = np.where(above, t, low[active])
            hopeless = (t > limit[active]) | (low[active] > give_up[active])
            tau[active[hopeless]] = np.inf
            high[active] = np.where(above, high[active], t)
            lo, hi = low[active], high[active]
            # Settled at a fixed point, or where g jumps across tau (the Poisson counts' truncation
            # moves with the load) within a bracket as narrow as that tolerance.
            tolerance = 1e-9 * np.maximum(t, 1e-9)
            settled = (np.abs(h) <= tolerance) | (hi - lo <= tolerance)
            # Newton from either side while it stays inside the bracket: from above too, since a step
            # from below may overshoot a little (g is not quite convex), and halving the bracket from
            # there instead converges only linearly (60 steps and more next to the capacity).
            newton = t + h / (1 - np.minimum(slope, 1 - 1e-12))
            step = np.where((newton > lo) & (newton < hi), newton, (lo + hi) / 2)
            # Where g climbs as fast as tau or faster (g' >= 1 while g > tau), Newton has no fixed point ahead
            # to aim at: plain iteration tau <- g(tau) climbs to the least fixed point from below (g increases),
            # or past the saturation limit, where there is none.
            climbing = above & (slope >= 1)
            step = np.where(climbing, g, step)
            climbed[active] = climbing
            moving = ~settled & ~hopeless
            tau[active[moving]] = step[moving]
            active = active[moving]
        tau[active[climbed[active]]] = np.inf      # still climbing after every step: no fixed point within reach
        return np.where(tau > limit, np.inf, tau)

    # -- public -------------------------------------------------------------------------------------
    def evaluate(self, rate_per_s, mean_limits_s: Mapping[str, float] | None = None,
                 ttft_percentile: float | None = None) -> pd.DataFrame:
        """Predicted steady state at each total arrival rate (requests/s over all replicas).

        ``mean_limits_s`` (SLO metric -> limit on its mean, e.g. ``{"tpot": 0.05}``): a rate is solved only
        until it is sure to miss a limit (TPOT, E2E) or to be unstable, and is then reported unstable: for
        a search that asks only which rates meet the limits, the same answer for less work.
        ``ttft_percentile`` (e.g. 95): also the column ``ttft_percentile_s``, the TTFT at that percentile
        of the prompt lengths (see :meth:`_evaluate`).
        """
        rates = np.atleast_1d(np.asarray(rate_per_s, dtype=float))
        if np.any(rates <= 0) or not np.all(np.isfinite(rates)):
            raise ValueError("arrival rates must be positive and finite")
        frames = [self._evaluate(rates, work, mean_limits_s, ttft_percentile) for work in self.works]
        if len(frames) == 1:
            return frames[0]
        # The goodput policy: at each load, the k with the shortest TPOT among the stable ones.
        tpot = np.vstack([f["tpot_mean_s"].to_numpy() for f in frames])
        best = np.argmin(np.where(np.isfinite(tpot), tpot, np.inf), axis=0)
        return pd.concat([frames[b].iloc[[i]] for i, b in enumerate(best)], ignore_index=True)

    def _give_up_s(self, lam: np.ndarray, work: _Work, mean_limits_s: Mapping[str, float]) -> np.ndarray:
        """Per rate, a step time past which the rate is unstable or misses a limit on a mean, whatever else.

        With step time tau: decoders hold lam decode_steps tau slots (Little), prefill's share only adds,
        and stability asks fewer than the slots; TPOT is tau tpot_factor; E2E is at least TPOT times the
        mean decode tokens (TTFT >= 0). TTFT has no such bound in tau alone. The prefill budget's queue is
        unstable once lam tau E[P] passes max(max_batch_tokens - lam tau decode tokens per step, 1).
        """
        rate = np.maximum(lam, 1e-300)
        with np.errstate(divide="ignore"):          # no decode work (Stage.PREFILL): no bound from the slots
            bound = self._slots(work) / (rate * work.decode_steps)
        bound = np.minimum(bound, np.maximum(self.max_tokens / (rate * (self.mean_prompt + tokens_of(work.decode))),
                                             1.0 / (rate * self.mean_prompt)))
        if "tpot" in mean_limits_s:
            bound = np.minimum(bound, mean_limits_s["tpot"] / work.tpot_factor)
        if "e2e" in mean_limits_s and self.mean_decode > 0:
            bound = np.minimum(bound, mean_limits_s["e2e"] / (work.tpot_factor * self.mean_decode))
        return bound

    def _slots(self, work: _Work) -> float:
        """Batch slots per engine: max_num_seqs, or fewer where the KV cache holds fewer requests (a request
        with no decode work, Stage.PREFILL, holds its prompt's KV)."""
        kv_per_request = work.kv_token_steps / work.decode_steps if work.decode_steps > 0 else self.mean_prompt
        return float(np.minimum(self.max_seqs, self.kv_tokens / kv_per_request))

    def _evaluate(self, rates: np.ndarray, work: _Work, mean_limits_s: Mapping[str, float] | None = None,
                  ttft_percentile: float | None = None) -> pd.DataFrame:
        """The frame of :meth:`evaluate` for one k occupancy. A rate with no step time (unstable, or given up) is
        unstable whatever else: its row is inf (NaN throughput), and the rest is worked out for the others alone
        (every figure of a row is its own, and such a rate's load, 0, never sets the Poisson counts' truncation:
        the same bits as with it)."""
        lam = rates / self.engines
        tau = self._solve(lam, work, None if mean_limits_s is None else self._give_up_s(lam, work, mean_limits_s))
        finite = np.isfinite(tau)
        columns = {"step_time_s": np.inf, "batch_size": np.inf, "in_system": np.inf, "utilisation": np.inf,
                   "stable": False, "ttft_mean_s": np.inf, "tpot_mean_s": np.inf}
        if ttft_percentile is not None:
            columns["ttft_percentile_s"] = np.inf
        frame = {name: np.full(len(rates), fill, dtype=type(fill)) for name, fill in columns.items()}
        if finite.any():
            for name, values in self._stable_rows(lam[finite], tau[finite], work, ttft_percentile).items():
                frame[name][finite] = values
        stable = frame["stable"]
        out = pd.DataFrame({
            "rate_per_s": rates, "mean_k": work.k, "tokens_per_step": 1.0 / work.tpot_factor,
            **{name: frame[name] for name in ("step_time_s", "batch_size", "in_system", "utilisation", "stable",
                                              "ttft_mean_s", "tpot_mean_s")},
            "e2e_mean_s": frame["ttft_mean_s"] + frame["tpot_mean_s"] * self.mean_decode,
            "output_tokens_per_s": np.where(stable, rates * self.mean_output, np.nan),
        })
        if ttft_percentile is not None:
            out["ttft_percentile_s"] = frame["ttft_percentile_s"]
        return out

    def _stable_rows(self, lam: np.ndarray, t: np.ndarray, work: _Work,
                     ttft_percentile: float | None) -> dict[str, np.ndarray]:
        """The columns of :meth:`_evaluate` at per-engine rates ``lam`` with finite step times ``t``."""
        load = lam * t
        batch = load * work.decode_steps                        # B, decoding sequences
        times, weights = self._steps(lam, t, work)
        residual = (weights * times ** 2).sum(axis=(1, 2)) / (2 * np.maximum(t, 1e-300))
        # The iteration(s) computing a prompt of each quantile length: its chunks plus the mean
        # prefill of the others, within the token budget left by the decoders.
        room = np.maximum(self.max_tokens - load[:, None] * tokens_of(work.decode), 1.0)   # (rates, 1)
        others = load[:, None] * self.mean_prompt
        p, pp = self.ttft_prompt[None, :], self.ttft_pairs[None, :]
        chunks = np.ceil((p + others) / room)
        own = p / chunks
        # The prompt's chunk i of ``chunks`` sees i / chunks of it: the mean over its chunks.
        longest = p * (chunks + 1) / (2 * chunks)
        prefill = self._prefill_rows(own + others / chunks, (pp + others * self.pairs_per_token) / chunks,
                                     np.ones_like(own), longest)
        busy_step = self._iteration_time(load[:, None] + 0 * own, prefill, work)
        idle_step = self._iteration_time(0 * own, self._prefill_rows(own, pp / chunks, np.ones_like(own), longest),
                                         work)
        prefill_busy_by_prompt, prefill_idle_by_prompt = chunks * busy_step, chunks * idle_step
        prefill_busy, prefill_idle = prefill_busy_by_prompt.mean(axis=1), prefill_idle_by_prompt.mean(axis=1)
        decode_s = work.decode_steps * t
        # Requests in the system (Little) and the chance an arrival finds the engine busy.
        in_system = lam * (prefill_busy + decode_s)
        busy = 1.0 - np.exp(-in_system)
        # Prefill budget: an M/G/1 queue whose server computes the budget the decoders leave per step. A prompt
        # holds it for its share of the budget times the steps that carry it, which last busy_step, not tau
        # (where prefill steps are much slower than decode steps, tau undercounts them): Pollaczek-Khinchine
        # over the prompt quantiles' service times; stable only while that server is busy less than all the time.
        budget = room[:, 0]
        rho_budget = load * self.mean_prompt / budget
        service = p / room * busy_step
        rho_service = lam * service.mean(axis=1)
        wait_budget = np.where((rho_budget < 1) & (rho_service < 1), lam * (service ** 2).mean(axis=1)
                               / (2 * np.maximum(1 - rho_service, 1e-12)), np.inf)
        # Batch slots: M/G/c (Erlang C, Allen-Cunneen), c from max_num_seqs or the KV cache. A replica's engines
        # (one per pipeline micro-batch) share its queue and KV cache, so a request waits only while all of them
        # are full: one queue over the replica's slots, not one per engine over a share of them.
        held_s = prefill_busy + decode_s
        offered = lam * held_s
        slots = self._slots(work)
        pooled = self.engines_per_replica
        wait_slot = self._erlang_wait(offered * pooled, slots * pooled, held_s, self.decode_cv2)
        stable = (offered < slots) & (rho_budget < 1) & (rho_service < 1)
        waits = wait_budget + wait_slot
        ttft = busy * (residual + prefill_busy) + (1 - busy) * prefill_idle + waits
        tpot = t * work.tpot_factor
        frame = {
            "step_time_s": t,
            # Sequences per iteration, decoding (B) and prefilling (the prompts a step carries).
            "batch_size": batch + load,
            "in_system": in_system * self.engines,
            "utilisation": np.maximum(offered / slots, np.maximum(rho_budget, rho_service)), "stable": stable,
            "ttft_mean_s": np.where(stable, ttft, np.inf), "tpot_mean_s": np.where(stable, tpot, np.inf),
        }
        if ttft_percentile is not None:
            # A prompt's own prefill sets most of its TTFT's spread: the TTFT of each prompt quantile (the
            # waits and the residual step at their means), read at the percentile over the quantiles.
            by_prompt = (busy[:, None] * (residual[:, None] + prefill_busy_by_prompt)
                         + (1 - busy[:, None]) * prefill_idle_by_prompt + waits[:, None])
            at = (np.arange(by_prompt.shape[1]) + 0.5) / by_prompt.shape[1]
            tail = np.array([np.interp(ttft_percentile / 100, at, row) for row in by_prompt])
            frame["ttft_percentile_s"] = np.where(stable, tail, np.inf)
        return frame

    @staticmethod
    def _erlang_wait(offered: np.ndarray, servers: np.ndarray | float, held_s: np.ndarray, cv2: float):
        """Mean wait in M/G/c: Erlang C times (1 + cs^2)/2 (Allen-Cunneen, Poisson arrivals), with cs^2
        the squared coefficient of variation of the time a request holds its slot; inf at or past saturation."""
        c = np.maximum(np.floor(servers), 1.0)
        a = offered
        with np.errstate(divide="ignore", invalid="ignore"):
            erlang_b = np.exp(special.xlogy(c, a) - a - special.gammaln(c + 1)) / special.pdtr(c, a)
            rho = a / c
            erlang_c = erlang_b / (1 - rho * (1 - erlang_b))
            wait = erlang_c * held_s / (c * (1 - rho)) * (1 + cv2) / 2
        return np.where((rho < 1) & (a > 0), np.nan_to_num(wait, nan=0.0), np.where(a > 0, np.inf, 0.0))

    def capacity(self, rounds: int = 3) -> float:
        """The largest total arrival rate (requests/s) the model predicts to be stable (:func:`stable_capacity`)."""
        return stable_capacity(self.evaluate, rounds)


def stable_capacity(evaluate: Callable[[np.ndarray], pd.DataFrame], rounds: int = 3) -> float:
    """The largest total arrival rate (requests/s) that ``evaluate`` (a fluid model's) predicts to be stable.

    Stability falls once with the rate: powers of two bracket it, then each round
    evaluates 32 rates across the bracket at once (relative precision 32^-rounds).
    """
    rates = 2.0 ** np.arange(-12, 25)
    stable = evaluate(rates)["stable"].to_numpy()
    if not stable.any():
        return 0.0
    last = int(np.flatnonzero(stable)[-1])
    if last == len(rates) - 1:
        return math.inf
    low, high = rates[last], rates[last + 1]
    for _ in range(rounds):
        grid = np.linspace(low, high, 33)
        ok = evaluate(grid[1:-1])["stable"].to_numpy()
        index = int(np.flatnonzero(ok)[-1]) + 1 if ok.any() else 0
        low, high = grid[index], grid[index + 1]
    return float(low)
