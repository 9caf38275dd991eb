"""One replica of a serving engine: iteration-level scheduling over a paged KV cache.

The replica is a SimPy process. Each loop turn is one engine iteration: the
scheduler picks a batch, the cost model prices it, simulated time advances by
that much, and the batch's tokens appear at the end of it. Time therefore moves
per iteration, never per token per request.

Continuous batching (Orca, vLLM) works as vLLM's V1 scheduler does: running
sequences decode one token each; chunked prefill fills the rest of the token
budget ``max_batch_tokens``; new requests join from the queue while there is
budget, a free sequence slot (``max_num_seqs``) and KV blocks for their first
chunk. Without chunked prefill the engine alternates, prefill-first, between
prefill-only and decode-only iterations (vLLM V0). When decoding sequences
need a new block and none is free, the most recently admitted sequence is
preempted and later recomputed. A queue timeout either forces an old request
into the next iteration past the token budget or rejects it.

Static batching is the request-level baseline (FasterTransformer, early TGI): a
batch is formed when the engine is free, reserves KV for every request's full
length, prefills together padded to the longest prompt and decodes padded to
the longest output; nobody joins until the whole batch is done.

Bookkeeping is per event, not per token: the replica counts its decode
iterations ("steps"), and a sequence that starts decoding at step ``s0`` with
``r`` tokens to go finishes at step ``s0 + r`` (a heap finds it), needs its next
KV block at a step known in advance (a dict of due steps), and has a context
length that is a closed-form function of the step. An iteration of any batch
size thus costs a few scalar operations.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np
import simpy

from llmsim.cost.roofline import CostModel
from llmsim.sim.kvcache import KVCache
from llmsim.cost.features import F, FEATURES
from llmsim.sim.request import InterTokenGaps, Request, WaitingQueue
from llmsim.scenario.scenario import EngineConfig

LOG_COLUMNS = ("start_s", "duration_s", "decode_seqs", "prefill_seqs", "prefill_tokens", "tokens_out",
               "flops", "bytes", "kv_used_blocks", "running", "queued",
               # speculative decoding (zero without it): sequences that speculated, draft tokens
               # proposed, draft tokens accepted, and the part of duration_s spent drafting
               "spec_seqs", "draft_tokens", "accepted_tokens", "draft_s")


class Replica:
    """A serving engine instance on ``tp x pp`` devices, pulling work from its waiting queue.

    With pipeline parallelism a replica runs one of these per micro-batch in flight; they
    share the replica's queue and KV cache (see ``simulation.simulate``).
    """

    def __init__(self, env: simpy.Environment, index: int, cost: CostModel, kv: KVCache,
                 queue: WaitingQueue, config: EngineConfig, on_done: Callable[[Request, float], None],
                 micro_batch: int = 0):
        self.env, self.index, self.cost, self.kv, self.queue, self.config = env, index, cost, kv, queue, config
        self.micro_batch = micro_batch              # which of the pipeline's micro-batches this engine runs
        self.on_done = on_done
        self.now = env.now                          # the replica's clock: may run ahead of env.now, see run()
        self.log: list[tuple] = []                  # one row per iteration, LOG_COLUMNS
        self.gaps = InterTokenGaps()
        self.preemptions = 0
        self._wakeup: simpy.Event | None = None
        self._admitted = 0
        self._window = cost.model.sliding_window
        self._moe = cost.model.num_experts > 1
        self._experts_touched = cost.model.expected_experts_touched
        self._block_size = kv.block_size
        self._x = np.zeros(len(FEATURES))
        self._x[F["one"]] = 1.0
        self.running: dict[int, Request] = {}       # everything admitted, in admission order
        self._static_batch: tuple[list[Request], np.ndarray] | None = None   # batch in flight, step ends
        self.prefilling: list[Request] = []         # admitted, prompt not yet fully computed
        # Decoding sequences, by event: see the module docstring.
        self.step = 0                               # decode iterations done so far
        self.n_decode = 0
        self._finishing: list[tuple[int, int, int, Request]] = []   # (finish step, order, epoch, request)
        self._block_due: dict[int, list[tuple[Request, int]]] = {}
        self._window_due: dict[int, list[tuple[Request, int]]] = {}
        self._growing = 0                           # decoding sequences whose context is below the window
        self._offset_sum = 0                        # sum of (context_start - decode_start) over those
        self._joined = 0                            # sequences whose first decode step is the next one
        self._step_end_s = np.zeros(1024)           # end time of every decode step
        self._step_gap_s = np.zeros(1024)           # and the time since the decode step before it
        self._continuing: list[int] = []            # per decode step: sequences that also decoded the step before
        self._first_gap_end_s: list[float] = []     # first decode token of each decode run: when, and its gap
        self._first_gap_s: list[float] = []
        env.process(self.run())

    # -- outside world ------------------------------------------------------------------------
    def notify(self) -> None:
        """New work may be waiting: wake the engine if it is idle."""
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def run(self):
        env, cfg = self.env, self.config
        expire = cfg.queue_timeout_s is not None and cfg.on_timeout == "reject"
        while True:
            self.now = now = env.now if self.now < env.now else self.now
            if expire:
                for request in self.queue.expire(now, cfg.queue_timeout_s):
                    request.status, request.reason = "rejected", "timeout"
                    request.finish_s = request.arrival_s + cfg.queue_timeout_s
                    self.on_done(request, now)
            if cfg.batching == "static":
                worked = yield from self._static_step()
            else:
                plan = self._schedule()
                worked = plan is not None
                if worked:
                    chunks, decoding, duration = plan
                    end = now + duration
                    # The iteration ends before any other event in the simulation (an arrival,
                    # another replica's step, the horizon): nothing can observe it, so run it
                    # without a trip through the event queue. Otherwise let SimPy order it.
                    if end >= env.peek():
                        yield env.timeout(end - env.now)
                    self.now = end
                    self._apply(chunks, decoding)
            if not worked:
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None

    def close(self) -> None:
        """End of the run: bring unfinished requests' token counts up to date and hand the
        decode-step gaps to ``self.gaps`` (call once)."""
        for request in self.running.values():
            if request.status == "running" and request not in self.prefilling and request.decode_start >= 0:
                request.generated += self.step - request.decode_start
        if self._static_batch is not None:
            batch, ends = self._static_batch
            done = int(np.searchsorted(ends, self.env.now, side="right"))   # steps completed
            for request in batch:
                if request.status == "running":
                    request.generated = min(done, request.output_tokens)
                    if done:
                        request.first_token_s = float(ends[0])
        steps = len(self._continuing)
        if steps > 1:
            self.gaps.add(self._step_end_s[1:steps], self._step_gap_s[1:steps], self._continuing[1:])
        self.gaps.add(self._first_gap_end_s, self._first_gap_s, np.ones(len(self._first_gap_s)))

    # -- continuous batching ------------------------------------------------------------------
    def _schedule(self):
        """Pick and price the next iteration: (chunks, decoding?, duration), or None if idle."""
        cfg, now = self.config, self.now
        chunks: list[tuple[Request, int]] = []
        # (The membership tests skip calls that would find nothing to do: this is the hot loop.)
        if cfg.chunked_prefill:
            budget = cfg.max_batch_tokens - self._prepare_decode(now)
            if self.prefilling:
                budget = self._schedule_prefills(budget, chunks)
            if self.queue:
                self._admit(now, budget, chunks)
            decoding = True
        else:
            # Prefill-first: any admissible prompt runs in a prefill-only iteration.
            if self.queue:
                self._admit(now, cfg.max_batch_tokens, chunks)
            decoding = not chunks
            if decoding:
                self._prepare_decode(now)
        decoding = decoding and self.n_decode > 0      # admission may have preempted decoders
        if not decoding and not chunks:
            return None
        return chunks, decoding, self._price(chunks, decoding)

    def _prepare_decode(self, now: float) -> int:
        """Make room for this step's decode tokens; returns how many tokens they are."""
        if self.step in self._block_due:
            self._reserve_decode_blocks(now)
        return self.n_decode

    def _prefill_sums(self, chunks) -> tuple[float, float, float, int]:
        """Prefill chunks as cost features: (tokens, attention pairs, KV read, prompts completed)."""
        pre_tokens = pairs = pre_kv = 0.0
        logits = 0
        window = self._window
        for request, chunk in chunks:
            seen = request.prefilled if not window else min(request.prefilled, window)
            pre_tokens += chunk
            pairs += chunk * seen + chunk * (chunk + 1) / 2
            pre_kv += seen + chunk
            logits += request.prefilled + chunk == request.prefill_target
        return pre_tokens, pairs, pre_kv, logits

    def _price(self, chunks, decoding: bool) -> float:
        """Cost one iteration (prefill chunks plus, if ``decoding``, a token per decoder) and log it."""
        n = self.n_decode if decoding else 0
        pre_tokens, pairs, pre_kv, logits = self._prefill_sums(chunks)
        # Each decoding sequence reads its whole context plus the new token (capped by the window).
        window = self._window
        decode_kv = (self._offset_sum + self._growing * (self.step + 1)
                     + (n - self._growing) * (window or 0)) if n else 0
        tokens = pre_tokens + n
        x = self._x
        x[1:] = (tokens, pre_tokens, pairs, pre_kv, n, decode_kv,
                 self._experts_touched(tokens) if self._moe else 1.0, n + logits)
        duration, flops, moved = self.cost.iteration(x)
        self.log.append((self.now, duration, n, len(chunks), pre_tokens, n + logits, flops, moved,
                         self.kv.used_blocks, len(self.running), len(self.queue), 0, 0, 0, 0.0))
        return duration

    def _reserve_decode_blocks(self, now: float) -> None:
        """Give every decoding sequence due a new block this step its block, preempting if they run out."""
        due = self._block_due.pop(self.step)
        while True:
            # Entries of preempted sequences are stale (their epoch moved on).
            valid = [(r, e) for r, e in due if r.epoch == e and r.status == "running"]
            if len(valid) <= self.kv.free_blocks:
                break
            self._preempt(next(reversed(self.running.values())), now)
        self.kv.allocate(len(valid))
        next_due = self.step + self._block_size
        later = self._block_due.setdefault(next_due, [])
        for entry in valid:
            request = entry[0]
            request.blocks += 1
            if next_due < request.finish_step:
                later.append(entry)

    def _due(self, table: dict, step: int, request: Request, epoch: int) -> None:
        if step < request.finish_step:
            table.setdefault(step, []).append((request, epoch))

    def _schedule_prefills(self, budget: int, chunks: list) -> int:
        """Continue prompts already admitted (in admission order) with what the budget allows."""
        for request in list(self.prefilling):
            if budget <= 0:
                break
            if request.status != "running":          # preempted while making room for an earlier one
                continue
            chunk = min(request.prefill_target - request.prefilled, budget)
            if not self._grow(request, chunk):
                continue
            chunks.append((request, chunk))
            budget -= chunk
        return budget

    def _grow(self, request: Request, chunk: int) -> bool:
        """Allocate blocks for ``chunk`` more tokens of a prefilling request; preempt later ones if needed."""
        kv = self.kv
        while True:
            wanted = kv.blocks_for(request.prefilled + chunk) - request.blocks
            if wanted <= kv.free_blocks:
                kv.allocate(wanted)
                request.blocks += wanted
                return True
            latest = next(reversed(self.running.values()))
            self._preempt(latest, self.now)
            if latest is request:
                return False

    def _admit(self, now: float, budget: int, chunks: list) -> None:
        """Move requests from the queue head into the batch while budget, slots and blocks allow."""
        cfg, kv, queue = self.config, self.kv, self.queue
        timeout = cfg.queue_timeout_s if cfg.on_timeout == "dispatch" else None
        while queue and len(self.running) < cfg.max_num_seqs:
            request = queue.head()
            todo = request.prefill_target - request.prefilled
            forced = timeout is not None and now - request.arrival_s >= timeout
            limit = max(budget, cfg.max_batch_tokens) if forced else budget
            chunk = min(todo, limit) if cfg.chunked_prefill else todo
            if chunk <= 0 or chunk > limit:
                break
            wanted = kv.blocks_for(chunk)
            if wanted > kv.free_blocks:
                break
            queue.pop(now)
            kv.allocate(wanted)
            request.blocks = wanted
            request.status = "running"
            request.admit_order = self._admitted
            self._admitted += 1
            if request.first_scheduled_s != request.first_scheduled_s:   # NaN: first time
                request.first_scheduled_s = now
            self.running[request.id] = request
            self.prefilling.append(request)
            chunks.append((request, chunk))
            budget -= chunk

    # -- applying an iteration's results ---------------------------------------------------------
    def _apply(self, chunks, decoding: bool) -> None:
        now = self.now
        if decoding:
            self._advance_decodes(now)
        self._complete_chunks(chunks, now)

    def _advance_decodes(self, now: float) -> None:
        """One token for every decoding sequence: finish those due, saturate sliding windows."""
        n = self.n_decode
        if n:
            step = self.step
            if step >= len(self._step_end_s):
                self._step_end_s = np.concatenate([self._step_end_s, np.zeros(len(self._step_end_s))])
                self._step_gap_s = np.concatenate([self._step_gap_s, np.zeros(len(self._step_gap_s))])
            self._step_end_s[step] = now
            if step:
                self._step_gap_s[step] = now - self._step_end_s[step - 1]
            self._continuing.append(n - self._joined)
            self._joined = 0
            self.step = step = step + 1
            finishing = self._finishing
            while finishing and finishing[0][0] <= step:
                _, _, epoch, request = heapq.heappop(finishing)
                if request.epoch == epoch and request.status == "running":
                    self._end_decode(request, step)
                    self._finish(request, now)
            saturating = self._window_due.pop(step, None)
            if saturating:
                for request, epoch in saturating:
                    if request.epoch == epoch and request.status == "running":
                        request.growing = False
                        self._growing -= 1
                        self._offset_sum -= request.context_start - request.decode_start

    def _complete_chunks(self, chunks, now: float) -> None:
        """Prefill chunks done: a prompt that is complete gives its first token and starts decoding."""
        for request, chunk in chunks:
            request.prefilled += chunk
            if request.prefilled < request.prefill_target:
                continue
            self.prefilling.remove(request)
            if request.generated == 0:
                request.first_token_s = now
            else:
                request.max_itl_s = max(request.max_itl_s, now - request.last_token_s)
                self._first_gap_end_s.append(now)
                self._first_gap_s.append(now - request.last_token_s)
            request.generated += 1
            request.last_token_s = now
            if request.generated >= request.output_tokens:
                self._finish(request, now)
            else:
                self._start_decode(request)

    def _start_decode(self, request: Request) -> None:
        step = self.step
        request.epoch += 1
        request.decode_start = step
        request.context_start = context = request.prefill_target
        request.finish_step = step + request.output_tokens - request.generated
        heapq.heappush(self._finishing, (request.finish_step, request.admit_order, request.epoch, request))
        # The step at which the context reaches the end of the last allocated block.
        self._due(self._block_due, step + request.blocks * self._block_size - context, request, request.epoch)
        window = self._window
        request.growing = not window or context + 1 < window   # else it already reads a full window
        if request.growing:
            self._growing += 1
            self._offset_sum += context - step
            if window:
                self._due(self._window_due, step + window - 1 - context, request, request.epoch)
        self.n_decode += 1
        self._joined += 1

    def _end_decode(self, request: Request, step: int) -> None:
        """Close a decode run at ``step``: tokens generated, KV length, its inter-token gaps."""
        start = request.decode_start
        done = step - start
        request.generated += done
        request.epoch += 1                           # its heap and due-step entries are now stale
        if request.growing:
            request.growing = False
            self._growing -= 1
            self._offset_sum -= request.context_start - start
        self.n_decode -= 1
        if start == self.step:
            self._joined -= 1                        # left before its first decode step
        if done:
            ends = self._step_end_s
            first = ends[start] - request.last_token_s
            self._first_gap_end_s.append(float(ends[start]))
            self._first_gap_s.append(float(first))
            longest = float(self._step_gap_s[start + 1:step].max()) if done > 1 else 0.0
            request.max_itl_s = max(request.max_itl_s, first, longest)
            request.last_token_s = float(ends[step - 1])

    def _finish(self, request: Request, now: float) -> None:
        self.kv.free(request.blocks)
        request.blocks = 0
        request.generated = request.output_tokens
        request.finish_s = now
        request.status = "finished"
        del self.running[request.id]
        self.on_done(request, now)

    # -- preemption -----------------------------------------------------------------------------
    def _preempt(self, request: Request, now: float) -> None:
        """Free the request's KV and send it back to the queue front to be recomputed."""
        if request in self.prefilling:
            self.prefilling.remove(request)
        else:
            self._end_decode(request, self.step)
        self.kv.free(request.blocks)
        del self.running[request.id]
        request.prefill_target = request.prompt_tokens + request.generated
        request.prefilled = 0
        request.blocks = 0
        request.preemptions += 1
        self.preemptions += 1
        self.queue.push_front(request, now)

    # -- static batching ------------------------------------------------------------------------
    def _static_step(self):
        """Form and run one request-level batch. False when the queue is empty."""
        cfg, kv, queue, now = self.config, self.kv, self.queue, self.env.now
        batch: list[Request] = []
        while queue and len(batch) < cfg.max_num_seqs:
            request = queue.head()
            wanted = kv.blocks_for(request.prompt_tokens + request.output_tokens)
            if wanted > kv.free_blocks:
                break
            queue.pop(now)
            kv.allocate(wanted)
            request.blocks, request.status, request.first_scheduled_s = wanted, "running", now
            batch.append(request)
        if not batch:
            return False
        size = len(batch)
        held_blocks = sum(r.blocks for r in batch)
        longest_prompt = max(r.prompt_tokens for r in batch)
        longest_output = max(r.output_tokens for r in batch)
        # Every step of the batch, priced at once: one padded prefill, then padded decode steps.
        steps = np.array([self.cost.features([longest_prompt] * size, [0] * size, [])]
                         + [self.cost.features([], [], [longest_prompt + j] * size)
                            for j in range(longest_output - 1)])
        durations, flops, moved = self.cost.iteration(steps)
        ends = now + np.cumsum(durations)
        count = len(durations)
        lengths = np.array([r.output_tokens for r in batch])
        useful = (lengths[None, :] > np.arange(count)[:, None]).sum(axis=1)   # padding emits nothing
        self.log.extend(zip((ends - durations).tolist(), durations.tolist(), [0] + [size] * (count - 1),
                            [size] + [0] * (count - 1), [size * longest_prompt] + [0] * (count - 1),
                            useful.tolist(), flops.tolist(), moved.tolist(), [kv.used_blocks] * count,
                            [size] * count, [len(queue)] * count, *([[0] * count] * 3), [0.0] * count))
        # Decode step j gives a token, after a gap of its duration, to every request still generating.
        self.gaps.add(ends[1:], durations[1:], useful[1:])
        gap_max = np.maximum.accumulate(np.concatenate([[0.0], durations[1:]]))
        self._static_batch = (batch, ends)
        # Requests leave in the order their own last token appears. The batch holds its KV until
        # the longest one is done, which is when the batch ends.
        leaving = sorted(batch, key=lambda r: r.output_tokens)
        for request in leaving:
            last = request.output_tokens - 1
            yield self.env.timeout(max(float(ends[last]) - self.env.now, 0.0))
            request.first_token_s = float(ends[0])
            request.max_itl_s = float(gap_max[last])
            request.blocks = 0
            request.generated = request.output_tokens
            request.finish_s = self.env.now
            request.status = "finished"
            if request is leaving[-1]:
                self.kv.free(held_blocks)
                self._static_batch = None
            self.on_done(request, self.env.now)
        return True
