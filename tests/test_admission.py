"""Engine admission modes (engine.admission): vLLM's preempt-and-recompute, TensorRT-LLM's
MAX_UTILIZATION and GUARANTEED_NO_EVICT, checked by invariants recounted at every iteration."""
from __future__ import annotations

import pytest

from llmsim import simulate
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import EngineConfig

from .helpers import make_scenario

# A small KV cache under overload: the default (vLLM) engine preempts here.
TIGHT = {"engine": {"memory_utilization": 0.25, "max_model_len": 8192}, "workload": {"arrival": {"rate": 30.0},
                                                                                      "num_requests": 300}}


def run(admission: str, observer=None):
    overrides = {**TIGHT, "engine": {**TIGHT["engine"], "admission": admission}}
    return simulate(make_scenario(overrides), observers=[observer] if observer else [])


def test_the_default_is_vllms_preempt_and_recompute():
    assert EngineConfig().admission == "preempt"
    assert run("preempt").preemptions > 0


def test_guaranteed_no_evict_reserves_every_full_length_and_never_preempts():
    """At every iteration the running requests' full lengths (prompt + output) fit the cache, and the KV
    they hold is what the cache has handed out; nothing is preempted and every request finishes."""
    checked = {"iterations": 0}

    def reservation(engine, iteration):
        kv = engine.kv
        full = sum(kv.blocks_for(r.prompt_tokens + r.output_tokens) for r in engine.running.values())
        assert full <= kv.num_blocks
        assert sum(r.blocks for r in engine.running.values()) == kv.used_blocks
        checked["iterations"] += 1

    result = run("guaranteed_no_evict", reservation)
    assert result.preemptions == 0
    assert checked["iterations"] == len(result.iterations)
    assert (result.requests["status"] == "finished").all()


def test_max_utilization_holds_back_prompts_that_do_not_fit_whole():
    """A request joins only when its whole prompt's blocks are free (vLLM needs only its first chunk's): on
    the same trace every request finishes, with no more running at once and no more preemptions than vLLM."""
    result, vllm = run("max_utilization"), run("preempt")
    assert (result.requests["status"] == "finished").all()
    assert result.iterations["running"].mean() <= vllm.iterations["running"].mean()
    assert result.preemptions <= vllm.preemptions


def test_an_unknown_admission_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"engine\.admission.*guaranteed_no_evict"):
        make_scenario({"engine": {"admission": "greedy"}})
