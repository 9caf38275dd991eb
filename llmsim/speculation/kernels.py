"""Compiled inner loops of speculative decoding (numba).

A decode step decides, for every speculating sequence of the batch, how many of its ``k``
draft tokens the target accepts. With numpy that is a dozen array calls on arrays of a
few dozen numbers, and their call overhead dominated the speculative engine's time;
compiled, a whole batch costs about a microsecond. The hash is the one of
:func:`llmsim.speculation.config.hashed_uniforms` (splitmix64 of seed, request and output
position), so every number drawn here equals the numpy function's, and runs stay
identical whichever path draws them (tests/test_speculative.py checks both).

Compiled code is cached next to this file (``cache=True``): the first run of a fresh
install compiles for a few seconds, later processes load it.
"""
from __future__ import annotations

import numba
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)


@numba.njit(cache=True, inline="always")
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def accepted_prefixes(key, request_ids, positions, alphas, k, decay, out):
    """Accepted draft tokens of each sequence this step; returns their total.

    Draft token ``j`` of sequence ``i`` proposes output ``positions[i] + j`` and is accepted
    when ``U(key, request_ids[i], positions[i] + j) < alphas[i] * decay**j``; the accepted
    prefix stops at the first rejection. Rows with ``k == 0`` accept nothing.
    """
    total = 0
    for i in range(len(k)):
        accepted = 0
        if k[i] > 0:
            base = _mix(np.uint64(key) ^ (np.uint64(request_ids[i]) * _GOLDEN))
            for j in range(k[i]):
                z = _mix(base + np.uint64(positions[i] + j) * _GOLDEN + _ONE)
                u = np.float64(z >> np.uint64(11)) * 2.0 ** -53
                p = alphas[i] * (decay ** np.float64(j)) if decay != 1.0 else alphas[i]
                if u >= p:
                    break
                accepted += 1
        out[i] = accepted
        total += accepted
    return total


@numba.njit(cache=True)
def replayed_prefixes(key, request_ids, positions, samples, k, out):
    """Accepted lengths drawn from measured ``samples`` by ``U(key, request, position)``, capped at k."""
    total = 0
    count = len(samples)
    for i in range(len(k)):
        accepted = 0
        if k[i] > 0:
            base = _mix(np.uint64(key) ^ (np.uint64(request_ids[i]) * _GOLDEN))
            z = _mix(base + np.uint64(positions[i]) * _GOLDEN + _ONE)
            u = np.float64(z >> np.uint64(11)) * 2.0 ** -53
            accepted = min(samples[int(u * count)], k[i])
        out[i] = accepted
        total += accepted
    return total
