"""The default horizon of a run: long enough for its arrivals, and for the work they bring.

A run stops at ``simulation.horizon``. Unset, the horizon is twice the arrival window and at least
60 s past it, which serves a load the deployment carries: its requests finish within moments of
arriving. A load it cannot carry as it comes (an offline run, every request at t=0, or a burst
beyond its capacity) leaves a backlog that drains at the deployment's full speed, however short the
arrival window: there the horizon is ``DRAIN_MARGIN`` times the time to serve every request back to
back (:func:`drain_time_s`).

That time is a fluid view of the backlog priced by the cost model, as the resource guard's
(:mod:`llmsim.sim.resources`): every engine decodes full batches (``max_num_seqs``, or as many
sequences as its KV cache holds at the mean context) and prefills each prompt on its own. The
analytic model of :mod:`llmsim.analysis.fluid` would give the deployment's capacity more closely,
but it belongs to a later stage than the simulator (``tests/test_architecture.py``), and a margin
of two covers what this simpler view leaves out (partial batches while the backlog drains).
"""
from __future__ import annotations

from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import Scenario

DRAIN_MARGIN = 2.0
MIN_TAIL_S = 60.0             # past the last arrival, at least


def default_horizon_s(scenario: Scenario, window_s: float, requests: int, prompt_tokens: float,
                      output_tokens: float) -> float:
    """The horizon of a run of ``requests`` (mean lengths ``prompt_tokens`` and ``output_tokens``)
    arriving over ``window_s``, when the scenario sets none."""
    return max(2 * window_s, window_s + MIN_TAIL_S,
               DRAIN_MARGIN * drain_time_s(scenario, requests, prompt_tokens, output_tokens))


def drain_time_s(scenario: Scenario, requests: int, prompt_tokens: float, output_tokens: float) -> float:
    """Seconds for the deployment to serve ``requests`` waiting at once: their decode steps in full
    batches and their prompts' prefill, spread over every engine."""
    if requests <= 0:
        return 0.0
    resolved = ResolvedDeployment.of(scenario)
    engines = resolved.replicas * resolved.engines_per_replica
    context = int(prompt_tokens + output_tokens / 2)
    held = resolved.memory.kv_capacity_tokens // max(1, int(prompt_tokens + output_tokens))
    batch = int(max(1, min(resolved.engine.max_num_seqs, held)))
    decode_s = requests * output_tokens / batch * resolved.cost.decode_time(batch, max(1, context))
    prefill_s = requests * resolved.cost.prefill_time(max(1, int(prompt_tokens)))
    return (decode_s + prefill_s) / engines
