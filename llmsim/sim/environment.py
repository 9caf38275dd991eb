"""SimPy's environment with a fast lane for engine steps.

An engine waits for two things only: the end of the iteration it priced, and new work when
it is idle. As a SimPy wait each costs an event object, a trip through that event's callbacks
and a generator resumption through ``Process._resume``. With one replica most iterations need
no wait at all (an iteration that ends before any other event runs at once, see
``Engine._resume``), but with many replicas another engine's step almost always comes first, so
every iteration pays a wait.

:class:`Environment` keeps such waits as plain calls (:meth:`Environment.schedule_call`: an
engine's ``_resume``, a bound method, not a generator) in a heap of their own, keyed exactly as
SimPy keys its events (time, priority, then SimPy's own insertion counter, shared by both heaps),
and :meth:`Environment.step` runs the calls whose keys come before the next SimPy event's, then
that event. So everything happens in the order, and at the times, it would with SimPy events;
only the bookkeeping per wait is smaller. An engine ending an iteration asks
:meth:`Environment.call_unless_next`, which tests whether the end comes before every other event
and, if not, schedules the wait, in one call. :func:`schedule_call` and :func:`call_unless_next` also
work on a plain ``simpy.Environment`` (through an event), so engines run on either.

:func:`frozen_heap` keeps Python's cyclic garbage collector off the objects that existed before a
run while it runs; :func:`ctrl_c_between_steps` makes Ctrl-C end a run between two steps, not in the
middle of one.
"""
from __future__ import annotations

import gc
import signal
import threading
from contextlib import contextmanager
from functools import partial
from collections.abc import Callable, Iterator
from heapq import heappop, heappush

import simpy
from simpy.core import Infinity, StopSimulation
from simpy.events import NORMAL, EventPriority


class Environment(simpy.Environment):
    """A ``simpy.Environment`` that also runs scheduled calls (see the module docstring)."""

    def __init__(self, initial_time: float = 0):
        super().__init__(initial_time)
        self._calls: list[tuple[float, EventPriority, int, Callable[[], None]]] = []
        self._halted_with: object = None

    def halt(self, value: object) -> None:
        """End :meth:`run` before its next step, returning ``value`` (not None). Safe from a signal
        handler, which may run between any two bytecodes: it only sets an attribute."""
        self._halted_with = value

    @property
    def halted(self) -> bool:
        return self._halted_with is not None

    def schedule_call(self, call: Callable[[], None], priority: EventPriority = NORMAL, delay: float = 0.0) -> None:
        """Call ``call()`` at ``now + delay``, ordered as an event of ``priority`` scheduled now would be."""
        heappush(self._calls, (self._now + delay, priority, next(self._eid), call))

    def call_unless_next(self, call: Callable[[], None], at_s: float) -> bool:
        """Schedule ``call()`` at ``at_s`` (ordered as a NORMAL event scheduled now with delay ``at_s - now``),
        unless ``at_s`` comes before every other event: then schedule nothing and return False (the
        caller may run on to ``at_s`` at once: nothing can observe the time in between). One call for
        the test ``at_s >= peek()`` and the scheduling, as an engine asks at the end of every iteration."""
        calls, queue = self._calls, self._queue
        if (calls and at_s >= calls[0][0]) or (queue and at_s >= queue[0][0]):     # at_s >= self.peek()
            now = self._now
            # (now + (at_s - now), not at_s: the time the delay a process would wait gives, to the last bit)
            heappush(calls, (now + (at_s - now), NORMAL, next(self._eid), call))
            return True
        return False

    def peek(self) -> float:
        calls, queue = self._calls, self._queue
        if calls:
            at = calls[0][0]
            return queue[0][0] if queue and queue[0][0] < at else at
        return queue[0][0] if queue else Infinity

    def step(self) -> None:
        """Run the scheduled calls that come before the next SimPy event, then that event
        (SimPy's ``step``: raises ``EmptySchedule`` when nothing is left; ``StopSimulation``, which ends
        :meth:`run`, once :meth:`halt` was called)."""
        calls, queue = self._calls, self._queue
        # The keys (time, priority, counter) are unique: the comparison never reaches the call (or the
        # event), which mypy cannot know; comparing key slices instead would cost in the hottest loop.
        while calls and (not queue or calls[0] < queue[0]):  # type: ignore[operator]
            if self._halted_with is not None:       # (a run of calls may be the whole simulation)
                raise StopSimulation(self._halted_with)
            self._now, _, _, call = heappop(calls)
            call()
        if self._halted_with is not None:
            raise StopSimulation(self._halted_with)
        super().step()


def schedule_call(env: simpy.Environment, call: Callable[[], None], priority: EventPriority = NORMAL,
                  delay: float = 0.0) -> None:
    """Call ``call()`` at ``env.now + delay``, in SimPy's event order; on a plain SimPy
    environment through an event (the same order, at SimPy's cost)."""
    if isinstance(env, Environment):
        env.schedule_call(call, priority, delay)
        return
    event = env.event()
    event._ok, event._value = True, None         # what succeed() sets; it is scheduled below
    event.callbacks.append(lambda _: call())
    env.schedule(event, priority, delay)


def call_unless_next(env: simpy.Environment, call: Callable[[], None], at_s: float) -> bool:
    """:meth:`Environment.call_unless_next` on any SimPy environment (on a plain one through an event)."""
    if at_s >= env.peek():
        schedule_call(env, call, NORMAL, at_s - env.now)
        return True
    return False


def waker(env: simpy.Environment) -> Callable[[Callable[[], None], float], bool]:
    """:func:`call_unless_next` bound to ``env`` once (an engine asks it at the end of every iteration)."""
    return env.call_unless_next if isinstance(env, Environment) else partial(call_unless_next, env)


def scheduler(env: simpy.Environment) -> Callable[..., None]:
    """``schedule_call`` bound to ``env`` once (an engine schedules a call at nearly every step)."""
    return env.schedule_call if isinstance(env, Environment) else partial(schedule_call, env)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, the objects that existed before it (the modules, the scenario, the trace, the engines)
    are left out of the cyclic garbage collector's passes (``gc.freeze``); afterwards, even when the block
    raises, they are collected as before (``gc.unfreeze``).

    A run builds and drops objects by the million but keeps few: its collections then look at the run's own
    young objects, not at everything the process holds, which a full collection would walk again and again.
    Where the collector is off or the process froze objects itself, nothing changes: unfreezing would take
    back what the caller froze.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def ctrl_c_between_steps(env: simpy.Environment, value: object) -> Iterator[None]:
    """Within the block, a first Ctrl-C (SIGINT) halts ``env`` (:meth:`Environment.halt`): its ``run``
    returns ``value`` before the next step. Python raises ``KeyboardInterrupt`` wherever the interpreter
    happens to be, so a run stopped that way could be stopped halfway through a step's bookkeeping (a
    change log's time appended, its value not yet) and report a torn state. A second Ctrl-C raises
    ``KeyboardInterrupt`` at once, for a caller to abort. Nothing changes where Ctrl-C would not raise
    ``KeyboardInterrupt`` anyway (ignored, as in a pool's workers, or handled by the caller's own
    handler), off the main thread (signal handlers run only on it) or on a plain SimPy environment."""
    if (not isinstance(env, Environment) or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def first_ctrl_c(signum, frame) -> None:
        env.halt(value)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, first_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
