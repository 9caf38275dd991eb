"""Each request's acceptance rate, as a run draws it (``simulate._alphas``): one stream per (acceptance, seed),
drawn once at the longest request count asked for; every count must see exactly what the acceptance process
gives those requests on its own (``Acceptance.request_alphas``), in any order of counts."""
from __future__ import annotations

import numpy as np

from llmsim.scenario.variants import variant
from llmsim.search.plan import as_scenario
from llmsim.sim.simulate import _alphas
from llmsim.speculation.config import stream_key

SPECULATIVE = "scenarios/llama3-70b-h100-speculative.yaml"      # the beta process: one rate per request


def test_every_count_gets_the_process_own_rates_whatever_was_drawn_before():
    scenario = as_scenario(SPECULATIVE)
    acceptance = scenario.speculation.acceptance
    for seed in (7, 8):
        at_seed = scenario.with_seed(seed)
        for n in (300, 1200, 50, 1200, 0, 2000):
            drawn = _alphas(at_seed, n)
            direct = acceptance.request_alphas(stream_key(seed, 1), np.arange(n, dtype=np.int64))
            np.testing.assert_array_equal(drawn, direct)
            assert len(np.unique(direct)) == n          # a rate per request: a slice of the wrong stream shows
    # Another acceptance process at the same seed is another stream.
    other = variant(scenario, {"speculation.acceptance": {"process": "beta", "mean": 0.5, "concentration": 4}})
    assert not np.array_equal(_alphas(other.with_seed(7), 100), _alphas(scenario.with_seed(7), 100))


def test_a_run_changing_its_rates_leaves_the_stream_alone():
    scenario = as_scenario(SPECULATIVE).with_seed(11)
    first = _alphas(scenario, 500)
    kept = first.copy()
    first[:] = 0.0
    np.testing.assert_array_equal(_alphas(scenario, 500), kept)
