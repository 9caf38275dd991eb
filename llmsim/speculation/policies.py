"""How many tokens each decoding sequence drafts per step: the k policies.

A policy is asked once per decode step for every decoding sequence's draft length
(:meth:`KPolicyRule.choose`) and is then told what the target accepted
(:meth:`KPolicyRule.observe`), or, for the per-request adaptive rule, names its settings
(:attr:`KPolicyRule.windows`) and the engine's compiled step applies the rule to every row
(:func:`~llmsim.speculation.kernels.observe_windows`) in the call that closes the step.
The decoding sequences are packed numpy columns, rows ``[0, n)``
(``llmsim.sim.speculative_decode.DecodeSlots``); a policy that keeps state per request keeps it
in those columns (``k_policy``, ``window_*``, ``backoff``, ``seen_*``), so it
moves with the request's row, and state for the whole batch on the policy object.

- :class:`StaticK`: every eligible sequence drafts ``k``.
- :class:`AdaptiveK`: the 80/50 rule over windows of ``window`` rounds, per request or one
  k for the batch (``scope``), with exponential back-off while speculation is off.
- :class:`GoodputK`: each step the k in [0, ``k_max``] with the most expected tokens per
  second for the batch (SmartSpec's criterion), pricing every candidate at once.

:func:`k_policy` builds the one a :class:`~llmsim.speculation.config.KPolicy` names.
"""
from __future__ import annotations

from dataclasses import replace
from collections.abc import Callable

import numpy as np

from llmsim.config.policies import KPolicyName, KScope
from llmsim.speculation.config import KPolicy, expected_tokens_per_step
from llmsim.speculation.kernels import adapt_window, window_length

MAX_BACKOFF = 5                                   # the adaptive rule's longest time off: 2^5 windows
# observe_windows' settings: window rounds (0: no per-request windows), longest back-off, raise above, lower below,
# k_max, fallback; one type for every policy, so the step kernel compiles once.
Windows = tuple[int, int, float, float, int, bool]
NO_WINDOWS: Windows = (0, MAX_BACKOFF, 0.0, 0.0, 0, False)


class KPolicyRule:
    """One decode engine's k policy (see the module docstring); ``config`` holds its settings."""

    name: KPolicyName
    per_batch = False                             # one k for the whole batch (else per request)
    observes = False                              # whether observe does anything (the engine skips it if not)
    reads_eligible = False                        # whether choose reads ``eligible`` (else it is not marked yet)
    windows: Windows = NO_WINDOWS                 # the per-request adaptive rule the engine's step kernel applies

    def __init__(self, config: KPolicy):
        self.config = config

    @property
    def initial_k(self) -> int:
        """The k a request starts decoding with (the per-request state's first value)."""
        return self.config.k

    def choose(self, slots, n: int, eligible: np.ndarray, price: Callable) -> np.ndarray:
        """Each of the ``n`` decoding sequences' draft length before the engine's caps: the first ``n`` entries
        of an int64 array the caller only reads (it may be the policy's own state, and longer: the step's kernel
        reads its first ``n``, so a policy that keeps one k per row returns its row without a slice).

        ``eligible`` marks the sequences allowed to speculate (its first ``n`` entries; exactly ``n`` for a policy
        that :attr:`reads_eligible`); ``price(eligible, drafted, limit)`` returns the decode step's seconds for
        every candidate column of ``drafted`` (only the goodput policy asks).
        """
        raise NotImplementedError

    def observe(self, slots, n: int, k: np.ndarray, accepted: np.ndarray, speculated: np.ndarray) -> None:
        """This step's outcome: draft lengths, accepted prefixes, which sequences speculated."""


class StaticK(KPolicyRule):
    name = KPolicyName.STATIC

    def __init__(self, config: KPolicy):
        super().__init__(config)
        self._k = np.full(64, config.k)

    def choose(self, slots, n, eligible, price):
        if n > len(self._k):
            self._k = np.full(2 * n, self.config.k)
        return self._k

    def set_k(self, k: int) -> None:
        """Draft ``k`` tokens from the next step on (the adaptive controller's speculation_k knob)."""
        self.config = replace(self.config, k=k)
        self._k[:] = k


class AdaptiveK(KPolicyRule):
    """The 80/50 rule: after ``window`` rounds, k + 1 when the window's acceptance is above
    ``raise_above``, k - 1 below ``lower_below``, within [1, ``k_max``] (or down to 0 with
    ``fallback``, then a probe at k = 1 after a window, twice as long after each failed probe).

    The rule itself is compiled (:func:`~llmsim.speculation.kernels.adapt_window`), and so is
    the per-request bookkeeping of every sequence's window, which runs every decode step: inside
    the engine's compiled step (``windows`` gives its settings), as one more call per step would
    cost more than the bookkeeping. :meth:`observe` keeps the window of a per-batch k."""

    name = KPolicyName.ADAPTIVE

    def __init__(self, config: KPolicy):
        super().__init__(config)
        self.per_batch = self.observes = config.scope is KScope.PER_BATCH
        if not self.per_batch:
            self.windows = (int(config.window), MAX_BACKOFF, float(config.raise_above), float(config.lower_below),
                            int(config.k_max), bool(config.fallback))
        self._batch_k = config.k
        self._batch_window = [0, 0, 0]            # proposed, accepted, rounds
        self._batch_backoff = 0

    def choose(self, slots, n, eligible, price):
        return slots.k_policy if not self.per_batch else np.full(n, self._batch_k)

    def observe(self, slots, n, k, accepted, speculated):
        config = self.config
        window = self._batch_window
        window[0] += int(k.sum())
        window[1] += int(accepted.sum())
        window[2] += bool(speculated.any()) or self._batch_k == 0
        if window[2] >= window_length(self._batch_k, self._batch_backoff, config.window, MAX_BACKOFF):
            self._batch_k, self._batch_backoff = adapt_window(
                self._batch_k, self._batch_backoff, window[1] / max(window[0], 1), window[0] > 0,
                config.raise_above, config.lower_below, config.k_max, config.fallback)
            self._batch_window = [0, 0, 0]


class GoodputK(KPolicyRule):
    """One k for the batch: the candidate in [0, ``k_max``] with the most expected tokens per second.

    Acceptance per request is estimated from its recent verify steps (accepted /
    (accepted + rejections), the per-token rate's maximum-likelihood estimate, decayed
    with a half-life of ``window`` rounds) shrunk towards the batch's pooled estimate,
    which itself starts at ``prior_alpha``. The prompt chunks that may join the
    iteration are not known when k is chosen and are left out of the price.
    """

    name = KPolicyName.GOODPUT
    per_batch = True
    observes = True
    reads_eligible = True

    def __init__(self, config: KPolicy):
        super().__init__(config)
        self._pooled = [0.0, 0.0]                # decayed accepted, rejected over the batch
        self._decay = 0.5 ** (1.0 / config.window)
        self._plain_rounds = 0                   # steps in a row it chose k = 0

    def choose(self, slots, n, eligible, price):
        s, config = slots, self.config
        pooled = (self._pooled[0] + 4 * config.prior_alpha) / (self._pooled[0] + self._pooled[1] + 4)
        acc, rej = s.seen_accepted[:n][eligible], s.seen_rejected[:n][eligible]
        alpha = np.minimum((acc + 2 * pooled) / (acc + rej + 2), 1.0 - 1e-9)
        ks = np.arange(config.k_max + 1)
        limit = s.remaining[:n][eligible] - 1
        drafted = np.minimum(ks[None, :], limit[:, None])                 # (eligible sequences, candidates)
        tokens = expected_tokens_per_step(alpha[:, None], drafted).sum(axis=0) + (n - len(limit))
        best = int(np.argmax(tokens / price(eligible, drafted, limit)))
        if best == 0:
            # Without speculating nothing is learnt: try k = 1 after a window of plain steps.
            self._plain_rounds += 1
            if self._plain_rounds >= config.window:
                self._plain_rounds, best = 0, 1
        else:
            self._plain_rounds = 0
        return np.full(n, best)

    def observe(self, slots, n, k, accepted, speculated):
        if not speculated.any():
            return
        s, decay, rejected = slots, self._decay, accepted < k
        s.seen_accepted[:n] = np.where(speculated, decay * s.seen_accepted[:n] + accepted, s.seen_accepted[:n])
        s.seen_rejected[:n] = np.where(speculated, decay * s.seen_rejected[:n] + rejected, s.seen_rejected[:n])
        self._pooled = [decay * self._pooled[0] + float(accepted[speculated].sum()),
                        decay * self._pooled[1] + float(rejected[speculated].sum())]


POLICIES: dict[KPolicyName, type[KPolicyRule]] = {rule.name: rule for rule in (StaticK, AdaptiveK, GoodputK)}


def k_policy(config: KPolicy) -> KPolicyRule:
    """The policy ``config.policy`` names, with fresh state."""
    return POLICIES[config.policy](config)
