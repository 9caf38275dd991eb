"""Compiled inner loops of speculative decoding (numba): acceptance draws and the adaptive k rule.

A decode step decides, for every speculating sequence of the batch, how many of its ``k``
draft tokens the target accepts, and the adaptive k policy then updates each sequence's
window. With numpy each is a dozen array calls on arrays of a few dozen numbers, and
their call overhead dominated the speculative engine's time; compiled, a whole batch
costs a microsecond or two. The hash is the one of
:func:`llmsim.speculation.config.hashed_uniforms` (splitmix64 of seed, request and output
position), so every number drawn here equals the numpy function's, and runs stay
identical whichever path draws them (tests/speculation/test_speculative.py checks both).

Compiled code is cached next to this file (``cache=True``): the first run of a fresh
install compiles for a few seconds, later processes load it.
"""
from __future__ import annotations

import numba
import numpy as np

from llmsim.compiled import kernel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)


# The signatures the draws are called with through their entry points (llmsim.compiled: unchecked, so a caller
# of ``Acceptance.draws(..., checked=False)`` passes exactly these types): a uint64 key, C-contiguous int64 and
# float64 columns, a float decay and an int branching.
_INTS, _FLOATS = numba.int64[::1], numba.float64[::1]
ACCEPTED_PREFIXES_SIGNATURE = (numba.uint64, _INTS, _INTS, _FLOATS, _INTS, numba.float64, _INTS, numba.int64)
REPLAYED_PREFIXES_SIGNATURE = (numba.uint64, _INTS, _INTS, _INTS, _INTS, _INTS)


@kernel(inline="always")
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@kernel
def accepted_prefixes(key, request_ids, positions, alphas, k, decay, out, branching=1):
    """Accepted draft tokens of sequences ``[0, len(out))`` this step; returns their total.

    Draft token ``j`` of sequence ``i`` proposes output ``positions[i] + j`` and is accepted
    when ``U(key, request_ids[i], positions[i] + j) < p_j``, ``p_j = alphas[i] * decay**j``;
    the accepted prefix stops at the first rejection. Rows with ``k == 0`` accept nothing.
    A tree with ``branching`` candidates per node accepts level ``j`` with
    ``1 - (1 - p_j)^branching`` (one of the candidates is the target's token; see
    :func:`llmsim.speculation.proposers.level_acceptance`): the same uniform decides, so a
    tree accepts at least what the chain would on the same tokens.

    Every one of the ``k`` tokens is drawn, those after the first rejection too (they count for
    nothing): the rejection falls at random, so stopping there would be a branch mispredicted about
    once a sequence, which costs more than the hashes it saves.
    """
    total = 0
    for i in range(len(out)):
        accepted = 0
        if k[i] > 0:
            base = _mix(np.uint64(key) ^ (np.uint64(request_ids[i]) * _GOLDEN))
            unbroken = True                      # every token so far accepted
            for j in range(k[i]):
                z = _mix(base + np.uint64(positions[i] + j) * _GOLDEN + _ONE)
                u = np.float64(z >> np.uint64(11)) * 2.0 ** -53
                p = alphas[i] * (decay ** np.float64(j)) if decay != 1.0 else alphas[i]
                if branching > 1:
                    p = 1.0 - (1.0 - p) ** branching
                unbroken &= u < p
                accepted += unbroken
        out[i] = accepted
        total += accepted
    return total


@kernel
def replayed_prefixes(key, request_ids, positions, samples, k, out):
    """Accepted lengths of sequences ``[0, len(out))`` drawn from measured ``samples`` by
    ``U(key, request, position)``, capped at k; returns their total."""
    total = 0
    count = len(samples)
    for i in range(len(out)):
        accepted = 0
        if k[i] > 0:
            base = _mix(np.uint64(key) ^ (np.uint64(request_ids[i]) * _GOLDEN))
            z = _mix(base + np.uint64(positions[i]) * _GOLDEN + _ONE)
            u = np.float64(z >> np.uint64(11)) * 2.0 ** -53
            accepted = min(samples[int(u * count)], k[i])
        out[i] = accepted
        total += accepted
    return total


@kernel
def window_length(k, backoff, window, max_backoff):
    """Rounds in an adaptive window: ``window`` while speculating; while off (k = 0), twice as
    many after each probe at k = 1 that failed in a row, at most ``2**max_backoff`` windows."""
    return window << min(backoff, max_backoff) if k == 0 else window


@kernel
def adapt_window(k, backoff, rate, observed, raise_above, lower_below, k_max, fallback):
    """The adaptive k rule on one finished window; returns ``(k, backoff)`` for the next one.

    k + 1 (up to ``k_max``) when the window's acceptance ``rate`` is above ``raise_above``,
    k - 1 below ``lower_below`` (not below 1 without ``fallback``), unchanged when nothing
    was ``observed``. A window spent off (k = 0) probes again at k = 1; a probe that turns
    speculation off again counts one more failure, a window that keeps speculating clears them.
    """
    if k == 0:
        return 1, backoff
    new = k
    if observed and rate > raise_above:
        new = min(k + 1, k_max)
    elif observed and rate < lower_below:
        new = k - 1
    new = max(new, 0 if fallback else 1)
    return new, (backoff + 1 if new == 0 else 0)


@kernel
def observe_windows(n, k, accepted, speculated, k_policy, window_proposed, window_accepted, window_rounds, backoff,
                    window, max_backoff, raise_above, lower_below, k_max, fallback):
    """Per-request adaptive k: add this step to each sequence's window (a round when it
    speculated or is off); when it has lasted :func:`window_length`, :func:`adapt_window`."""
    for i in range(n):
        window_proposed[i] += k[i]
        window_accepted[i] += accepted[i]
        window_rounds[i] += 1 if speculated[i] or k_policy[i] == 0 else 0
        if window_rounds[i] >= window_length(k_policy[i], backoff[i], window, max_backoff):
            rate = window_accepted[i] / max(window_proposed[i], 1)
            k_policy[i], backoff[i] = adapt_window(k_policy[i], backoff[i], rate, window_proposed[i] > 0,
                                                   raise_above, lower_below, k_max, fallback)
            window_proposed[i] = window_accepted[i] = window_rounds[i] = 0
