"""The draft lengths a k policy runs at, in closed form, for the analytic fast path.

A request's verify step at draft length k accepts ``a`` draft tokens, ``a`` in 0..k, and
emits ``a + 1``. Its distribution follows from the acceptance process: i.i.d. at rate
alpha (``bernoulli``; ``beta`` draws alpha per request, represented here by classes of
requests at the Beta distribution's midpoint quantiles), ``alpha * decay^j`` for the
j-th draft token (``positional``), or the measured lengths truncated at k (``replay``).
E[a + 1] is Leviathan's (1 - alpha^(k+1)) / (1 - alpha) in the i.i.d. case. A tree of
``branching`` candidates per node, k levels deep, accepts a level when any of its b
candidates is the target's token: the chain's formulas at the level rate
``1 - (1 - p_j)^b`` (:func:`llmsim.speculation.proposers.level_acceptance`), as the
simulator draws it.

The adaptive 80/50 rule is a Markov chain over k: after each window of ``window``
verify steps at draft length k, the window's acceptance rate (accepted / proposed, the
sum of ``window`` independent accepted counts divided by k * window; its distribution
is their convolution) moves k up by one above ``raise_above`` and down by one below
``lower_below``; a request at k = 0 (the fallback) probes k = 1 after a window. Each
request starts at k0 and lives for only a few windows, so what matters is the
occupancy of each k over its life (the chain's transient from k0, averaged over the
windows a request lasts), not the stationary distribution. With ``scope: per_batch``
the chain runs for the whole batch and its stationary occupancy is used, with one
request's window noise (pooling over the batch makes the real chain steadier).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from llmsim.config.policies import AcceptanceProcess
from llmsim.speculation.config import Acceptance, SpeculationConfig
from llmsim.speculation.policies import k_policy
from llmsim.speculation.proposers import level_acceptance

ALPHA_CLASSES = 16            # Beta acceptance: request classes at midpoint quantiles


@dataclass(frozen=True)
class KMix:
    """How often each class of requests runs at each k, and what a step at that k emits.

    ``occupancy[c, k]``: the fraction of class c's verify steps at draft length k;
    ``tokens[c, k]``: E[tokens emitted by one step at k] for class c. Classes are
    equally likely requests.
    """
    occupancy: np.ndarray
    tokens: np.ndarray

    @property
    def class_tokens_per_step(self) -> np.ndarray:
        return (self.occupancy * self.tokens).sum(axis=1)

    def step_weights(self) -> np.ndarray:
        """The fraction of all verify steps at each k (classes weighted by how many steps they take)."""
        steps = 1.0 / self.class_tokens_per_step
        return (self.occupancy * steps[:, None]).sum(axis=0) / steps.sum()


def accepted_pmf(acceptance: Acceptance, alpha: float, k: int, branching: int = 1) -> np.ndarray:
    """P(a = j), j = 0..k, for one verify step at draft length (tree depth) k."""
    if k == 0:
        return np.ones(1)
    if acceptance.process is AcceptanceProcess.REPLAY:
        samples = np.minimum(np.asarray(acceptance.samples), k)
        return np.bincount(samples, minlength=k + 1)[:k + 1] / len(samples)
    decay = acceptance.decay if acceptance.process is AcceptanceProcess.POSITIONAL else 1.0
    p = level_acceptance(np.minimum(alpha * decay ** np.arange(k), 1.0), branching)   # level j's chance
    reach = np.concatenate([[1.0], np.cumprod(p)])                  # P(a >= j)
    return reach - np.concatenate([reach[1:], [0.0]])


@lru_cache(maxsize=64)
def class_alphas(acceptance: Acceptance) -> np.ndarray:
    """One acceptance rate per request class (one class unless alpha is drawn per request). Remembered
    (read-only): a search builds a fluid model per setting, most of them on one acceptance process."""
    if acceptance.process is AcceptanceProcess.BETA:
        q = (np.arange(ALPHA_CLASSES) + 0.5) / ALPHA_CLASSES
        return _read_only(acceptance.beta_quantiles(q))
    return _read_only(np.array([acceptance.mean_alpha]))


@lru_cache(maxsize=64)
def tokens_table(acceptance: Acceptance, k_max: int, branching: int = 1) -> np.ndarray:
    """E[tokens per step] for every class and k in 0..k_max (remembered, read-only, as :func:`class_alphas`)."""
    return _read_only(np.array([[float(accepted_pmf(acceptance, alpha, k, branching) @ np.arange(k + 1)) + 1.0
                                 for k in range(k_max + 1)] for alpha in class_alphas(acceptance)]))


def _read_only(values: np.ndarray) -> np.ndarray:
    """A remembered table, shared by every caller: writing into it would change the others' answers."""
    values.flags.writeable = False
    return values


def static_mix(acceptance: Acceptance, k: int, k_max: int, branching: int = 1) -> KMix:
    tokens = tokens_table(acceptance, k_max, branching)
    occupancy = np.zeros_like(tokens)
    occupancy[:, k] = 1.0
    return KMix(occupancy, tokens)


def adaptive_mix(spec: SpeculationConfig, mean_decode_tokens: float) -> KMix:
    """The 80/50 rule's occupancy of each k (see the module docstring)."""
    policy, acceptance, branching = spec.policy, spec.acceptance, spec.proposer.branching
    tokens = tokens_table(acceptance, policy.k_max, branching)
    occupancy = np.zeros_like(tokens)
    for c, alpha in enumerate(class_alphas(acceptance)):
        chain = _transitions(acceptance, alpha, policy, branching)
        if k_policy(policy).per_batch:
            occupancy[c] = _stationary(chain)
            continue
        # Windows a request lives: its decode tokens over (window x tokens per step), refined once.
        state = np.zeros(policy.k_max + 1)
        state[policy.k] = 1.0
        per_step = tokens[c, policy.k]
        for _ in range(2):
            windows = max(mean_decode_tokens / (policy.window * per_step), 1.0)
            occupancy[c] = _transient(chain, state, windows)
            per_step = float(occupancy[c] @ tokens[c])
    return KMix(occupancy, tokens)


def _transitions(acceptance: Acceptance, alpha: float, policy, branching: int) -> np.ndarray:
    """One window's move of k: up, down or stay, from the distribution of the window's acceptance."""
    size = policy.k_max + 1
    chain = np.zeros((size, size))
    floor = 0 if policy.fallback else 1
    chain[0, 1] = 1.0                                  # a window spent off: probe with k = 1
    for k in range(1, size):
        pmf = np.ones(1)
        step = accepted_pmf(acceptance, alpha, k, branching)
        for _ in range(policy.window):
            pmf = np.convolve(pmf, step)
        rate = np.arange(len(pmf)) / (k * policy.window)
        up = float(pmf[rate > policy.raise_above].sum()) if k < policy.k_max else 0.0
        down = float(pmf[rate < policy.lower_below].sum()) if k > floor else 0.0
        chain[k, min(k + 1, policy.k_max)] += up
        chain[k, max(k - 1, floor)] += down
        chain[k, k] += 1.0 - up - down
    return chain


def _transient(chain: np.ndarray, start: np.ndarray, windows: float) -> np.ndarray:
    """Mean occupancy over the first ``windows`` windows (the last one counted in part)."""
    whole = int(windows)
    total, state = np.zeros_like(start), start.copy()
    for _ in range(whole):
        total += state
        state = state @ chain
    total += (windows - whole) * state
    return total / windows


def _stationary(chain: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eig(chain.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    return vector / vector.sum()


def steps_to_emit(acceptance: Acceptance, k_max: int, tokens: np.ndarray, branching: int = 1,
                  exact_up_to: int = 64) -> np.ndarray:
    """E[verify steps to emit ``tokens`` tokens] for every class and static k in 0..k_max.

    The engine never drafts past the last token asked for (k' = min(k, r - 1) with r
    tokens to go), so short outputs take more steps per token than 1 / E[tokens per step].
    Exact by recursion on r up to ``exact_up_to``, then linear at 1 / E[tokens per step]
    per token (the cap only touches a request's last steps). Shape (classes, k_max + 1, n).
    """
    tokens = np.asarray(tokens)
    limit = min(int(np.max(tokens, initial=0)), exact_up_to)
    table = _steps_table(acceptance, k_max, limit, branching)
    per_token = 1.0 / tokens_table(acceptance, k_max, branching)
    return table[:, :, np.minimum(tokens, limit)] + per_token[:, :, None] * np.maximum(tokens - limit, 0)


@lru_cache(maxsize=64)
def _steps_table(acceptance: Acceptance, k_max: int, limit: int, branching: int) -> np.ndarray:
    """E[steps to emit r tokens], r = 0..limit, by recursion on r (vectorised over classes)."""
    alphas = class_alphas(acceptance)
    table = np.zeros((len(alphas), k_max + 1, limit + 1))
    pmfs = [np.array([accepted_pmf(acceptance, alpha, k, branching) for alpha in alphas]) for k in range(k_max + 1)]
    for k in range(k_max + 1):
        for r in range(1, limit + 1):
            pmf = pmfs[min(k, r - 1)]                                  # (classes, k' + 1)
            table[:, k, r] = 1.0 + (pmf * table[:, k, r - 1 - np.arange(pmf.shape[1])]).sum(axis=1)
    return table
