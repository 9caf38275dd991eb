"""The roofline cost of one engine iteration, and how memory is split between weights and KV.

An iteration runs every operator of every layer once over the whole batch
(prefill chunks and decode tokens together, as in vLLM or SGLang). Each operator
takes ``max(FLOPs / effective peak, bytes / effective bandwidth)``: weights are
read once per iteration, each sequence's KV cache once per layer. Tensor
parallelism splits weights, heads and FLOPs over ``tp`` devices and adds two
all-reduces of the hidden state per layer; pipeline parallelism runs the layers
as ``pp`` stages in sequence with an activation hop between stages. Every computed
position writes its KV (an operator of its own, bytes over bandwidth, beside attention) and
every sampled row streams the vocabulary's logits (``sampling``). Fixed per-step and
per-layer overheads stand for the engine's CPU work and launches (:meth:`CostModel.host_time_s`).

A profile with measured kernel terms (``kernels:``, see :mod:`llmsim.catalog.kernel_terms`)
prices GEMMs by a smooth maximum of their memory and compute times plus a launch floor,
at the tokens per iteration (the one non-linear part, :meth:`CostModel._gemm_times`);
streaming kernels by floors plus bytes over their own bandwidths; all-reduces by the
measured latency and bus bandwidth of the group; decode attention with a fixed cost per
sequence; prefill attention at its backend's efficiency; and an overhead per sampling sequence.

The model knows nothing of SimPy: :meth:`CostModel.iteration` takes batch
feature vectors (see :mod:`llmsim.cost.features`) and works on one vector or a
whole array of them at once.
"""
from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
import pandas as pd

from llmsim.compiled import EntryPoint, kernel
from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.kernel_terms import AllReduce, CustomAllReduce, Fp8Dispatch, KernelTerms
from llmsim.catalog.models import ModelSpec
from llmsim.config.recent import Keyed, recent, recent_for
from llmsim.cost.features import F, FEATURES, TILE_FEATURES_FROM, batch_features
from llmsim.cost.kernels import (GEMM_OPERATORS, SHARPNESS_REFERENCE_TILES, TILE_COLUMNS, TILE_ROWS, GemmShape,
                                 add_norm_bytes_per_token, all_reduce_time_s, custom_all_reduce_time_s,
                                 dispatch_gemm_body_s, elementwise_layer_terms, gemm_scalar_body_s, layer_gemm_shapes,
                                 stream_time_s)
from llmsim.cost.work import ATTENTION_OPS, BYTE_KINDS, LAYER_OPS, MODEL_OPS, work_coefficients
from llmsim.catalog.placement import Placement


_ONE, _TOKENS, _EXPERTS, _LOGITS = F["one"], F["tokens"], F["experts_touched"], F["logit_tokens"]
NONLINEAR_MEMO_SIZE = 200_000     # remembered token counts per cost model (a few tens of MB at most)
SHARED_MEMOS = 16                 # GEMM term sets whose memos a process keeps (the most recently built)
_shared_memos: OrderedDict[bytes, tuple[dict, dict, list[np.ndarray], DispatchTables | None]] = OrderedDict()
FEW_ROWS = 32                     # up to this many rows, the non-linear part is looked up row by row
TABLE_TOKENS = 1 << 16            # the most tokens (and logit rows) the tables of rows_total reach
_NO_TABLE = np.zeros(0)
_NO_DISPATCH_TABLE = np.zeros((0, 2))
DISPATCH_BLOCK_ROWS = 4096        # the dispatch tables grow by whole blocks of rows (the same values however grown)
_T = TypeVar("_T")
# A decode-only step's terms (CostModel.decode_terms): its feature row, the non-linear seconds, and the seconds,
# FLOPs and bytes added after them (NaN: none).
DecodeTerms = tuple[np.ndarray, float, float, float, float]


DECODE_TIMES_KEPT = 4096          # CostModel.decode_time's remembered steps, per model


def shared_memo(memos: OrderedDict[bytes, _T], key: bytes, fresh: Callable[[], _T]) -> _T:
    """The memo ``memos`` holds under ``key`` (``fresh()`` the first time), for every cost model pricing alike:
    a search builds one per run, and its runs price the same token counts over and over. ``memos`` keeps the
    :data:`SHARED_MEMOS` most recently asked for."""
    return recent(memos, key, fresh, SHARED_MEMOS)


@kernel
def _add_tile_columns(y, stacked, m, padding, longest):
    """Add the prefill tile columns' part to the first ``m`` outputs ``y`` of a row's product: their two
    coefficients per output are stacked below the other columns' matrix (:class:`CostModel`). A row without
    prefill adds nothing."""
    if padding != 0.0 or longest != 0.0:
        for i in range(m):
            y[i] += stacked[m + i, 0] * padding + stacked[m + i, 1] * longest


@kernel
def _linear_step(stacked, n_ops, x, tokens, prefill_tokens, prefill_pairs, prefill_kv_read, decode_seqs,
                 decode_kv_read, experts, logits, prefill_padding, prefill_longest):
    """Fill the feature row ``x`` (``one`` already 1) and return the roofline part of its (time, FLOPs,
    bytes): the stacked matrix times the row (``np.dot`` is the BLAS product numpy's ``@`` computes;
    the prefill tile columns as :meth:`CostModel.iteration` adds them), then the operators' larger
    bounds summed in order, as :meth:`CostModel.iteration` sums them."""
    x[1], x[2], x[3], x[4] = tokens, prefill_tokens, prefill_pairs, prefill_kv_read
    x[5], x[6], x[7], x[8] = decode_seqs, decode_kv_read, experts, logits
    x[9], x[10] = prefill_padding, prefill_longest
    return _row_product(stacked, n_ops, x)


@kernel
def _row_product(stacked, n_ops, x):
    """The roofline part of the (time, FLOPs, bytes) of the feature row ``x``, as :func:`_linear_step` says."""
    m = 2 * n_ops + 3
    y = np.dot(stacked[:m], x[:TILE_FEATURES_FROM])
    _add_tile_columns(y, stacked, m, x[TILE_FEATURES_FROM], x[TILE_FEATURES_FROM + 1])
    time_s = 0.0
    for i in range(n_ops):
        compute_s, memory_s = y[i], y[n_ops + i]
        time_s += memory_s if memory_s > compute_s else compute_s
    return time_s + y[2 * n_ops], y[2 * n_ops + 1], y[2 * n_ops + 2]


@kernel
def _decode_price(stacked, n_ops, x, decode_kv_read, nonlinear_s, extra_s, extra_flops, extra_bytes):
    """The (time, FLOPs, bytes) :meth:`CostModel.step` gives a decode-only row whose other features ``x``
    already holds (a row of its own per batch size, :meth:`CostModel.decode_terms`): :func:`_linear_step`'s
    product with the KV read set, then the non-linear terms added to the time, then what a subclass adds to
    each (NaN: none), in :meth:`CostModel.step`'s order."""
    x[6] = decode_kv_read
    time_s, flops, moved = _row_product(stacked, n_ops, x)
    if nonlinear_s == nonlinear_s:
        time_s += nonlinear_s
    if extra_s == extra_s:
        return time_s + extra_s, flops + extra_flops, moved + extra_bytes
    return time_s, flops, moved


# The one specialization :meth:`CostModel.step` calls (an entry point: llmsim.compiled), every scalar a float
# (a Python int converts exactly).
_LINEAR_STEP_SIGNATURE = (numba.float64[:, ::1], numba.int64, numba.float64[::1], *[numba.float64] * 10)
# And :meth:`CostModel.decode_step`'s (fewer arguments to convert: the entry point's cost is mostly theirs).
_DECODE_PRICE_SIGNATURE = (numba.float64[:, ::1], numba.int64, numba.float64[::1], *[numba.float64] * 5)


@kernel
def _pairwise_sum(values, start, n):
    """numpy's pairwise summation of ``values[start:start + n]`` (``np.add.reduce`` of a contiguous
    run of up to 128 values, and its sums along a row), in the same order, so to the same bits."""
    if n < 8:
        total = 0.0
        for i in range(n):
            total += values[start + i]
        return total
    r0, r1, r2, r3 = values[start], values[start + 1], values[start + 2], values[start + 3]
    r4, r5, r6, r7 = values[start + 4], values[start + 5], values[start + 6], values[start + 7]
    i = 8
    while i < n - n % 8:
        r0 += values[start + i]
        r1 += values[start + i + 1]
        r2 += values[start + i + 2]
        r3 += values[start + i + 3]
        r4 += values[start + i + 4]
        r5 += values[start + i + 5]
        r6 += values[start + i + 6]
        r7 += values[start + i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        total += values[start + i]
        i += 1
    return total


@kernel
def _rows_total(stacked, n_ops, rows, layer_by_tokens, head_by_logits):
    """:meth:`CostModel.iteration` of a few ``rows`` summed, as its vectorised branch computes the roofline
    part (the same BLAS product, numpy's maxima and pairwise sums) and its row-by-row branch the
    non-linear terms, here read from tables by the integer tokens and logit rows of rows that run one
    iteration with one expert (empty tables: a cost model without them). Returns (time, FLOPs,
    bytes) summed as ``np.add.reduce`` sums them; the time is NaN when a row's terms are not in the
    tables."""
    m = 2 * n_ops + 3
    y = np.dot(np.ascontiguousarray(rows[:, :TILE_FEATURES_FROM]), stacked[:m].T)
    for r in range(len(rows)):
        _add_tile_columns(y[r], stacked, m, rows[r, TILE_FEATURES_FROM], rows[r, TILE_FEATURES_FROM + 1])
    bounds = np.empty(n_ops)
    times, flops, moved = np.empty(len(rows)), np.empty(len(rows)), np.empty(len(rows))
    for r in range(len(rows)):
        for i in range(n_ops):
            compute_s, memory_s = y[r, i], y[r, n_ops + i]
            bounds[i] = memory_s if memory_s > compute_s else compute_s
        times[r] = _pairwise_sum(bounds, 0, n_ops) + y[r, 2 * n_ops]
        flops[r], moved[r] = y[r, 2 * n_ops + 1], y[r, 2 * n_ops + 2]
        if len(layer_by_tokens):
            tokens, logits = rows[r, _TOKENS], rows[r, _LOGITS]
            if (rows[r, _ONE] != 1.0 or rows[r, _EXPERTS] != 1.0 or not 0.0 <= tokens < len(layer_by_tokens)
                    or not 0.0 <= logits < len(head_by_logits) or tokens != int(tokens) or logits != int(logits)):
                return np.nan, 0.0, 0.0
            layers_s, head_s = layer_by_tokens[int(tokens)], head_by_logits[int(logits)]
            if np.isnan(layers_s) or np.isnan(head_s):
                return np.nan, 0.0, 0.0
            times[r] += layers_s + head_s
    return _pairwise_sum(times, 0, len(rows)), _pairwise_sum(flops, 0, len(rows)), _pairwise_sum(moved, 0, len(rows))


@kernel
def _power(base, exponent):
    """``base ** exponent`` by the C library's ``pow``, which gives exactly 1 for a base of 1 (the larger of a smooth
    maximum's terms over itself) whatever the exponent: that case without the call."""
    return 1.0 if base == 1.0 else base ** exponent


@kernel
def _gemm_run_s(g, rows, iterations, runs, fixed_s, per_token_s, compute_s, n, floor_s, half_tiles, sharpness, growth,
                dispatched, dispatch_table, dispatch_floor_s):
    """The launch floors of ``iterations`` and the bodies of ``runs`` runs of GEMM ``g`` (by column) on ``rows`` rows
    each, as :meth:`CostModel._gemm_sum` prices them: the body by :func:`~llmsim.cost.kernels.gemm_scalar_body_s`'s
    operations in its order, the powers by the C library's ``pow`` as Python's floats take them (the same bits), or
    (``dispatched[g] >= 0``) interpolated in that row of ``dispatch_table`` (:class:`DispatchTables`, covering
    ``rows``)."""
    if dispatched[g] >= 0:
        low = int(math.floor(rows))
        below = dispatch_table[dispatched[g], low]
        body_s = below + (rows - low) * (dispatch_table[dispatched[g], low + 1] - below)
        return iterations * dispatch_floor_s + runs * body_s
    memory = fixed_s[g] + rows * per_token_s[g]
    compute = rows * compute_s[g]
    tiles = max(float(math.ceil(rows / TILE_ROWS)), 1.0) * float(math.ceil(n[g] / TILE_COLUMNS))
    occupancy = tiles / (tiles + half_tiles)
    p = 1.0 + (sharpness - 1.0) * (tiles / SHARPNESS_REFERENCE_TILES) ** growth
    compute = compute / occupancy
    larger = compute if compute > memory else memory
    safe = larger if larger > 0 else 1.0
    body_s = larger * (_power(memory / safe, p) + _power(compute / safe, p)) ** (1.0 / p)
    return iterations * floor_s + runs * body_s


@kernel
def _gemm_table(table, start, fixed_s, per_token_s, compute_s, repeats, scale, n, floor_s, half_tiles, sharpness,
                growth, dispatched, dispatch_table, dispatch_floor_s):
    """``table[t]`` for ``t`` from ``start`` on: :meth:`CostModel._gemm_sum` of the GEMM rows given by column
    (the layers' or the LM head's) for a row of one iteration with one expert and ``t`` tokens and logit
    rows, each GEMM by :func:`_gemm_run_s` (the same bits)."""
    for t in range(start, len(table)):
        total = 0.0
        for g in range(len(fixed_s)):
            total += repeats[g] * _gemm_run_s(g, t * scale[g] / 1.0, 1.0, 1.0, fixed_s, per_token_s, compute_s, n,
                                              floor_s, half_tiles, sharpness, growth, dispatched, dispatch_table,
                                              dispatch_floor_s)
        table[t] = total


@kernel
def _gemm_grid(x, one, count, tokens, fixed_s, per_token_s, compute_s, repeats, scale, n, floor_s, half_tiles,
               sharpness, growth, dispatched, dispatch_table, dispatch_floor_s):
    """The GEMMs of feature rows ``x`` (shape (rows, features)) as :meth:`CostModel._nonlinear_time` prices one row,
    each GEMM by :func:`_gemm_run_s`: (their times, shape (gemms, rows), 0 where a GEMM's count column is not
    positive; the layers' GEMMs (all but the last, the LM head) summed GEMM after GEMM, as :meth:`CostModel._gemm_sum`
    sums them, one per row). The same bits as the rows priced one at a time, on any machine: numpy's array powers
    (SIMD code on AVX-512) differ from the C library's ``pow`` in the last bit of a few percent of inputs. A GEMM
    whose count, tokens and iterations are the previous row's takes its time (the fluid model's grids repeat the
    decode load along their prefill axes: three rows in four of a speculative search's)."""
    gemms = len(fixed_s)
    times = np.zeros((gemms, len(x)))
    layers = np.zeros(len(x))
    for r in range(len(x)):
        total = 0.0
        for g in range(gemms):
            runs = x[r, count[g]]
            if runs > 0:
                if (r > 0 and runs == x[r - 1, count[g]] and x[r, tokens[g]] == x[r - 1, tokens[g]]
                        and x[r, one] == x[r - 1, one]):
                    times[g, r] = times[g, r - 1]
                else:
                    times[g, r] = repeats[g] * _gemm_run_s(g, x[r, tokens[g]] * scale[g] / runs, x[r, one], runs,
                                                           fixed_s, per_token_s, compute_s, n, floor_s, half_tiles,
                                                           sharpness, growth, dispatched, dispatch_table,
                                                           dispatch_floor_s)
                if g < gemms - 1:
                    total += times[g, r]
        layers[r] = total
    return times, layers


class DispatchTables:
    """The bodies of a cost model's dispatch-priced GEMMs (8-bit weights under an
    :class:`~llmsim.catalog.kernel_terms.Fp8Dispatch`) by whole rows ``M = 0, 1, 2, ...``, one table row per GEMM:
    :func:`~llmsim.cost.kernels.dispatch_gemm_body_s` once per row count, then its running maximum over ``M``. The
    form's time falls where the dispatch switches to a configuration of wider tiles (more rows run in fewer waves),
    and the fluid model's fixed point (:mod:`llmsim.analysis.fluid`) needs a step time that never falls as tokens
    grow. A fractional row count (a row standing for several iterations: the fluid model's mean step) is
    interpolated between its two whole neighbours: it is an average over kernels of whole rows, and interpolation
    keeps the time continuous in the tokens, which the fixed point needs
    as well (a ceiling would jump). Grown by whole blocks of :data:`DISPATCH_BLOCK_ROWS`, each computed alike
    however the table grew, so a price never depends on what was priced before."""

    def __init__(self, dispatch: Fp8Dispatch, shapes: list[tuple[float, float, float, float, float]]):
        self.dispatch = dispatch
        self.shapes = shapes                # (n, k, weight bytes, activation bytes, bandwidth) per GEMM
        self.values = np.zeros((len(shapes), 0))

    def cover(self, rows: float) -> np.ndarray:
        """The table, grown to hold ``rows`` and the whole row count above it."""
        have = self.values.shape[1]
        if math.floor(rows) + 2 > have:
            blocks = [self.values]
            last = self.values[:, -1] if have else np.full(len(self.shapes), -np.inf)
            for start in range(have, int(math.floor(rows)) + 2, DISPATCH_BLOCK_ROWS):
                m = np.arange(start, start + DISPATCH_BLOCK_ROWS, dtype=float)
                raw = np.array([dispatch_gemm_body_s(m, n, k, weight, activation, bandwidth, self.dispatch)
                                for n, k, weight, activation, bandwidth in self.shapes])
                block = np.maximum(np.maximum.accumulate(raw, axis=1), last[:, None])
                blocks.append(block)
                last = block[:, -1]
            self.values = np.ascontiguousarray(np.hstack(blocks))
        return self.values


def summed_iteration(cost, rows: np.ndarray) -> tuple[float, float, float]:
    """(time_s, FLOPs, bytes) of iterations ``rows`` together, priced by any cost with ``iteration(rows)``
    (a draft model's, Medusa heads', an n-gram lookup's) and summed by ``np.add.reduce``."""
    times, flops, moved = cost.iteration(rows)
    return float(np.add.reduce(times)), float(np.add.reduce(flops)), float(np.add.reduce(moved))


class CostModel:
    """Iteration time, FLOPs and bytes of a model on ``tp x pp`` devices of one profile."""

    # :func:`_linear_step` and :func:`_decode_price` through their entry points (see llmsim.compiled).
    _linear_step: EntryPoint[Callable[..., tuple[float, float, float]]] = EntryPoint(_linear_step,
                                                                                     _LINEAR_STEP_SIGNATURE)
    _decode_price: EntryPoint[Callable[..., tuple[float, float, float]]] = EntryPoint(_decode_price,
                                                                                      _DECODE_PRICE_SIGNATURE)

    def __init__(self, model: ModelSpec, hardware: HardwareProfile,
                 tensor_parallel: int = 1, pipeline_parallel: int = 1, placement: Placement | None = None,
                 routed_experts: bool = True):
        self.model, self.hardware = model, hardware
        self.routed_experts = routed_experts       # False: expert parallelism prices them (cost.experts)
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self.num_devices = tensor_parallel * pipeline_parallel
        # The buffer :meth:`step` builds an iteration's features in, for every engine this model prices
        # (they price one iteration at a time): one buffer stays in cache while 64 replicas take turns.
        self._x = np.zeros(len(FEATURES))
        self._x[_ONE] = 1.0
        self._decode_times: dict[tuple[int, int], float] = {}     # see decode_time
        self._experts_touched = model.expected_experts_touched if model.num_experts > 1 else None
        coeffs = work_coefficients(model, tensor_parallel, routed_experts)
        # Stack layer operators (run once per layer) and model operators (once). The work is that
        # of every layer; the time is paced by the slowest of pp stages, ceil(layers / pp) layers,
        # since a micro-batch comes round again only after it has served all pp of them.
        self.op_names = tuple(f"layer.{op}" for op in LAYER_OPS) + MODEL_OPS
        paced_layers = pipeline_parallel * -(-model.num_layers // pipeline_parallel)
        repeat = np.array([model.num_layers] * len(LAYER_OPS) + [1] * len(MODEL_OPS), dtype=float)[:, None]
        pace = np.array([paced_layers / model.num_layers] * len(LAYER_OPS) + [1] * len(MODEL_OPS))[:, None]
        self.placement = placement
        tiers = hardware.tiers
        weight_tier = placement.weight_tier if placement else tiers[0]
        kv_tier = placement.kv_tier if placement else tiers[0]
        # Seconds per byte of each kind, from the tier it lives in; attention kernels move more
        # than the KV bytes they need when they gather paged blocks.
        compute_efficiency, attention_efficiency, efficiency = hardware.efficiencies_for(model.weight_dtype)
        seconds_per_byte = {"weights": 1.0 / (weight_tier.bandwidth_bytes_per_s * efficiency),
                            "kv": hardware.kv_read_penalty / (kv_tier.bandwidth_bytes_per_s * efficiency),
                            "activations": 1.0 / (tiers[0].bandwidth_bytes_per_s * efficiency)}
        self.flops_matrix = np.vstack([coeffs.layer_flops, coeffs.model_flops]) * repeat
        self.bytes_matrix = sum(np.vstack([coeffs.layer_bytes[kind], coeffs.model_bytes[kind]])
                                for kind in BYTE_KINDS) * repeat
        memory_time = sum(np.vstack([coeffs.layer_bytes[kind], coeffs.model_bytes[kind]]) * seconds_per_byte[kind]
                          for kind in BYTE_KINDS) * repeat * pace
        gemm_peak = hardware.peak_for(model.weight_dtype) * compute_efficiency
        attention_peak = hardware.peak_for("bf16") * attention_efficiency
        self.seconds_per_flop = np.array(
            [1.0 / (attention_peak if op in ATTENTION_OPS else gemm_peak) for op in LAYER_OPS]
            + [1.0 / gemm_peak] * len(MODEL_OPS))
        self.fixed_vector = self._fixed_and_communication_vector()
        self._memory_time = memory_time
        self._compute_time = self.flops_matrix * self.seconds_per_flop[:, None] * pace
        self.prefill_tile_tokens = 0      # the prefill kernel's tile (features.prefill_sums; 0: exact pairs)
        self.prefill_query_tile_pairs = 0.0   # its cost per query tile of a head, in pairs (features.prefill_sums)
        # Decode attention over context c runs at attention_efficiency * c / (c + half): as if each
        # sequence attended to `half` more tokens (time only; the FLOPs stay those of the work).
        decode = LAYER_OPS.index("attention_decode")
        self._compute_time[decode, F["decode_seqs"]] += (self._compute_time[decode, F["decode_kv_read"]]
                                                         * hardware.attention_half_context)
        self._gemm_rows: list[tuple] = []
        self._tables = [_NO_TABLE, _NO_TABLE]       # rows_total's non-linear terms (none without kernel terms)
        self._all_reduce: AllReduce | None = None
        self._custom_all_reduce: CustomAllReduce | None = None
        self._dispatch: DispatchTables | None = None
        self.kernels: KernelTerms | None = None
        if hardware.kernels is not None:
            self._use_kernel_terms(hardware.kernels, paced_layers,
                                   weight_tier.bandwidth_bytes_per_s / tiers[0].bandwidth_bytes_per_s)
        # One matrix turns a feature vector into everything an iteration needs: per-operator
        # compute time, per-operator memory time, fixed time, total FLOPs, total bytes.
        self._n_ops = len(self.op_names)
        stacked = np.vstack([self._compute_time,
                             self._memory_time,
                             self.fixed_vector,
                             self.flops_matrix.sum(axis=0) * self.tp,
                             self.bytes_matrix.sum(axis=0) * self.tp])
        # The prefill tile columns apart from the product (their two coefficients per output, stacked below
        # the other columns' matrix): the others sum in BLAS's order for their count of columns, and a row
        # without prefill adds nothing, so a profile without tile terms prices every iteration to the same
        # bits as before those columns existed.
        tiles = np.zeros((len(stacked), TILE_FEATURES_FROM))
        tiles[:, :len(FEATURES) - TILE_FEATURES_FROM] = stacked[:, TILE_FEATURES_FROM:]
        self._stacked = np.ascontiguousarray(np.vstack([stacked[:, :TILE_FEATURES_FROM], tiles]))
        self._linear = self._stacked[:len(stacked)]
        self._tile_padding, self._tile_longest = self._stacked[len(stacked):, 0], self._stacked[len(stacked):, 1]
        # The outputs a tile column reads (prefill attention's): on the others the columns add 0 x their (finite,
        # non-negative) features, exactly nothing, so a batch of rows adds them to these alone.
        # (Each as (output, its padding coefficient, its longest keys' coefficient).)
        self._tiled_outputs = [(int(at), float(self._tile_padding[at]), float(self._tile_longest[at]))
                               for at in np.flatnonzero((self._tile_padding != 0.0) | (self._tile_longest != 0.0))]
        # The entry point takes the arrays as its signature types them, unchecked.
        assert self._stacked.dtype == np.float64 and self._stacked.flags.c_contiguous
        # step() counts the experts touched only where a coefficient reads them: with the routed experts priced
        # elsewhere (expert parallelism) their column is zeros, and 0 x the count adds exactly nothing.
        self._step_touched = self._experts_touched if self._linear[:, _EXPERTS].any() else None
        # decode_terms's, by the batch's sequences (read by a decode set that calls decode_terms on a miss)
        self.decode_terms_by_seqs: dict[int, DecodeTerms] = {}

    def _use_kernel_terms(self, terms: KernelTerms, paced_layers: int, weight_bandwidth_share: float) -> None:
        """Replace the roofline's rows by the measured kernel ``terms`` (the hardware's; see the module docstring).

        GEMMs leave the linear rows for :meth:`_gemm_times`; weights streamed from an outer
        tier are read at the fitted bandwidth scaled by that tier's share of the primary one."""
        model, tp = self.model, self.tp
        kernels = self.kernels = terms.for_dtype(model.weight_dtype).for_kv_dtype(model.kv_dtype)
        op = {name: i for i, name in enumerate(self.op_names)}
        for name in ("layer.qkv", "layer.out_proj", "layer.mlp", "lm_head"):
            self._compute_time[op[name]] = self._memory_time[op[name]] = 0.0
        fixed_s, per_token_s = elementwise_layer_terms(model, tp, kernels)
        elementwise = op["layer.elementwise"]
        self._compute_time[elementwise] = self._memory_time[elementwise] = 0.0
        self._memory_time[elementwise, F["one"]] = fixed_s * paced_layers
        self._memory_time[elementwise, F["tokens"]] = per_token_s * paced_layers
        # Each decoding sequence's fixed work (block-table walk, split and merge of its softmax) overlaps
        # with streaming the KV cache: it adds to the compute side of decode attention's max.
        decode = op["layer.attention_decode"]
        if kernels.decode_attention_efficiency:
            # Measured decode kernels: their FLOPs at the fitted share of the 16-bit peak replace the roofline's.
            self._compute_time[decode] = (self.flops_matrix[decode] * paced_layers / model.num_layers
                                          / (self.hardware.peak_for("bf16") * kernels.decode_attention_efficiency))
        kv_heads = max(model.num_kv_heads / tp, 1.0)
        self._compute_time[decode, F["decode_seqs"]] += (kernels.decode_attention_per_sequence_s
                                                         + kernels.decode_attention_per_kv_head_s * kv_heads
                                                         ) * paced_layers
        if kernels.decode_attention_bandwidth_bytes_per_s:
            self._memory_time[decode] = (self.bytes_matrix[decode] * paced_layers / model.num_layers
                                         / kernels.decode_attention_bandwidth_bytes_per_s)
        # One attention kernel per layer serves the whole batch (prefill and decode together, as vLLM's
        # varlen kernels do): its launch floor adds to both sides of the decode row, once per iteration.
        self._compute_time[decode, F["one"]] += kernels.attention_floor_s * paced_layers
        self._memory_time[decode, F["one"]] += kernels.attention_floor_s * paced_layers
        # Prefill attention at e * L / (L + half) of the 16-bit peak: as if each query saw `half` more keys, and
        # `kv_half` more per KV head on the GPU over query heads (each query tile loads its KV head's keys and values).
        backend = kernels.prefill_attention
        prefill = op["layer.attention_prefill"]
        per_flop = paced_layers / model.num_layers / (self.hardware.peak_for("bf16") * backend.efficiency)
        extra_keys = backend.half_length_tokens + backend.kv_half_length_tokens * kv_heads / (model.num_heads / tp)
        self._compute_time[prefill] = self.flops_matrix[prefill] * per_flop
        per_pair_s = self.flops_matrix[prefill, F["prefill_pairs"]] * per_flop
        self._compute_time[prefill, F["prefill_tokens"]] += per_pair_s * extra_keys
        if backend.tile_tokens:
            self.prefill_tile_tokens = backend.tile_tokens
            self.prefill_query_tile_pairs = backend.query_tile_pairs
            self._compute_time[prefill, F["prefill_tile_padding"]] = per_pair_s
        if backend.critical_path_blocks:
            # The critical path, an operator row of its own: max(L - overlap T, 0) on top of prefill attention's
            # T, with L one query tile of one head against the step's longest keys at 1/blocks of the rate.
            critical = np.zeros((1, len(FEATURES)))
            critical[0, F["prefill_longest_keys"]] = (per_pair_s / (model.num_heads / tp) * backend.tile_tokens
                                                      * backend.critical_path_blocks)
            critical[0] -= backend.critical_path_overlap * self._compute_time[prefill]
            self.op_names += ("layer.attention_prefill_critical_path",)
            self._compute_time = np.vstack([self._compute_time, critical])
            self._memory_time = np.vstack([self._memory_time, np.zeros_like(critical)])
            self.flops_matrix = np.vstack([self.flops_matrix, np.zeros_like(critical)])
            self.bytes_matrix = np.vstack([self.bytes_matrix, np.zeros_like(critical)])
        bandwidth = kernels.gemm_bandwidth_bytes_per_s * weight_bandwidth_share
        flops = kernels.gemm_rate(model.weight_dtype)
        activation_bytes = model.activation_bytes_per_element
        experts = model.experts_per_token if model.num_experts > 1 else 1
        # Each shape runs in its share of the (paced) layers; routed ones once per expert touched.
        gemms = [(shape, paced_layers * shape.layer_share, F["experts_touched"] if shape.routed else F["one"],
                  experts if shape.routed else 1, F["tokens"])
                 for shape in layer_gemm_shapes(model, tp) if self.routed_experts or not shape.routed]
        gemms.append((GemmShape("lm_head", model.vocab_size / tp, model.hidden_size), 1, F["one"], 1,
                      F["logit_tokens"]))     # last: _nonlinear_time keys it apart
        # (name, fixed memory s, memory s per token, compute s per token, repeats, count column,
        #  tokens per count, tokens column, output columns n, row of the dispatch tables or -1) for each GEMM.
        # Weights in their own dtype: routed experts (gpt-oss's fp4), the LM head (16-bit in quantized checkpoints).
        weight_bytes = dict.fromkeys(GEMM_OPERATORS, model.weight_bytes_per_param)
        weight_bytes.update(mlp_up=model.expert_bytes_per_param, mlp_down=model.expert_bytes_per_param,
                            lm_head=model.embedding_bytes_per_param)
        # vLLM's CUTLASS dispatch prices the GEMMs whose weights are 8-bit (the dtype's own kernels), by tables; not the
        # routed experts, which run vLLM's fused MoE kernel (every expert's tiles in one launch, not one GEMM each).
        dispatch = kernels.gemm_dispatch
        dispatched = [dispatch is not None and weight_bytes[shape.name] == 1.0
                      and not (shape.routed and model.num_experts > 1) for shape, *_ in gemms]
        dispatch_rows = np.cumsum(dispatched) - 1
        self._gemm_rows = [(shape.name, shape.n * shape.k * weight_bytes[shape.name] / bandwidth,
                            (shape.n + shape.k) * activation_bytes / bandwidth, 2.0 * shape.n * shape.k / flops,
                            float(repeats), count, float(scale), tokens, float(shape.n),
                            int(dispatch_rows[i]) if dispatched[i] else -1)
                           for i, (shape, repeats, count, scale, tokens) in enumerate(gemms)]
        self._gemm_columns = tuple(np.array([row[i] for row in self._gemm_rows]) for i in range(1, 9))
        # The count and tokens columns as indices, for :meth:`_gemm_grid`.
        self._gemm_features = (self._gemm_columns[4].astype(np.intp), self._gemm_columns[6].astype(np.intp))
        self._dispatched = np.array([row[9] for row in self._gemm_rows], dtype=np.int64)
        dispatch_shapes = [(shape.n, shape.k, weight_bytes[shape.name], activation_bytes,
                            dispatch.bandwidth_bytes_per_s * weight_bandwidth_share)
                           for (shape, *_), priced in zip(gemms, dispatched) if priced and dispatch is not None]
        if kernels.gemm_quantize_bandwidth_bytes_per_s:
            # 8-bit weights: a kernel of its own first quantizes the 16-bit input (read 2 bytes, write 1 per
            # element), linear in the tokens; it adds to both bounds of its operator's row as a floor does. None
            # where the kernel before the GEMM writes 8 bits: the engine's (fusion.quantized_inputs), or the add-norm
            # inside the all-reduce for the GEMMs it feeds (:meth:`_all_reduce_time` prices the pass where the
            # all-reduce falls back to NCCL).
            fusion = kernels.stream_fusion
            norm_fused = fusion.norm_in_all_reduce(model.hidden_size, tp)
            for shape, repeats, _, scale, tokens in gemms:
                if (weight_bytes[shape.name] < 2 and shape.name not in fusion.quantized_inputs
                        and not (norm_fused and shape.k == model.hidden_size)):
                    at = op[GEMM_OPERATORS[shape.name]]
                    seconds = repeats * scale * shape.k * 3.0 / kernels.gemm_quantize_bandwidth_bytes_per_s
                    self._compute_time[at, tokens] += seconds
                    self._memory_time[at, tokens] += seconds
        self._all_reduce = kernels.all_reduce_for(tp) if tp > 1 else None
        self._custom_all_reduce = kernels.custom_all_reduce_for(tp) if tp > 1 else None
        # Every cost model with the same GEMM and all-reduce terms shares the memos.
        key = pickle.dumps((self._gemm_rows, kernels, self._all_reduce, self._custom_all_reduce, tp, model.hidden_size,
                            model.num_layers, model.activation_bytes_per_element, dispatch_shapes))
        self._layer_memo, self._head_memo, self._tables, self._dispatch = shared_memo(
            _shared_memos, key, lambda: ({}, {}, [np.full(1, np.nan), np.full(1, np.nan)],
                                         DispatchTables(dispatch, dispatch_shapes) if dispatch_shapes and dispatch
                                         else None))

    def step(self, prefill_tokens, prefill_pairs, prefill_kv_read, prefill_logits, decode_seqs,
             decode_kv_read, prefill_padding=0.0, prefill_longest=0.0) -> tuple[float, float, float]:
        """(time_s, FLOPs, bytes) of one iteration: prefill positions (of which ``prefill_logits`` sample)
        and ``decode_seqs`` sequences decoding one token each, reading ``decode_kv_read`` KV tokens;
        the prefill kernel's tile padding and longest keys (:func:`~llmsim.cost.features.prefill_sums`).
        :meth:`iteration` of that feature row, to the last bit, at a fraction of its cost (the
        simulator's hot path). The non-linear terms are remembered by the tokens alone (the experts
        touched follow from them) and the LM head's by the logit rows, in the memos
        :meth:`_nonlinear_time` keys by tuples."""
        tokens = prefill_tokens + decode_seqs
        touched = self._step_touched
        logits = decode_seqs + prefill_logits
        time_s, flops, moved = self._linear_step(self._stacked, self._n_ops, self._x, tokens, prefill_tokens,
                                            prefill_pairs, prefill_kv_read, decode_seqs, decode_kv_read,
                                            touched(tokens) if touched is not None else 1.0, logits,
                                            prefill_padding, prefill_longest)
        if self._gemm_rows:
            time_s += self._step_nonlinear_s(tokens, logits)
        return time_s, flops, moved

    def step_terms(self, tokens: float, logits: int) -> tuple[float, float, float, float, float] | None:
        """What :meth:`step` adds to the product of a row of ``tokens`` tokens (prefill plus decode) and ``logits``
        sampling rows, where it is remembered: (the experts touched, the non-linear terms, what a subclass adds to
        the time, FLOPs and bytes after them), NaN for a term not added; None where the non-linear terms are not
        remembered yet (only :meth:`step` works them out, from the row its product fills)."""
        touched = self._step_touched(tokens) if self._step_touched is not None else 1.0
        if not self._gemm_rows:
            return touched, math.nan, math.nan, math.nan, math.nan
        layers_s = self._layer_memo.get(tokens)
        head_s = self._head_memo.get(logits)
        if layers_s is None or head_s is None:
            return None
        return touched, layers_s + head_s, math.nan, math.nan, math.nan

    def _step_nonlinear_s(self, tokens: float, logits: int) -> float:
        """The non-linear terms (GEMMs, all-reduces) of the row :meth:`step` last filled in the feature buffer,
        of ``tokens`` tokens and ``logits`` sampling rows: the layers' remembered by the tokens, the LM head's
        by the rows."""
        layers_s = self._layer_memo.get(tokens)
        head_s = self._head_memo.get(logits)
        if layers_s is None or head_s is None:
            values = self._x.tolist()
            if layers_s is None:
                layers_s = self._layers_time(values)
                if len(self._layer_memo) < NONLINEAR_MEMO_SIZE:
                    self._layer_memo[tokens] = layers_s
            if head_s is None:
                head_s = self._head_memo[logits] = self._gemm_sum(values, self._gemm_rows[-1:])
        return layers_s + head_s

    def decode_step(self, seqs: int, kv_read: float) -> tuple[float, float, float]:
        """:meth:`step` of a decode-only iteration (``seqs`` sequences decoding one token each, reading
        ``kv_read`` KV tokens; no prompt), to the last bit, at less cost: a batch keeps its size for many
        steps and only its KV read grows, so what depends on the size alone (:meth:`decode_terms`) is
        remembered by it and a step is one compiled call."""
        row, nonlinear_s, extra_s, extra_flops, extra_bytes = self.decode_terms(seqs, kv_read)
        return self._decode_price(self._stacked, self._n_ops, row, kv_read, nonlinear_s, extra_s, extra_flops,
                                  extra_bytes)

    def decode_terms(self, seqs: int, kv_read: float) -> DecodeTerms:
        """What prices a decode-only iteration of ``seqs`` sequences beside its KV read (``kv_read``: any,
        the first time), remembered by ``seqs``: its feature row, the non-linear terms, and what a subclass
        adds to the time, FLOPs and bytes after them (NaN: nothing), as :func:`_decode_price` takes them
        after the stacked matrix, the operator count and the KV read (:meth:`compiled_terms` gives those)."""
        terms = self.decode_terms_by_seqs.get(seqs)
        if terms is None:
            terms = self.decode_terms_by_seqs[seqs] = self._decode_terms(seqs, kv_read)
        return terms

    def _decode_terms(self, seqs: int, kv_read: float) -> DecodeTerms:
        """:meth:`decode_terms` worked out as :meth:`step` works them out (``tokens`` is the float
        ``0.0 + seqs`` there); nothing after the non-linear terms here."""
        tokens = 0.0 + seqs
        touched = self._step_touched(tokens) if self._step_touched is not None else 1.0
        self._linear_step(self._stacked, self._n_ops, self._x, tokens, 0.0, 0.0, 0.0, seqs, kv_read, touched, seqs,
                          0.0, 0.0)
        # (The non-linear terms read the feature row the product filled.)
        nonlinear_s = self._step_nonlinear_s(tokens, seqs) if self._gemm_rows else math.nan
        return self._x.copy(), nonlinear_s, math.nan, math.nan, math.nan

    @property
    def dense(self) -> bool:
        """Whether every token runs the same weights (no experts to count)."""
        return self._experts_touched is None

    def compiled_terms(self) -> tuple[np.ndarray, int, np.ndarray, list[np.ndarray]]:
        """What compiled callers price a step by as :meth:`step` and :meth:`rows_total` do: the stacked
        matrix (the prefill tile columns' coefficients below it), the operator count, the feature row
        :meth:`step` fills and the list of the non-linear terms' tables (layers by tokens, LM head by logit
        rows; its items are replaced as the tables grow, so read them at each call)."""
        return self._stacked, self._n_ops, self._x, self._tables

    def tabulate_last_step(self) -> bool:
        """Put the non-linear terms of the row last priced in the feature row of :meth:`compiled_terms`
        into the tables; False when they cannot hold it."""
        return self._tabulate(self._x[None])

    def rows_total(self, rows: np.ndarray) -> tuple[float, float, float]:
        """(time_s, FLOPs, bytes) of a few iterations ``rows`` (shape (n, 9)) together: :meth:`iteration`
        of the rows summed by ``np.add.reduce``, to the last bit (a speculative step's draft rows), in
        one compiled call once the rows' token counts are in its tables."""
        if len(rows) <= FEW_ROWS:
            for _ in range(2):
                total = _rows_total(self._stacked, self._n_ops, rows, *self._tables)
                if total[0] == total[0]:
                    return total
                if not self._tabulate(rows):
                    break
        return summed_iteration(self, rows)

    def _tabulate(self, rows: np.ndarray) -> bool:
        """Put the non-linear terms of ``rows`` into the tables of :func:`_rows_total` (shared as the
        memos are); False when a row is not one they hold (several iterations or experts, fractional or
        too many tokens)."""
        values = rows.tolist()             # a few rows: Python floats cost less here than numpy's calls
        largest = 0.0
        for row in values:
            tokens, logits = row[_TOKENS], row[_LOGITS]
            if (row[_ONE] != 1.0 or row[_EXPERTS] != 1.0 or tokens % 1.0 != 0.0 or logits % 1.0 != 0.0
                    or tokens < 0 or logits < 0):
                return False
            largest = max(largest, tokens, logits)
        if largest >= TABLE_TOKENS:
            return False
        size = max(len(self._tables[0]), 1 << int(largest).bit_length())
        for i, table in enumerate(self._tables):
            if len(table) < size:
                self._tables[i] = grown = np.concatenate([table, np.full(size - len(table), np.nan)])
                # Every entry at once: a run reaches thousands of token counts, each a miss in the step's
                # compiled pricing otherwise.
                self._fill_table(grown, self._gemm_columns, i == 1)
        layers, heads = self._tables
        for row in values:
            tokens, logits = int(row[_TOKENS]), int(row[_LOGITS])
            if layers[tokens] != layers[tokens] or heads[logits] != heads[logits]:
                layers[tokens] = self._layers_time(row)
                heads[logits] = self._gemm_sum(row, self._gemm_rows[-1:])
        return True

    def _fill_table(self, table: np.ndarray, columns: tuple[np.ndarray, ...], head: bool) -> None:
        """Fill ``table`` (every entry) with the layers' time by tokens (:meth:`_layers_time`: GEMMs and any
        all-reduces), or (``head``) the LM head's by logit rows, of an iteration with one expert: :func:`_gemm_table`
        of :meth:`_gemm_sum`'s rows."""
        kernels = self.kernels
        assert kernels is not None          # tables exist only with kernel terms (_use_kernel_terms)
        fixed_s, per_token_s, compute_s, repeats, _, scale, _, n, dispatched = (
            column[-1:] if head else column[:-1] for column in (*columns, self._dispatched))
        dispatch_table, dispatch_floor_s = _NO_DISPATCH_TABLE, 0.0
        if self._dispatch is not None and np.any(dispatched >= 0):
            dispatch_table = self._dispatch.cover((len(table) - 1) * float(np.max(scale[dispatched >= 0])))
            dispatch_floor_s = self._dispatch.dispatch.floor_s
        _gemm_table(table, 0, fixed_s, per_token_s, compute_s, repeats, scale, n, kernels.gemm_floor_s,
                    kernels.gemm_occupancy_half_tiles, kernels.gemm_sharpness, kernels.gemm_sharpness_growth,
                    dispatched, dispatch_table, dispatch_floor_s)
        if self._all_reduce is not None and not head:
            # The layers' all-reduces, added to their GEMMs as :meth:`_layers_time` adds them: vectorised over
            # rows of one iteration and ``t`` tokens, element for element the arithmetic of one row's call.
            rows = np.zeros((len(table), len(FEATURES)))
            rows[:, _ONE] = 1.0
            rows[:, _TOKENS] = np.arange(len(table))
            table += self._all_reduce_time(rows)

    def _layers_time(self, values: list[float]) -> float:
        """The layers' GEMMs and all-reduces of one iteration's feature ``values``."""
        layers_s = self._gemm_sum(values, self._gemm_rows[:-1])
        if self._all_reduce is not None:
            layers_s += float(self._all_reduce_time(np.array(values)))
        return layers_s

    def _nonlinear_time(self, values: list[float]) -> float:
        """GEMMs and all-reduces of one iteration (the terms not linear in the features; ``values``: its
        feature vector as a list), remembered by the features each part depends on: the layers' by the
        tokens per iteration (and experts), the LM head's by the sampling rows. The simulator's batches
        repeat those counts over and over, so after a warm-up the terms cost two dict lookups."""
        layers_key = (values[_ONE], values[_TOKENS], values[_EXPERTS])
        layers_s = self._layer_memo.get(layers_key)
        if layers_s is None:
            layers_s = self._layers_time(values)
            if len(self._layer_memo) < NONLINEAR_MEMO_SIZE:
                self._layer_memo[layers_key] = layers_s
        head_key = (values[_ONE], values[_LOGITS])
        head_s = self._head_memo.get(head_key)
        if head_s is None:
            head_s = self._head_memo[head_key] = self._gemm_sum(values, self._gemm_rows[-1:])
        return layers_s + head_s

    def _gemm_sum(self, values: list[float], gemm_rows) -> float:
        """The summed time of ``gemm_rows`` (see _gemm_times) for one iteration's feature ``values``."""
        kernels = self.kernels
        assert kernels is not None          # GEMM rows exist only with kernel terms (_use_kernel_terms)
        floor_s = kernels.gemm_floor_s
        iterations = values[_ONE]
        total = 0.0
        for _, fixed_s, per_token_s, compute_s, repeats, count, scale, tokens, n, dispatched in gemm_rows:
            runs = values[count]
            if runs > 0:
                rows = values[tokens] * scale / runs
                if dispatched >= 0:
                    assert self._dispatch is not None        # dispatched rows exist only with the tables
                    table = self._dispatch.cover(rows)[dispatched]
                    low = math.floor(rows)
                    below = float(table[low])
                    body_s = below + (rows - low) * (float(table[low + 1]) - below)
                    total += repeats * (iterations * self._dispatch.dispatch.floor_s + runs * body_s)
                    continue
                body_s = gemm_scalar_body_s(fixed_s + rows * per_token_s, rows * compute_s, rows, n, kernels)
                total += repeats * (iterations * floor_s + runs * body_s)
        return total

    def _all_reduce_time(self, x):
        """Two measured all-reduces of the hidden state per layer and iteration (kernel terms, TP > 1 only):
        of ``tokens / iterations`` rows each, the message NCCL's protocol choice prices non-linearly."""
        if x.ndim == 1:
            iterations, tokens = x[F["one"]], x[F["tokens"]]
        else:
            iterations, tokens = x[..., F["one"]], x[..., F["tokens"]]
        rows = np.divide(tokens, iterations, out=np.zeros(np.shape(tokens)), where=iterations > 0)
        message = rows * self.model.hidden_size * self.model.activation_bytes_per_element
        once = all_reduce_time_s(message, self.tp, self._all_reduce)
        custom = self._custom_all_reduce
        fusion = self.kernels.stream_fusion
        if custom is not None:
            # The engine's own kernel below its switch-over size, NCCL above (as vLLM and SGLang choose), and NCCL
            # for a message past the engine's all-reduce workspace whatever the sizes' times (TensorRT-LLM's
            # ``ifFallbackToNCCL``).
            own = min(custom.switch_over_bytes, fusion.all_reduce_workspace_bytes(self.tp))
            once = np.where(message <= own, custom_all_reduce_time_s(message, self.tp, custom), once)
        if fusion.norm_in_all_reduce(self.model.hidden_size, self.tp):
            # The add-norm the engine runs inside its all-reduce runs after it where the message outgrows the
            # engine's workspace (the all-reduce falls back to NCCL), and with 8-bit weights a quantization pass of
            # its output (read 2 bytes, write 1 per element) for the GEMMs it feeds: the engine's measured quantizer
            # where the profile has it, else at the GEMMs' input quantization rate.
            quantizer = self.kernels.quantize
            after = stream_time_s(rows, add_norm_bytes_per_token(self.model), self.kernels.elementwise["norm"])
            if self.model.weight_bytes_per_param < 2:
                row_bytes = self.model.hidden_size * 3.0
                if quantizer is not None:
                    after = after + stream_time_s(rows, row_bytes, quantizer)
                elif self.kernels.gemm_quantize_bandwidth_bytes_per_s:
                    after = after + rows * row_bytes / self.kernels.gemm_quantize_bandwidth_bytes_per_s
            once = once + np.where(message > fusion.all_reduce_workspace_bytes(self.tp), after, 0.0)
        return 2 * self.model.num_layers * iterations * once

    def _gemm_times(self, x) -> np.ndarray | float:
        """Time of every GEMM of iterations ``x``, summed (one row) or per GEMM (rows: shape (..., gemms)).

        The GEMMs of a row that stands for ``count`` iterations (or MoE experts) run ``count``
        times on ``tokens / count`` rows each; as in the roofline, every iteration reads the weights
        (continuous in the tokens, which the fluid model's fixed point needs). The launch floor is paid
        once per GEMM and iteration: the experts of an MoE layer run as one grouped GEMM (vLLM's fused
        MoE kernel launches once per projection), not one kernel per expert."""
        if x.ndim == 1:
            return self._gemm_sum(x.tolist(), self._gemm_rows)
        times, _ = self._gemm_grid(x)
        return np.ascontiguousarray(times.T).reshape(*x.shape[:-1], len(times))

    def _gemm_grid(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`_gemm_grid` of rows ``x`` (any shape (..., features), taken in order): the time of each GEMM (shape
        (gemms, rows)) and the layers' GEMMs summed, by row."""
        kernels = self.kernels
        assert kernels is not None          # GEMM rows exist only with kernel terms (_use_kernel_terms)
        fixed_s, per_token_s, compute_s, repeats, _, scale, _, n = self._gemm_columns
        count, tokens = self._gemm_features
        features = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=float)
        dispatch_table, dispatch_floor_s = _NO_DISPATCH_TABLE, 0.0
        if self._dispatch is not None:
            # The tables grown to the most rows a dispatch-priced GEMM runs (the kernel's arithmetic for them).
            at = self._dispatched >= 0
            runs = features[:, count[at]]
            rows = np.divide(features[:, tokens[at]] * scale[at], runs, out=np.zeros(runs.shape), where=runs > 0)
            dispatch_table = self._dispatch.cover(float(np.max(rows, initial=0.0)))
            dispatch_floor_s = self._dispatch.dispatch.floor_s
        return _gemm_grid(features, _ONE, count, tokens, fixed_s, per_token_s, compute_s, repeats, scale, n,
                          kernels.gemm_floor_s, kernels.gemm_occupancy_half_tiles, kernels.gemm_sharpness,
                          kernels.gemm_sharpness_growth, self._dispatched, dispatch_table, dispatch_floor_s)

    def _nonlinear_times(self, x: np.ndarray) -> np.ndarray:
        """:meth:`_nonlinear_time` of rows ``x`` (shape (..., features)), one per row in the shape of ``x`` less its
        last axis: the same operations in the same order (the layers' GEMMs, their all-reduces, the LM head), so the
        same bits as each row priced alone."""
        times, layers_s = self._gemm_grid(x)
        if self._all_reduce is not None:
            layers_s = layers_s + self._all_reduce_time(x).reshape(-1)
        return (layers_s + times[-1]).reshape(x.shape[:-1])

    def _fixed_and_communication_vector(self) -> np.ndarray:
        """Time that adds to the roofline: overheads, all-reduces and pipeline hops, per feature."""
        hw, model = self.hardware, self.model
        vector = np.zeros(len(FEATURES))
        vector[F["one"]] = hw.per_step_overhead_s + model.num_layers * (
            hw.per_layer_overhead_s + model.hidden_size * hw.per_layer_per_hidden_element_s)
        hidden_bytes = model.hidden_size * model.activation_bytes_per_element
        link = hw.interconnect_bandwidth_bytes_per_s * hw.interconnect_efficiency
        if hw.kernels is not None:
            vector[F["logit_tokens"]] += hw.kernels.step_overhead_per_sequence_s
        if self.tp > 1 and hw.kernels is None:
            # Ring all-reduce moves 2 (tp-1)/tp of the message over each link; two per layer.
            per_token = 2 * (self.tp - 1) / self.tp * hidden_bytes / link
            vector[F["one"]] += 2 * model.num_layers * hw.interconnect_latency_s
            vector[F["tokens"]] += 2 * model.num_layers * per_token
        if self.pp > 1:
            vector[F["one"]] += (self.pp - 1) * hw.interconnect_latency_s
            vector[F["tokens"]] += (self.pp - 1) * hidden_bytes / link
        return vector

    def host_time_s(self, sampled: int) -> float:
        """The part of an iteration's time that is the engine's CPU work (scheduling, input preparation,
        output processing: the profile's per-step overhead and, with kernel terms, its per-sampled-sequence
        one) for ``sampled`` sequences sampled. With asynchronous scheduling it overlaps the GPU's previous
        step (:class:`~llmsim.sim.engine.Engine`)."""
        kernels = self.hardware.kernels
        return self.hardware.per_step_overhead_s + (kernels.step_overhead_per_sequence_s * sampled if kernels else 0.0)

    # -- the cost of a batch ------------------------------------------------------------------
    def features(self, prefill_new=(), prefill_context=(), decode_context=(), prefill_logits=None):
        """Feature vector of a batch; ``prefill_logits`` defaults to every chunk ending its prompt."""
        if prefill_logits is None:
            prefill_logits = len(prefill_new)
        return batch_features(prefill_new, prefill_context, decode_context, prefill_logits, self.model,
                              self.prefill_tile_tokens, self.prefill_query_tile_pairs)

    def iteration(self, x):
        """(time_s, FLOPs, bytes) of iterations with feature vectors ``x`` (shape (9,) or (n, 9)).

        FLOPs and bytes are totals over all devices of the replica.
        """
        n = self._n_ops
        if type(x) is not np.ndarray:
            x = np.asarray(x, dtype=float)
        if x.ndim == 1:
            # The simulator's hot path: plain floats beat numpy reductions on 8 numbers.
            y = self._linear @ x[:TILE_FEATURES_FROM]
            if x[TILE_FEATURES_FROM] != 0.0 or x[TILE_FEATURES_FROM + 1] != 0.0:
                y = y + (self._tile_padding * x[TILE_FEATURES_FROM] + self._tile_longest * x[TILE_FEATURES_FROM + 1])
            y = y.tolist()
            time_s = sum(map(max, y[:n], y[n:2 * n])) + y[2 * n]
            if self._gemm_rows:
                time_s += self._nonlinear_time(x.tolist())
            return time_s, y[2 * n + 1], y[2 * n + 2]
        y = x[..., :TILE_FEATURES_FROM] @ self._linear.T
        # A row without prefill adds 0 x its zero tile features: nothing, as the one-row path leaves it.
        padding, longest = x[..., TILE_FEATURES_FROM], x[..., TILE_FEATURES_FROM + 1]
        for at, per_padding, per_longest in self._tiled_outputs:
            y[..., at] += per_padding * padding + per_longest * longest
        time_s = np.maximum(y[..., :n], y[..., n:2 * n]).sum(axis=-1) + y[..., 2 * n]
        if self._gemm_rows:
            if x.ndim == 2 and len(x) <= FEW_ROWS:
                # The speculative engine's per-step rows: remembered row by row beats numpy on a few rows.
                time_s = time_s + np.array([self._nonlinear_time(row) for row in x.tolist()])
            else:
                time_s = time_s + self._nonlinear_times(x)
        return time_s, y[..., 2 * n + 1], y[..., 2 * n + 2]

    def attention_time_s(self, x) -> np.ndarray:
        """Time of the attention operators alone (prefill and decode, every layer of one shard) for iterations
        ``x`` (shape (n, 9)): what an attention kernel benchmark measures, to hold the model against one."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        rows = [i for i, name in enumerate(self.op_names) if name.startswith("layer.attention_")]
        return sum(np.maximum(x @ self._compute_time[row], x @ self._memory_time[row]) for row in rows)

    def step_time(self, x) -> float:
        return float(self.iteration(x)[0])

    def breakdown(self, x) -> pd.DataFrame:
        """Per-operator FLOPs, bytes, time and bound for one batch (all layers, one shard)."""
        x = np.asarray(x, dtype=float)
        flops, moved = self.flops_matrix @ x, self.bytes_matrix @ x
        compute_s, memory_s = self._compute_time @ x, self._memory_time @ x
        time_s = np.maximum(compute_s, memory_s)
        if self._gemm_rows:
            # Measured-kernel GEMMs: the two bounds each alone, and the fitted time of their smooth maximum.
            fixed_s, per_token_s, compute_per_token_s, repeats, count, scale, tokens, _ = self._gemm_columns
            runs = x[count.astype(int)]
            rows_per_run = np.divide(x[tokens.astype(int)] * scale, runs, out=np.zeros(runs.shape), where=runs > 0)
            ran = repeats * runs
            gemm_times = self._gemm_times(x[None, :])
            assert isinstance(gemm_times, np.ndarray)      # one iteration's row in: its row of GEMM times out
            times = gemm_times[0]
            for i, row in enumerate(self._gemm_rows):
                at = self.op_names.index(GEMM_OPERATORS[row[0]])
                memory_s[at] += ran[i] * (fixed_s[i] + rows_per_run[i] * per_token_s[i])
                compute_s[at] += ran[i] * rows_per_run[i] * compute_per_token_s[i]
                time_s[at] += times[i]
        rows = pd.DataFrame({"operator": self.op_names, "flops": flops, "bytes": moved,
                             "compute_s": compute_s, "memory_s": memory_s,
                             "time_s": time_s,
                             "bound": np.where(time_s == 0, "none",
                                               np.where(compute_s >= memory_s, "compute", "memory"))})
        fixed = pd.DataFrame({"operator": ["overhead+communication"], "flops": [0.0], "bytes": [0.0],
                              "compute_s": [0.0], "memory_s": [0.0],
                              "time_s": [float(self.fixed_vector @ x) + (
                                  float(self._all_reduce_time(x)) if self._gemm_rows and self._all_reduce else 0.0)],
                              "bound": ["fixed"]})
        return pd.concat([rows, fixed], ignore_index=True)

    # -- conveniences ---------------------------------------------------------------------------
    def prefill_time(self, tokens: int, context: int = 0) -> float:
        return self.step_time(self.features([tokens], [context], []))

    def decode_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences at ``context`` tokens each; remembered, as the run-size guard
        and the default horizon ask the same few before every run (a model is resolved once per deployment)."""
        key = (batch, context)
        time_s = self._decode_times.get(key)
        if time_s is None:
            if len(self._decode_times) >= DECODE_TIMES_KEPT:
                self._decode_times.clear()
            time_s = self._decode_times[key] = self.step_time(self.features([], [], [context] * batch))
        return time_s

    @property
    def peak_flops_per_s(self) -> float:
        """Replica peak for the model's GEMM dtype, for MFU."""
        return self.hardware.peak_for(self.model.weight_dtype) * self.num_devices

    @property
    def peak_bandwidth_bytes_per_s(self) -> float:
        return self.hardware.memory_bandwidth_bytes_per_s * self.num_devices


COST_MODELS_KEPT = 32             # cost models shared_cost_model keeps (the most recently asked for)
_cost_models: Keyed[CostModel] = OrderedDict()


def shared_cost_model(model: ModelSpec, hardware: HardwareProfile, tensor_parallel: int = 1,
                      pipeline_parallel: int = 1, placement: Placement | None = None) -> CostModel:
    """``CostModel(model, hardware, tensor_parallel, pipeline_parallel, placement)``, kept from an earlier call on
    the same model and chip objects with the same parallelism and an equal placement (the constructor reads
    nothing else). A search resolves every setting it scores and every run it simulates anew, and settings that
    differ in the engine's knobs or the speculation alone price iterations with the same model: building one
    took about 1 ms (408 in one speculative 70B search). What a cost model remembers (its memos and tables,
    :func:`shared_memo`) is a function of its keys alone, so one shared between runs prices each iteration as a
    fresh one would."""
    return recent_for(_cost_models, (model, hardware), (tensor_parallel, pipeline_parallel, placement),
                      lambda: CostModel(model, hardware, tensor_parallel, pipeline_parallel, placement),
                      COST_MODELS_KEPT)
