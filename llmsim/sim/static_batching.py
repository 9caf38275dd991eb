"""Static batching: the request-level baseline (FasterTransformer, early TGI).

A batch is formed when the engine is free, reserves KV for every request's full
length, prefills together padded to the longest prompt and decodes padded to the
longest output; nobody joins until the whole batch is done. Every step of a batch is
known when it forms, so it is priced and logged at once, and the process only wakes
when a request's last token is out.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import simpy

from llmsim.cost.roofline import CostModel
from llmsim.scenario.scenario import EngineConfig
from llmsim.sim.engine import EngineProcess
from llmsim.sim.kvcache import KVCache
from llmsim.sim.request import RUNNING, Request, WaitingQueue


class StaticBatchEngine(EngineProcess):
    """An engine that serves one static batch at a time (see the module docstring). A batch
    reserves all the KV it needs, so it is never preempted (``preemptions`` stays 0)."""

    __slots__ = ("_batch", "_steps")

    def __init__(self, env: simpy.Environment, index: int, cost: CostModel, kv: KVCache,
                 queue: WaitingQueue, config: EngineConfig, on_done: Callable[[Request, float], None],
                 micro_batch: int = 0):
        super().__init__(env, index, cost, kv, queue, config, on_done, micro_batch)
        self._batch: tuple[list[Request], np.ndarray] | None = None   # in flight, and its steps' ends
        self._steps = self.run()
        self.start()

    def _resume(self) -> None:
        self._wait(next(self._steps))

    def run(self):
        """The engine's loop, a generator: it yields how long it waits (None: until notified)."""
        env = self.env
        expire = self.rejects_on_timeout()
        while True:
            if expire:
                self.expire_waiting(env.now)
            batch = self._form(env.now)
            if batch:
                yield from self._serve(batch)
            else:
                yield None                          # idle until notify()

    def _form(self, now: float) -> list[Request]:
        """Take requests from the queue head while slots and KV for their full length allow."""
        cfg, kv, queue = self.config, self.kv, self.queue
        batch: list[Request] = []
        while queue and len(batch) < cfg.max_num_seqs:
            request = queue.head()
            wanted = kv.blocks_for(request.prompt_tokens + request.output_tokens)
            if wanted > kv.free_blocks:
                break
            queue.pop(now)
            kv.allocate(wanted)
            request.blocks, request.status, request.first_scheduled_s = wanted, RUNNING, now
            batch.append(request)
        return batch

    def _serve(self, batch: list[Request]):
        now, kv = self.env.now, self.kv
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
        first = np.arange(count) == 0
        self.log.extend({"start_s": ends - durations, "duration_s": durations, "decode_seqs": np.where(first, 0, size),
                         "prefill_seqs": np.where(first, size, 0),
                         "prefill_tokens": np.where(first, size * longest_prompt, 0), "tokens_out": useful,
                         "flops": flops, "bytes": moved, "kv_used_blocks": kv.used_blocks, "running": size,
                         "queued": len(self.queue)})
        # Decode step j gives a token, after a gap of its duration, to every request still generating.
        self.gaps.add(ends[1:], durations[1:], useful[1:])
        gap_max = np.maximum.accumulate(np.concatenate([[0.0], durations[1:]]))
        self._batch = (batch, ends)
        # Requests leave in the order their own last token appears. The batch holds its KV until
        # the longest one is done, which is when the batch ends.
        leaving = sorted(batch, key=lambda r: r.output_tokens)
        for request in leaving:
            last = request.output_tokens - 1
            yield max(float(ends[last]) - self.env.now, 0.0)
            request.first_token_s = float(ends[0])
            request.max_itl_s = float(gap_max[last])
            if request is leaving[-1]:
                kv.free(held_blocks)
                self._batch = None
            self.report_finished(request, self.env.now)

    def close(self) -> None:
        """End of the run: the batch in flight has the tokens of the steps completed by now."""
        if self._batch is None:
            return
        batch, ends = self._batch
        done = int(np.searchsorted(ends, self.env.now, side="right"))   # steps completed
        for request in batch:
            if request.status is RUNNING:
                request.generated = min(done, request.output_tokens)
                if done:
                    request.first_token_s = float(ends[0])
