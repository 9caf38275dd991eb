"""Arrival processes and length distributions against their defining statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llmsim import generate_trace
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.workload.workload import workload_from_node

N = 40000


def trace(workload: dict, seed: int = 3):
    return generate_trace(workload_from_node(Node(workload), max_tokens=100000), seed)


def base(**arrival):
    return {"arrival": arrival, "num_requests": N, "prompt_tokens": 100, "output_tokens": 10}


def test_poisson_gaps_are_exponential_at_the_rate():
    gaps = np.diff(trace(base(process="poisson", rate=5.0)).arrival_s)
    # Mean 1/rate; coefficient of variation 1. Standard errors: sigma/sqrt(n).
    assert abs(gaps.mean() - 0.2) < 4 * 0.2 / math.sqrt(len(gaps))
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.03


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_gaps_have_the_requested_burstiness(cv):
    gaps = np.diff(trace(base(process="gamma", rate=10.0, cv=cv)).arrival_s)
    assert abs(gaps.mean() - 0.1) < 4 * cv * 0.1 / math.sqrt(len(gaps))
    # The sample CV's standard error grows with the shape's tail; bootstrap it from the sample.
    rng = np.random.default_rng(0)
    boot = [np.std(g) / np.mean(g) for g in (rng.choice(gaps, len(gaps)) for _ in range(200))]
    assert abs(gaps.std() / gaps.mean() - cv) < 4 * np.std(boot)


def test_deterministic_arrivals_and_duration_mode():
    t = trace({"arrival": {"process": "deterministic", "rate": "120/min"}, "duration": "10 s",
               "prompt_tokens": 10, "output_tokens": 10})
    assert np.allclose(np.diff(t.arrival_s), 0.5)
    assert len(t) == 20 and t.arrival_s[-1] <= 10.0


def test_length_distributions():
    w = base(process="poisson", rate=1.0)
    w["prompt_tokens"] = {"distribution": "lognormal", "mean": 800, "sigma": 0.7, "max": 10 ** 6}
    w["output_tokens"] = {"distribution": "uniform", "low": 5, "high": 15}
    t = trace(w)
    sd = 800 * math.sqrt(math.exp(0.7 ** 2) - 1)
    assert abs(t.prompt_tokens.mean() - 800) < 4 * sd / math.sqrt(N) + 0.5     # +0.5: rounding to tokens
    assert t.output_tokens.min() == 5 and t.output_tokens.max() == 15
    assert abs(t.output_tokens.mean() - 10) < 4 * math.sqrt((11 ** 2 - 1) / 12) / math.sqrt(N)
    w["output_tokens"] = {"distribution": "exponential", "mean": 50, "max": 10 ** 6}
    out = trace(w).output_tokens
    assert abs(out.mean() - 50) < 4 * 50 / math.sqrt(N)
    w["prompt_tokens"] = {"distribution": "lognormal", "mean": 800, "sigma": 2.0, "min": 16, "max": 2048}
    clipped = trace(w).prompt_tokens
    assert clipped.min() >= 16 and clipped.max() == 2048


def test_empirical_lengths_come_from_the_csv(tmp_path):
    (tmp_path / "lengths.csv").write_text("prompt_tokens\n10\n20\n30\n")
    w = {"arrival": {"rate": 1.0}, "num_requests": 3000, "output_tokens": 5,
         "prompt_tokens": {"distribution": "empirical", "path": str(tmp_path / "lengths.csv")}}
    values = trace(w).prompt_tokens
    assert set(values) == {10, 20, 30}
    counts = np.bincount(values)[[10, 20, 30]]
    assert np.all(np.abs(counts - 1000) < 4 * math.sqrt(3000 * (1 / 3) * (2 / 3)))


def test_trace_replay_sorts_and_validates(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,user\n2.0,10,5,a\n0.5,20,6,b\n")
    t = trace({"arrival": {"process": "trace", "path": str(path)}})
    assert list(t.arrival_s) == [0.5, 2.0] and list(t.prompt_tokens) == [20, 10]
    path.write_text("arrival_s,prompt_tokens\n1,2\n")
    with pytest.raises(ConfigError, match="output_tokens"):
        trace({"arrival": {"process": "trace", "path": str(path)}})
    path.write_text("arrival_s,prompt_tokens,output_tokens\n1,2,3\n2,-4,3\n")
    with pytest.raises(ConfigError, match="data row 2"):
        trace({"arrival": {"process": "trace", "path": str(path)}})


def test_same_seed_same_trace_and_rates_share_requests():
    a, b = trace(base(process="poisson", rate=5.0), 9), trace(base(process="poisson", rate=5.0), 9)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    c = trace(base(process="poisson", rate=10.0), 9)
    # Common random numbers: twice the rate is the same arrivals at half the times.
    assert np.allclose(c.arrival_s, a.arrival_s / 2)
    assert not np.array_equal(trace(base(process="poisson", rate=5.0), 10).arrival_s, a.arrival_s)
