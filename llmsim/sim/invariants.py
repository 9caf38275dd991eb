"""Invariants of a run, watched on every iteration: attach :class:`InvariantChecker` as an observer.

``simulate(scenario, observers=[checker])`` calls the checker after every iteration of every
continuous-batching engine; ``checker.check_result(result)`` then checks the run as a whole.
A broken invariant raises :class:`InvariantError` at the iteration that broke it (inside the
simulation, so the error carries the partial result). What is checked, from first principles
rather than from the engine's own bookkeeping formulas:

- time: every iteration has a finite, positive duration, and an engine's iterations neither
  go back in time nor overlap (each starts at or after the previous one's end);
- KV blocks: the cache never holds more blocks than it has or fewer than none, and blocks
  allocated = blocks freed + blocks held, at every iteration and at the end (with prefix caching,
  :class:`~llmsim.sim.prefix_cache.TieredKV`, the held blocks include the idle cached ones, which
  an allocation may take back); with a host tier the same holds there: blocks copied in =
  blocks dropped or swapped back + blocks held (cached plus swapped), never more than its capacity;
- queues and batches: no count is negative, an engine never runs more sequences than its
  ``max_num_seqs``;
- tokens: the tokens the observed iterations emitted are the tokens the requests received
  (and the iteration log's), and every finished request received exactly what it asked for;
- requests: every arrived request is finished, rejected or unfinished, exactly once.

The test suite attaches it to the engine tests (``tests/helpers.py``: ``simulate_checked``).
"""
from __future__ import annotations

import math

from llmsim.config.policies import Batching
from llmsim.sim.iterations import Iteration

SLACK_S = 1e-9          # float rounding of start + duration, relative to the clock


class InvariantError(AssertionError):
    """An invariant of the simulation does not hold (a bug in the simulator, not in the input)."""


class InvariantChecker:
    """An observer ``(engine, iteration)`` that checks every iteration; see the module docstring.

    The per-iteration check is one boolean expression (about 5 us an iteration); the messages are
    built only when it fails (:meth:`_explain`).
    """

    def __init__(self):
        self.iterations = 0
        self.tokens_out = 0
        self._last_end: dict[int, float] = {}           # by engine: when its last iteration ended

    def __call__(self, engine, iteration: Iteration) -> None:
        start, duration = iteration.start_s, iteration.duration_s
        last_end = self._last_end.get(id(engine), 0.0)
        kv = engine.kv
        used = kv.num_blocks - kv.free_blocks
        held = kv.num_blocks - getattr(kv, "empty_blocks", kv.free_blocks)     # cached idle blocks too
        host = getattr(kv, "host", None)
        if host is not None and not (host.allocated_total - host.freed_total == len(host.lru) + host.swapped
                                     <= host.capacity_blocks and host.swapped >= 0):
            _require(False, f"engine {engine.index}.{engine.micro_batch}, iteration at {start!r} s: host tier "
                            f"{host.allocated_total} blocks in, {host.freed_total} out, {len(host.lru)} cached + "
                            f"{host.swapped} swapped held of {host.capacity_blocks}")
        if not (0.0 < duration < math.inf and start >= last_end - SLACK_S * (1.0 + last_end)
                and 0 <= used <= held <= kv.num_blocks and kv.allocated_total - kv.freed_total == held
                and 0 <= iteration.kv_used_blocks <= kv.num_blocks
                and min(iteration.decode_seqs, iteration.prefill_seqs, iteration.prefill_tokens, iteration.tokens_out,
                        iteration.running, iteration.queued) >= 0
                and len(engine.running) <= engine.config.max_num_seqs):
            self._explain(engine, iteration, last_end)
        self._last_end[id(engine)] = start + duration
        self.iterations += 1
        self.tokens_out += iteration.tokens_out

    @staticmethod
    def _explain(engine, iteration: Iteration, last_end: float) -> None:
        """Raise an InvariantError saying which invariant ``iteration`` broke."""
        where = f"engine {engine.index}.{engine.micro_batch}, iteration at {iteration.start_s!r} s"
        duration = iteration.duration_s
        _require(math.isfinite(duration) and duration > 0, f"{where}: duration {duration!r} s")
        _require(iteration.start_s >= last_end - SLACK_S * (1.0 + last_end),
                 f"{where}: starts before the engine's previous iteration ended ({last_end!r} s)")
        kv = engine.kv
        held = kv.num_blocks - getattr(kv, "empty_blocks", kv.free_blocks)
        _require(0 <= kv.used_blocks <= held <= kv.num_blocks,
                 f"{where}: {kv.used_blocks} KV blocks in use, {held} held of {kv.num_blocks}")
        _require(kv.allocated_total - kv.freed_total == held,
                 f"{where}: {kv.allocated_total} blocks allocated, {kv.freed_total} freed, {held} held")
        _require(0 <= iteration.kv_used_blocks <= kv.num_blocks, f"{where}: logged {iteration.kv_used_blocks} blocks")
        counts = {name: getattr(iteration, name) for name in ("decode_seqs", "prefill_seqs", "prefill_tokens",
                                                              "tokens_out", "running", "queued")}
        _require(min(counts.values()) >= 0, f"{where}: a negative count in {counts}")
        _require(False, f"{where}: {len(engine.running)} sequences running, max_num_seqs {engine.config.max_num_seqs}")

    def check_result(self, result) -> None:
        """The whole run: requests, tokens and blocks balance (call after ``simulate`` returns)."""
        records = result.requests
        statuses = records["status"].value_counts().to_dict()
        _require(set(statuses) <= {"finished", "rejected", "unfinished"}, f"request statuses {statuses}")
        _require(sum(statuses.values()) == len(records), "a request counted twice or never")
        _require(result.kv_allocated_blocks == result.kv_freed_blocks + result.kv_held_blocks,
                 f"{result.kv_allocated_blocks} blocks allocated, {result.kv_freed_blocks} freed, "
                 f"{result.kv_held_blocks} held at the end")
        generated = int(records["generated_tokens"].sum())
        logged = int(result.iterations["tokens_out"].sum())
        _require(logged == generated, f"the iteration log emitted {logged} tokens, the requests received {generated}")
        if result.scenario.engine.batching is Batching.CONTINUOUS:
            # Iterations that ended past the run's end (an engine ran ahead) were observed, not logged.
            _require(self.iterations >= len(result.iterations),
                     f"{self.iterations} iterations observed, {len(result.iterations)} logged")
            if self.iterations == len(result.iterations):
                _require(self.tokens_out == generated,
                         f"observed iterations emitted {self.tokens_out} tokens, the requests received {generated}")
        finished = records[records["status"] == "finished"]
        _require((finished["generated_tokens"] == finished["output_tokens"]).all(),
                 "a finished request did not receive every token it asked for")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(f"simulation invariant broken: {message}")
