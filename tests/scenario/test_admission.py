"""Engine admission modes (engine.admission): vLLM's preempt-and-recompute, TensorRT-LLM's
MAX_UTILIZATION and GUARANTEED_NO_EVICT, checked by invariants recounted at every iteration."""
from __future__ import annotations

import pytest

from llmsim import simulate
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import EngineConfig

from tests.helpers import make_scenario

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
        assert sum(engine.decode.blocks(r) for r in engine.running.values()) == kv.used_blocks
        checked["iterations"] += 1

    result = run("guaranteed_no_evict", reservation)
    assert result.preemptions == 0
    assert checked["iterations"] == len(result.iterations)
    assert (result.requests["status"] == "finished").all()


def test_max_utilization_holds_back_prompts_that_do_not_fit_whole():
    """A request joins only when its whole prompt's blocks are free. vLLM asks for more: the rest of its prompt
    beside what the running prompts still need, plus the watermark. On the same trace every request
    finishes, and vLLM's stricter test preempts no more often."""
    result, vllm = run("max_utilization"), run("preempt")
    assert (result.requests["status"] == "finished").all()
    assert vllm.preemptions <= result.preemptions


def test_an_unknown_admission_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"engine\.admission.*guaranteed_no_evict"):
        make_scenario({"engine": {"admission": "greedy"}})


def test_long_prompts_under_a_tight_cache_are_not_preempted_over_and_over():
    """The reported thrash: 20,000-token prompts on a cache of a few of them. vLLM admits a prompt only when
    the rest of it fits beside what the running prompts still need, with its watermark spare, so at most
    k = floor((blocks - watermark) / prompt blocks) requests ever run at once (the k-th needs its prompt's
    blocks + the watermark free while the others hold at least theirs). When k whole requests (prompt +
    output) fit the cache, no running request can ever lack a block: nothing is preempted and every prompt
    is computed exactly once. (Admitting on the first chunk's blocks alone, each prompt was preempted and
    recomputed hundreds of times here.)"""
    prompt, output = 20_000, 2_000
    scenario = make_scenario({"engine": {"memory_utilization": 0.35, "max_model_len": prompt + output},
                              "workload": {"arrival": {"rate": 2.0}, "num_requests": 40, "prompt_tokens": prompt,
                                           "output_tokens": output}, "simulation": {"horizon": "3000 s"}})
    blocks, block_size = scenario.memory.num_blocks, scenario.engine.block_size
    watermark = int(0.01 * blocks)
    prompt_blocks, whole_blocks = -(-prompt // block_size), -(-(prompt + output) // block_size)
    at_once = (blocks - watermark) // prompt_blocks
    assert at_once >= 2 and at_once * whole_blocks <= blocks < (at_once + 1) * prompt_blocks + watermark
    result = simulate(scenario)
    assert result.preemptions == 0
    assert (result.requests["status"] == "finished").all()
    assert result.iterations["prefill_tokens"].sum() == result.requests["prompt_tokens"].sum()
    assert result.iterations["running"].max() == at_once
