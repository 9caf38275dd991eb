"""The batch of one engine iteration, reduced to the sums the cost of every operator is affine in.

An iteration's cost depends on its batch only through a few sums (:data:`FEATURES`):
how many tokens it computes, how many of them are prompt (prefill) positions, how
many query-key pairs prefill attention scores, how much KV prefill and decode
attention read, how many sequences decode, how many distinct MoE experts the tokens
route to, and how many positions produce logits. ``one`` carries the fixed cost
(weights read once per iteration). The roofline (:mod:`llmsim.cost.roofline`) is a
set of linear maps of this vector.

This module is the only code that builds feature vectors or indexes them by name;
the simulator and the fluid model describe their batches in its terms (prefill
chunks, decode sequences, speculative verify chunks, the draft's sequential steps).
Scalar functions stay scalar, for the simulator's per-iteration path; the ``*_rows``
functions work on arrays and give one row per batch.

Attention: a chunk of ``new`` positions after ``seen`` visible cached tokens scores
``new * seen + new (new + 1) / 2`` query-key pairs (every query sees the cache and,
causally, the chunk up to itself) and reads ``seen + new`` tokens of KV. A sliding
window of ``W`` tokens caps what a query sees at ``W``, its chunk's own positions included
(:func:`chunk_pairs`; a speculative verify chunk, ``k + 1`` positions, keeps its small
triangle whole); when only a share ``f`` of the
layers slide (Gemma-2: every other layer, Gemma-3: five in six), ``seen`` is the mean
over the layers, ``c - f max(c - W, 0)``: the features are per average layer, so a
context ``c > W`` costs ``(1 - f) c + f W`` per layer, ``n_global c + n_local W`` over
the model. Every attention sum is linear in ``seen``, so the mean over the layers of
each layer's sum is the sum at the mean ``seen``.

Prefill attention kernels compute whole tiles of ``t x t`` query-key pairs (``t`` the profile's
``tile_tokens``; 0: exact pairs): ``prefill_tile_padding`` sums the pairs the causal tiles on each
chunk's diagonal add and the profile's ``query_tile_pairs`` per query tile, a query tile's fixed cost
(:func:`causal_tile_padding`), and ``prefill_longest_keys`` is the most keys one
query of the step sees (the last query of its longest chunk: one thread block's work, the step's
critical path when few blocks run). Both are time only: the FLOPs stay those of the pairs.
"""
from __future__ import annotations

from typing import Protocol
from collections.abc import Iterable

import numba
import numpy as np

from llmsim.compiled import kernel
from llmsim.catalog.models import ModelSpec

FEATURES = ("one", "tokens", "prefill_tokens", "prefill_pairs", "prefill_kv_read",
            "decode_seqs", "decode_kv_read", "experts_touched", "logit_tokens", "prefill_tile_padding",
            "prefill_longest_keys")
F = {name: i for i, name in enumerate(FEATURES)}
# The same columns as constants, for compiled code (numba reads module globals when it compiles).
(_ONE, _TOKENS, _PREFILL_TOKENS, _PREFILL_PAIRS, _PREFILL_KV_READ, _DECODE_SEQS, _DECODE_KV_READ, _EXPERTS, _LOGITS,
 _PREFILL_PADDING, _PREFILL_LONGEST) = (F[name] for name in FEATURES)
# The prefill kernel's tile terms come last: the cost model prices them in a product of their own (CostModel),
# so that the other columns' product sums as it did before they existed, to the same bits.
TILE_FEATURES_FROM = _PREFILL_PADDING
# The columns a draft's rows fill, for compiled code outside this module (llmsim.sim.speculative_kernels).
DRAFT_ROW_COLUMNS = (_TOKENS, _PREFILL_TOKENS, _PREFILL_PAIRS, _DECODE_SEQS, _DECODE_KV_READ, _LOGITS)


# -- attention arithmetic ---------------------------------------------------------------------

def visible(context, window: int | None, local_share: float = 1.0):
    """The cached tokens a query attends to, averaged over the layers: its context, capped by the
    sliding window on the ``local_share`` of the layers that use it (scalar or array)."""
    if not window:
        return context
    scalar = isinstance(context, (int, float))
    capped = min(context, window) if scalar else np.minimum(context, window)
    if local_share == 1.0:
        return capped
    return context - local_share * (context - capped)


def attention_pairs(new, seen, chunks=1):
    """Query-key pairs of ``chunks`` chunks of ``new`` positions whose visible contexts sum to ``seen``.

    One chunk (``chunks = 1``) after ``seen`` cached tokens: ``new * seen + new (new + 1) / 2``.
    The same sum counts the KV a sequence reads decoding ``new`` tokens one after another
    after ``seen`` cached ones. Works on scalars and arrays alike.
    """
    return new * seen + new * (new + 1) / 2 * chunks


def causal_tile_padding(new, cached, tile: int, query_tile_pairs: float = 0.0):
    """Query-key pairs a chunk of ``new`` positions after ``cached`` cached tokens computes beyond its causal
    pairs when its kernel works in ``t x t`` tiles (``t = tile``): query tiles start at the chunk's first
    position, query tile ``i`` (of ``T = ceil(new / t)``) reads key tiles up to its last query's position,
    ``ceil((cached + min(t (i + 1), new)) / t)`` of them, every tile whole. Summed over the query tiles,
    ``t^2 ((T - 1) ceil(cached / t) + T (T - 1) / 2 + ceil((cached + new) / t))`` pairs, less the causal ones,
    plus ``query_tile_pairs`` per query tile: a query tile's fixed cost (its thread block's start, its output's
    normalization and write) in pairs' time (scalar or array; 0 for ``new = 0``)."""
    query_tiles = -(-new // tile)
    tiles = ((query_tiles - 1) * -(-cached // tile) + query_tiles * (query_tiles - 1) // 2
             + -(-(cached + new) // tile))
    return (tile * tile * tiles - attention_pairs(new, cached) + query_tile_pairs * query_tiles) * (new > 0)


def chunk_pairs(new, cached, window: int | None, local_share: float = 1.0):
    """Query-key pairs of a chunk of ``new`` positions after ``cached`` cached tokens, averaged over
    the layers: query ``i`` (from 1) sees ``cached + i`` keys on a global layer and at most ``window``
    on a local one, ``sum_{c=cached+1}^{cached+new} min(c, window)`` (scalar or array)."""
    full = attention_pairs(new, cached)
    if not window:
        return full
    local = windowed_context_sum(cached + 1, cached + new, window)
    return local if local_share == 1.0 else full - local_share * (full - local)


class Prefilling(Protocol):
    """A sequence computing its prompt: ``prefilled`` positions are cached, ``prefill_target`` is the
    prompt's length (the simulator's :class:`~llmsim.sim.request.Request` is one)."""
    prefilled: int
    prefill_target: int


def prefill_sums(chunks: Iterable[tuple[Prefilling, int]], window: int | None, local_share: float = 1.0,
                 tile: int = 0, query_tile_pairs: float = 0.0) -> tuple[float, float, float, int, float, float]:
    """Prefill chunks ``(sequence, new)``: (tokens, attention pairs, KV read, prompts completed, tile padding,
    longest keys), as :func:`chunk_sums` works them out from the chunks' rows."""
    rows = np.array([(sequence.prefilled, new, sequence.prefill_target) for sequence, new in chunks],
                    dtype=np.int64).reshape(-1)
    return chunk_sums(rows, len(rows) // 3, window or 0, float(local_share), int(tile), float(query_tile_pairs))


@kernel
def chunk_sums(rows, count, window, local_share, tile, query_tile_pairs):
    """Prefill chunks, ``count`` rows of (cached positions, new positions, prompt length) in ``rows`` (flat, row
    ``i`` from ``3 * i``): (tokens, attention pairs, KV read, prompts completed, tile padding, longest keys).

    ``new`` positions of the sequence's prompt are computed after its ``cached`` ones (chunked prefill); a chunk
    that reaches the prompt's end samples a token (a logit row). The window (0: none) caps the cache a chunk sees
    on the ``local_share`` of the layers (:func:`visible`). ``tile``: the prefill kernel's tile
    (:func:`causal_tile_padding`; 0: none, no padding), whose padding is that of the chunk's causal diagonal (a
    window's far edge is not counted), with ``query_tile_pairs`` more per query tile. Compiled: the engine sums
    an iteration's chunks with it (the step with prompt chunks inside its one-call step), and the sums are those
    of the scalar arithmetic below, float for float.
    """
    tokens = pairs = kv_read = padding = longest = 0.0
    completed = 0
    square = tile * tile
    for i in range(count):
        cached, new, target = rows[3 * i], rows[3 * i + 1], rows[3 * i + 2]
        tokens += new
        end = cached + new
        full = new * cached + new * (new + 1) / 2
        if tile:                # causal_tile_padding in scalar arithmetic
            query_tiles = -(-new // tile)
            padding += square * ((query_tiles - 1) * -(-cached // tile) + query_tiles * (query_tiles - 1) // 2
                                 - (-end // tile)) - full + query_tile_pairs * query_tiles
        if not window or end <= window:            # every query sees its whole context
            pairs += full
            kv_read += end
            completed += end == target
            if end > longest:
                longest = end
            continue
        # chunk_pairs in scalar arithmetic: the queries below the window see their whole context, the others the
        # window, on the local layers.
        below = window - cached - 1 if cached + 1 < window else 0
        local = below * (2 * cached + below + 1) / 2 + (new - below) * window
        pairs += local if local_share == 1.0 else full - local_share * (full - local)
        seen = cached if cached < window else cached - local_share * (cached - window)
        kv_read += seen + new
        completed += end == target
        if seen + new > longest:
            longest = seen + new
    return tokens, pairs, kv_read, completed, padding, longest


# :func:`chunk_sums`' one specialization an engine calls (an entry point: llmsim.compiled).
CHUNK_SUMS_SIGNATURE = (numba.int64[::1], numba.int64, numba.int64, numba.float64, numba.int64, numba.float64)


def windowed_context_sum(first, last, window: int | None, local_share: float = 1.0):
    """``sum_{c=first}^{last} visible(c)`` elementwise (0 when last < first): the KV one sequence's
    decode steps read, from context ``first`` to ``last`` (``min(c, window)`` when every layer slides)."""
    n = np.maximum(last - first + 1, 0)
    full = n * (first + last) / 2
    if not window:
        return full
    below = np.clip(window - first, 0, n)                # terms below the window
    capped = below * (2 * first + below - 1) / 2 + (n - below) * window
    return capped if local_share == 1.0 else full - local_share * (full - capped)


# -- many rows, vectorised -----------------------------------------------------------------------

def batch_rows(prefill_tokens=0.0, prefill_pairs=0.0, prefill_kv_read=0.0, prefill_logits=0.0,
               decode_seqs=0.0, decode_kv_read=0.0, model: ModelSpec | None = None,
               iterations=1.0, prefill_tile_padding=0.0, prefill_longest_keys=0.0) -> np.ndarray:
    """Feature rows (shape ``broadcast shape + (len(FEATURES),)``) of batches given by arrays of sums.

    ``iterations`` is how many iterations the sums are spread over (the fluid model's
    per-request totals; 1 for one iteration each, 0 for a bare addend to be summed with
    another row). MoE expert counts come from ``model`` at the tokens per iteration;
    without a model every row touches one "expert" per iteration (the dense case).
    """
    # Assignment broadcasts each sum into its column (cheaper than broadcasting them all first:
    # the simulator's speculative steps call this every iteration on tiny arrays).
    shape = np.broadcast_shapes(*(np.shape(v) for v in (
        prefill_tokens, prefill_pairs, prefill_kv_read, prefill_logits, decode_seqs, decode_kv_read, iterations,
        prefill_tile_padding, prefill_longest_keys)))
    x = np.zeros(shape + (len(FEATURES),))
    x[..., F["tokens"]] = np.add(prefill_tokens, decode_seqs, dtype=float)
    x[..., F["prefill_tokens"]] = prefill_tokens
    x[..., F["prefill_pairs"]] = prefill_pairs
    x[..., F["prefill_kv_read"]] = prefill_kv_read
    x[..., F["decode_seqs"]] = decode_seqs
    x[..., F["decode_kv_read"]] = decode_kv_read
    x[..., F["logit_tokens"]] = np.add(decode_seqs, prefill_logits, dtype=float)
    x[..., F["prefill_tile_padding"]] = prefill_tile_padding
    x[..., F["prefill_longest_keys"]] = prefill_longest_keys
    return set_iterations(x, iterations, model)


def set_iterations(x: np.ndarray, iterations, model: ModelSpec | None = None) -> np.ndarray:
    """Rows ``x`` spread over ``iterations`` iterations: the fixed term, and the MoE experts per
    iteration at the tokens per iteration (in place; returns ``x``)."""
    x[..., F["one"]] = iterations
    if model is None or model.num_experts == 1:
        x[..., F["experts_touched"]] = iterations
    else:
        x[..., F["experts_touched"]] = iterations * model.expected_experts_touched(x[..., F["tokens"]] / iterations)
    return x


def sequential_decode_rows(drafts: np.ndarray, context: np.ndarray, steps: int) -> np.ndarray:
    """Rows of ``steps`` sequential decode steps where step ``j`` runs the sequences with ``drafts > j``.

    A draft model proposing ``k`` tokens runs ``k`` steps; the sequence's step ``j`` reads
    ``context + j + 1`` KV tokens. ``context`` broadcasts against ``drafts`` (one
    sequence per row). Experts touched are counted as one per step (dense drafts).
    """
    j = np.arange(steps)
    running = drafts[:, None] > j
    count = running.sum(axis=0)
    return batch_rows(decode_seqs=count, decode_kv_read=((context.reshape(-1, 1) + j + 1) * running).sum(axis=0))


@kernel
def seen_by_layers(context, window, local_share):
    """:func:`visible` for one integer context, compiled (``window`` 0: no window)."""
    if window == 0 or context < window:
        return context
    return context - local_share * (context - window)


@kernel
def expanded_verify(verify_tokens, verify_pairs, decode_seqs, decode_kv):
    """A step's verify chunks as vLLM V0's batch expansion scores them (vllm/spec_decode/batch_expansion.py):
    each chunk of ``k + 1`` positions after ``seen`` cached tokens becomes ``k + 1`` one-token decode
    sequences with contexts ``seen + 1 .. seen + k + 1``, each reading its whole KV cache, so the chunk's
    query-key pairs become decode KV read. Returns the sums with no verify chunk left:
    ``(0, 0, 0, decode_seqs + verify_tokens, decode_kv + verify_pairs)``."""
    return 0.0, 0.0, 0.0, decode_seqs + verify_tokens, decode_kv + verify_pairs


@kernel
def speculative_step_sums(n, k, context, window, draft_fed, draft_rows, prompt_tokens, prompt_pairs, prompt_kv_read,
                          prompt_chunks, local_share=1.0, prompt_padding=0.0, prompt_longest=0.0):
    """The sums of one speculative decode step of sequences ``[0, n)``, compiled (it runs every step).

    Sequence ``i`` sees ``seen = visible(context[i])`` cached tokens (``window`` 0: no
    window; ``local_share`` of the layers slide). With ``k[i] > 0`` the target verifies a chunk of
    ``k[i] + 1`` positions after
    them, every one giving logits; with ``k[i] = 0`` it decodes one token. The draft's rows
    go into ``draft_rows`` (none when it has no rows: an n-gram speculator): ``max k``
    sequential decode steps as in :func:`sequential_decode_rows`, the first of which also
    prefills, for each speculating sequence, the ``draft_fed[i] - 1`` tokens it has not
    processed beyond the one every step feeds, and, when ``prompt_chunks``, the iteration's
    prompt chunks (``prompt_*`` sums, their tile padding and longest keys among them: the draft prefills what
    the target prefills). Verify and catch-up chunks, a few positions each, carry no tile terms.

    Returns ``(verify_tokens, verify_pairs, verify_kv_read, spec_seqs, draft_tokens,
    decode_kv_read, draft_steps)``: ``decode_kv_read`` is the plain sequences' KV read,
    ``draft_steps`` the rows of ``draft_rows`` filled. Unless only some layers slide, every
    sum is a sum of integers, exact in float64 whatever the order, so they equal the
    vectorised builders' values (to rounding when they do). The draft's rows take the
    target's visible context (a draft's own window is not modelled).
    """
    tokens = pairs = kv_read = decode_kv = 0.0
    spec_seqs = drafted = steps = 0
    for i in range(n):
        seen = seen_by_layers(context[i], window, local_share)
        new = k[i] + 1
        if k[i] > 0:
            tokens += new
            pairs += new * seen + new * (new + 1) // 2
            kv_read += seen + new
            spec_seqs += 1
            drafted += k[i]
            steps = max(steps, k[i])
        else:
            decode_kv += seen_by_layers(context[i] + 1, window, local_share)
    if len(draft_rows) == 0 or (steps == 0 and not prompt_chunks):
        return float(tokens), float(pairs), float(kv_read), spec_seqs, drafted, float(decode_kv), 0
    steps = max(steps, 1)
    draft_rows[:steps] = 0.0
    behind_tokens = behind_pairs = behind_kv = 0
    for i in range(n):
        if k[i] == 0:
            continue
        seen = seen_by_layers(context[i], window, local_share)
        for j in range(k[i]):
            draft_rows[j, _DECODE_SEQS] += 1.0
            draft_rows[j, _DECODE_KV_READ] += seen + j + 1
        behind = draft_fed[i] - 1
        if behind > 0:
            behind_tokens += behind
            behind_pairs += behind * seen
            behind_kv += seen + behind
    for j in range(steps):
        row = draft_rows[j]
        row[_ONE] = row[_EXPERTS] = 1.0                  # dense draft: one "expert" per step
        row[_TOKENS] = row[_LOGITS] = row[_DECODE_SEQS]
    if not prompt_chunks:
        prompt_tokens = prompt_pairs = prompt_kv_read = prompt_padding = prompt_longest = 0.0
    first = draft_rows[0]
    first[_PREFILL_PADDING] = prompt_padding
    first[_PREFILL_LONGEST] = prompt_longest
    first[_TOKENS] += behind_tokens + prompt_tokens
    first[_PREFILL_TOKENS] += behind_tokens + prompt_tokens
    first[_PREFILL_PAIRS] += behind_pairs + prompt_pairs
    first[_PREFILL_KV_READ] += behind_kv + prompt_kv_read
    return float(tokens), float(pairs), float(kv_read), spec_seqs, drafted, float(decode_kv), steps


def tokens_of(x: np.ndarray):
    """Tokens an iteration (or rows of them) computes."""
    return x[..., F["tokens"]]


def decode_seqs_of(x: np.ndarray):
    """Sequences an iteration (or rows of them) decodes: a view, so assigning to it sets them."""
    return x[..., F["decode_seqs"]]


def decode_kv_read_of(x: np.ndarray):
    """Context tokens the decoding sequences of an iteration (or rows of them) read."""
    return x[..., F["decode_kv_read"]]


# -- from sequence lengths ---------------------------------------------------------------------------

def batch_features(prefill_new, prefill_context, decode_context, prefill_logits: int,
                   model: ModelSpec, tile: int = 0, query_tile_pairs: float = 0.0) -> np.ndarray:
    """The feature vector of one iteration's batch, from its sequences' lengths.

    ``prefill_new[i]`` tokens of a prompt are computed after ``prefill_context[i]``
    cached ones (chunked prefill); each decode sequence adds one token after
    ``decode_context[j]`` cached ones; ``prefill_logits`` chunks end their prompt
    and so sample a token. A sliding window caps the context each query sees; ``tile``: the prefill
    kernel's tile and its pairs per query tile (:func:`prefill_sums`).
    """
    new = np.asarray(prefill_new, dtype=float)
    context = np.asarray(prefill_context, dtype=float)
    window, share = model.sliding_window, model.local_attention_share
    seen = visible(context, window, share)
    dec = visible(np.asarray(decode_context, dtype=float) + 1.0, window, share)  # the new token attends to itself
    pairs = chunk_pairs(new, context, window, share)
    padding = float(np.sum(causal_tile_padding(new, context, tile, query_tile_pairs))) if tile else 0.0
    return batch_rows(new.sum(), float(np.sum(pairs)), float(np.sum(seen + new)),
                      prefill_logits, len(dec), float(dec.sum()), model, prefill_tile_padding=padding,
                      prefill_longest_keys=float(np.max(seen + new, initial=0.0)))
