"""Scheduling several traffic classes on one engine: who joins the batch next, and who makes room.

With ``workload.classes`` every replica keeps one FIFO per class (:class:`ClassQueue`) and
its engines serve it through a :class:`ClassQueueing`. ``engine.scheduling_policy`` chooses, whenever a
sequence slot and token budget are free, which class's oldest waiting request joins:

``fcfs``
    the oldest arrival of any class (the single FIFO of a run without classes); requests
    back from a preemption first, as the plain engine does.
``priority``
    strict priority: the most urgent class (lowest ``priority`` number) with a waiting
    request, FIFO within a class; nothing running is interrupted (non-preemptive).
``preemptive_priority``
    the same, and at each iteration boundary a waiting request preempts running requests of
    less urgent classes (the least urgent, most recently admitted first) when it lacks a
    sequence slot or KV blocks. The preempted request is recomputed later (prompt plus what
    it generated, as the engine's own preemption does): one prefill iteration of its context,
    about one decode step when the engine is memory-bound.
``weighted_fair``
    deficit round robin (Shreedhar and Varghese, 1996) over the classes' token work: each
    backlogged class earns ``weight / max weight x`` :data:`DRR_QUANTUM_TOKENS` of credit per round
    and admits its oldest request while its credit covers the request's tokens (the prompt
    still to compute plus the output still to generate). Backlogged classes get token shares
    in proportion to their weights: over any stretch where both are backlogged, each class's
    tokens are within twice (the largest request + the quantum) of its weight's share.
``edf``
    earliest deadline first: each request's deadline is its arrival plus its class's TTFT
    limit (else its end-to-end limit; none: never urgent, FIFO after those with deadlines).
``vllm_priority``
    vLLM's ``--scheduling-policy priority`` (V1 scheduler, as its source reads in 2025,
    ``confidence: assumption``): waiting requests ordered by (priority, arrival time), lower
    first; no preemption to admit a waiting request; when the KV cache runs out, the running
    request with the largest (priority, arrival time) is preempted instead of the most
    recently admitted one.

Under every policy a class's ``reserved_seqs`` are slots no other class may take (hard
isolation: they stay free when the class has nothing waiting), and a class's queue timeout
forces its waiting request in (``dispatch``: past the token budget; ``dedicated``: past the
budget and into at most ``dedicated_seqs`` slots beyond ``max_num_seqs``) or rejects it.
Under the priority policies the plain engine's KV preemption (make room for a running
request) takes the least urgent running request instead of the most recent one.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

import numpy as np

from llmsim.config.policies import OnTimeout, SchedulingPolicy
from llmsim.scenario.scenario import Scenario
from llmsim.sim.engine import Engine, Queueing, reject_timed_out
from llmsim.sim.request import QUEUED, Request, TimeAverage

# Credit per round of the heaviest class: small against a request, so a class's turn admits a
# request or two, not a long burst (a larger quantum loosens the fairness bound).
DRR_QUANTUM_TOKENS = 1024
INF = float("inf")


@dataclass(frozen=True)
class ClassRule:
    """How the scheduler treats one class: the class's settings resolved against the engine's."""
    name: str
    priority: int
    weight: float
    reserved_seqs: int
    timeout_s: float | None
    on_timeout: OnTimeout
    dedicated_seqs: int
    deadline_s: float            # from arrival (EDF); inf when the class has no TTFT or e2e limit


def class_rules(scenario: Scenario) -> tuple[ClassRule, ...]:
    """Every traffic class's scheduling rule; a class without a timeout takes the engine's."""
    engine = scenario.engine
    rules = []
    for c in scenario.workload.classes:
        slo = scenario.slo.for_class(c.name)
        deadline = slo.ttft_s if slo.ttft_s is not None else slo.e2e_s
        timeout = c.queue_timeout_s if c.queue_timeout_s is not None else engine.queue_timeout_s
        action = c.on_timeout if c.queue_timeout_s is not None else engine.on_timeout
        rules.append(ClassRule(c.name, c.priority, c.weight, c.reserved_seqs, timeout, action or OnTimeout.DISPATCH,
                               c.dedicated_seqs, INF if deadline is None else deadline))
    return tuple(rules)


class ClassQueue(set):
    """One FIFO per traffic class, and the policy's choice between their heads (module docstring).

    It offers the plain queue's interface (``head``/``pop``, ``push``, ``push_front``, ``length``)
    plus per-class access: :meth:`choose` among some classes, :meth:`front`, :meth:`pop_class`.
    ``class_length[c]`` integrates class ``c``'s queue length over time. The queue is also the set of
    the requests waiting in it (never iterated: the classes' FIFOs hold the order): the engine asks
    whether it is empty and how long it is every iteration, which a set answers without a Python call
    (as :class:`~llmsim.sim.request.WaitingQueue`'s deque does).
    """

    def __init__(self, rules: tuple[ClassRule, ...], order: ClassOrder, quantum_tokens: int):
        super().__init__()
        self.rules = rules
        self._queues: list[deque[Request]] = [deque() for _ in rules]
        self.length = TimeAverage()
        self.class_length = [TimeAverage(logged=False) for _ in rules]
        self._chosen = -1
        top = max(r.weight for r in rules)
        self._quantum = [r.weight / top * quantum_tokens for r in rules]
        self._deficit = [0.0] * len(rules)
        self._turn = 0
        self._key = order.head_key
        # Where the policy orders the heads by their class's priority first and no two classes share one, the class
        # chosen is the most urgent waiting one whatever its head: the classes in that order (else None).
        priorities = [r.priority for r in rules]
        self._ranked = (sorted(range(len(rules)), key=priorities.__getitem__)
                        if order.by_priority_first and len(set(priorities)) == len(priorities) else None)

    def waiting_classes(self) -> list[int]:
        return [c for c, q in enumerate(self._queues) if q]

    def front(self, c: int) -> Request:
        return self._queues[c][0]

    def _change(self, c: int, now: float, delta: int) -> None:
        self.length.change(now, delta)
        self.class_length[c].change(now, delta)

    def push(self, request: Request, now: float) -> None:
        request.status = QUEUED
        self._queues[request.class_index].append(request)
        self.add(request)
        self._change(request.class_index, now, +1)

    def push_front(self, request: Request, now: float) -> None:
        request.status = QUEUED
        self._queues[request.class_index].appendleft(request)
        self.add(request)
        self._change(request.class_index, now, +1)

    def choose(self, classes: list[int]) -> int:
        """The class, among ``classes`` (each with a request waiting), whose head goes next."""
        if self._key is not None:
            if len(classes) == 1:                # the one waiting class (most admissions: no key to compare)
                return classes[0]
            if self._ranked is not None:         # the most urgent: the keys' first items differ
                rank = self._ranked
                return min(classes, key=rank.index)
            key, rules, queues = self._key, self.rules, self._queues
            return min(classes, key=lambda c: key(queues[c][0], rules[c]))
        return self._round_robin(classes)

    def next_class(self) -> int:
        """:meth:`choose` among every waiting class (the queue is not empty)."""
        ranked = self._ranked
        if ranked is not None:
            queues = self._queues
            for c in ranked:
                if queues[c]:
                    return c
        return self.choose(self.waiting_classes())

    def _round_robin(self, classes: list[int]) -> int:
        """Deficit round robin: the class whose turn it is, once its credit covers its head's tokens.

        After one full round without a class admitted, the rounds in which none could be are
        credited at once (a light class's head may need millions of rounds of its quantum)."""
        n = len(self.rules)
        step = 0
        while True:
            c = self._turn
            if c in classes and self._deficit[c] >= _work(self._queues[c][0]):
                return c
            if step and step % n == 0:
                self._skip_rounds(classes)
            self._turn = (c + 1) % n
            if self._turn in classes:
                self._deficit[self._turn] += self._quantum[self._turn]
            step += 1

    def _skip_rounds(self, classes: list[int]) -> None:
        """Credit every waiting class the whole rounds that pass before the first of them can admit its
        head: one fewer than the fewest rounds any of them still needs, so none is passed over."""
        rounds = min(math.ceil((_work(self._queues[c][0]) - self._deficit[c]) / self._quantum[c]) for c in classes)
        for c in classes:
            self._deficit[c] += (rounds - 1) * self._quantum[c]

    def pop_class(self, c: int, now: float) -> Request:
        request = self._queues[c].popleft()
        self.remove(request)
        self._change(c, now, -1)
        if self._key is None:
            self._deficit[c] -= _work(request)
            if not self._queues[c]:
                self._deficit[c] = 0.0           # an idle class keeps no credit (DRR)
        return request

    def head(self) -> Request:
        self._chosen = self.next_class()
        return self.front(self._chosen)

    def pop(self, now: float) -> Request:                    # type: ignore[override]
        return self.pop_class(self._chosen, now)

    def expire(self, now: float) -> list[tuple[Request, float]]:
        """Remove and return (request, its timeout) for never-started requests of ``reject`` classes
        that have waited their class's timeout (started ones, back from a preemption, stay)."""
        expired: list[tuple[Request, float]] = []
        for c, rule in enumerate(self.rules):
            if rule.on_timeout is not OnTimeout.REJECT or rule.timeout_s is None or not self._queues[c]:
                continue
            queue = self._queues[c]
            kept: list[Request] = []
            while queue:
                request = queue[0]
                if request.first_scheduled_s == request.first_scheduled_s:      # started: not NaN
                    kept.append(queue.popleft())
                elif now - request.arrival_s >= rule.timeout_s:
                    expired.append((queue.popleft(), rule.timeout_s))
                    self.remove(request)
                    self._change(c, now, -1)
                else:
                    break
            queue.extendleft(reversed(kept))
        return expired


def _forcing_s(rules: tuple[ClassRule, ...]) -> list[float]:
    """Per class, the wait past which a waiting request is forced in by its queue timeout (``dispatch`` or
    ``dedicated``; inf: never, no timeout or ``reject``)."""
    return [INF if r.timeout_s is None or r.on_timeout is OnTimeout.REJECT else r.timeout_s for r in rules]


def _work(request: Request) -> int:
    """Tokens a request still needs: the prompt (or recompute) left to compute plus the output left."""
    return request.prefill_target - request.prefilled + request.output_tokens - request.generated


# (``not started``: a NaN first admission, inline: these keys order the heads at every admission)
def _fcfs(r: Request, rule: ClassRule) -> tuple:
    return (r.first_scheduled_s != r.first_scheduled_s, r.arrival_s)


def _by_priority(r: Request, rule: ClassRule) -> tuple:
    return (rule.priority, r.first_scheduled_s != r.first_scheduled_s, r.arrival_s)


def _by_priority_then_arrival(r: Request, rule: ClassRule) -> tuple:
    return (rule.priority, r.arrival_s)


def _by_deadline(r: Request, rule: ClassRule) -> tuple:
    return (r.arrival_s + rule.deadline_s, r.arrival_s)


def _least_urgent_latest(r: Request, rules: tuple[ClassRule, ...]) -> tuple:
    return (rules[r.class_index].priority, r.admit_order)


def _least_urgent_youngest(r: Request, rules: tuple[ClassRule, ...]) -> tuple:
    return (rules[r.class_index].priority, r.arrival_s)


@dataclass(frozen=True)
class ClassOrder:
    """One scheduling policy (module docstring): ``head_key`` orders the classes' heads, smallest first
    (None: deficit round robin over the classes' token work); ``victim_key`` picks the running request
    preempted for KV room, the largest (None: the most recently admitted, as without classes);
    ``preempts_for_waiting``: a waiting request preempts running ones of less urgent classes;
    ``by_priority_first``: ``head_key``'s first item is the head's class's priority."""
    head_key: Callable[[Request, ClassRule], tuple] | None
    victim_key: Callable[[Request, tuple[ClassRule, ...]], tuple] | None = None
    preempts_for_waiting: bool = False
    by_priority_first: bool = False


CLASS_ORDERS: dict[SchedulingPolicy, ClassOrder] = {
    SchedulingPolicy.FCFS: ClassOrder(_fcfs),
    SchedulingPolicy.PRIORITY: ClassOrder(_by_priority, _least_urgent_latest, by_priority_first=True),
    SchedulingPolicy.PREEMPTIVE_PRIORITY: ClassOrder(_by_priority, _least_urgent_latest, preempts_for_waiting=True,
                                                     by_priority_first=True),
    SchedulingPolicy.WEIGHTED_FAIR: ClassOrder(None),
    SchedulingPolicy.EDF: ClassOrder(_by_deadline),
    SchedulingPolicy.VLLM_PRIORITY: ClassOrder(_by_priority_then_arrival, _least_urgent_youngest,
                                               by_priority_first=True),
}


# The policies whose choice between the classes' heads is a sort key over the heads alone (no credit, no
# preemption for a waiting request): FCFS, and the priority and deadline orders.
KEYED_POLICIES = (SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY, SchedulingPolicy.VLLM_PRIORITY,
                  SchedulingPolicy.EDF)


def head_order(policy: SchedulingPolicy, first: ClassRule, second: ClassRule,
               longest_waits_s: tuple[float, float]) -> str | None:
    """Which of two classes' heads a keyed policy (:data:`KEYED_POLICIES`) admits first, for heads that never
    ran (in a run without preemptions, every waiting request) and have waited at most ``longest_waits_s``
    (first's, second's): ``"first"``, ``"second"``, ``"arrival"`` (the earlier arrival), or None where it
    depends on their arrivals otherwise. EDF puts ``first`` ahead of any such head of ``second`` when its
    deadline is shorter by more than second's longest wait (``a1 + d1 <= t + d1 < t - W2 + d2 <= a2 + d2``)."""
    if policy is SchedulingPolicy.FCFS:
        return "arrival"
    if policy is not SchedulingPolicy.EDF:
        return "arrival" if first.priority == second.priority else "first" if first.priority < second.priority \
            else "second"
    if first.deadline_s == second.deadline_s:
        return "arrival"
    # a relative margin so that rounding in the arrivals' sums never decides
    if first.deadline_s + longest_waits_s[1] < second.deadline_s * (1 - 1e-9):
        return "first"
    if second.deadline_s + longest_waits_s[0] < first.deadline_s * (1 - 1e-9):
        return "second"
    return None


def same_admissions(held: SchedulingPolicy, policy: SchedulingPolicy, rules: tuple[ClassRule, ...],
                    longest_waits_s: Sequence[float], preemptions: int) -> bool:
    """Whether a run under ``held`` is the run ``policy`` gives with the same classes (``rules``): the same
    policy; or, in a run without preemptions (so no victim was chosen and no waiting request had run, which is
    where the keyed policies' other differences lie), two keyed policies that order every pair of classes'
    heads alike whenever each head had waited at most its class's longest wait in the run (``longest_waits_s``,
    per class) (:func:`head_order`). The two runs then admit the same requests until they first differ, and up
    to then every wait is within the run's own, so they never do. A ``preemptive_priority`` run that preempted
    nothing is the ``priority`` run: its one difference, preempting for a waiting request, never acted."""
    if held is policy:
        return True
    if held is SchedulingPolicy.PREEMPTIVE_PRIORITY and not preemptions:
        held = SchedulingPolicy.PRIORITY
    if preemptions or held not in KEYED_POLICIES or policy not in KEYED_POLICIES:
        return False
    if held is policy:
        return True
    for i, j in combinations(range(len(rules)), 2):
        waits = (longest_waits_s[i], longest_waits_s[j])
        order = head_order(held, rules[i], rules[j], waits)
        if order is None or order != head_order(policy, rules[i], rules[j], waits):
            return False
    return True


class ClassQueueing(Queueing):
    """An engine's :class:`~llmsim.sim.engine.Queueing` over a :class:`ClassQueue`: admission follows the
    policy, class reservations and class timeouts; ``seats[c]`` counts class ``c``'s running requests where a class
    reserves slots (nothing else reads them)."""

    def __init__(self, engine: Engine, rules: tuple[ClassRule, ...], order: ClassOrder):
        super().__init__(engine)
        queue = engine.queue
        assert isinstance(queue, ClassQueue)      # a run with classes builds every queue with class_queue_factory
        self.queue = queue
        self.rules, self.order = rules, order
        self.preempts_for_waiting = order.preempts_for_waiting
        self.seats = [0] * len(rules)
        self._reserving = any(r.reserved_seqs for r in rules)
        # only reserved slots read the seats (:meth:`_may_seat`): without them the engine need not report them
        self.tracks_seats = self._reserving
        # no class reserves slots or takes dedicated ones: every waiting class's head may take a slot while one is
        # free (:meth:`_may_seat` asks nothing else), so :meth:`admit` asks once for all of them
        self._seats_alike = not self._reserving and all(r.on_timeout is not OnTimeout.DEDICATED for r in rules)
        self._forcing_s = _forcing_s(rules)
        # A head not forced in by its class's timeout fits nothing once the token budget is spent (``fit``'s first
        # chunk is then 0): admission stops there without asking, except with a tiered cache, whose match ``fit``
        # runs first and which changes the cache's state.
        self._stops_when_spent = engine._tiered is None

    # -- timeouts ---------------------------------------------------------------------------------
    def rejects_on_timeout(self) -> bool:
        return any(r.on_timeout is OnTimeout.REJECT and r.timeout_s is not None for r in self.rules)

    def expire_waiting(self, now: float) -> None:
        engine = self.engine
        for request, timeout_s in self.queue.expire(now):
            reject_timed_out(request, timeout_s, now, engine.on_done)

    def scale_timeouts(self, rules: tuple[ClassRule, ...], scale: float) -> None:
        """Use ``rules`` with every queue timeout multiplied by ``scale`` (the adaptive controller)."""
        self.rules = tuple(r if r.timeout_s is None else replace(r, timeout_s=r.timeout_s * scale) for r in rules)
        self.queue.rules = self.rules
        self._forcing_s = _forcing_s(self.rules)

    # -- admission -----------------------------------------------------------------------------
    def _forced(self, c: int, request: Request, now: float) -> bool:
        """Whether class ``c``'s waiting ``request`` is forced in by its class's queue timeout now."""
        return now - request.arrival_s >= self._forcing_s[c]

    def _may_seat(self, c: int, now: float) -> bool:
        """Whether class ``c``'s head may take a sequence slot now."""
        engine, rule = self.engine, self.rules[c]
        seats = engine.config.max_num_seqs
        if rule.on_timeout is OnTimeout.DEDICATED and self._forced(c, self.queue.front(c), now):
            seats += rule.dedicated_seqs
        if self._reserving and self.seats[c] >= rule.reserved_seqs:
            # Slots other classes reserved and do not use are not this class's to take.
            seats -= sum(max(0, r.reserved_seqs - self.seats[d]) for d, r in enumerate(self.rules) if d != c)
        return len(engine.running) < seats

    def admit(self, now: float, budget: int, chunks: list[tuple[Request, int]]) -> None:
        engine = self.engine
        queue, running, forcing_s = self.queue, engine.running, self._forcing_s
        while queue:
            if self._seats_alike:                # every waiting head may take a free slot (:meth:`_may_seat`)
                if len(running) >= engine.config.max_num_seqs:
                    break
                c = queue.next_class()
            else:
                classes = [c for c in queue.waiting_classes() if self._may_seat(c, now)]
                if not classes:
                    break
                c = queue.choose(classes)
            request = queue.front(c)
            forced = now - request.arrival_s >= forcing_s[c]          # :meth:`_forced`, inline
            if budget <= 0 and not forced and self._stops_when_spent:
                break
            chunk = engine.fit(request, now, budget, forced)
            if not chunk:
                break
            queue.pop_class(c, now)
            engine.start_request(request, now, chunk, chunks)
            budget -= chunk

    def started(self, request: Request) -> None:
        self.seats[request.class_index] += 1

    # -- leaving and preemption ----------------------------------------------------------------
    def left(self, request: Request) -> None:
        self.seats[request.class_index] -= 1

    def victim(self) -> Request:
        """Make room in the KV cache: under a priority policy, the least urgent running request."""
        victim_key = self.order.victim_key
        if victim_key is None:
            return super().victim()
        rules = self.rules
        return max(reversed(self.engine.running.values()), key=lambda r: victim_key(r, rules))

    def make_room(self, now: float) -> None:
        """Preemptive priority: while the most urgent waiting request lacks a slot or KV blocks for its
        first chunk, preempt the least urgent running request of a less urgent class."""
        engine = self.engine
        cfg, kv, queue, rules = engine.config, engine.kv, self.queue, self.rules
        while queue:
            c = queue.next_class()
            request = queue.front(c)
            chunk = request.prefill_target - request.prefilled
            if cfg.chunked_prefill:
                chunk = min(chunk, cfg.max_batch_tokens)
            # (:meth:`_may_seat` asks only for a free slot where every head may take one, as in :meth:`admit`)
            seated = len(engine.running) < cfg.max_num_seqs if self._seats_alike else self._may_seat(c, now)
            if seated and kv.blocks_for(chunk) <= kv.free_blocks:
                return
            lower = [r for r in reversed(engine.running.values()) if rules[r.class_index].priority > rules[c].priority]
            if not lower:
                return
            engine.preempt(max(lower, key=lambda r: rules[r.class_index].priority), now)


def class_queue_factory(scenario: Scenario) -> Callable[[], ClassQueue] | None:
    """A maker of the scenario's class queues (None without traffic classes)."""
    if not scenario.workload.classes:
        return None
    rules, order = class_rules(scenario), CLASS_ORDERS[scenario.engine.scheduling_policy]
    return lambda: ClassQueue(rules, order, DRR_QUANTUM_TOKENS)


def class_queueing(scenario: Scenario) -> Callable[[Engine], ClassQueueing]:
    """A maker of each engine's :class:`ClassQueueing` under the scenario's classes and policy."""
    rules, order = class_rules(scenario), CLASS_ORDERS[scenario.engine.scheduling_policy]
    return lambda engine: ClassQueueing(engine, rules, order)


def class_mean_queue_lengths(queues: Iterable[ClassQueue], end_s: float) -> np.ndarray:
    """Time-average waiting requests per class over ``[0, end_s]``, summed over ``queues``."""
    return np.sum([[length.mean(end_s) for length in q.class_length] for q in queues], axis=0)
