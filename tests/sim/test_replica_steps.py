"""A replica's engines stepped together (llmsim.sim.replica_steps) make the run the general path makes.

Each run below goes once with the replica's micro-batch engines stepped together through their decode-only
iterations and once with every iteration through the engines' own loop (``step_together`` switched off), and the two
must agree to the last bit: every request record, every iteration row, every inter-token gap and its weight, the
longest wait a dispatching queue timeout could have acted on, the KV blocks handed out. The runs reach what ends a
stretch: finishes, admissions of transferred or queued requests, preemptions when the cache runs out, other events
(arrivals, a prefill pool's steps, transfers), and the three admission tests; and most stretches read the engines'
rows kept from the stretch before (an engine that stepped on its own since is read again). On a disaggregated decode
pool the stretches go on past the calls that cannot reach it (arrivals, the prefill pool's steps, hand-offs), run in
their turn, where :meth:`~llmsim.sim.disaggregated.DisaggregatedRouter.decode_apart` lets them, and only there.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from llmsim.config.reader import Node
from llmsim.scenario.scenario import scenario_from_node
from llmsim.sim import disaggregated, replica_steps
from llmsim.sim.environment import Environment
from llmsim.sim import simulate as simulate_module
from llmsim.sim.simulate import simulate
from tests.helpers import REPO, make_scenario

CS3 = REPO / "scenarios" / "llama3-70b-h100-prefill-cs3-decode.yaml"


def _cs3(rate: float, requests: int, max_batch_tokens: int, disaggregation: dict | None = None,
         replicas: int = 1, **engine):
    data = yaml.safe_load(Path(CS3).read_text())
    data["workload"].update({"arrival": {"process": "poisson", "rate": rate}, "num_requests": requests})
    data["engine"].update(max_batch_tokens=max_batch_tokens, **engine)
    data["deployment"]["disaggregation"].update(disaggregation or {})
    for pool in ("prefill", "decode"):
        data["deployment"]["disaggregation"][pool]["replicas"] = replicas
    return scenario_from_node(Node(data, file=str(CS3), base_dir=CS3.parent))


def _four_stages(admission: str, **engine):
    """Four micro-batch engines over a KV cache small enough at this load that the queue waits for blocks
    (and, but under GUARANTEED_NO_EVICT, sequences are preempted)."""
    return make_scenario({"deployment": {"pipeline_parallel": 4},
                          "engine": {"admission": admission, "memory_utilization": 0.08, "max_model_len": 8192,
                                     **engine},
                          "workload": {"num_requests": 300, "arrival": {"process": "poisson", "rate": 60}}})


def _run_both(scenario, monkeypatch):
    stepped: list[int] = []
    gathered: list[int] = []
    went_on: list[bool] = []
    run, gather, go_past = (replica_steps.ReplicaSteps.run, replica_steps.ReplicaSteps._gather,
                            replica_steps.ReplicaSteps._go_past)

    def counted(self, first, in_flight):
        before = len(first.log)
        taken = run(self, first, in_flight)
        stepped.append(taken and len(first.log) > before)
        return taken

    def counted_gather(self, i):
        gathered.append(i)
        gather(self, i)

    def counted_go_past(self):
        went_on.append(go_past(self))
        return went_on[-1]

    envs: list[Environment] = []

    def kept_environment():
        envs.append(Environment())
        return envs[-1]

    with monkeypatch.context() as patch:
        patch.setattr(simulate_module, "Environment", kept_environment)
        patch.setattr(replica_steps.ReplicaSteps, "run", counted)
        patch.setattr(replica_steps.ReplicaSteps, "_gather", counted_gather)
        patch.setattr(replica_steps.ReplicaSteps, "_go_past", counted_go_past)
        together = simulate(scenario, force=True)
        for module in (simulate_module, disaggregated):
            patch.setattr(module, "step_together", lambda engines: None)
        alone = simulate(scenario, force=True)
    # The event queue's counter, which orders events at the same time: every call the general path schedules took
    # its value in the same order (a step run on at once, before every other event, takes none, in both runs).
    assert next(envs[0]._eid) == next(envs[1]._eid)
    return together, alone, sum(stepped), len(gathered), sum(went_on)


# Where a stretch goes on past other events' calls (arrivals, the prefill pool's steps, hand-offs): how many times it
# does at least (None: it must not).
@pytest.mark.parametrize("scenario, goes_past", [
    pytest.param(lambda: _cs3(10, 300, 2048), 500, id="prefill-on-gpu-decode-on-cs3"),
    pytest.param(lambda: _cs3(40, 200, 8192), 100, id="cs3-cache-full-preempting"),
    # The KV sent layer by layer (the hand-off reads the link's load); two replicas in each pool (one decode
    # replica's steps are not let past the other's: they end its stretches); some prompts run whole on the decode pool
    # (their arrivals are not let past). (With the decode blocks reserved before the transfer no decode engine steps
    # together: each runs the router's hook after every iteration.)
    pytest.param(lambda: _cs3(10, 300, 2048, {"streaming": True}), 300, id="cs3-streaming"),
    pytest.param(lambda: _cs3(24, 400, 2048, replicas=2), 100, id="cs3-two-replicas-each"),
    pytest.param(lambda: _cs3(10, 300, 2048, {"aggregated_below_tokens": 1500}), 200, id="cs3-short-prompts-whole"),
    pytest.param(lambda: _four_stages("preempt"), None, id="four-stages-preempt"),
    pytest.param(lambda: _four_stages("max_utilization"), None, id="four-stages-max-utilization"),
    pytest.param(lambda: _four_stages("guaranteed_no_evict"), None, id="four-stages-guaranteed-no-evict"),
    # Queue timeouts: a stretch ends before the step at which one acts (forcing the head in, or rejecting).
    pytest.param(lambda: _cs3(10, 300, 2048, queue_timeout="50 ms"), 300, id="cs3-timeout-dispatching"),
    pytest.param(lambda: _four_stages("preempt", queue_timeout="200 ms"), None, id="four-stages-timeout-dispatching"),
    pytest.param(lambda: _four_stages("preempt", queue_timeout="200 ms", on_timeout="reject"), None,
                 id="four-stages-timeout-rejecting"),
])
def test_engines_stepped_together_make_the_run_the_general_path_makes(scenario, goes_past, monkeypatch):
    together, alone, stretches, gathered, went_on = _run_both(scenario(), monkeypatch)
    assert stretches > 50                               # the stepping did take over
    assert went_on >= goes_past if goes_past is not None else went_on == 0
    assert gathered < stretches                         # most engines' rows kept from the stretch before
    assert together.iterations["decode_seqs"].gt(0).mean() > 0.5
    assert together.iterations["queued"].gt(0).mean() > 0.3            # admissions that fail, stretches past them
    pd.testing.assert_frame_equal(together.requests, alone.requests, check_exact=True)
    pd.testing.assert_frame_equal(together.iterations, alone.iterations, check_exact=True)
    pd.testing.assert_frame_equal(together.queue_length, alone.queue_length, check_exact=True)
    # The inter-token gaps, each step's weighted by the sequences that continued through it, as handed over.
    for mine, theirs in zip(together.inter_token_gaps.chunks(), alone.inter_token_gaps.chunks(), strict=True):
        for column, other in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(column, other)
    for name in ("end_s", "kv_allocated_blocks", "kv_freed_blocks", "kv_held_blocks", "preemptions", "mean_in_system",
                 "mean_queue_length", "dispatch_wait_s"):
        assert getattr(together, name) == getattr(alone, name), name
