"""vLLM's engine-argument names and serve flags in a scenario (llmsim.scenario.vllm)."""
from __future__ import annotations

import pytest

from llmsim.cli.main import main
from llmsim.errors import ConfigError
from tests.helpers import make_scenario


def test_vllm_names_snake_or_kebab_set_the_same_engine():
    ours = make_scenario({"engine": {"max_batch_tokens": 4096, "chunked_prefill": False, "memory_utilization": 0.8,
                                     "max_num_seqs": 64, "prefix_caching": True}})
    snake = make_scenario({"engine": {"max_num_batched_tokens": 4096, "enable_chunked_prefill": False,
                                      "gpu_memory_utilization": 0.8, "max_num_seqs": 64,
                                      "enable_prefix_caching": True}})
    kebab = make_scenario({"engine": {"max-num-batched-tokens": 4096, "enable-chunked-prefill": False,
                                      "gpu-memory-utilization": 0.8, "max-num-seqs": 64,
                                      "enable-prefix-caching": True}})
    assert ours.engine == snake.engine == kebab.engine
    assert ours.engine.block_size == 128              # llmsim's default: these keys alone do not say "vLLM"


def test_vllm_args_map_to_settings_and_take_vllm_defaults():
    scenario = make_scenario({"engine": {"vllm_args": "vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 128 "
                                                      "--max-num-batched-tokens=2048 -tp 2 --kv-cache-dtype fp8 "
                                                      "--no-enable-chunked-prefill --gpu-memory-utilization 0.85"}})
    engine = scenario.engine
    assert (engine.max_num_seqs, engine.max_batch_tokens, engine.chunked_prefill, engine.memory_utilization) == \
        (128, 2048, False, 0.85)
    assert scenario.deployment.tensor_parallel == 2 and scenario.model.kv_dtype == "fp8"
    assert engine.block_size == 16 and engine.prefix_caching      # vLLM's defaults (V1)
    assert scenario.vllm_notes == ()
    assert make_scenario({"engine": {"defaults": "vllm"}}).engine.block_size == 16
    assert not make_scenario({"engine": {"vllm_args": "--no-enable-prefix-caching --preemption-mode swap"}}) \
        .engine.prefix_caching


def test_flags_not_modelled_are_reported_never_silently_accepted():
    scenario = make_scenario({"engine": {"vllm_args": "--enforce-eager --swap-space 8 --port 8000 "
                                                      "--scheduling-policy fcfs --made-up-flag 3"}})
    notes = "\n".join(scenario.vllm_notes)
    assert len(scenario.vllm_notes) == 4
    for flag in ("--enforce-eager not modelled", "--swap-space not modelled", "--port ignored",
                 "--made-up-flag not modelled"):
        assert flag in notes
    with pytest.raises(ConfigError, match="enforce_eager is not modelled"):
        make_scenario({"engine": {"enforce-eager": True}})


@pytest.mark.parametrize("flags, message", [
    ("--max-num-seqs lots", "cannot read --max-num-seqs lots.*an integer"),
    ("--scheduling-policy lifo", "cannot read --scheduling-policy lifo.*fcfs, priority"),
    ("--kv-cache-dtype int3", "cannot read --kv-cache-dtype int3.*fp8_e4m3"),
    ("--max-num-seqs", "cannot read --max-num-seqs"),
])
def test_bad_flag_values_name_the_key_value_and_what_is_allowed(flags, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_scenario({"engine": {"vllm_args": flags}})
    assert error.value.key == "engine.vllm_args" and error.value.value == flags


def test_a_setting_given_twice_is_refused():
    with pytest.raises(ConfigError, match="sets engine.max_batch_tokens to 8192, which the scenario sets to 4096"):
        make_scenario({"engine": {"max_batch_tokens": 4096, "vllm_args": "--max-num-batched-tokens 8192"}})
    with pytest.raises(ConfigError, match="a second time"):
        make_scenario({"engine": {"max_batch_tokens": 4096, "max_num_batched_tokens": 8192}})


def test_cli_vllm_args_exit_2_on_a_bad_value(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("model: Llama-3.1-8B\nhardware: H100-SXM\nworkload:\n  arrival: {process: poisson, rate: 1}\n"
                        "  num_requests: 5\n  prompt_tokens: 10\n  output_tokens: 2\n")
    assert main(["run", str(scenario), "--out", str(tmp_path / "o"), "--vllm-args", "--gpu-memory-utilization x"]) == 2
    err = capsys.readouterr().err
    assert "at key '--vllm-args'" in err and "--gpu-memory-utilization x" in err and "Traceback" not in err


def test_command_line_flags_override_the_scenario_and_say_so(tmp_path):
    """--vllm-args is applied after the file: it replaces what the file sets (a note says so), where the file's
    own engine.vllm_args may not contradict the file's keys (test_a_setting_given_twice_is_refused)."""
    from llmsim.scenario.scenario import load_scenario
    scenario = tmp_path / "s.yaml"
    scenario.write_text("model: Llama-3.1-8B\nhardware: H100-SXM\nengine: {max_num_seqs: 256, max_batch_tokens: 4096}\n"
                        "workload:\n  arrival: {process: poisson, rate: 1}\n  num_requests: 5\n  prompt_tokens: 10\n"
                        "  output_tokens: 2\n")
    assert load_scenario(scenario).engine.max_num_seqs == 256
    overridden = load_scenario(scenario, vllm_args="--max-num-seqs 64")
    assert overridden.engine.max_num_seqs == 64 and overridden.engine.max_batch_tokens == 4096
    assert any("--max-num-seqs overrides the scenario's engine.max_num_seqs: 256 -> 64" in note
               for note in overridden.vllm_notes)
    assert load_scenario(scenario, vllm_args="--max-num-seqs 256").vllm_notes == ()


def test_vllm_priority_scheduling_maps_to_its_llmsim_policy():
    classes = {"interactive": {"share": 0.5, "priority": 0}, "batch": {"share": 0.5, "priority": 1}}
    scenario = make_scenario({"workload": {"classes": classes},
                              "engine": {"vllm_args": "--scheduling-policy priority"}})
    assert scenario.engine.scheduling_policy == "vllm_priority" and scenario.vllm_notes == ()
