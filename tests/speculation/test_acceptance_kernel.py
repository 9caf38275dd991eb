"""The compiled acceptance draws equal the numpy definition of common random numbers.

``hashed_uniforms`` (numpy) defines U(key, request, position); the compiled kernels must
accept exactly the prefixes that definition implies, for every process, or runs would
depend on which code path drew them.
"""
import numpy as np
import pytest

from llmsim.speculation.config import Acceptance, hashed_uniforms


def _reference(acceptance: Acceptance, key, ids, positions, alphas, k):
    """Accepted prefixes computed from the numpy uniforms, token by token."""
    out = np.zeros(len(k), dtype=np.int64)
    for i in range(len(k)):
        if acceptance.process == "replay":
            if k[i] > 0:
                u = hashed_uniforms(key, ids[i:i + 1], positions[i:i + 1])[0]
                samples = np.asarray(acceptance.samples)
                out[i] = min(samples[int(u * len(samples))], k[i])
            continue
        for j in range(k[i]):
            u = hashed_uniforms(key, ids[i:i + 1], positions[i:i + 1] + j)[0]
            decay = acceptance.decay ** j if acceptance.process == "positional" else 1.0
            if u >= alphas[i] * decay:
                break
            out[i] += 1
    return out


@pytest.mark.parametrize("acceptance", [Acceptance("bernoulli", alpha=0.7),
                                        Acceptance("beta", beta_a=7.0, beta_b=3.0),
                                        Acceptance("positional", alpha=0.9, decay=0.8),
                                        Acceptance("replay", samples=(0, 1, 4, 2, 3, 4, 0), measured_k=4)],
                         ids=lambda a: a.process)
def test_compiled_acceptance_equals_the_numpy_definition(acceptance):
    rng = np.random.default_rng(3)
    n = 400
    key = int(np.uint64(0xFEDCBA9876543210))          # keys use all 64 bits
    ids = rng.integers(0, 10**6, n)
    positions = rng.integers(0, 4000, n)
    alphas = rng.uniform(0.0, 1.0, n)
    k = rng.integers(0, 9, n)
    got = acceptance.accepted(key, ids, positions, alphas, k)
    assert (got == _reference(acceptance, key, ids, positions, alphas, k)).all()
    assert (got <= k).all() and got.sum() > 0


@pytest.mark.parametrize("acceptance", [Acceptance("bernoulli", alpha=0.7),
                                        Acceptance("positional", alpha=0.9, decay=0.8),
                                        Acceptance("replay", samples=(0, 1, 4, 2, 3, 4, 0), measured_k=4)],
                         ids=lambda a: a.process)
@pytest.mark.parametrize("branching", [1, 3])
def test_draws_through_entry_points_equal_the_dispatcher(acceptance, branching):
    """The unchecked draws (the kernels' entry points, as the speculative decode set calls them on its packed
    columns: rows of 2-D C-contiguous arrays) accept the prefixes the dispatcher's do, a tree's levels included,
    and write only the first ``len(out)`` rows."""
    rng = np.random.default_rng(5)
    n = 300
    ints = np.ascontiguousarray(np.stack([rng.integers(0, 10**6, n), rng.integers(0, 4000, n), rng.integers(0, 9, n),
                                          np.full(n, -1)]))
    floats = np.ascontiguousarray(np.stack([rng.uniform(0.0, 1.0, n), np.zeros(n)]))
    ids, positions, k, out = ints
    key = int(np.uint64(0xFEDCBA9876543210))
    expected = np.zeros(n - 7, dtype=np.int64)
    total = acceptance.draws(key, branching)(ids.copy(), positions.copy(), floats[0].copy(), k.copy(), expected)
    assert acceptance.draws(key, branching, checked=False)(ids, positions, floats[0], k, out[:n - 7]) == total
    assert (out[:n - 7] == expected).all() and (out[n - 7:] == -1).all()
    assert total > 0
