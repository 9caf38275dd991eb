"""Multi-turn conversations and shared system prompts: workloads whose prompts share prefixes.

``workload.sessions`` turns the workload into conversations. Sessions start as the
arrival process says (``arrival.rate`` is sessions per second); each has a number of turns
(``turns``, a count distribution like a length), and each turn after the first arrives a
think time after the turn before it (exponential, mean ``think_time``). Turn ``k``'s prompt
is the session's whole history (the system prompt, then every earlier turn's new input and
output) plus its own new input (``prompt_tokens``); its output (``output_tokens``) joins the
history. A session ends early when its next turn would exceed the longest request accepted
(``engine.max_model_len``). A share of the sessions (``system_prompt.share``) starts with one
of ``system_prompt.variants`` shared system prompts (or few-shot templates) of
``system_prompt.tokens`` tokens, chosen uniformly.

Think times count from the previous turn's arrival, not from its answer: the trace is fixed
before the run (open loop), so every configuration is compared on the same arrivals. With
think times much longer than response times (tens of seconds against a few), the two agree;
a turn that arrives before the previous answer is complete finds less of its history cached.

``workload.num_requests`` counts turns (the trace is the first that many turn arrivals),
``workload.duration`` bounds their arrival times.

``start`` says what the run starts from. ``empty`` (the default): no conversation before the first, so
the turn rate builds up as the first sessions send their later turns (:meth:`Sessions.fill_time_s`).
``stationary``: conversations already in progress, as in the steady state. The number of sessions in
progress is that of an M/G/inf queue (Poisson arrivals, each session staying its think times' sum): a
renewal process of sessions started :meth:`Sessions.lead_s` before the run, whose turns before the run
are dropped, has the M/G/inf equilibrium at the run's start (for Poisson arrivals, exactly: its sessions
in progress are Poisson with mean ``rate x E[session life]``, their ages from the equilibrium
residual-life law) up to a turn-rate deficit of :data:`STATIONARY_DEFICIT`. The dropped turns' prompts
still carry their history; only the KV cache has not seen it (:meth:`Sessions.cold_time_s`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmsim.config.reader import Node
from llmsim.workload.lengths import LengthDistribution, length_from_node
from llmsim.workload.trace import Trace

MAX_TURNS = 10_000              # the longest session a turn-count distribution may draw
SESSION_STARTS = ("empty", "stationary")
# A stationary start's turn rate falls short of its steady rate by at most this share: it costs only
# sampling (the dropped turns are never simulated), and it is far below the standard error of any
# measured attainment (a share measured on the most requests a run simulates, 2 million, has one of
# at least 1.5e-4 at a 95% target).
STATIONARY_DEFICIT = 1e-4
# A search's warm-up after a stationary start lasts until at most this share of the turns arriving
# find their history uncached (the same 95% of steady state :meth:`Sessions.fill_time_s` asks of an
# empty start's turn rate).
COLD_SHARE = 0.05


@dataclass(frozen=True)
class SystemPrompts:
    tokens: int                 # length of each shared system prompt
    share: float                # fraction of sessions that start with one
    variants: int = 1           # distinct system prompts, each session picking one uniformly


@dataclass(frozen=True)
class Sessions:
    turns: LengthDistribution
    think_time_s: float
    system_prompt: SystemPrompts | None
    max_tokens: int             # a session ends before a turn whose prompt and output exceed this
    stationary: bool = False    # ``start: stationary``: sessions already in progress when the run starts

    def trace(self, arrival, num_requests: int | None, duration_s: float | None, prompt_tokens: LengthDistribution,
              output_tokens: LengthDistribution, seed: int) -> Trace:
        """The turns of sessions sampled from ``seed``, in arrival order (see the module docstring).

        The streams are spawned from the seed like a plain workload's (arrivals, prompt and output
        lengths first), plus turns, think times and system prompts.
        """
        streams = np.random.SeedSequence(seed).spawn(6)
        input_rng, output_rng, turns_rng, think_rng, system_rng = (np.random.default_rng(s) for s in streams[1:])
        lead_s = self.lead_s() if self.stationary else 0.0
        # Every session has at least one turn: as many sessions as turns wanted is always enough, plus
        # those a stationary start begins in its lead (drawn again with a larger allowance, the same
        # stream's prefix, until enough start in the run).
        in_lead = math.ceil(2 * arrival.rate_per_s * lead_s) + 10 if lead_s else 0
        while True:
            starts = arrival.times(np.random.default_rng(streams[0]),
                                   None if num_requests is None else num_requests + in_lead,
                                   None if duration_s is None else duration_s + lead_s) - lead_s
            if num_requests is None or np.count_nonzero(starts >= 0) >= num_requests:
                break
            in_lead *= 2
        n_sessions = len(starts)
        turns = self.turns.sample(turns_rng, n_sessions)
        session = np.repeat(np.arange(n_sessions), turns)
        first = np.concatenate([[0], np.cumsum(turns)[:-1]])            # each session's first turn
        n = len(session)
        gaps = think_rng.exponential(self.think_time_s, n)
        gaps[first] = 0.0
        arrival = starts[session] + _within(np.cumsum(gaps), gaps, first, session) + gaps   # its own gap too
        new_input = prompt_tokens.sample(input_rng, n)
        output = output_tokens.sample(output_rng, n)
        template, system_tokens = self._system_prompts(system_rng, n_sessions)
        history = new_input + output
        prompt = system_tokens[session] + _within(np.cumsum(history), history, first, session) + new_input
        # Lengths grow turn after turn, so the turns that do not fit end their sessions; a stationary
        # start's turns before the run are dropped (their history stays in the later prompts).
        keep = (prompt + output <= self.max_tokens) & (arrival >= 0)
        order = np.flatnonzero(keep)[np.argsort(arrival[keep], kind="stable")]
        trace = Trace(arrival[order], prompt[order], output[order], session_id=session[order],
                      system_prompt_id=template[session[order]], system_prompt_tokens=system_tokens[session[order]])
        return trace.cut(num_requests, duration_s)

    def mean_turns(self) -> float:
        """Turns per session: how many requests one arrival of the session process brings."""
        return self.turns.mean()

    def fill_time_s(self, fraction: float = 0.95) -> float:
        """Seconds after sessions start arriving (at a constant rate) until the turns arrive at
        ``fraction`` of their steady rate.

        A session's turn ``k`` (0 for the first) arrives the sum of ``k`` exponential think times
        after the session starts, Gamma(k, think_time); it exists when the session has more than
        ``k`` turns. So at time ``t`` the turn rate is the session rate times
        ``sum_k P(turns > k) P(Gamma(k) <= t)``, which tends to the session rate times the mean
        turns. Until then a run sees fewer turns per second than its steady state: a search's
        warm-up must cover this fill. (scipy.stats and scipy.optimize are imported here, for sessions only, not
        with this module, which every scenario reads: about 0.7 CPU s a process.)
        """
        from scipy import optimize, stats

        lengths, probabilities = self.turns.probabilities()
        follow_ups = np.arange(1, lengths[-1])                            # turn k exists iff turns > k
        at_most = np.searchsorted(lengths, follow_ups, side="right") - 1  # the last length <= k, if any
        survival = 1.0 - np.where(at_most >= 0, np.cumsum(probabilities)[np.maximum(at_most, 0)], 0.0)
        follow_ups, weights = follow_ups[survival > 0], survival[survival > 0]
        steady = self.mean_turns()
        if self.think_time_s == 0 or follow_ups.size == 0:
            return 0.0

        def filled(t: float) -> float:
            arrived = 1.0 + weights @ stats.gamma.cdf(t, follow_ups, scale=self.think_time_s)
            return arrived / steady - fraction

        upper = self.think_time_s * float(follow_ups[-1])
        while filled(upper) < 0:
            upper *= 2
        return float(optimize.brentq(filled, 0.0, upper))

    def lead_s(self) -> float:
        """How long before the run a stationary start's sessions begin: until their turn rate is within
        :data:`STATIONARY_DEFICIT` of its steady rate (the M/G/inf transient of :meth:`fill_time_s`)."""
        return self.fill_time_s(1.0 - STATIONARY_DEFICIT)

    def cold_time_s(self, share: float = COLD_SHARE) -> float:
        """Seconds after a stationary start until at most ``share`` of the turns arriving follow a turn
        from before the run (their history is not in the KV cache).

        A follow-up turn's previous turn arrived an exponential think time before it, independently of
        the rest, so at time ``t`` the share of follow-ups whose previous turn preceded the start is
        ``exp(-t / think_time)``; follow-ups are ``1 - 1 / mean turns`` of the steady turn rate.
        """
        follow_ups = 1.0 - 1.0 / self.mean_turns()
        if self.think_time_s == 0 or follow_ups <= share:
            return 0.0
        return self.think_time_s * math.log(follow_ups / share)

    def _system_prompts(self, rng: np.random.Generator, n_sessions: int) -> tuple[np.ndarray, np.ndarray]:
        """Per session: which shared system prompt it starts with (-1: none) and its tokens."""
        spec = self.system_prompt
        if spec is None:
            return np.full(n_sessions, -1, np.int64), np.zeros(n_sessions, np.int64)
        uses = rng.random(n_sessions) < spec.share
        template = np.where(uses, rng.integers(0, spec.variants, n_sessions), -1).astype(np.int64)
        return template, np.where(uses, spec.tokens, 0).astype(np.int64)


def _within(cumulative: np.ndarray, values: np.ndarray, first: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Exclusive running sums of ``values`` within each session, from the global running sum."""
    exclusive = cumulative - values
    return exclusive - exclusive[first][session]


def sessions_from_node(node: Node, max_tokens: int) -> Sessions:
    """``workload.sessions: {turns, think_time, system_prompt: {tokens, share, variants}}``."""
    turns = length_from_node(node, "turns", MAX_TURNS)
    think_time_s = node.quantity("think_time", "duration", 0.0, minimum=0.0, exclusive_minimum=False)
    system_prompt = None
    if node.has("system_prompt"):
        system = node.child("system_prompt")
        tokens = system.number("tokens", integer=True, minimum=1, maximum=max_tokens - 2)
        system_prompt = SystemPrompts(tokens, system.number("share", 1.0, minimum=0.0, maximum=1.0),
                                      system.number("variants", 1, integer=True, minimum=1))
        system.done()
    stationary = node.choice("start", SESSION_STARTS, "empty") == "stationary"
    node.done()
    return Sessions(turns, think_time_s, system_prompt, max_tokens, stationary)
