"""Arrival processes and length distributions against their defining statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llmsim import generate_trace
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.workload.lengths import Empirical, Exponential, Fixed, Lognormal, Uniform, length_from_node
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
    # Clipped (its mean moves -7%: within the 10% a length may move).
    w["prompt_tokens"] = {"distribution": "lognormal", "mean": 800, "sigma": 0.8, "min": 16, "max": 2048}
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


def test_trace_replay_refuses_unsorted_and_validates(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,user\n0.5,20,6,b\n2.0,10,5,a\n")
    t = trace({"arrival": {"process": "trace", "path": str(path)}})
    assert list(t.arrival_s) == [0.5, 2.0] and list(t.prompt_tokens) == [20, 10]
    # An unsorted trace is refused rather than silently reordered (issue 14): it names the line.
    path.write_text("arrival_s,prompt_tokens,output_tokens,user\n2.0,10,5,a\n0.5,20,6,b\n")
    with pytest.raises(ConfigError, match="line 3, column arrival_s"):
        trace({"arrival": {"process": "trace", "path": str(path)}})
    path.write_text("arrival_s,prompt_tokens\n1,2\n")
    with pytest.raises(ConfigError, match="output_tokens"):
        trace({"arrival": {"process": "trace", "path": str(path)}})
    path.write_text("arrival_s,prompt_tokens,output_tokens\n1,2,3\n2,-4,3\n")
    with pytest.raises(ConfigError, match="line 3, column prompt_tokens"):
        trace({"arrival": {"process": "trace", "path": str(path)}})


def test_same_seed_same_trace_and_rates_share_requests():
    a, b = trace(base(process="poisson", rate=5.0), 9), trace(base(process="poisson", rate=5.0), 9)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    c = trace(base(process="poisson", rate=10.0), 9)
    # Common random numbers: twice the rate is the same arrivals at half the times.
    assert np.allclose(c.arrival_s, a.arrival_s / 2)
    assert not np.array_equal(trace(base(process="poisson", rate=5.0), 10).arrival_s, a.arrival_s)


# -- each length distribution's own law against its samples and the closed forms -------------------

DISTRIBUTIONS = {
    "fixed": Fixed(value=7, maximum=4096),
    "uniform": Uniform(low=5, high=15, maximum=4096),
    "lognormal": Lognormal(unclipped_mean=800, sigma=0.7, maximum=10 ** 6),
    "lognormal clipped": Lognormal(unclipped_mean=800, sigma=2.0, minimum=16, maximum=2048),
    "exponential": Exponential(unclipped_mean=50, maximum=10 ** 6),
    "exponential clipped": Exponential(unclipped_mean=50, minimum=4, maximum=60),
    "exponential of mean 1": Exponential(unclipped_mean=1, maximum=10),
    "empirical": Empirical(samples=(10, 20, 30, 30, 3000), maximum=1000),
}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_sample_moments_match_the_distributions_own(name):
    dist = DISTRIBUTIONS[name]
    lengths, p = dist.probabilities()
    assert p.min() >= 0 and p.sum() == pytest.approx(1.0)
    assert lengths.min() >= dist.minimum and lengths.max() <= dist.maximum
    values = dist.sample(np.random.default_rng(11), N).astype(float)
    mean, var = dist.mean(), dist.variance()
    assert dist.second_moment() == pytest.approx(var + mean ** 2)
    # Standard errors: sigma / sqrt(n) for the mean, sqrt((mu4 - sigma^4) / n) for the variance.
    mu4 = float(p @ (lengths - mean) ** 4)
    assert abs(values.mean() - mean) <= 4 * math.sqrt(var / N) + 1e-12
    assert abs(values.var() - var) <= 4 * math.sqrt(max(mu4 - var ** 2, 0.0) / N) + 1e-9


def test_moments_against_closed_forms():
    assert (DISTRIBUTIONS["fixed"].mean(), DISTRIBUTIONS["fixed"].variance()) == (7.0, 0.0)
    uniform = DISTRIBUTIONS["uniform"]
    assert uniform.mean() == pytest.approx(10.0) and uniform.variance() == pytest.approx((11 ** 2 - 1) / 12)
    # Lognormal: E = m, Var = m^2 (e^{sigma^2} - 1); rounding to whole tokens adds 1/12 (Sheppard).
    lognormal = DISTRIBUTIONS["lognormal"]
    assert lognormal.mean() == pytest.approx(800.0, abs=1e-3)
    assert lognormal.variance() == pytest.approx(800 ** 2 * (math.exp(0.7 ** 2) - 1) + 1 / 12, rel=1e-6)
    # Geometric on 1, 2, ...: mean 1/p, variance (1 - p) / p^2.
    exponential = DISTRIBUTIONS["exponential"]
    assert exponential.mean() == pytest.approx(50.0) and exponential.variance() == pytest.approx(0.98 / 0.02 ** 2)
    assert (DISTRIBUTIONS["exponential of mean 1"].mean(), DISTRIBUTIONS["exponential of mean 1"].variance()) \
        == (1.0, 0.0)
    # Empirical: the samples' own moments, 3000 clipped to the maximum.
    clipped = np.array([10, 20, 30, 30, 1000])
    empirical = DISTRIBUTIONS["empirical"]
    assert empirical.mean() == pytest.approx(clipped.mean()) and empirical.variance() == pytest.approx(clipped.var())
    # Clipping moves the mass beyond the bounds onto them.
    lengths, p = DISTRIBUTIONS["exponential clipped"].probabilities()
    assert p[0] == pytest.approx(1 - 0.98 ** 4) and p[-1] == pytest.approx(0.98 ** 59)


def test_yaml_builds_each_distribution():
    read = {name: length_from_node(Node({"x": spec}), "x", max_tokens=4096) for name, spec in {
        "fixed": 12, "uniform": {"distribution": "uniform", "low": 2, "high": 9},
        "lognormal": {"distribution": "lognormal", "mean": 300, "sigma": 0.5, "max": 1000},
        "exponential": {"distribution": "exponential", "mean": 40, "min": 2}}.items()}
    assert read["fixed"] == Fixed(value=12, maximum=4096)
    assert read["uniform"] == Uniform(low=2, high=9, maximum=4096)
    assert read["lognormal"] == Lognormal(unclipped_mean=300, sigma=0.5, maximum=1000)
    assert read["exponential"] == Exponential(unclipped_mean=40, minimum=2, maximum=4096)



def _read_length(spec, max_tokens=4096):
    return length_from_node(Node({"workload": {"x": spec}}, file="w.yaml").child("workload"), "x", max_tokens)


def test_a_length_whose_clipping_moves_its_mean_is_refused():
    """sigma: 50 with mean 1024 puts nearly every draw below 1/2 token: every prompt would be 1 token."""
    with pytest.raises(ConfigError) as caught:
        _read_length({"distribution": "lognormal", "mean": 1024, "sigma": 50})
    text = str(caught.value)
    for fragment in ("w.yaml", "workload.x", "'sigma': 50", "1,024 tokens becomes 1 ", "10% allowed", "smaller sigma"):
        assert fragment in text, (fragment, text)
    with pytest.raises(ConfigError, match="5,000 tokens becomes 4,096"):      # a fixed length above max
        _read_length(5000)


@pytest.mark.parametrize("sigma, kept", [(1.0, True), (1.3, True), (1.6, False), (2.0, False)])
def test_the_tolerance_is_on_the_exact_clipped_mean(sigma, kept):
    """Accepted exactly when the law after rounding and clipping keeps the mean within 10%
    (max 8192 moves a mean of 1024 by -1.8%, -7.3%, -17% and -32% at these sigmas)."""
    spec = {"distribution": "lognormal", "mean": 1024, "sigma": sigma, "max": 8192}
    law = Lognormal(unclipped_mean=1024, sigma=sigma, maximum=8192)
    assert (abs(law.mean() / 1024 - 1) <= 0.10) == kept
    if kept:
        assert _read_length(spec) == law
    else:
        with pytest.raises(ConfigError, match="more than the 10% allowed"):
            _read_length(spec)


def test_a_laws_moments_are_its_own_however_many_laws_are_asked_in_turn():
    """The moments are remembered by the law's value: laws asked in turn each get their own (each mean and
    variance within six standard errors of 200,000 draws'), and equal laws built apart get the same."""
    laws = [Lognormal(unclipped_mean=mean, sigma=sigma, maximum=8192) for mean, sigma in ((2048.0, 0.6),
                                                                                          (400.0, 0.6),
                                                                                          (2048.0, 0.3))]
    rng = np.random.default_rng(7)
    for _ in range(2):
        for law in laws:
            draws = law.sample(rng, 200_000).astype(float)
            assert abs(law.mean() - draws.mean()) <= 6 * draws.std() / math.sqrt(len(draws))
            # the sample variance's standard error: sqrt((m4 - s^4) / n)
            spread = math.sqrt((((draws - draws.mean()) ** 4).mean() - draws.var() ** 2) / len(draws))
            assert abs(law.variance() - draws.var()) <= 6 * spread
    twin = Lognormal(unclipped_mean=2048.0, sigma=0.6, maximum=8192)
    assert twin is not laws[0] and twin.mean() == laws[0].mean() and twin.variance() == laws[0].variance()
    assert len({law.mean() for law in laws}) == 3
