"""Speculative decoding inside continuous batching: the decode set with variable tokens per step.

Scheduling (admission, chunked prefill, preemption, timeouts) is the engine's. What
changes is the decode step. Each decoding sequence gets a draft length k from the k
policy (:mod:`llmsim.speculation.policies`; 0 when it is not eligible, or when
speculation is off for this step), so one iteration may mix speculating and plainly
decoding sequences:

1. the draft runs ``max k`` sequential steps over the sequences still drafting at each
   step (its first step also catches up on tokens it has not seen, and the draft
   prefills every prompt chunk the target prefills);
2. the target verifies: a speculating sequence is a chunk of ``k + 1`` positions over
   its context (a tree: the root and all its nodes), and the engine reserves KV for all
   of them before the step; a plain one decodes one token;
3. the acceptance process decides each sequence's accepted prefix ``a``; it emits
   ``a + 1`` tokens, keeps KV for them and gives back the blocks of the rejected tail
   (a tree's: every node off the accepted path).

With the draft on the target's devices the iteration lasts draft + verify; with the
draft on devices of its own the two overlap as a producer-consumer pipeline (the
draft proposes the next step while the target verifies this one), so it lasts the
longer of the two plus a hand-off. Variable tokens per step rule out the one-token
set's closed-form bookkeeping, so the decoding sequences live in packed numpy columns
(:class:`DecodeSlots`). A batch is a few dozen rows, too few for numpy's per-call
overhead to pay off, so each phase of a step is one compiled loop over the columns
(numba): the caps and the KV reservation (:mod:`llmsim.sim.speculative_kernels`), the
step's feature sums and the draft's rows (:func:`llmsim.cost.features.speculative_step_sums`),
the acceptance draws, the outcome with its rollback and the adaptive rule's windows. What
stays in Python per step is the policy's choice, the two roofline prices (target and
draft, :meth:`~llmsim.cost.roofline.CostModel.iteration`) and finishing requests.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import fields
from functools import partial

import numpy as np

from llmsim.compiled import EntryPoint
from llmsim.config.policies import AcceptanceProcess, Scorer
from llmsim.cost.features import (FEATURES, batch_rows, expanded_verify, sequential_decode_rows, speculative_step_sums,
                                  visible)
from llmsim.cost.roofline import FEW_ROWS, CostModel, summed_iteration
from llmsim.sim.decode import DecodeSet, StepPrice
from llmsim.sim.iterations import IterationLog
from llmsim.sim.request import InterTokenGaps, Request
from llmsim.sim.result import SpeculationSteps
from llmsim.sim.speculative_kernels import (ADVANCE_ROWS_SIGNATURE, CLOSE_ROW_SIGNATURE, FLOAT_COLUMNS, INT_COLUMNS,
                                            LOG_STEP_SIGNATURE, OPEN_ROW_SIGNATURE, PRICE_STEP_SIGNATURE,
                                            RESERVE_BLOCKS_PLAIN_SIGNATURE, RESERVE_BLOCKS_SIGNATURE, advance_rows,
                                            close_row, eligible_rows, log_step, open_row, price_step,
                                            reserve_blocks, tree_extras, with_draft)
from llmsim.speculation.config import SpeculationConfig
from llmsim.speculation.policies import k_policy
from llmsim.speculation.proposers import tree_tokens, tree_verify_pairs


_NO_ROWS = np.zeros((0, 0))
_NO_CHUNKS = np.zeros(0, np.int64)          # a decode-only step's prompt chunks' rows
_NO_TABLE = np.zeros(0)
_STEP_COLUMNS = (("eligible", bool), ("speculated", bool), ("finished_rows", np.int64))   # this step's: not moved


class DecodeSlots:
    """The engine's decoding sequences as parallel arrays, packed in rows ``[0, n)``.

    ``context`` is the KV length (tokens whose keys and values are stored), ``blocks``
    the KV blocks held, ``lag`` the tokens the draft has not processed yet, ``k`` /
    ``accepted`` this step's draft length and outcome, ``eligible`` / ``speculated`` /
    ``finished_rows`` this step's scratch (not moved with a row). The k policies keep their
    per-request state here (:mod:`llmsim.speculation.policies`): ``k_policy`` the adaptive
    k, ``window_*`` the adaptive rule's current window, ``backoff`` its failed probes in a
    row since it turned speculation off, ``seen_*`` the goodput policy's decayed acceptance
    counts.

    The integer columns are the rows of one 2-D array ``ints`` and the float columns of
    another, ``floats`` (in the order :mod:`llmsim.sim.speculative_kernels` lays out; each
    column contiguous), so a kernel takes the two arrays, and removing a row, which moves
    the last one into it, is two array copies.
    """

    # open_row and close_row through their entry points (see llmsim.compiled).
    _open_row: EntryPoint[Callable[..., None]] = EntryPoint(open_row, OPEN_ROW_SIGNATURE)
    _close_row: EntryPoint[Callable[..., tuple[int, int, float, float, int, int]]] = EntryPoint(close_row,
                                                                                                CLOSE_ROW_SIGNATURE)

    # The columns by name (set by _grow): views of the rows of ``ints`` (int64) and ``floats`` (float64),
    # in INT_COLUMNS and FLOAT_COLUMNS order, and this step's scratch columns (_STEP_COLUMNS).
    context: np.ndarray
    generated: np.ndarray
    remaining: np.ndarray
    blocks: np.ndarray
    request_id: np.ndarray
    k_policy: np.ndarray
    k: np.ndarray
    accepted: np.ndarray
    lag: np.ndarray
    window_proposed: np.ndarray
    window_accepted: np.ndarray
    window_rounds: np.ndarray
    backoff: np.ndarray
    proposed_total: np.ndarray
    accepted_total: np.ndarray
    alpha: np.ndarray
    last_token_s: np.ndarray
    max_gap_s: np.ndarray
    seen_accepted: np.ndarray
    seen_rejected: np.ndarray
    eligible: np.ndarray
    speculated: np.ndarray
    finished_rows: np.ndarray

    def __init__(self, capacity: int = 64):
        self.n = 0
        self.requests: list[Request] = []
        self.ints: np.ndarray = np.zeros((len(INT_COLUMNS), 0), dtype=np.int64)
        self.floats: np.ndarray = np.zeros((len(FLOAT_COLUMNS), 0))
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        ints: np.ndarray = np.zeros((len(INT_COLUMNS), capacity), dtype=np.int64)
        floats: np.ndarray = np.zeros((len(FLOAT_COLUMNS), capacity))
        ints[:, :self.ints.shape[1]] = self.ints
        floats[:, :self.floats.shape[1]] = self.floats
        self.ints, self.floats = ints, floats
        for name, column in zip(INT_COLUMNS, ints):
            setattr(self, name, column)
        for name, column in zip(FLOAT_COLUMNS, floats):
            setattr(self, name, column)
        for name, dtype in _STEP_COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype=dtype))

    def add(self, request: Request, k_policy: int) -> int:
        """A row for ``request``, which starts decoding from its state now with ``k_policy`` as the policy's k."""
        i = self.n
        if i == self.ints.shape[1]:
            self._grow(2 * i)
        self._open_row(self.ints, self.floats, i, request.prefill_target, request.generated,
                       request.output_tokens - request.generated, request.blocks, request.id, k_policy, request.alpha,
                       request.last_token_s, request.max_itl_s)
        self.requests.append(request)
        request.slot = i
        self.n += 1
        return i

    def remove(self, i: int) -> tuple[int, int, float, float, int, int]:
        """Take row ``i`` out (the last row moves into it); returns what its request keeps, as :func:`close_row`."""
        last = self.n - 1
        kept = self._close_row(self.ints, self.floats, i, last)
        if i != last:
            moved = self.requests[last]
            self.requests[i] = moved
            moved.slot = i
        self.requests.pop()
        self.n = last
        return kept


class SpeculativeDecodeSet(DecodeSet):
    """Decoding sequences whose steps speculate (see the module docstring).

    ``draft_cost`` is None for a free n-gram speculator; ``handoff_s`` is the hand-off
    between a draft on devices of its own and the target (None: the draft is colocated);
    ``acceptance_key`` keys the acceptance stream (common random numbers across configurations).
    ``blocked`` counts decoding sequence-steps: all of them (``sequence_steps``), those that
    speculated, and those kept from it by each rule (the fields of
    :class:`~llmsim.sim.result.SpeculationSteps`, which the run's result sums them into).
    """

    # The step's kernels through their entry points (see llmsim.compiled; the signatures of
    # llmsim.sim.speculative_kernels say why they are what they are). Blocks are reserved with the policy's k
    # per row (``_reserve_blocks_per_row``) or, on a step where nobody speculates, without (``chosen`` None).
    _reserve_blocks_per_row: EntryPoint[Callable[..., tuple[int, int, bool, int]]] = EntryPoint(
        reserve_blocks, RESERVE_BLOCKS_SIGNATURE)
    _reserve_blocks_no_drafts: EntryPoint[Callable[..., tuple[int, int, bool, int]]] = EntryPoint(
        reserve_blocks, RESERVE_BLOCKS_PLAIN_SIGNATURE)
    _price_step: EntryPoint[Callable[..., tuple]] = EntryPoint(price_step, PRICE_STEP_SIGNATURE)
    _advance_rows: EntryPoint[Callable[..., tuple[int, int, int, int]]] = EntryPoint(advance_rows,
                                                                                     ADVANCE_ROWS_SIGNATURE)
    _log_step: EntryPoint[Callable[..., tuple[float, int, int, int]]] = EntryPoint(log_step, LOG_STEP_SIGNATURE)

    def __init__(self, engine, speculation: SpeculationConfig, draft_cost, acceptance_key: int,
                 handoff_s: float | None = None):
        super().__init__(engine)
        self.spec = speculation
        self.policy = k_policy(speculation.policy)
        self.draft_cost = draft_cost
        # A draft model's rows in one compiled call; Medusa heads' and n-gram lookups' by their own iteration.
        self._draft_total = (draft_cost.rows_total if isinstance(draft_cost, CostModel)
                             else partial(summed_iteration, draft_cost))
        self._branching = speculation.proposer.branching
        self._sequential = speculation.proposer.sequential      # one draft step per level (else one pass)
        self._expanded = speculation.scorer is Scorer.BATCH_EXPANSION
        # (the columns are the entry points' exact types: C-contiguous int64 and float64 rows)
        self._draw = speculation.acceptance.draws(acceptance_key, self._branching, checked=False)
        self.blocked = {f.name: 0 for f in fields(SpeculationSteps)}
        self._blocked_step: tuple[str | None, int] = (None, 0)   # this step: a rule blocking all, or eligible count
        self.slots = DecodeSlots()
        self._separate = handoff_s is not None and draft_cost is not None
        self._handoff_s = handoff_s if self._separate and handoff_s is not None else 0.0
        self._force_plain = False                    # this step's reservation could not hold k tokens
        # The draft's feature rows, one per sequential step (no sequence drafts more than the policy's k or k_max).
        longest = max(speculation.policy.k, speculation.policy.k_max, 1)
        self._draft_rows = np.zeros((longest if draft_cost is not None else 0, len(FEATURES)))
        # Inter-token gaps as weighted samples: per step, runs of sequences with equal gaps (end,
        # gap, tokens: one run a step under chunked prefill), and the tokens beyond one per
        # sequence at the step's end (they come with the first: gap 0).
        self._gap_runs = np.zeros((1024, 3))
        self._runs_used = 0
        self._step_ends_s = array("d")
        self._burst_tokens = array("q")
        # A step's sums and prices in one compiled call (price_step) for a dense target; a draft model's
        # rows priced in it too, Medusa heads' and n-gram lookups' outside.
        target = engine.cost
        self._target_terms = (target.compiled_terms() if isinstance(target, CostModel) and target.dense
                              and self._draft_rows.shape[0] <= FEW_ROWS else None)
        self._draft_terms = (draft_cost.compiled_terms() if isinstance(draft_cost, CostModel)
                             else (_NO_ROWS, -1, _NO_TABLE, [_NO_TABLE, _NO_TABLE]))
        # A step priced, drawn and logged in one call (log_step), without prompt chunks or with them, where
        # price_step prices both models and the acceptance is drawn by accepted_prefixes; else None, and the
        # engine's general path.
        self.log_decode_step: Callable[..., float] | None = None
        self.log_step: Callable[..., float] | None = None
        if (self._target_terms is not None and (draft_cost is None or isinstance(draft_cost, CostModel))
                and speculation.acceptance.process is not AcceptanceProcess.REPLAY):
            self._tabulated_target: tuple = self._target_terms
            self._key = np.uint64(acceptance_key)
            self._decay = speculation.acceptance.draw_decay
            self.log_decode_step = self._log_decode_step_in_one_call
            self.log_step = self._log_chunks_in_one_call

    # -- joining and leaving ------------------------------------------------------------------------
    def start(self, request: Request) -> None:
        self.slots.add(request, self.policy.initial_k)
        self.n += 1

    def stop(self, request: Request) -> None:
        self._release(request.slot)

    def blocks(self, request: Request) -> int:
        """The KV blocks a running ``request`` holds now: a decoding sequence's are its row's (written back to
        ``request.blocks`` only when it leaves the set), a prompt's ``request.blocks``."""
        s, slot = self.slots, request.slot
        if 0 <= slot < s.n and s.requests[slot] is request:
            return int(s.blocks[slot])
        return request.blocks

    def _release(self, i: int) -> Request:
        """Take row ``i`` out, handing the arrays' state back to its request."""
        s = self.slots
        request = s.requests[i]
        request.generated, request.blocks, request.last_token_s, request.max_itl_s, proposed, accepted = s.remove(i)
        request.draft_tokens += proposed
        request.accepted_tokens += accepted
        self.n -= 1
        return request

    # -- a step: choose k, reserve KV ---------------------------------------------------------------
    def prepare(self, now: float) -> int:
        """Choose each sequence's k and reserve KV for the positions it verifies (k + 1 for a chain,
        the root and every node of a tree); returns the decode tokens (the verify pass's).

        When the free blocks cannot hold the speculative positions the step decodes
        plainly; when they cannot hold even that, the latest admitted request is preempted.
        """
        s, engine, policy, rule = self.slots, self.engine, self.policy, self.spec.eligibility
        kv = engine.kv
        while True:
            n = self.n
            if n == 0:
                self._force_plain = False
                return 0
            # The policy's k for each sequence (None: nobody speculates this step), and the
            # ``min_sequence_tokens`` by which the reservation is to mark who is eligible (-1: marked here already,
            # for a policy that reads it). Never drafted past the last token asked for, nor past the iteration's
            # token budget (the reservation's caps).
            chosen, marks = None, -1
            if self._force_plain:
                self._blocked_step = ("kv_cache", 0)
            elif len(engine.running) < rule.min_concurrent_requests:
                self._blocked_step = ("min_concurrent_requests", 0)
            elif not policy.reads_eligible:
                # A sequence that is not eligible drafts nothing whatever the policy chose for it. (The columns
                # whole: the policy reads neither, and the kernel only their first n rows.)
                chosen, marks = policy.choose(s, n, s.eligible, self._candidate_times), rule.min_sequence_tokens
            else:
                eligible = eligible_rows(n, s.ints, rule.min_sequence_tokens, s.eligible)
                self._blocked_step = (None, eligible)
                if eligible:
                    chosen = policy.choose(s, n, s.eligible[:n], self._candidate_times)
            reserve = self._reserve_blocks_per_row if chosen is not None else self._reserve_blocks_no_drafts
            needed, drafted, reserved, eligible = reserve(
                n, chosen, s.eligible, s.ints, engine.config.max_batch_tokens - n, kv.block_size, kv.free_blocks,
                self._branching, marks)
            if marks >= 0:
                self._blocked_step = (None, eligible)
            if reserved:
                break
            if drafted:
                self._force_plain = True
            else:
                engine.preempt_latest(now)
        self._force_plain = False
        if needed:                                   # (a step whose tokens fit the blocks held takes none)
            kv.allocate(needed)
        return n + drafted

    def _count_blocked(self, n: int, n_spec: int) -> None:
        blocked = self.blocked
        blocked["sequence_steps"] += n
        blocked["speculated"] += n_spec
        rule, eligible = self._blocked_step
        if rule is not None:
            blocked[rule] += n
            return
        blocked["min_sequence_tokens"] += n - eligible
        blocked["policy"] += eligible - n_spec

    # -- a step: price it -----------------------------------------------------------------------
    def price(self, chunks, decoding, pre_tokens, pairs, pre_kv, logits, padding, longest) -> StepPrice:
        if self._target_terms is None:
            return self._price_in_steps(chunks, decoding, pre_tokens, pairs, pre_kv, logits, padding, longest)
        n = self.n if decoding else 0
        s = self.slots
        stacked, n_ops, x, tables = self._target_terms
        draft_stacked, draft_n_ops, _, draft_tables = self._draft_terms
        for _ in range(2):
            (n_spec, proposed, draft_steps, duration, flops, moved, draft_s, draft_flops,
             draft_bytes) = self._price_step(
                n, s.k, s.context, self._window_tokens, s.lag, self._draft_rows, pre_tokens, pairs, pre_kv,
                bool(chunks), logits, padding, longest, self._local_share, self._branching, self._sequential,
                self._expanded, stacked, n_ops, x, tables[0], tables[1], draft_stacked, draft_n_ops, draft_tables[0],
                draft_tables[1])
            if duration == duration:
                break
            if not self.engine.cost.tabulate_last_step():
                return self._price_in_steps(chunks, decoding, pre_tokens, pairs, pre_kv, logits, padding, longest)
        else:
            return self._price_in_steps(chunks, decoding, pre_tokens, pairs, pre_kv, logits, padding, longest)
        accepted = self._accept(n, n_spec, proposed)
        if not draft_steps:
            draft_s = 0.0
        elif draft_s != draft_s:                 # a draft the fused call does not price (heads, a lookup)
            draft_s, draft_flops, draft_bytes = self._draft_total(self._draft_rows[:draft_steps])
        return self._with_draft(duration, n, accepted, logits, flops, moved, n_spec, proposed, draft_steps, draft_s,
                                draft_flops, draft_bytes)

    def _price_in_steps(self, chunks, decoding, pre_tokens, pairs, pre_kv, logits, padding, longest) -> StepPrice:
        """:meth:`price` by separate calls: the step's sums, the target's :meth:`~llmsim.cost.roofline.CostModel.step`
        (any target, an MoE one included) and the draft's price."""
        n = self.n if decoding else 0
        s = self.slots
        # The verify chunks' tokens (each gives logits), pairs and KV read; the draft's rows.
        tokens, verify_pairs, verify_kv, n_spec, proposed, decode_kv, draft_steps = speculative_step_sums(
            n, s.k, s.context, self._window_tokens, s.lag, self._draft_rows, pre_tokens, pairs, pre_kv, bool(chunks),
            self._local_share, padding, longest)
        if self._branching > 1 and n_spec:
            extra_tokens, extra_pairs = tree_extras(n, s.k, s.context, self._window_tokens, self._branching,
                                                    self._draft_rows, draft_steps if self._sequential else 0,
                                                    self._local_share)
            tokens, verify_pairs = tokens + extra_tokens, verify_pairs + extra_pairs
            verify_kv = verify_kv + extra_tokens
        if not self._sequential:
            draft_steps = min(draft_steps, 1)        # the heads or the lookup run once, whatever k
        accepted = self._accept(n, n_spec, proposed)
        plain = n - n_spec
        if self._expanded:
            tokens, verify_pairs, verify_kv, plain, decode_kv = expanded_verify(tokens, verify_pairs, plain, decode_kv)
        duration, flops, moved = self._cost_step(pre_tokens + tokens, pairs + verify_pairs, pre_kv + verify_kv,
                                                 logits + tokens, plain, decode_kv, padding, longest)
        draft_s = draft_flops = draft_bytes = 0.0
        if draft_steps:
            draft_s, draft_flops, draft_bytes = self._draft_total(self._draft_rows[:draft_steps])
        return self._with_draft(duration, n, accepted, logits, flops, moved, n_spec, proposed, draft_steps, draft_s,
                                draft_flops, draft_bytes)

    def _log_decode_step_in_one_call(self, log: IterationLog, now: float, kv_used_blocks: int, running: int,
                                     queued: int) -> float:
        """:meth:`price_decode`'s step added to ``log`` as the engine would add it (its counts as given), in one
        compiled call (:func:`log_step`); returns its duration, NaN (nothing drawn or logged) where a price is not
        in the cost models' tables: the engine then prices the step through :meth:`price_decode`."""
        return self._log_in_one_call(log, now, _NO_CHUNKS, 0, self.n, kv_used_blocks, running, queued)

    def _log_chunks_in_one_call(self, log: IterationLog, now: float, chunk_rows: np.ndarray, prefill_seqs: int,
                                decoding: bool, prefill_tokens: float, completed: int, kv_used_blocks: int,
                                running: int, queued: int) -> float:
        """:meth:`price`'s iteration with ``prefill_seqs`` prompt chunks (their rows in ``chunk_rows``) added to
        ``log`` as the engine would add it, in one compiled call (:func:`log_step`); returns its duration, NaN
        (nothing drawn or logged) where a price is not in the cost models' tables: the engine then prices the
        step through :meth:`price`."""
        return self._log_in_one_call(log, now, chunk_rows, prefill_seqs, self.n if decoding else 0, kv_used_blocks,
                                     running, queued)

    def _log_in_one_call(self, log: IterationLog, now: float, chunk_rows: np.ndarray, prefill_seqs: int, n: int,
                         kv_used_blocks: int, running: int, queued: int) -> float:
        """:func:`log_step` of the step with ``prefill_seqs`` prompt chunks and ``n`` decoding sequences; its
        duration, or NaN where nothing was drawn or logged."""
        s = self.slots
        stacked, n_ops, x, tables = self._tabulated_target
        draft_stacked, draft_n_ops, _, draft_tables = self._draft_terms
        duration_s, n_spec, _, _ = self._log_step(
            log.doubles, log.at, now, kv_used_blocks, running, queued, n, s.ints, s.floats, self._window_tokens,
            self._draft_rows, self._local_share, self._branching, self._sequential, self._expanded, stacked, n_ops,
            x, tables[0], tables[1], draft_stacked, draft_n_ops, draft_tables[0], draft_tables[1], self._key,
            self._decay, self._separate, self._handoff_s, chunk_rows, prefill_seqs, self._prefill_tile,
            self._query_tile_pairs)
        if duration_s == duration_s:
            if n:
                self._count_blocked(n, n_spec)
            log.row_added()
        return duration_s

    def _accept(self, n: int, n_spec: int, proposed: int) -> int:
        """Count the step's sequences kept from speculating, and draw how many drafted tokens the target accepts."""
        s = self.slots
        if n:
            self._count_blocked(n, n_spec)
        if proposed:
            return self._draw(s.request_id, s.generated, s.alpha, s.k, s.accepted[:n])
        if n:
            s.accepted[:n] = 0
        return 0

    def _with_draft(self, duration: float, n: int, accepted: int, logits: int, flops: float, moved: float,
                    n_spec: int, proposed: int, draft_steps: int, draft_s: float, draft_flops: float,
                    draft_bytes: float) -> StepPrice:
        """The step's price with the draft's (:func:`with_draft`, its Python body)."""
        duration, flops, moved = with_draft.py_func(duration, flops, moved, draft_steps, draft_s, draft_flops,
                                                    draft_bytes, self._separate, self._handoff_s)
        return duration, n, n + accepted + logits, flops, moved, n_spec, proposed, accepted, draft_s

    # -- a step: apply its outcome ----------------------------------------------------------------
    def advance(self, now: float) -> None:
        n = self.n
        s, kv = self.slots, self.engine.kv
        at = self._runs_used
        if at + n > len(self._gap_runs):
            self._gap_runs.resize((2 * (at + n), 3), refcheck=False)     # in place: appends rows
        freed, emitted, finished, runs = self._advance_rows(n, now, s.ints, s.floats, s.speculated, s.finished_rows,
                                                            kv.block_size, self._gap_runs, at, self.policy.windows)
        self._runs_used = at + runs
        self._step_ends_s.append(now)
        self._burst_tokens.append(emitted - n)
        if freed:                                    # (rejected nodes often hold no block of their own)
            kv.free(freed)
        if self.policy.observes:
            self.policy.observe(s, n, s.k[:n], s.accepted[:n], s.speculated[:n])
        if finished:
            for i in s.finished_rows[:finished].tolist():
                self.engine.finish(self._release(i), now)

    def _candidate_times(self, eligible: np.ndarray, drafted: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Decode-step time for every candidate k (columns of ``drafted``, draft lengths of the
        ``eligible`` sequences, each at most its ``limit``)."""
        s, window, n = self.slots, self._window, len(eligible)
        context = s.context[:n]
        seen = visible(context, window, self._local_share)
        cs = seen[eligible][:, None]
        spec = drafted > 0
        t = (tree_tokens(drafted, self._branching) + 1) * spec
        verify_tokens = t.sum(axis=0)
        plain = n - spec.sum(axis=0)
        kv_plain = float((seen + 1).sum()) - ((cs + 1) * spec).sum(axis=0)
        pairs = (tree_verify_pairs(drafted, self._branching, cs) * spec).sum(axis=0)
        verify_kv = ((cs + t) * spec).sum(axis=0)
        if self._expanded:
            # The Python body: the same sums over every candidate k at once.
            verify_tokens, pairs, verify_kv, plain, kv_plain = expanded_verify.py_func(verify_tokens, pairs, plain,
                                                                                       kv_plain)
        rows = batch_rows(verify_tokens, pairs, verify_kv, verify_tokens, plain, kv_plain, self.engine.cost.model)
        verify_s = self.engine.cost.iteration(rows)[0]
        if self.draft_cost is None:
            return verify_s
        # Draft step j runs the sequences that can still draft j + 1 tokens, whatever k is chosen
        # (a tree's extra nodes are left out of this price); heads and lookups run once.
        steps = sequential_decode_rows(limit, cs, drafted.shape[1] - 1)
        step_s = self.draft_cost.iteration(steps)[0]
        if not self._sequential:
            step_s = np.concatenate([step_s[:1], np.zeros(len(step_s) - 1)])
        draft_s = np.concatenate([[0.0], np.cumsum(step_s)])
        return np.maximum(verify_s, draft_s) + self._handoff_s if self._separate else verify_s + draft_s

    # -- end of run -------------------------------------------------------------------------------
    def close(self, gaps: InterTokenGaps) -> None:
        s = self.slots
        for i in range(s.n):
            request = s.requests[i]
            request.generated = int(s.generated[i])
            request.draft_tokens += int(s.proposed_total[i])
            request.accepted_tokens += int(s.accepted_total[i])
        if self._step_ends_s:
            runs = self._gap_runs[:self._runs_used]
            gaps.add(runs[:, 0], runs[:, 1], runs[:, 2])
            gaps.add(self._step_ends_s, np.zeros(len(self._step_ends_s)), self._burst_tokens)
