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

Decoding sequences live in numpy arrays (one slot each) so that one iteration
costs a handful of vector operations, whatever the batch size.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import simpy

from .costmodel import CostModel
from .kvcache import KVCache
from .models import F, FEATURES
from .request import GapHistogram, Request, WaitingQueue
from .scenario import EngineConfig


class IterationLog:
    """One row per iteration, kept as plain lists (appending is the cheapest record)."""

    COLUMNS = ("start_s", "duration_s", "decode_seqs", "prefill_seqs", "prefill_tokens", "tokens_out",
               "flops", "bytes", "kv_used_blocks", "running", "queued")

    def __init__(self):
        self.columns = {name: [] for name in self.COLUMNS}
        self._append = [self.columns[name].append for name in self.COLUMNS]

    def add(self, *values) -> None:
        for append, value in zip(self._append, values):
            append(value)

    def extend(self, **columns) -> None:
        for name, values in columns.items():
            self.columns[name].extend(values)


class Replica:
    """A serving engine instance on ``tp x pp`` devices, pulling work from its waiting queue."""

    def __init__(self, env: simpy.Environment, index: int, cost: CostModel, kv: KVCache,
                 queue: WaitingQueue, config: EngineConfig, on_done: Callable[[Request, float], None],
                 gaps: GapHistogram):
        self.env, self.index, self.cost, self.kv, self.queue, self.config = env, index, cost, kv, queue, config
        self.on_done = on_done
        self.log = IterationLog()
        self.gaps = gaps                       # inter-token gaps of every token (steady-state window)
        self.preemptions = 0
        self._wakeup: simpy.Event | None = None
        self._admitted = 0
        self._window = cost.model.sliding_window
        cap = config.max_num_seqs
        # Decoding sequences, one slot each, compact in [0, n_decode).
        self.n_decode = 0
        self.slot_request: list[Request | None] = [None] * cap
        self.context = np.zeros(cap, dtype=np.int64)      # tokens in this sequence's KV cache
        self.remaining = np.zeros(cap, dtype=np.int64)    # tokens still to generate
        self.blocks = np.zeros(cap, dtype=np.int64)       # KV blocks held
        self.order = np.zeros(cap, dtype=np.int64)        # admission order (preemption victim choice)
        self.max_gap = np.zeros(cap)                      # longest inter-token gap so far
        self.last_token_s = np.zeros(cap)                 # when the sequence last emitted a token
        self.prefilling: list[Request] = []               # admitted, prompt not yet fully computed
        self._x = np.zeros(len(FEATURES))
        self._x[F["one"]] = 1.0
        env.process(self.run())

    # -- outside world ------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self.n_decode + len(self.prefilling)

    @property
    def idle(self) -> bool:
        return self._wakeup is not None

    def notify(self) -> None:
        """New work may be waiting: wake the engine if it is idle."""
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def run(self):
        step = self._continuous_step if self.config.batching == "continuous" else self._static_step
        while True:
            if self.config.queue_timeout_s is not None and self.config.on_timeout == "reject":
                for request in self.queue.expire(self.env.now, self.config.queue_timeout_s):
                    request.status, request.reason = "rejected", "timeout"
                    request.finish_s = request.arrival_s + self.config.queue_timeout_s
                    self.on_done(request, self.env.now)
            worked = yield from step()
            if not worked:
                self._wakeup = self.env.event()
                yield self._wakeup
                self._wakeup = None

    # -- continuous batching ------------------------------------------------------------------
    def _continuous_step(self):
        """One iteration: schedule, advance time by its cost, apply. False when there is nothing to do."""
        cfg, kv, now = self.config, self.kv, self.env.now
        decoding = True
        chunks: list[tuple[Request, int]] = []
        if cfg.chunked_prefill:
            budget = cfg.max_batch_tokens - self._reserve_decode_blocks(now)
            budget = self._schedule_prefills(budget, chunks)
            self._admit(now, budget, chunks)
        else:
            # Prefill-first: any admissible prompt runs in a prefill-only iteration.
            self._admit(now, cfg.max_batch_tokens, chunks)
            decoding = not chunks
            if decoding:
                self._reserve_decode_blocks(now)
        n = self.n_decode if decoding else 0
        if n == 0 and not chunks:
            return False

        x = self._x
        pre_tokens = pairs = pre_kv = 0.0
        logits = 0
        for request, chunk in chunks:
            seen = request.prefilled if not self._window else min(request.prefilled, self._window)
            pre_tokens += chunk
            pairs += chunk * seen + chunk * (chunk + 1) / 2
            pre_kv += seen + chunk
            logits += request.prefilled + chunk == request.prefill_target
        if n:
            context = self.context[:n]
            decode_kv = float(context.sum()) + n if not self._window else \
                float(np.minimum(context + 1, self._window).sum())
        else:
            decode_kv = 0.0
        tokens = pre_tokens + n
        x[1:] = (tokens, pre_tokens, pairs, pre_kv, n, decode_kv,
                 self.cost.model.expected_experts_touched(tokens), n + logits)
        duration, flops, moved = self.cost.iteration(x)
        self.log.add(now, duration, n, len(chunks), pre_tokens, n + logits, flops, moved,
                     kv.used_blocks, self.running, len(self.queue))
        yield self.env.timeout(duration)
        self._apply(chunks, n, duration)
        return True

    def _reserve_decode_blocks(self, now: float) -> int:
        """Give every decoding sequence room for one more token, preempting if blocks run out."""
        while self.n_decode:
            n = self.n_decode
            needs = self.context[:n] >= self.blocks[:n] * self.kv.block_size
            wanted = int(np.count_nonzero(needs))
            if wanted <= self.kv.free_blocks:
                if wanted:
                    self.kv.allocate(wanted)
                    self.blocks[:n] += needs
                return n
            self._preempt_latest(now)
        return 0

    def _schedule_prefills(self, budget: int, chunks: list) -> int:
        """Continue prompts already admitted (in admission order) with what the budget allows."""
        for request in list(self.prefilling):
            if budget <= 0:
                break
            if request not in self.prefilling:      # preempted while making room for an earlier one
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
            if self._latest_admitted() is request:
                self._preempt(request, self.env.now)
                return False
            self._preempt_latest(self.env.now)

    def _admit(self, now: float, budget: int, chunks: list) -> None:
        """Move requests from the queue head into the batch while budget, slots and blocks allow."""
        cfg, kv, queue = self.config, self.kv, self.queue
        timeout = cfg.queue_timeout_s if cfg.on_timeout == "dispatch" else None
        while queue and self.running < cfg.max_num_seqs:
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
            if request.first_scheduled_s != request.first_scheduled_s:
                request.first_scheduled_s = now
            self.prefilling.append(request)
            chunks.append((request, chunk))
            budget -= chunk

    # -- preemption -----------------------------------------------------------------------------
    def _latest_admitted(self) -> Request | None:
        best = self.prefilling[-1] if self.prefilling else None
        if self.n_decode:
            slot = int(np.argmax(self.order[:self.n_decode]))
            if best is None or self.order[slot] > best.admit_order:
                best = self.slot_request[slot]
        return best

    def _preempt_latest(self, now: float) -> None:
        self._preempt(self._latest_admitted(), now)

    def _preempt(self, request: Request, now: float) -> None:
        """Free the request's KV and send it back to the queue front to be recomputed."""
        if request in self.prefilling:
            self.prefilling.remove(request)
            self.kv.free(request.blocks)
        else:
            slot = self.slot_request.index(request, 0, self.n_decode)
            request.generated = request.output_tokens - int(self.remaining[slot])
            request.max_itl_s = max(request.max_itl_s, float(self.max_gap[slot]))
            request.last_token_s = float(self.last_token_s[slot])
            self.kv.free(int(self.blocks[slot]))
            self._remove_slot(slot)
        request.prefill_target = request.prompt_tokens + request.generated
        request.prefilled = 0
        request.blocks = 0
        request.preemptions += 1
        self.preemptions += 1
        self.queue.push_front(request, now)

    # -- applying an iteration's results ---------------------------------------------------------
    def _apply(self, chunks, n: int, duration: float) -> None:
        now = self.env.now
        if n:
            self.context[:n] += 1
            self.remaining[:n] -= 1
            gaps = now - self.last_token_s[:n]
            np.maximum(self.max_gap[:n], gaps, out=self.max_gap[:n])
            self.last_token_s[:n] = now
            self.gaps.add(now, gaps)
            done = np.flatnonzero(self.remaining[:n] == 0)
            for slot in done[::-1]:      # from the back, so swapped-in slots are not skipped
                request = self.slot_request[slot]
                request.max_itl_s = max(request.max_itl_s, float(self.max_gap[slot]))
                self._finish(request, now, int(self.blocks[slot]))
                self._remove_slot(int(slot))
        for request, chunk in chunks:
            request.prefilled += chunk
            if request.prefilled < request.prefill_target:
                continue
            self.prefilling.remove(request)
            if request.generated == 0:
                request.first_token_s = now
            else:
                gap = now - request.last_token_s
                self.gaps.add(now, np.array([gap]))
                request.max_itl_s = max(request.max_itl_s, gap)
            request.generated += 1
            if request.generated >= request.output_tokens:
                self._finish(request, now, request.blocks)
            else:
                self._add_slot(request)

    def _finish(self, request: Request, now: float, blocks: int) -> None:
        self.kv.free(blocks)
        request.blocks = 0
        request.generated = request.output_tokens
        request.finish_s = now
        request.status = "finished"
        self.on_done(request, now)

    def _add_slot(self, request: Request) -> None:
        slot = self.n_decode
        self.slot_request[slot] = request
        self.context[slot] = request.prefill_target
        self.remaining[slot] = request.output_tokens - request.generated
        self.blocks[slot] = request.blocks
        self.order[slot] = request.admit_order
        self.max_gap[slot] = 0.0
        self.last_token_s[slot] = self.env.now
        self.n_decode += 1

    def _remove_slot(self, slot: int) -> None:
        last = self.n_decode - 1
        if slot != last:
            self.slot_request[slot] = self.slot_request[last]
            for array in (self.context, self.remaining, self.blocks, self.order, self.max_gap, self.last_token_s):
                array[slot] = array[last]
        self.slot_request[last] = None
        self.n_decode = last

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
        offsets = np.cumsum(durations)
        gap_max = np.maximum.accumulate(durations)
        # Decode step j gives a token to every request still generating (output > j + 1).
        for j in range(1, count):
            self.gaps.add(now + float(offsets[j]), np.full(int(np.count_nonzero(lengths > j)), durations[j]))
        count = len(durations)
        lengths = np.array([r.output_tokens for r in batch])
        self.log.extend(start_s=(now + offsets - durations).tolist(), duration_s=durations.tolist(),
                        decode_seqs=[0] + [size] * (count - 1), prefill_seqs=[size] + [0] * (count - 1),
                        prefill_tokens=[size * longest_prompt] + [0] * (count - 1),
                        tokens_out=(lengths[None, :] > np.arange(count)[:, None]).sum(axis=1).tolist(),
                        flops=flops.tolist(), bytes=moved.tolist(), kv_used_blocks=[kv.used_blocks] * count,
                        running=[size] * count, queued=[len(queue)] * count)
        # Requests leave in the order their own last token appears; the batch holds its KV until the end.
        for request in sorted(batch, key=lambda r: r.output_tokens):
            last = request.output_tokens - 1
            yield self.env.timeout(max(now + float(offsets[last]) - self.env.now, 0.0))
            request.first_token_s = now + float(offsets[0])
            request.max_itl_s = float(gap_max[last]) if last > 0 else 0.0
            self._finish(request, self.env.now, 0)
        yield self.env.timeout(max(now + float(offsets[-1]) - self.env.now, 0.0))
        self.kv.free(held_blocks)
        return True
