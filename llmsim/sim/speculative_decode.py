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
   its context (the engine reserves KV for all of them before the step), a plain one
   decodes one token;
3. the acceptance process decides each sequence's accepted prefix ``a``; it emits
   ``a + 1`` tokens, keeps KV for them and gives back the blocks of the rejected tail.

With the draft on the target's devices the iteration lasts draft + verify; with the
draft on devices of its own the two overlap as a producer-consumer pipeline (the
draft proposes the next step while the target verifies this one), so it lasts the
longer of the two plus a hand-off. Variable tokens per step rule out the one-token
set's closed-form bookkeeping, so the decoding sequences live in packed numpy arrays
(:class:`DecodeSlots`) and every step is a handful of vector operations.
"""
from __future__ import annotations

import numpy as np

from llmsim.cost.features import (add_prefill, attention_pairs, batch_rows, chunk_sums,
                                  sequential_decode_rows)
from llmsim.sim.decode import DecodeSet
from llmsim.sim.request import InterTokenGaps, Request
from llmsim.speculation.config import SpeculationConfig
from llmsim.speculation.policies import k_policy

_INT_FIELDS = ("context", "generated", "remaining", "blocks", "request_id", "k_policy", "k", "emitted",
               "accepted", "lag", "window_proposed", "window_accepted", "window_rounds", "backoff",
               "proposed_total", "accepted_total")
_FLOAT_FIELDS = ("alpha", "last_token_s", "max_gap_s", "seen_accepted", "seen_rejected")


class DecodeSlots:
    """The engine's decoding sequences as parallel arrays, packed in rows ``[0, n)``.

    ``context`` is the KV length (tokens whose keys and values are stored), ``blocks``
    the KV blocks held, ``lag`` the tokens the draft has not processed yet, ``k`` /
    ``emitted`` / ``accepted`` this step's draft length and outcome. The k policies keep
    their per-request state here (:mod:`llmsim.speculation.policies`): ``k_policy`` the
    adaptive k, ``window_*`` the adaptive rule's current window, ``backoff`` its failed
    probes in a row since it turned speculation off, ``seen_*`` the goodput policy's
    decayed acceptance counts. Removing a row moves the last one into it.
    """

    def __init__(self, capacity: int = 64):
        self.n = 0
        self.requests: list[Request] = []
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(capacity, dtype=np.int64))
        for name in _FLOAT_FIELDS:
            setattr(self, name, np.zeros(capacity))

    def add(self, request: Request) -> int:
        i = self.n
        if i == len(self.context):
            for name in _INT_FIELDS + _FLOAT_FIELDS:
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        for name in _INT_FIELDS + _FLOAT_FIELDS:
            getattr(self, name)[i] = 0
        self.requests.append(request)
        request.slot = i
        self.n += 1
        return i

    def remove(self, i: int) -> None:
        last = self.n - 1
        if i != last:
            for name in _INT_FIELDS + _FLOAT_FIELDS:
                array = getattr(self, name)
                array[i] = array[last]
            moved = self.requests[last]
            self.requests[i] = moved
            moved.slot = i
        self.requests.pop()
        self.n = last


class SpeculativeDecodeSet(DecodeSet):
    """Decoding sequences whose steps speculate (see the module docstring).

    ``draft_cost`` is None for an n-gram speculator (free); ``handoff_s`` is the hand-off
    between a draft on devices of its own and the target (None: the draft is colocated);
    ``acceptance_key`` keys the acceptance stream (common random numbers across configurations).
    """

    def __init__(self, engine, speculation: SpeculationConfig, draft_cost, acceptance_key: int,
                 handoff_s: float | None = None):
        super().__init__(engine)
        self.spec = speculation
        self.policy = k_policy(speculation.policy)
        self.draft_cost = draft_cost
        self.key = acceptance_key
        self.slots = DecodeSlots()
        self._separate = handoff_s is not None and draft_cost is not None
        self._handoff_s = handoff_s if self._separate else 0.0
        self._force_plain = False                    # this step's reservation could not hold k tokens
        self._step_gaps_s: list[np.ndarray] = []     # per decode step: each sequence's gap
        self._step_ends_s: list[float] = []
        self._burst_tokens: list[int] = []           # per decode step: tokens beyond one per sequence

    # -- joining and leaving ------------------------------------------------------------------------
    def start(self, request: Request) -> None:
        s = self.slots
        i = s.add(request)
        s.context[i] = request.prefill_target
        s.generated[i] = request.generated
        s.remaining[i] = request.output_tokens - request.generated
        s.blocks[i] = request.blocks
        s.request_id[i] = request.id
        s.alpha[i] = request.alpha
        s.k_policy[i] = self.policy.initial_k
        s.lag[i] = 1                                 # the token just sampled is new to the draft
        s.last_token_s[i] = request.last_token_s
        s.max_gap_s[i] = request.max_itl_s
        self.n += 1

    def stop(self, request: Request) -> None:
        self._release(request.slot)

    def _release(self, i: int) -> Request:
        """Take row ``i`` out, handing the arrays' state back to its request."""
        s = self.slots
        request = s.requests[i]
        request.generated = int(s.generated[i])
        request.blocks = int(s.blocks[i])
        request.last_token_s = float(s.last_token_s[i])
        request.max_itl_s = float(s.max_gap_s[i])
        request.draft_tokens += int(s.proposed_total[i])
        request.accepted_tokens += int(s.accepted_total[i])
        s.remove(i)
        self.n -= 1
        return request

    # -- a step: choose k, reserve KV ---------------------------------------------------------------
    def prepare(self, now: float) -> int:
        """Choose each sequence's k and reserve KV for its k + 1 positions; returns the decode tokens.

        When the free blocks cannot hold the speculative positions the step decodes
        plainly; when they cannot hold even that, the latest admitted request is preempted.
        """
        s, kv, size = self.slots, self.engine.kv, self.engine.kv.block_size
        while True:
            n = self.n
            if n == 0:
                self._force_plain = False
                return 0
            k = self._choose_k(n)
            need = np.maximum(-(-(s.context[:n] + k + 1) // size) - s.blocks[:n], 0)
            total = int(need.sum())
            if total <= kv.free_blocks:
                break
            if k.any():
                self._force_plain = True
            else:
                self.engine.preempt_latest(now)
        self._force_plain = False
        kv.allocate(total)
        s.blocks[:n] += need
        s.k[:n] = k
        return n + int(k.sum())

    def _choose_k(self, n: int) -> np.ndarray:
        s, rule = self.slots, self.spec.eligibility
        if self._force_plain or len(self.engine.running) < rule.min_concurrent_requests:
            return np.zeros(n, dtype=np.int64)
        eligible = s.context[:n] + 1 > rule.min_sequence_tokens
        if not eligible.any():
            return np.zeros(n, dtype=np.int64)
        k = self.policy.choose(s, n, eligible, self._candidate_times)
        # Never draft past the last token asked for, nor past the iteration's token budget.
        k = np.where(eligible, np.minimum(k, s.remaining[:n] - 1), 0)
        budget = self.engine.config.max_batch_tokens - n
        if k.sum() > budget:
            cap = int(k.max())
            while cap > 0 and np.minimum(k, cap).sum() > budget:
                cap -= 1
            k = np.minimum(k, cap)
        return k

    # -- a step: price it -----------------------------------------------------------------------
    def price(self, chunks, decoding, pre_tokens, pairs, pre_kv, logits):
        n = self.n if decoding else 0
        s, window = self.slots, self._window
        verify = (0.0, 0.0, 0.0)                      # tokens (each gives logits), pairs, KV read of verify chunks
        plain, decode_kv, n_spec, proposed, accepted, emitted = n, 0.0, 0, 0, 0, 0
        draft_x = None
        if n:
            k, context = s.k[:n], s.context[:n]
            seen = np.minimum(context, window) if window else context
            spec = k > 0
            n_spec = int(np.count_nonzero(spec))
            s.accepted[:n] = 0
            if n_spec:
                ks, cs = k[spec], seen[spec]
                verify = chunk_sums(ks + 1, cs)       # k + 1 positions over each context
                a = self.spec.acceptance.accepted(self.key, s.request_id[:n][spec], s.generated[:n][spec],
                                                  s.alpha[:n][spec], ks)
                s.accepted[:n][spec] = a
                proposed, accepted = int(ks.sum()), int(a.sum())
                if self.draft_cost is not None:
                    draft_x = self._draft_rows(ks, cs, s.lag[:n][spec])
            s.emitted[:n] = s.accepted[:n] + 1        # k <= remaining - 1, so a + 1 never overshoots
            emitted = n + accepted
            plain = n - n_spec
            rest = seen[~spec] + 1
            decode_kv = float((np.minimum(rest, window) if window else rest).sum())
        x = self._row.fill(pre_tokens + verify[0], pairs + verify[1], pre_kv + verify[2], logits + verify[0],
                           plain, decode_kv)
        duration, flops, moved = self.engine.cost.iteration(x)
        draft_s = 0.0
        if self.draft_cost is not None and (draft_x is not None or chunks):
            if draft_x is None:                       # the draft prefills what the target prefills
                draft_x = batch_rows()[None, :]
            add_prefill(draft_x[0], pre_tokens, pairs, pre_kv)
            times, draft_flops, draft_bytes = self.draft_cost.iteration(draft_x)
            draft_s = float(times.sum())
            flops, moved = flops + float(draft_flops.sum()), moved + float(draft_bytes.sum())
            duration = max(duration, draft_s) + self._handoff_s if self._separate else duration + draft_s
        return duration, n, emitted + logits, flops, moved, n_spec, proposed, accepted, draft_s

    def _draft_rows(self, k: np.ndarray, context: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """Feature rows of the draft's ``max k`` sequential steps; step j runs the sequences with k > j.

        Step 0 also feeds the draft the tokens it has not seen (``lag - 1`` beyond the one
        every step feeds), as a short prefill.
        """
        rows = sequential_decode_rows(k, context, int(k.max()))
        behind = lag - 1
        if behind.any():
            add_prefill(rows[0], behind.sum(), (behind * context).sum(), ((context + behind) * (behind > 0)).sum())
        return rows

    # -- a step: apply its outcome ----------------------------------------------------------------
    def advance(self, now: float) -> None:
        n = self.n
        s, kv = self.slots, self.engine.kv
        size = kv.block_size
        k, a, e = s.k[:n], s.accepted[:n], s.emitted[:n]
        gaps = now - s.last_token_s[:n]
        self._step_gaps_s.append(gaps)
        self._step_ends_s.append(now)
        self._burst_tokens.append(int(e.sum()) - n)   # emitted together with a sequence's first: gap 0
        np.maximum(s.max_gap_s[:n], gaps, out=s.max_gap_s[:n])
        s.last_token_s[:n] = now
        s.generated[:n] += e
        s.remaining[:n] -= e
        s.context[:n] += e
        # Roll back the rejected positions' KV: keep the blocks the accepted context needs.
        keep = -(-s.context[:n] // size)
        kv.free(int((s.blocks[:n] - keep).sum()))
        s.blocks[:n] = keep
        s.proposed_total[:n] += k
        s.accepted_total[:n] += a
        spec = k > 0
        # The draft has seen its own accepted tokens except the last, when all k were accepted.
        s.lag[:n] = np.where(spec, 1 + (a == k), s.lag[:n] + 1)
        self.policy.observe(s, n, k, a, spec)
        for i in np.flatnonzero(s.remaining[:n] == 0)[::-1]:
            self.engine.finish(self._release(int(i)), now)

    def _candidate_times(self, eligible: np.ndarray, drafted: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Decode-step time for every candidate k (columns of ``drafted``, draft lengths of the
        ``eligible`` sequences, each at most its ``limit``)."""
        s, window, n = self.slots, self._window, len(eligible)
        context = s.context[:n]
        seen = np.minimum(context, window) if window else context
        cs = seen[eligible][:, None]
        spec = drafted > 0
        t = (drafted + 1) * spec
        verify_tokens = t.sum(axis=0)
        plain = n - spec.sum(axis=0)
        kv_plain = float((seen + 1).sum()) - ((cs + 1) * spec).sum(axis=0)
        rows = batch_rows(verify_tokens, attention_pairs(t, cs).sum(axis=0), ((cs + t) * spec).sum(axis=0),
                          verify_tokens, plain, kv_plain, self.engine.cost.model)
        verify_s = self.engine.cost.iteration(rows)[0]
        if self.draft_cost is None:
            return verify_s
        # Draft step j runs the sequences that can still draft j + 1 tokens, whatever k is chosen.
        steps = sequential_decode_rows(limit, cs, drafted.shape[1] - 1)
        draft_s = np.concatenate([[0.0], np.cumsum(self.draft_cost.iteration(steps)[0])])
        return np.maximum(verify_s, draft_s) + self._handoff_s if self._separate else verify_s + draft_s

    # -- end of run -------------------------------------------------------------------------------
    def close(self, gaps: InterTokenGaps) -> None:
        s = self.slots
        for i in range(s.n):
            request = s.requests[i]
            request.generated = int(s.generated[i])
            request.draft_tokens += int(s.proposed_total[i])
            request.accepted_tokens += int(s.accepted_total[i])
        if self._step_gaps_s:
            lengths = [len(g) for g in self._step_gaps_s]
            each = np.concatenate(self._step_gaps_s)
            gaps.add(np.repeat(self._step_ends_s, lengths), each, np.ones(len(each)))
            gaps.add(self._step_ends_s, np.zeros(len(self._step_ends_s)), self._burst_tokens)

