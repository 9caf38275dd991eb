"""When each token of each request appeared: per-request inter-token latencies, on request.

The engines keep inter-token gaps per decode step (:class:`~llmsim.sim.request.InterTokenGaps`),
which is all the ITL statistics need and costs nothing per token. ``vllm bench serve
--save-detailed`` also lists every request's own gaps (``itls``); :class:`TokenTimes` records
them when asked, as an observer of the one-token engines (``simulate(observers=[times])``):

- a prompt chunk that completes its prompt samples a token at the iteration's end (the
  first token, or the next one after a recomputed preemption);
- a decoding iteration gives every sequence of the one-token decode set one token at its end;
  the sequences are those that completed their prompt before, less those that finished, or
  were preempted and not yet recomputed;
- a speculative decode step gives a sequence its accepted tokens and one more at once: one
  time for the step, as ``vllm bench serve`` records one gap per streamed chunk (the slots'
  ``last_token_s`` says which sequences emitted; a finished one has left them, its request's says).

It costs a few operations per decoding sequence and iteration, and a float per token, so it
is off unless asked for. Static batching has no such engine and is refused.
"""
from __future__ import annotations

import numpy as np

from llmsim.sim.decode import EventDecodeSet
from llmsim.sim.request import FINISHED, RUNNING
from llmsim.sim.speculative_decode import SpeculativeDecodeSet


def records_token_times(engine) -> bool:
    """Whether :class:`TokenTimes` can follow ``engine``: a continuous-batching engine (one-token or
    speculative decoding)."""
    return isinstance(getattr(engine, "decode", None), (EventDecodeSet, SpeculativeDecodeSet))


class TokenTimes:
    """Token appearance times by request id (see the module docstring); call it as an observer."""

    def __init__(self):
        self.times: dict[int, list[float]] = {}
        self._decoding: dict[int, dict] = {}          # per engine: the requests of its decode set

    def __call__(self, engine, iteration) -> None:
        if not records_token_times(engine):
            raise ValueError("per-request token times need a continuous-batching engine (not static batching)")
        now, times, running = engine.now, self.times, engine.running
        decoding = self._decoding.setdefault(id(engine), {})
        from_prompt = set()
        for request, _ in iteration.chunks:
            if request.last_token_s == now:            # its prompt is complete: a token sampled now
                times.setdefault(request.id, []).append(now)
                from_prompt.add(request.id)
                if request.status is RUNNING and request.id in running:
                    decoding[request.id] = request     # decodes from the next step
                else:
                    decoding.pop(request.id, None)     # that was its last token (after a recompute, say)
        if not iteration.decoding:
            return
        if isinstance(engine.decode, SpeculativeDecodeSet):
            self._speculative_step(engine.decode.slots, decoding, from_prompt, now)
            return
        prefilling = {request.id for request in engine.prefilling}
        for rid, request in list(decoding.items()):
            if rid in from_prompt:
                continue                               # joined this iteration: its token is the prompt's
            still = request.status is RUNNING and rid in running and rid not in prefilling
            if still or request.status is FINISHED:
                times[rid].append(now)
            if not still:
                del decoding[rid]                      # finished, or preempted (back when recomputed)

    def _speculative_step(self, slots, decoding: dict, from_prompt: set, now: float) -> None:
        """The sequences that emitted at this step: their slot's last token is now (or, finished and
        so released, their request's)."""
        times = self.times
        in_slots = set()
        for i in range(slots.n):
            request = slots.requests[i]
            in_slots.add(request.id)
            if request.id not in from_prompt and slots.last_token_s[i] == now:
                times[request.id].append(now)
            decoding[request.id] = request
        for rid, request in list(decoding.items()):
            if rid in in_slots:
                continue
            if request.status is FINISHED and request.last_token_s == now and rid not in from_prompt:
                times[rid].append(now)
            del decoding[rid]

    def itls(self, ids) -> list[list[float]]:
        """Each request's gaps between consecutive tokens, in seconds (empty for one token or none)."""
        return [np.diff(self.times[i]).tolist() if i in self.times else [] for i in ids]
