"""A replica that decodes speculatively inside continuous batching.

Scheduling (admission, chunked prefill, preemption, timeouts) is the plain replica's.
What changes is the decode step. Each decoding sequence gets a draft length k from
the policy (0 when it is not eligible, or when speculation is off for this step), so
one iteration may mix speculating and plainly decoding sequences:

1. the draft runs ``max k`` sequential steps over the sequences still drafting at each
   step (its first step also catches up on tokens it has not seen, and the draft
   prefills every prompt chunk the target prefills);
2. the target verifies: a speculating sequence is a chunk of ``k + 1`` positions over
   its context (it writes KV for all of them), a plain one decodes one token;
3. the acceptance process decides each sequence's accepted prefix ``a``; it emits
   ``a + 1`` tokens, keeps KV for them and gives back the blocks of the rejected tail.

With the draft on the target's devices the iteration lasts draft + verify; with the
draft on devices of its own the two overlap as a producer-consumer pipeline (the
draft proposes the next step while the target verifies this one), so it lasts the
longer of the two plus a hand-off. Variable tokens per step rule out the plain
engine's closed-form bookkeeping, so the decoding sequences live in packed numpy
arrays (:class:`DecodeSlots`) and every step is a handful of vector operations.
"""
from __future__ import annotations

import numpy as np

from llmsim.sim.engine import Replica
from llmsim.cost.features import F, FEATURES
from llmsim.sim.request import Request
from llmsim.speculation.config import SpeculationConfig, expected_tokens_per_step

_INT_FIELDS = ("context", "generated", "remaining", "blocks", "request_id", "k_policy", "k", "emitted",
               "accepted", "lag", "window_proposed", "window_accepted", "window_rounds", "backoff",
               "proposed_total", "accepted_total")
MAX_BACKOFF = 5                                   # the adaptive rule's longest time off: 2^5 windows
_FLOAT_FIELDS = ("alpha", "last_token_s", "max_gap_s", "seen_accepted", "seen_rejected")


class DecodeSlots:
    """The replica's decoding sequences as parallel arrays, packed in rows ``[0, n)``.

    ``context`` is the KV length (tokens whose keys and values are stored), ``lag``
    the tokens the draft has not processed yet, ``k_policy`` a per-request adaptive k,
    ``k`` / ``emitted`` / ``accepted`` this step's draft length and outcome, the
    ``window_*`` fields the adaptive rule's current window, ``backoff`` its failed probes in a
    row since it turned speculation off, and ``seen_*`` the goodput
    policy's decayed acceptance counts. Removing a row moves the last one into it.
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


class SpeculativeReplica(Replica):
    """A :class:`~llmsim.engine.Replica` whose decode steps speculate (see the module docstring)."""

    def __init__(self, env, index, cost, kv, queue, config, on_done, speculation: SpeculationConfig,
                 draft_cost, acceptance_key: int, micro_batch: int = 0):
        super().__init__(env, index, cost, kv, queue, config, on_done, micro_batch)
        self.spec, self.policy = speculation, speculation.policy
        self.draft_cost = draft_cost                 # None: an n-gram speculator, free
        self.key = acceptance_key
        self.slots = DecodeSlots()
        self._separate = speculation.placement == "separate" and draft_cost is not None
        self._handoff_s = cost.hardware.interconnect_latency_s if self._separate else 0.0
        self._force_plain = False                    # this step's reservation could not hold k tokens
        self._batch_k = self.policy.k                # adaptive per batch
        self._batch_window = [0, 0, 0]               # proposed, accepted, rounds
        self._batch_backoff = 0
        self._pooled = [0.0, 0.0]                    # goodput: decayed accepted, rejected over the batch
        self._decay = 0.5 ** (1.0 / self.policy.window)
        self._plain_rounds = 0                       # goodput: steps in a row it chose k = 0
        self._xd = np.zeros(len(FEATURES))
        self._step_gaps_s: list[np.ndarray] = []     # per decode step: each sequence's gap
        self._step_ends_s: list[float] = []
        self._burst_tokens: list[int] = []           # per decode step: tokens beyond one per sequence

    # -- decode set -----------------------------------------------------------------------------
    def _start_decode(self, request: Request) -> None:
        s = self.slots
        i = s.add(request)
        s.context[i] = request.prefill_target
        s.generated[i] = request.generated
        s.remaining[i] = request.output_tokens - request.generated
        s.blocks[i] = request.blocks
        s.request_id[i] = request.id
        s.alpha[i] = request.alpha
        s.k_policy[i] = self.policy.k
        s.lag[i] = 1                                 # the token just sampled is new to the draft
        s.last_token_s[i] = request.last_token_s
        s.max_gap_s[i] = request.max_itl_s
        self.n_decode += 1

    def _end_decode(self, request: Request, step: int) -> None:
        """Leave the decode set (preemption): hand the arrays' state back to the request."""
        self._release(request.slot)

    def _release(self, i: int) -> Request:
        s = self.slots
        request = s.requests[i]
        request.generated = int(s.generated[i])
        request.blocks = int(s.blocks[i])
        request.last_token_s = float(s.last_token_s[i])
        request.max_itl_s = float(s.max_gap_s[i])
        request.draft_tokens += int(s.proposed_total[i])
        request.accepted_tokens += int(s.accepted_total[i])
        s.remove(i)
        self.n_decode -= 1
        return request

    # -- a step: choose k, reserve KV ---------------------------------------------------------------
    def _prepare_decode(self, now: float) -> int:
        """Choose each sequence's k and reserve KV for its k + 1 positions; returns the decode tokens.

        When the free blocks cannot hold the speculative positions the step decodes
        plainly; when they cannot hold even that, the latest admitted request is preempted.
        """
        s, kv, size = self.slots, self.kv, self.kv.block_size
        while True:
            n = self.n_decode
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
                self._preempt(next(reversed(self.running.values())), now)
        self._force_plain = False
        kv.allocate(total)
        s.blocks[:n] += need
        s.k[:n] = k
        return n + int(k.sum())

    def _choose_k(self, n: int) -> np.ndarray:
        s, policy, rule = self.slots, self.policy, self.spec.eligibility
        if self._force_plain or len(self.running) < rule.min_concurrent_requests:
            return np.zeros(n, dtype=np.int64)
        eligible = s.context[:n] + 1 > rule.min_sequence_tokens
        if not eligible.any():
            return np.zeros(n, dtype=np.int64)
        if policy.policy == "static":
            k = np.full(n, policy.k)
        elif policy.policy == "adaptive":
            k = s.k_policy[:n].copy() if policy.scope == "per_request" else np.full(n, self._batch_k)
        else:
            k = np.full(n, self._goodput_k(n, eligible))
        # Never draft past the last token asked for, nor past the iteration's token budget.
        k = np.where(eligible, np.minimum(k, s.remaining[:n] - 1), 0)
        budget = self.config.max_batch_tokens - n
        if k.sum() > budget:
            cap = int(k.max())
            while cap > 0 and np.minimum(k, cap).sum() > budget:
                cap -= 1
            k = np.minimum(k, cap)
        return k

    # -- a step: price it -----------------------------------------------------------------------
    def _price(self, chunks, decoding: bool) -> float:
        pre_tokens, pairs, pre_kv, logits = self._prefill_sums(chunks)
        n = self.n_decode if decoding else 0
        s, window = self.slots, self._window
        verify = np.zeros(4)                          # tokens, pairs, KV read, logits of verifying sequences
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
                verify = self._verify_sums(ks, cs)
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
        tokens = pre_tokens + plain + verify[0]
        x = self._x
        x[1:] = (tokens, pre_tokens + verify[0], pairs + verify[1], pre_kv + verify[2], plain, decode_kv,
                 self._experts_touched(tokens) if self._moe else 1.0, plain + logits + verify[3])
        duration, flops, moved = self.cost.iteration(x)
        draft_s = 0.0
        if self.draft_cost is not None and (draft_x is not None or chunks):
            if draft_x is None:                       # the draft prefills what the target prefills
                draft_x = self._xd.copy()[None, :]
                draft_x[0, F["one"]] = draft_x[0, F["experts_touched"]] = 1.0
            row = draft_x[0]
            row[F["tokens"]] += pre_tokens
            row[F["prefill_tokens"]] += pre_tokens
            row[F["prefill_pairs"]] += pairs
            row[F["prefill_kv_read"]] += pre_kv
            times, draft_flops, draft_bytes = self.draft_cost.iteration(draft_x)
            draft_s = float(times.sum())
            flops, moved = flops + float(draft_flops.sum()), moved + float(draft_bytes.sum())
            duration = max(duration, draft_s) + self._handoff_s if self._separate else duration + draft_s
        self.log.append((self.now, duration, n, len(chunks), pre_tokens, emitted + logits, flops, moved,
                         self.kv.used_blocks, len(self.running), len(self.queue), n_spec, proposed, accepted,
                         draft_s))
        return duration

    @staticmethod
    def _verify_sums(k: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Verification as prefill work: k + 1 positions over each context (tokens, pairs, KV, logits)."""
        t = k + 1
        return np.array([t.sum(), (t * context + t * (t + 1) / 2).sum(), (context + t).sum(), t.sum()], dtype=float)

    def _draft_rows(self, k: np.ndarray, context: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """Feature rows of the draft's ``max k`` sequential steps; step j runs the sequences with k > j.

        Step 0 also feeds the draft the tokens it has not seen (``lag - 1`` beyond the one
        every step feeds), as a short prefill.
        """
        j = np.arange(int(k.max()))
        drafting = k[:, None] > j
        count = drafting.sum(axis=0)
        rows = np.zeros((len(j), len(FEATURES)))
        rows[:, F["one"]] = rows[:, F["experts_touched"]] = 1.0
        rows[:, F["tokens"]] = rows[:, F["decode_seqs"]] = rows[:, F["logit_tokens"]] = count
        rows[:, F["decode_kv_read"]] = ((context[:, None] + j + 1) * drafting).sum(axis=0)
        behind = lag - 1
        if behind.any():
            rows[0, F["tokens"]] += behind.sum()
            rows[0, F["prefill_tokens"]] += behind.sum()
            rows[0, F["prefill_pairs"]] += (behind * context).sum()
            rows[0, F["prefill_kv_read"]] += ((context + behind) * (behind > 0)).sum()
        return rows

    # -- a step: apply its outcome ----------------------------------------------------------------
    def _advance_decodes(self, now: float) -> None:
        n = self.n_decode
        if not n:
            return
        s, size = self.slots, self.kv.block_size
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
        self.kv.free(int((s.blocks[:n] - keep).sum()))
        s.blocks[:n] = keep
        s.proposed_total[:n] += k
        s.accepted_total[:n] += a
        spec = k > 0
        # The draft has seen its own accepted tokens except the last, when all k were accepted.
        s.lag[:n] = np.where(spec, 1 + (a == k), s.lag[:n] + 1)
        self._observe(n, k, a, spec)
        self.step += 1
        for i in np.flatnonzero(s.remaining[:n] == 0)[::-1]:
            self._finish(self._release(int(i)), now)

    def _observe(self, n: int, k: np.ndarray, a: np.ndarray, spec: np.ndarray) -> None:
        """Feed this step's acceptance to the policy."""
        policy, s = self.policy, self.slots
        if policy.policy == "adaptive" and policy.scope == "per_request":
            s.window_proposed[:n] += k
            s.window_accepted[:n] += a
            s.window_rounds[:n] += spec | (s.k_policy[:n] == 0)
            due = np.flatnonzero(s.window_rounds[:n] >= self._window_rounds(s.k_policy[:n], s.backoff[:n]))
            if len(due):
                rate = s.window_accepted[due] / np.maximum(s.window_proposed[due], 1)
                s.k_policy[due], s.backoff[due] = self._adapt(s.k_policy[due], s.backoff[due], rate,
                                                              s.window_proposed[due] > 0)
                s.window_proposed[due] = s.window_accepted[due] = s.window_rounds[due] = 0
        elif policy.policy == "adaptive":
            window = self._batch_window
            window[0] += int(k.sum())
            window[1] += int(a.sum())
            window[2] += bool(spec.any()) or self._batch_k == 0
            if window[2] >= self._window_rounds(self._batch_k, self._batch_backoff):
                rate = np.array([window[1] / max(window[0], 1)])
                k_new, backoff = self._adapt(np.array([self._batch_k]), np.array([self._batch_backoff]), rate,
                                             np.array([window[0] > 0]))
                self._batch_k, self._batch_backoff = int(k_new[0]), int(backoff[0])
                self._batch_window = [0, 0, 0]
        elif policy.policy == "goodput" and spec.any():
            decay, rejected = self._decay, a < k
            s.seen_accepted[:n] = np.where(spec, decay * s.seen_accepted[:n] + a, s.seen_accepted[:n])
            s.seen_rejected[:n] = np.where(spec, decay * s.seen_rejected[:n] + rejected, s.seen_rejected[:n])
            self._pooled = [decay * self._pooled[0] + float(a[spec].sum()),
                            decay * self._pooled[1] + float(rejected[spec].sum())]

    def _window_rounds(self, k, backoff):
        """Rounds in the adaptive rule's window: ``window`` while speculating; while off, twice
        as many after each probe at k = 1 that failed in a row (at most 2^MAX_BACKOFF windows)."""
        return np.where(k == 0, self.policy.window << np.minimum(backoff, MAX_BACKOFF), self.policy.window)

    def _adapt(self, k: np.ndarray, backoff: np.ndarray, rate: np.ndarray,
               observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The 80/50 rule on one window: up above ``raise_above``, down below ``lower_below``.

        Returns the new k and back-off: a window spent off probes again with k = 1; a probe
        that turns speculation off again counts one more failure, a window that keeps
        speculating clears them.
        """
        policy = self.policy
        up = observed & (rate > policy.raise_above) & (k > 0)
        down = observed & (rate < policy.lower_below) & (k > 0)
        new = np.where(up, np.minimum(k + 1, policy.k_max), np.where(down, k - 1, k))
        new = np.maximum(new, 0 if policy.fallback else 1)
        backoff = np.where(k == 0, backoff, np.where(new == 0, backoff + 1, 0))
        return np.where(k == 0, 1, new), backoff

    def _goodput_k(self, n: int, eligible: np.ndarray) -> int:
        """The k in [0, k_max] with the most expected tokens per second of decode for this batch.

        Acceptance per request is estimated from its recent verify steps (accepted /
        (accepted + rejections), the per-token rate's maximum-likelihood estimate,
        decayed with a half-life of ``window`` rounds) shrunk towards the batch's pooled
        estimate, which itself starts at ``prior_alpha``. Steps are priced by the cost
        model for every candidate k at once; the prompt chunks that may join the
        iteration are not known yet and are left out.
        """
        s, policy = self.slots, self.policy
        pooled = (self._pooled[0] + 4 * policy.prior_alpha) / (self._pooled[0] + self._pooled[1] + 4)
        acc, rej = s.seen_accepted[:n][eligible], s.seen_rejected[:n][eligible]
        alpha = np.minimum((acc + 2 * pooled) / (acc + rej + 2), 1.0 - 1e-9)
        ks = np.arange(policy.k_max + 1)
        limit = s.remaining[:n][eligible] - 1
        drafted = np.minimum(ks[None, :], limit[:, None])                 # (eligible sequences, candidates)
        tokens = expected_tokens_per_step(alpha[:, None], drafted).sum(axis=0) + (n - len(limit))
        time_s = self._candidate_times(n, eligible, drafted, limit)
        best = int(np.argmax(tokens / time_s))
        if best == 0:
            # Without speculating nothing is learnt: try k = 1 after a window of plain steps.
            self._plain_rounds += 1
            if self._plain_rounds >= policy.window:
                self._plain_rounds, best = 0, 1
        else:
            self._plain_rounds = 0
        return best

    def _candidate_times(self, n: int, eligible: np.ndarray, drafted: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Decode-step time for every candidate k (columns of ``drafted``)."""
        s, window = self.slots, self._window
        context = s.context[:n]
        seen = np.minimum(context, window) if window else context
        cs = seen[eligible][:, None]
        spec = drafted > 0
        t = (drafted + 1) * spec
        verify_tokens = t.sum(axis=0)
        plain = n - spec.sum(axis=0)
        kv_plain = float((seen + 1).sum()) - ((cs + 1) * spec).sum(axis=0)
        rows = np.zeros((drafted.shape[1], len(FEATURES)))
        rows[:, F["one"]] = rows[:, F["experts_touched"]] = 1.0
        rows[:, F["tokens"]] = plain + verify_tokens
        rows[:, F["prefill_tokens"]] = verify_tokens
        rows[:, F["prefill_pairs"]] = (t * cs + t * (t + 1) / 2).sum(axis=0)
        rows[:, F["prefill_kv_read"]] = ((cs + t) * spec).sum(axis=0)
        rows[:, F["decode_seqs"]] = plain
        rows[:, F["decode_kv_read"]] = kv_plain
        rows[:, F["logit_tokens"]] = plain + verify_tokens
        if self._moe:
            rows[:, F["experts_touched"]] = self._experts_touched(rows[:, F["tokens"]])
        verify_s = self.cost.iteration(rows)[0]
        if self.draft_cost is None:
            return verify_s
        # Draft step j runs the sequences that can still draft j + 1 tokens, whatever k is chosen.
        j = np.arange(drafted.shape[1] - 1)
        drafting = limit[:, None] > j
        steps = np.zeros((len(j), len(FEATURES)))
        steps[:, F["one"]] = steps[:, F["experts_touched"]] = 1.0
        steps[:, F["tokens"]] = steps[:, F["decode_seqs"]] = steps[:, F["logit_tokens"]] = drafting.sum(axis=0)
        steps[:, F["decode_kv_read"]] = ((cs + j + 1) * drafting).sum(axis=0)
        draft_s = np.concatenate([[0.0], np.cumsum(self.draft_cost.iteration(steps)[0])])
        return np.maximum(verify_s, draft_s) + self._handoff_s if self._separate else verify_s + draft_s

    # -- end of run -------------------------------------------------------------------------------
    def close(self) -> None:
        s = self.slots
        for i in range(s.n):
            request = s.requests[i]
            request.generated = int(s.generated[i])
            request.draft_tokens += int(s.proposed_total[i])
            request.accepted_tokens += int(s.accepted_total[i])
        if self._step_gaps_s:
            lengths = [len(g) for g in self._step_gaps_s]
            gaps = np.concatenate(self._step_gaps_s)
            self.gaps.add(np.repeat(self._step_ends_s, lengths), gaps, np.ones(len(gaps)))
            self.gaps.add(self._step_ends_s, np.zeros(len(self._step_ends_s)), self._burst_tokens)
        self.gaps.add(self._first_gap_end_s, self._first_gap_s, np.ones(len(self._first_gap_s)))
