"""The fluid model of a disaggregated deployment: a prefill pool, a decode pool and the KV link between them.

Each pool is the fluid model of :mod:`llmsim.analysis.fluid` on its own chip, parallelism, replicas and engine
settings (:meth:`~llmsim.scenario.scenario.Scenario.pool`), for its part of each request
(:class:`~llmsim.analysis.fluid.Stage`): the prefill pool computes prompts and has no decode work; the decode pool
takes each request with its prompt's KV, computes the last prompt token over it (the first output token) and
decodes the rest, its KV cache holding the whole context. The link into each decode replica (``lanes`` ports, the
requests spread evenly over the decode replicas) carries each prompt's KV, shared by the transfers on it: an
M/G/1 processor-sharing queue, whose mean transfer time is ``E[bytes] / rate / (1 - rho)`` whatever the
distribution of sizes, plus the link's latency.

So the capacity is the least of the prefill pool's, the decode pool's and the link's (the rate at which its
``rho`` reaches 1); TTFT is the prefill pool's (queue and prefill) plus the transfer plus the decode pool's (its
queue for a slot and the first step); TPOT and the step time are the decode pool's.

What it leaves out, besides what each pool's fluid model leaves out: the KV blocks a decode replica reserves
before a transfer (``reservation: before_transfer``) and the prefill copy held while it moves; the layers
streamed during the prefill (``streaming``: only the last layer's KV is counted on the link, a lower bound on
what is left); and requests run whole on the decode pool (``aggregated_below_tokens``), which it refuses.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from llmsim.analysis.fluid import FluidModel, Stage, stable_capacity
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario
from llmsim.workload.trace import Trace

SPLIT_KEY = "deployment.disaggregation"      # the scenario key (llmsim.search.plan names it too)


class DisaggregatedFluid:
    """The fluid model of a disaggregated scenario (see the module docstring); :meth:`evaluate` returns the
    columns :meth:`FluidModel.evaluate <llmsim.analysis.fluid.FluidModel.evaluate>` does."""

    def __init__(self, scenario: Scenario, trace: Trace | None = None):
        split = scenario.disaggregation
        if split is None:
            raise ConfigError("the scenario has no disaggregated pools", file=scenario.path, key=SPLIT_KEY,
                              has_value=False, allowed="a deployment.disaggregation section")
        if split.aggregated_below_tokens > 0:
            raise ConfigError("the fluid model does not model requests run whole on the decode pool",
                              file=scenario.path, key=f"{SPLIT_KEY}.aggregated_below_tokens",
                              value=split.aggregated_below_tokens, allowed="0 (or simulate)")
        self.scenario = scenario
        self.prefill = FluidModel(scenario.pool("prefill"), trace, Stage.PREFILL)
        self.decode = FluidModel(scenario.pool("decode"), trace, Stage.DECODE)
        model = scenario.model
        share = 1.0 / model.num_layers if split.streaming else 1.0
        self.transfer_bytes = self.prefill.request_prompt * model.kv_bytes_per_token * share
        self.link_bytes_per_s = split.link.effective_bytes_per_s * split.lanes      # into one decode replica
        self.link_latency_s = split.link.latency_s
        self.decode_replicas = split.decode.replicas
        self.mean_output = self.decode.mean_output

    def link_utilisation(self, rate_per_s) -> np.ndarray:
        """The share of time the link into a decode replica is busy at each total arrival rate."""
        rates = np.atleast_1d(np.asarray(rate_per_s, dtype=float))
        return rates / self.decode_replicas * self.transfer_bytes / self.link_bytes_per_s

    def link_capacity_per_s(self) -> float:
        """The largest total arrival rate the link carries (requests/s)."""
        return self.decode_replicas * self.link_bytes_per_s / self.transfer_bytes

    def capacity(self, rounds: int = 3) -> float:
        """The largest total arrival rate the model predicts to be stable: the least of the pools' and the
        link's (:func:`~llmsim.analysis.fluid.stable_capacity`)."""
        return stable_capacity(self.evaluate, rounds)

    def evaluate(self, rate_per_s, mean_limits_s: Mapping[str, float] | None = None,
                 ttft_percentile: float | None = None) -> pd.DataFrame:
        """Predicted steady state at each total arrival rate; ``mean_limits_s`` as for FluidModel.evaluate
        (it bounds the decode pool's solve: TPOT and E2E are at least the decode pool's). ``ttft_percentile``:
        also ``ttft_percentile_s``, the prefill pool's TTFT at that percentile of the prompt lengths plus the
        mean transfer and the decode pool's mean first step (the prompt's length acts on the prefill)."""
        rates = np.atleast_1d(np.asarray(rate_per_s, dtype=float))
        prefill = self.prefill.evaluate(rates, ttft_percentile=ttft_percentile)
        decode = self.decode.evaluate(rates, mean_limits_s)
        rho = self.link_utilisation(rates)
        with np.errstate(divide="ignore"):
            transfer_s = np.where(rho < 1, self.transfer_bytes / self.link_bytes_per_s / (1 - rho), np.inf) \
                + self.link_latency_s
        stable = prefill["stable"].to_numpy() & decode["stable"].to_numpy() & (rho < 1)
        ttft = np.where(stable, prefill["ttft_mean_s"].to_numpy() + transfer_s + decode["ttft_mean_s"].to_numpy(),
                        np.inf)
        tpot = np.where(stable, decode["tpot_mean_s"].to_numpy(), np.inf)
        frame = decode.copy()
        frame["ttft_mean_s"], frame["tpot_mean_s"] = ttft, tpot
        if ttft_percentile is not None:
            frame["ttft_percentile_s"] = np.where(stable, prefill["ttft_percentile_s"].to_numpy() + transfer_s
                                                  + decode["ttft_mean_s"].to_numpy(), np.inf)
        frame["e2e_mean_s"] = ttft + tpot * (self.mean_output - 1.0)
        frame["in_system"] = prefill["in_system"].to_numpy() + decode["in_system"].to_numpy() \
            + np.where(stable, rates * transfer_s, np.inf)
        frame["utilisation"] = np.maximum.reduce([prefill["utilisation"].to_numpy(),
                                                 decode["utilisation"].to_numpy(), rho])
        frame["stable"] = stable
        frame["output_tokens_per_s"] = np.where(stable, rates * self.mean_output, np.nan)
        return frame


def fluid_model(scenario: Scenario, trace: Trace | None = None) -> FluidModel | DisaggregatedFluid:
    """The scenario's fluid model: its pools' (:class:`DisaggregatedFluid`) where it is disaggregated."""
    return FluidModel(scenario, trace) if scenario.disaggregation is None else DisaggregatedFluid(scenario, trace)
