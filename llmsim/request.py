"""A request as it moves through the system, and the queue it waits in."""
from __future__ import annotations

from collections import deque

import numpy as np

NAN = float("nan")


class Request:
    """One inference request: its sizes, its progress and the times that become its record.

    ``prefill_target`` is the number of tokens to compute before the next token can
    be sampled: the prompt at first, prompt plus generated tokens after a
    preemption (recompute).
    """

    __slots__ = ("id", "arrival_s", "prompt_tokens", "output_tokens", "replica", "status", "reason",
                 "first_scheduled_s", "first_token_s", "finish_s", "last_token_s", "generated",
                 "prefill_target", "prefilled", "blocks", "admit_order", "preemptions", "max_itl_s")

    def __init__(self, id: int, arrival_s: float, prompt_tokens: int, output_tokens: int):
        self.id = id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.replica = -1
        self.status = "pending"        # pending, queued, running, finished, rejected
        self.reason = ""               # why rejected: timeout, too_long
        self.first_scheduled_s = NAN
        self.first_token_s = NAN
        self.finish_s = NAN
        self.last_token_s = NAN
        self.generated = 0
        self.prefill_target = prompt_tokens
        self.prefilled = 0
        self.blocks = 0
        self.admit_order = -1
        self.preemptions = 0
        self.max_itl_s = 0.0


class TimeAverage:
    """The time integral of a piecewise-constant count, and its change log."""

    __slots__ = ("value", "area", "last_s", "log_s", "log_value")

    def __init__(self, start_s: float = 0.0):
        self.value = 0
        self.area = 0.0
        self.last_s = start_s
        self.log_s: list[float] = [start_s]
        self.log_value: list[int] = [0]

    def change(self, now: float, delta: int) -> None:
        self.area += self.value * (now - self.last_s)
        self.last_s = now
        self.value += delta
        self.log_s.append(now)
        self.log_value.append(self.value)

    def mean(self, until_s: float) -> float:
        area = self.area + self.value * (until_s - self.last_s)
        return area / until_s if until_s > 0 else 0.0


class WaitingQueue:
    """FIFO of requests waiting for a replica; preempted requests return to the front."""

    def __init__(self):
        self._items: deque[Request] = deque()
        self.length = TimeAverage()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def head(self) -> Request:
        return self._items[0]

    def push(self, request: Request, now: float) -> None:
        request.status = "queued"
        self._items.append(request)
        self.length.change(now, +1)

    def push_front(self, request: Request, now: float) -> None:
        request.status = "queued"
        self._items.appendleft(request)
        self.length.change(now, +1)

    def pop(self, now: float) -> Request:
        request = self._items.popleft()
        self.length.change(now, -1)
        return request

    def expire(self, now: float, timeout_s: float) -> list[Request]:
        """Remove and return never-started requests that have waited ``timeout_s`` or more.

        Preempted requests (already started) are never expired. Arrival order means
        the expired ones are the oldest fresh requests, at the front after any
        preempted ones.
        """
        expired, kept_front = [], []
        while self._items:
            request = self._items[0]
            if request.first_scheduled_s == request.first_scheduled_s:   # started: not NaN
                kept_front.append(self._items.popleft())
            elif now - request.arrival_s >= timeout_s:
                expired.append(self._items.popleft())
                self.length.change(now, -1)
            else:
                break
        self._items.extendleft(reversed(kept_front))
        return expired


class GapHistogram:
    """Inter-token gaps of every token emitted in a time window, in log-spaced bins.

    Bins are 1/200 of a decade wide (1.2% apart) from 1 us to 10,000 s, so
    quantiles are exact to about 1% while adding one iteration's gaps costs a few
    vector operations, not a Python loop.
    """
    BINS_PER_DECADE = 200
    LOW_EXP, HIGH_EXP = -6, 4

    def __init__(self, start_s: float = 0.0, end_s: float = float("inf")):
        self.start_s, self.end_s = start_s, end_s
        self.nbins = (self.HIGH_EXP - self.LOW_EXP) * self.BINS_PER_DECADE
        self.counts = np.zeros(self.nbins, dtype=np.int64)
        self.total_s = 0.0

    def add(self, now: float, gaps: np.ndarray) -> None:
        if not (self.start_s <= now <= self.end_s) or len(gaps) == 0:
            return
        index = ((np.log10(np.maximum(gaps, 1e-12)) - self.LOW_EXP) * self.BINS_PER_DECADE).astype(np.int64)
        np.clip(index, 0, self.nbins - 1, out=index)
        self.counts += np.bincount(index, minlength=self.nbins)
        self.total_s += float(gaps.sum())

    def merge(self, other: "GapHistogram") -> None:
        self.counts += other.counts
        self.total_s += other.total_s

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    @property
    def mean(self) -> float:
        return self.total_s / self.count if self.count else float("nan")

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1), at the geometric centre of its bin."""
        total = self.count
        if total == 0:
            return float("nan")
        index = int(np.searchsorted(np.cumsum(self.counts), q * total, side="left"))
        return 10 ** (self.LOW_EXP + (index + 0.5) / self.BINS_PER_DECADE)
