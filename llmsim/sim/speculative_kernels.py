"""Compiled phases of a speculative decode step over the packed decode columns (numba).

A step touches every decoding sequence a few times: choose and cap its draft length and
reserve KV for it (:func:`reserve_blocks`), then apply the outcome (:func:`advance_rows`).
The batch is a few dozen rows, so in numpy each phase would be a dozen or more array calls,
each with a fixed overhead larger than its work; compiled, each phase is one call. The feature sums a step is
priced from are built by :func:`llmsim.cost.features.speculative_step_sums`, the acceptance draws by
:mod:`llmsim.speculation.kernels`, and so is the per-request adaptive k rule, which :func:`advance_rows` applies.

Every kernel works on rows ``[0, n)`` of the packed columns (``llmsim.sim.speculative_decode.
DecodeSlots``, laid out here) and does the same integer and IEEE float operations as numpy would, so
runs do not depend on whether it is compiled. Compiled code is cached next to this file.
"""
from __future__ import annotations

import numba
import numpy as np

from llmsim.compiled import kernel
from llmsim.cost.features import (DRAFT_ROW_COLUMNS, chunk_sums, expanded_verify, seen_by_layers,
                                  speculative_step_sums)
from llmsim.cost.roofline import FEW_ROWS, _linear_step, _rows_total
from llmsim.sim.iterations import LOG_COLUMNS, write_row
from llmsim.speculation.kernels import accepted_prefixes, observe_windows

# The packed columns (``DecodeSlots``): rows of one int64 and one float64 2-D array, so a
# kernel takes two arrays, not fifteen (each argument costs a type check per call).
INT_COLUMNS = ("context", "generated", "remaining", "blocks", "request_id", "k_policy", "k", "accepted", "lag",
               "window_proposed", "window_accepted", "window_rounds", "backoff", "proposed_total", "accepted_total")
FLOAT_COLUMNS = ("alpha", "last_token_s", "max_gap_s", "seen_accepted", "seen_rejected")
_CONTEXT, _GENERATED, _REMAINING, _BLOCKS, _K, _ACCEPTED, _LAG, _PROPOSED_TOTAL, _ACCEPTED_TOTAL = (
    INT_COLUMNS.index(name) for name in ("context", "generated", "remaining", "blocks", "k", "accepted", "lag",
                                         "proposed_total", "accepted_total"))
_LAST_TOKEN_S, _MAX_GAP_S = FLOAT_COLUMNS.index("last_token_s"), FLOAT_COLUMNS.index("max_gap_s")
_REQUEST_ID, _K_POLICY = INT_COLUMNS.index("request_id"), INT_COLUMNS.index("k_policy")
_ALPHA = FLOAT_COLUMNS.index("alpha")
_WINDOW_PROPOSED, _WINDOW_ACCEPTED, _WINDOW_ROUNDS, _BACKOFF = (
    INT_COLUMNS.index(name) for name in ("window_proposed", "window_accepted", "window_rounds", "backoff"))
# Feature columns of the draft's rows, as constants for compiled code.
_ROW_TOKENS, _ROW_PREFILL_TOKENS, _ROW_PREFILL_PAIRS, _ROW_DECODE_SEQS, _ROW_DECODE_KV_READ, _ROW_LOGITS = (
    DRAFT_ROW_COLUMNS)


# The speculative columns of an iteration's log row (the others :func:`llmsim.sim.iterations.write_row` writes).
_LOG_SPEC_SEQS, _LOG_DRAFT_TOKENS, _LOG_ACCEPTED_TOKENS, _LOG_DRAFT_S = (
    LOG_COLUMNS.index(name) for name in ("spec_seqs", "draft_tokens", "accepted_tokens", "draft_s"))


# The signatures a step's kernels are called with through their entry points (llmsim.compiled: unchecked, so
# ``llmsim.sim.speculative_decode`` passes exactly these types): the packed columns (C-contiguous int64, float64
# and bool rows), Python ints, floats and bools, and ``windows`` in ``llmsim.speculation.policies.Windows``' layout.
_INTS, _FLOATS, _ROWS = numba.int64[::1], numba.float64[::1], numba.float64[:, ::1]
RESERVE_BLOCKS_SIGNATURE = (numba.int64, _INTS, numba.boolean[::1], numba.int64[:, ::1], *[numba.int64] * 5)
RESERVE_BLOCKS_PLAIN_SIGNATURE = (numba.int64, numba.types.none, *RESERVE_BLOCKS_SIGNATURE[2:])   # ``chosen`` None
ADVANCE_ROWS_SIGNATURE = (numba.int64, numba.float64, numba.int64[:, ::1], _ROWS, numba.boolean[::1], _INTS,
                          numba.int64, _ROWS, numba.int64,
                          numba.types.Tuple((numba.int64, numba.int64, numba.float64, numba.float64, numba.int64,
                                             numba.boolean)))
OPEN_ROW_SIGNATURE = (numba.int64[:, ::1], _ROWS, *[numba.int64] * 7, *[numba.float64] * 3)
CLOSE_ROW_SIGNATURE = (numba.int64[:, ::1], _ROWS, numba.int64, numba.int64)
PRICE_STEP_SIGNATURE = (numba.int64, _INTS, _INTS, numba.int64, _INTS, _ROWS, *[numba.float64] * 3, numba.boolean,
                        numba.int64, *[numba.float64] * 3, numba.int64, numba.boolean, numba.boolean, _ROWS,
                        numba.int64, _FLOATS, _FLOATS, _FLOATS, _ROWS, numba.int64, _FLOATS, _FLOATS)
# :func:`log_step`'s: the log's chunk and its row's counts, the packed columns, price_step's arguments but the
# prompt's and the columns, the draw's key and decay, the hand-off, then the prompt chunks' rows, their count and
# the tile terms as chunk_sums takes them.
LOG_STEP_SIGNATURE = (numba.float64[::1], numba.int64, numba.float64, *[numba.int64] * 3, numba.int64,
                      numba.int64[:, ::1], _ROWS, numba.int64, _ROWS, numba.float64, numba.int64,
                      numba.boolean, numba.boolean, _ROWS, numba.int64, _FLOATS, _FLOATS, _FLOATS, _ROWS,
                      numba.int64, _FLOATS, _FLOATS, numba.uint64, numba.float64, numba.boolean, numba.float64,
                      _INTS, numba.int64, numba.int64, numba.float64)


@kernel
def open_row(ints, floats, i, context, generated, remaining, blocks, request_id, k_policy, alpha, last_token_s,
             max_gap_s):
    """Row ``i`` for a sequence that starts decoding: every column 0 but these, and a lag of 1 (the
    token just sampled is new to the draft). One call, where numpy would take two column writes and
    a dozen element writes."""
    ints[:, i] = 0
    floats[:, i] = 0.0
    ints[_CONTEXT, i], ints[_GENERATED, i] = context, generated
    ints[_REMAINING, i], ints[_BLOCKS, i] = remaining, blocks
    ints[_REQUEST_ID, i], ints[_K_POLICY, i], ints[_LAG, i] = request_id, k_policy, 1
    floats[_ALPHA, i], floats[_LAST_TOKEN_S, i], floats[_MAX_GAP_S, i] = alpha, last_token_s, max_gap_s


@kernel
def close_row(ints, floats, i, last):
    """Take row ``i`` out of rows ``[0, last]``, the last row moving into it (the rows stay packed); returns
    what its request keeps: (generated, blocks, last token time, longest gap, draft tokens proposed and
    accepted)."""
    kept = (ints[_GENERATED, i], ints[_BLOCKS, i], floats[_LAST_TOKEN_S, i], floats[_MAX_GAP_S, i],
            ints[_PROPOSED_TOTAL, i], ints[_ACCEPTED_TOTAL, i])
    if i != last:
        ints[:, i] = ints[:, last]
        floats[:, i] = floats[:, last]
    return kept


@kernel
def eligible_rows(n, ints, min_sequence_tokens, eligible):
    """Mark the sequences long enough to speculate (prompt + output beyond ``min_sequence_tokens``
    once this step's token is counted); returns how many there are."""
    context = ints[_CONTEXT]
    count = 0
    for i in range(n):
        eligible[i] = context[i] + 1 > min_sequence_tokens
        count += eligible[i]
    return count


@kernel(inline="always")
def tree_nodes(depth, branching):
    """Nodes below the root of a full ``branching``-ary tree ``depth`` levels deep, ``sum_{j=1..depth} b^j``
    (``depth`` for a chain): the draft tokens one verify pass checks beyond the root."""
    if branching == 1:
        return depth
    nodes = 0
    width = 1
    for _ in range(depth):
        width *= branching
        nodes += width
    return nodes


@kernel
def reserve_blocks(n, chosen, eligible, ints, budget, block_size, free_blocks, branching=1, min_sequence_tokens=-1):
    """This step's draft lengths (column ``k``) and, if the free blocks hold them, their KV.

    ``chosen`` is the policy's k for every row, or None when nobody speculates. An eligible
    sequence drafts ``min(chosen, remaining - 1)`` levels (never past the last token asked
    for). It verifies the root and every draft node, :func:`tree_nodes` ``(k, branching)`` of
    them (``k`` for a chain), and each gets a KV slot while it is verified: when the nodes of
    all sequences exceed the iteration's token ``budget`` a common cap on k is lowered until
    they fit, and each sequence then needs the blocks that hold ``context + nodes + 1``
    tokens (the rejected nodes' are given back by :func:`advance_rows`, the accepted path's
    kept). With ``min_sequence_tokens`` >= 0 it first marks ``eligible`` as :func:`eligible_rows`
    does (for a policy that chooses without reading eligibility: one call instead of two). Returns
    ``(blocks needed, draft nodes verified, reserved, eligible sequences)`` (the last -1 when
    ``eligible`` was marked before): ``blocks`` grows only when all the needed blocks are free.
    """
    count = eligible_rows(n, ints, min_sequence_tokens, eligible) if min_sequence_tokens >= 0 else -1
    k, remaining, context, blocks = ints[_K], ints[_REMAINING], ints[_CONTEXT], ints[_BLOCKS]
    drafted = longest = 0
    for i in range(n):
        draft = 0
        if chosen is not None and eligible[i]:
            draft = min(chosen[i], remaining[i] - 1)
        k[i] = draft
        drafted += tree_nodes(draft, branching)
        longest = max(longest, draft)
    if drafted > budget:
        cap = longest
        while cap > 0:
            total = 0
            for i in range(n):
                total += tree_nodes(min(k[i], cap), branching)
            if total <= budget:
                break
            cap -= 1
        drafted = 0
        for i in range(n):
            k[i] = min(k[i], cap)
            drafted += tree_nodes(k[i], branching)
    needed = 0
    for i in range(n):
        needed += max(-(-(context[i] + tree_nodes(k[i], branching) + 1) // block_size) - blocks[i], 0)
    if needed > free_blocks:
        return needed, drafted, False, count
    for i in range(n):
        blocks[i] += max(-(-(context[i] + tree_nodes(k[i], branching) + 1) // block_size) - blocks[i], 0)
    return needed, drafted, True, count


@kernel
def advance_rows(n, now, ints, floats, speculated, finished_rows, block_size, gap_runs, runs_at, windows):
    """The verified step is over at ``now``: each sequence emits its accepted prefix plus one token.

    Records each sequence's gap since its last token as runs of equal gaps, in row order,
    from ``gap_runs[runs_at]`` on (columns: end, gap, tokens; after a step that decoded
    every sequence, as chunked prefill does, one run); rolls its KV back to the blocks its
    new context needs (the rejected positions' are given back; for a tree, every node off the
    accepted path: the engine moves the path's KV into place, a copy of at most k tokens' KV
    that is not priced), and records what the draft
    has not seen: its accepted tokens but the last, when it proposed and all were accepted,
    else one more. ``speculated`` marks the rows that drafted; ``finished_rows`` gets the
    rows that have all their tokens, last row first (the order to remove them in, as a
    removal moves the last row). With ``windows[0]`` > 0 it then adds the step to every row's
    adaptive k window, :func:`~llmsim.speculation.kernels.observe_windows` with the settings
    ``windows`` (:data:`llmsim.speculation.policies.NO_WINDOWS`' layout). Returns ``(blocks freed,
    tokens emitted, sequences finished, gap runs)``.
    """
    k, accepted, generated, remaining = ints[_K], ints[_ACCEPTED], ints[_GENERATED], ints[_REMAINING]
    context, blocks, lag = ints[_CONTEXT], ints[_BLOCKS], ints[_LAG]
    proposed_total, accepted_total = ints[_PROPOSED_TOTAL], ints[_ACCEPTED_TOTAL]
    last_token_s, max_gap_s = floats[_LAST_TOKEN_S], floats[_MAX_GAP_S]
    freed = emitted = finished = 0
    run = runs_at - 1
    for i in range(n):
        gap = now - last_token_s[i]
        if i > 0 and gap == gap_runs[run, 1]:
            gap_runs[run, 2] += 1.0
        else:
            run += 1
            gap_runs[run, 0], gap_runs[run, 1], gap_runs[run, 2] = now, gap, 1.0
        if gap > max_gap_s[i]:
            max_gap_s[i] = gap
        last_token_s[i] = now
        tokens = accepted[i] + 1                     # k <= remaining - 1, so this never overshoots
        emitted += tokens
        generated[i] += tokens
        remaining[i] -= tokens
        context[i] += tokens
        keep = -(-context[i] // block_size)
        freed += blocks[i] - keep
        blocks[i] = keep
        proposed_total[i] += k[i]
        accepted_total[i] += accepted[i]
        speculated[i] = k[i] > 0
        lag[i] = (2 if accepted[i] == k[i] else 1) if k[i] > 0 else lag[i] + 1
    if windows[0] > 0:
        observe_windows(n, k, accepted, speculated, ints[_K_POLICY], ints[_WINDOW_PROPOSED], ints[_WINDOW_ACCEPTED],
                        ints[_WINDOW_ROUNDS], ints[_BACKOFF], windows[0], windows[1], windows[2], windows[3],
                        windows[4], windows[5])
    for i in range(n - 1, -1, -1):
        if remaining[i] == 0:
            finished_rows[finished] = i
            finished += 1
    return freed, emitted, finished, run + 1 - runs_at


@kernel
def tree_extras(n, k, context, window, branching, draft_rows, draft_steps, local_share=1.0):
    """What a tree of ``branching`` candidates per node adds to a chain of the same depth.

    Verify: sequence ``i`` drafting ``k[i]`` levels sends ``b^j`` nodes at depth ``j`` instead
    of one; each attends to its ``seen`` cached tokens, the root and its ``j`` ancestors and
    itself (``seen + j + 1`` keys, a tree attention mask). Returns the extra verify
    ``(tokens, attention pairs)``; every extra token also reads its KV and gives logits.
    Draft: step ``j`` expands the ``b^j`` nodes of level ``j`` of every sequence still
    drafting (one query per node over the same context): the first is the chain's decode
    row, the other ``b^j - 1`` are added to ``draft_rows[j]`` (in place) as extra tokens
    with logits, attending to the same keys.
    """
    tokens, pairs = 0, 0.0
    for i in range(n):
        if k[i] == 0:
            continue
        seen = seen_by_layers(context[i], window, local_share)
        width = 1
        for j in range(1, k[i] + 1):
            width *= branching
            tokens += width - 1
            pairs += (width - 1) * (seen + j + 1)
    width = 1
    for j in range(draft_steps):
        row = draft_rows[j]
        extra = (width - 1) * row[_ROW_DECODE_SEQS]
        row[_ROW_TOKENS] += extra
        row[_ROW_PREFILL_TOKENS] += extra
        row[_ROW_PREFILL_PAIRS] += (width - 1) * row[_ROW_DECODE_KV_READ]
        row[_ROW_LOGITS] += extra
        width *= branching
    return float(tokens), float(pairs)


@kernel
def price_step(n, k, context, window, lag, draft_rows, prompt_tokens, prompt_pairs, prompt_kv_read, prompt_chunks,
               prompt_logits, prompt_padding, prompt_longest, local_share, branching, sequential, expanded, stacked,
               n_ops, x, layer_by_tokens, head_by_logits, draft_stacked, draft_n_ops, draft_layer_by_tokens,
               draft_head_by_logits):
    """A speculative step's sums and both prices in one call: :func:`speculative_step_sums` (and
    :func:`tree_extras` for a tree), the dense target's :meth:`~llmsim.cost.roofline.CostModel.step` (its
    linear part, ``stacked`` times the row ``x``, and its non-linear terms from its ``rows_total`` tables)
    and the draft rows' :meth:`~llmsim.cost.roofline.CostModel.rows_total` (``draft_n_ops`` < 0: a draft
    priced outside, as Medusa heads are). The same operations in the same order as those calls, so the
    same bits. ``expanded``: the verify chunks scored by batch expansion (:func:`expanded_verify`).

    Returns ``(spec_seqs, draft_tokens, draft_steps, time_s, flops, bytes, draft_s, draft_flops,
    draft_bytes)``: ``time_s`` is NaN when the target's terms are not in its tables, ``draft_s`` when the
    draft's rows are not in its tables or it is priced outside (the rows are filled either way).
    """
    tokens, pairs, kv_read, spec_seqs, drafted, decode_kv, draft_steps = speculative_step_sums(
        n, k, context, window, lag, draft_rows, prompt_tokens, prompt_pairs, prompt_kv_read, prompt_chunks,
        local_share, prompt_padding, prompt_longest)
    if branching > 1 and spec_seqs:
        extra_tokens, extra_pairs = tree_extras(n, k, context, window, branching, draft_rows,
                                                draft_steps if sequential else 0, local_share)
        tokens, pairs = tokens + extra_tokens, pairs + extra_pairs
        kv_read = kv_read + extra_tokens
    if not sequential:
        draft_steps = min(draft_steps, 1)
    decode_seqs = n - spec_seqs
    if expanded:
        tokens, pairs, kv_read, decode_seqs, decode_kv = expanded_verify(tokens, pairs, decode_seqs, decode_kv)
    prefill_tokens, logits = prompt_tokens + tokens, prompt_logits + tokens
    step_tokens = prefill_tokens + decode_seqs
    step_logits = decode_seqs + logits
    time_s, flops, moved = _linear_step(stacked, n_ops, x, step_tokens, prefill_tokens, prompt_pairs + pairs,
                                        prompt_kv_read + kv_read, decode_seqs, decode_kv, 1.0, step_logits,
                                        prompt_padding, prompt_longest)
    if len(layer_by_tokens):
        layers_s = head_s = np.nan
        if 0.0 <= step_tokens < len(layer_by_tokens) and step_tokens == int(step_tokens):
            layers_s = layer_by_tokens[int(step_tokens)]
        if 0.0 <= step_logits < len(head_by_logits) and step_logits == int(step_logits):
            head_s = head_by_logits[int(step_logits)]
        time_s += layers_s + head_s
    draft_s, draft_flops, draft_bytes = np.nan, 0.0, 0.0
    if draft_steps and draft_n_ops >= 0 and draft_steps <= FEW_ROWS:
        draft_s, draft_flops, draft_bytes = _rows_total(draft_stacked, draft_n_ops, draft_rows[:draft_steps],
                                                        draft_layer_by_tokens, draft_head_by_logits)
    return spec_seqs, drafted, draft_steps, time_s, flops, moved, draft_s, draft_flops, draft_bytes


@kernel(inline="always")
def with_draft(duration_s, flops, moved, draft_steps, draft_s, draft_flops, draft_bytes, separate, handoff_s):
    """A step's ``(time_s, flops, bytes)`` with its draft's (``draft_steps`` of them): the draft runs before the
    target verifies (colocated) or beside it, followed by a hand-off (``separate``: on devices of its own)."""
    if draft_steps:
        flops, moved = flops + draft_flops, moved + draft_bytes
        duration_s = max(duration_s, draft_s) + handoff_s if separate else duration_s + draft_s
    return duration_s, flops, moved


@kernel
def log_step(rows, at, start_s, kv_used_blocks, running, queued, n, ints, floats, window, draft_rows, local_share,
             branching, sequential, expanded, stacked, n_ops, x, layer_by_tokens, head_by_logits, draft_stacked,
             draft_n_ops, draft_layer_by_tokens, draft_head_by_logits, key, decay, separate, handoff_s, chunk_rows,
             prefill_seqs, tile, query_tile_pairs):
    """A speculative step priced, drawn and logged in one call, over the packed columns: its ``prefill_seqs``
    prompt chunks (none: a decode-only step) summed from their rows in ``chunk_rows``
    (:func:`~llmsim.cost.features.chunk_sums`, with the window and the tile terms), :func:`price_step` of them and
    the ``n`` decoding sequences, then (where it priced both the target and the draft from their tables) the
    acceptance draw (:func:`~llmsim.speculation.kernels.accepted_prefixes` into column ``accepted``, or zeros when
    nothing was proposed), :func:`with_draft` and the row written into ``rows`` (a log chunk's doubles) from ``at``
    on, as :meth:`~llmsim.sim.iterations.IterationLog.add` would pack it: the same operations in the same order as
    the separate calls. Returns ``(time_s, spec_seqs, draft_tokens, draft_steps)``; ``time_s`` is NaN, and nothing
    is drawn or written, where a price was not in the tables (the caller then prices the step the general way).
    """
    prompt_tokens, prompt_pairs, prompt_kv_read, completed, prompt_padding, prompt_longest = chunk_sums(
        chunk_rows, prefill_seqs, window, local_share, tile, query_tile_pairs)
    k, context, lag, accepted = ints[_K], ints[_CONTEXT], ints[_LAG], ints[_ACCEPTED]
    spec_seqs, drafted, draft_steps, time_s, flops, moved, draft_s, draft_flops, draft_bytes = price_step(
        n, k, context, window, lag, draft_rows, prompt_tokens, prompt_pairs, prompt_kv_read, prefill_seqs > 0,
        completed, prompt_padding, prompt_longest, local_share, branching, sequential, expanded, stacked, n_ops, x,
        layer_by_tokens, head_by_logits, draft_stacked, draft_n_ops, draft_layer_by_tokens, draft_head_by_logits)
    if time_s != time_s or (draft_steps and draft_s != draft_s):
        return np.nan, spec_seqs, drafted, draft_steps
    out = accepted[:n]
    if drafted:
        total = accepted_prefixes(key, ints[_REQUEST_ID], ints[_GENERATED], floats[_ALPHA], k, decay, out, branching)
    else:
        out[:] = 0
        total = 0
    if not draft_steps:
        draft_s = 0.0
    time_s, flops, moved = with_draft(time_s, flops, moved, draft_steps, draft_s, draft_flops, draft_bytes, separate,
                                      handoff_s)
    write_row(rows, at, start_s, time_s, n, prefill_seqs, prompt_tokens, n + total + completed, flops, moved,
              kv_used_blocks, running, queued)
    rows[at + _LOG_SPEC_SEQS] = spec_seqs
    rows[at + _LOG_DRAFT_TOKENS] = drafted
    rows[at + _LOG_ACCEPTED_TOKENS] = total
    rows[at + _LOG_DRAFT_S] = draft_s
    return time_s, spec_seqs, drafted, draft_steps
