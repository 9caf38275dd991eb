"""vLLM's serve flags and engine-argument names in a scenario are read strictly (issue 35): a flag's
value is read as vLLM's type with nothing coerced (no NaN, infinity, digit separators or
non-ASCII digits), within the range of the setting it maps to, and a bad one is a ConfigError
at ``engine.vllm_args`` naming the flag, its value and what is allowed. A property-based corpus
(arbitrary text, arbitrary YAML trees as the engine section, mutations of valid flag strings) ends
in a scenario or such an error."""
from __future__ import annotations

import copy
import math
import resource
import shlex
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.cli.main import main
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario, load_scenario, scenario_from_node

from tests.helpers import bounded

FILE = "scenario.yaml"
BASE = {"name": "vllm-args", "seed": 1, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
        "engine": {"max_model_len": 8192},
        "workload": {"arrival": {"process": "poisson", "rate": 5}, "num_requests": 20,
                     # whole-token laws over a short range: cheap to build, for the corpus's thousands
                     "prompt_tokens": {"distribution": "fixed", "value": 100, "max": 128},
                     "output_tokens": {"distribution": "fixed", "value": 10, "max": 16}}}


def scenario(engine: dict, **top) -> Scenario:
    data = copy.deepcopy(BASE)
    data["engine"].update(engine)
    data.update(top)
    return scenario_from_node(Node(data, file=FILE))


def refused(flags: str, **top) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        scenario({"vllm_args": flags}, **top)
    return error.value


# -- values vLLM would refuse or llmsim cannot use, taken or refused under another key before -------------

@pytest.mark.parametrize("flags, shown", [
    ("--gpu-memory-utilization nan", "nan"),
    ("--gpu-memory-utilization inf", "inf"),
    ("--gpu-memory-utilization 1e400", "1e400"),
    ("--gpu-memory-utilization 1.5", "1.5"),
    ("--gpu-memory-utilization -0.5", "-0.5"),
    ("--max-num-seqs 0", "0"),
    ("--max-num-seqs -5", "-5"),
    ("--max-num-seqs 99999999999999999999", "99999999999999999999"),
    ("--max-num-seqs 1_000", "1_000"),
    ("--max-num-seqs \u0663", "\u0663"),                  # an Arabic-Indic three, which int() takes
    ("--max-num-seqs 12.0", "12.0"),
    ("-tp 0", "0"),
    ("--pipeline-parallel-size -1", "-1"),
    ("--max-model-len 0", "0"),
    ("--block-size 0", "0"),
])
def test_a_bad_flag_value_is_refused_at_the_flag(flags, shown):
    error = refused(flags)
    assert error.key == "engine.vllm_args" and error.file == FILE and error.value == flags, str(error)
    written = flags.split()[0].split("=")[0]
    assert f"cannot read {written} {shown}".rstrip() in error.message and f"{written}:" in error.allowed


@pytest.mark.parametrize("flags", ["--max-num-seqs= 64", "--max-num-batched-tokens=", "--port= 8000"])
def test_an_empty_inline_value_does_not_take_the_next_word(flags):
    # vLLM reads `--max-num-seqs= 64` as an empty value and a stray word; llmsim took 64
    error = refused(flags)
    assert error.key == "engine.vllm_args" and f"{flags.split()[0]} has no value" in error.message


@pytest.mark.parametrize("flags", ["--", "-", "--max-num-seqs 8 stray", "---max-num-seqs 8", "--=3", "--é 3"])
def test_a_word_that_is_not_a_flag_is_refused(flags):
    error = refused(flags)
    assert error.key == "engine.vllm_args" and error.value == flags


def test_flags_longer_than_the_limit_are_refused_before_they_are_split():
    from llmsim.config.limits import MAX_FLAGS_CHARS
    flags = "--port 8000 " * (MAX_FLAGS_CHARS // 12 + 1)
    error = refused(flags)
    assert error.key == "engine.vllm_args" and "longer than the 65,536 characters" in error.message
    assert len(scenario({"vllm_args": flags[:MAX_FLAGS_CHARS]}).vllm_notes) > 1000      # at the limit: read


def test_negative_numbers_are_values_as_in_argparse():
    # `--seed -1` is a valid vLLM command line (argparse takes a negative number as a value)
    assert any("--seed ignored" in note for note in scenario({"vllm_args": "--seed -1 --max-num-seqs 64"}).vllm_notes)


def test_the_valid_forms_still_read():
    engine = scenario({"vllm_args": "vllm serve m --max-num-seqs +64 --gpu-memory-utilization .85 -tp=1 "
                                    "--max-num-batched-tokens 4096 --enable-chunked-prefill=false "
                                    "--gpu-memory-utilization 0.85"}).engine
    assert (engine.max_num_seqs, engine.memory_utilization, engine.max_batch_tokens, engine.chunked_prefill) == \
        (64, 0.85, 4096, False)
    assert scenario({"vllm_args": "--gpu-memory-utilization 1"}).engine.memory_utilization == 1.0


# -- the model a flag changes --------------------------------------------------------------------------------

def test_a_model_flag_on_a_model_yaml_path_or_no_model_is_refused_at_the_flag():
    error = refused("--kv-cache-dtype fp8", model="my-model.yaml")
    assert error.key == "engine.vllm_args" and "model.kv_dtype" in error.message and "my-model.yaml" in error.message
    error = refused("--kv-cache-dtype fp8", model=None)
    assert error.key == "engine.vllm_args" and "names no model" in error.message
    error = refused("--kv-cache-dtype fp8", model=7)
    assert error.key == "model" and error.value == 7
    # a catalog name and a config.json path still take the dtype
    assert scenario({"vllm_args": "--kv-cache-dtype fp8"}).model.kv_dtype == "fp8"


# -- the file's flags and the command line's -----------------------------------------------------------------

def test_cli_flags_are_not_joined_to_a_file_value_that_is_not_a_string(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    data["engine"]["vllm_args"] = ["--max-num-seqs", "64"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as error:
        load_scenario(path, vllm_args="--block-size 16")
    assert error.value.key == "engine.vllm_args" and error.value.value == ["--max-num-seqs", "64"]
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--vllm-args", "-tp 1"]) == 2
    err = capsys.readouterr().err
    assert "engine.vllm_args" in err and str(path) in err and "Traceback" not in err


# -- the property-based corpus -------------------------------------------------------------------------------

QUICK_EXAMPLES, SLOW_EXAMPLES = 25, 2000

# Valid flag strings (the vocabulary tests' and the README's), whose words the mutations change.
VALID_FLAGS = [
    "vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 128 --max-num-batched-tokens=2048 -tp 1 "
    "--kv-cache-dtype fp8 --no-enable-chunked-prefill --gpu-memory-utilization 0.85",
    "--no-enable-prefix-caching --preemption-mode swap",
    "--enforce-eager --swap-space 8 --port 8000 --scheduling-policy fcfs --made-up-flag 3",
    "--max-num-seqs 256 --max-num-batched-tokens 8192 -tp 1 --block-size 16 --max-model-len 8192",
    "--enable-chunked-prefill --enable-prefix-caching true --quantization fp8 --seed -1",
]
WORDS = sorted({word for flags in VALID_FLAGS for word in shlex.split(flags)}
               | {"--tensor-parallel-size", "-pp", "-dp", "--data-parallel-size", "--", "-", "=", "'", '"', "\\",
                  "nan", "inf", "-inf", "1e400", "0", "-0", "1_0", "\u0663", "0x10", "true", "false", "maybe", "",
                  "--max-num-seqs=", "--gpu-memory-utilization=0.5", "--kv-cache-dtype=auto", "-q", "priority"})

flag_words = st.one_of(st.sampled_from(WORDS), st.text(alphabet=string.printable, max_size=10))


@st.composite
def mutated_flags(draw) -> str:
    """A valid flag string with one to four words replaced, inserted, dropped or swapped."""
    words = shlex.split(draw(st.sampled_from(VALID_FLAGS)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["replace", "insert", "drop", "swap"]))
        at = draw(st.integers(0, len(words)))
        if action == "insert" or not words:
            words.insert(at, draw(flag_words))
        elif action == "drop":
            words.pop(min(at, len(words) - 1))
        elif action == "swap":
            other = draw(st.integers(0, len(words) - 1))
            at = min(at, len(words) - 1)
            words[at], words[other] = words[other], words[at]
        else:
            words[min(at, len(words) - 1)] = draw(flag_words)
    return shlex.join(words) if draw(st.booleans()) else " ".join(words)


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.sampled_from([2**53 + 1, 10**400]),
                         st.floats(allow_subnormal=False), st.text(alphabet=string.printable, max_size=10),
                         st.sampled_from(["vllm", "llmsim", "fcfs", "swap"]), mutated_flags())
ENGINE_KEYS = ["vllm_args", "defaults", "max_num_seqs", "max-num-seqs", "max_num_batched_tokens", "max_batch_tokens",
               "enable_chunked_prefill", "chunked_prefill", "enable-prefix-caching", "gpu_memory_utilization",
               "block_size", "enforce_eager", "scheduling_policy", "batching", "max_model_len", "bogus"]
yaml_trees = st.recursive(yaml_scalars, lambda children: st.one_of(
    st.lists(children, max_size=3), st.dictionaries(st.sampled_from(ENGINE_KEYS), children, max_size=3)),
    max_leaves=8)
engines = st.one_of(yaml_trees, st.dictionaries(st.sampled_from(ENGINE_KEYS), yaml_trees, max_size=5))


EXAMPLE_BOUND_S = 10.0            # a hang bound per example (each takes milliseconds)
MAX_GROWTH_BYTES = 512 * 2**20     # peak memory the corpus may add to the test process


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # kB on Linux


def check_outcome(engine) -> None:
    """A scenario whose settings are the types they must be, or a ConfigError naming file, key and value."""
    data = copy.deepcopy(BASE)
    data["engine"] = engine
    try:
        with bounded(EXAMPLE_BOUND_S):
            result = scenario_from_node(Node(data, file=FILE))
    except ConfigError as error:
        text = str(error)
        assert error.file == FILE and FILE in text, text
        assert error.key and f"'{error.key}'" in text, text
        return
    eng = result.engine
    for count in (eng.max_num_seqs, eng.max_batch_tokens, eng.block_size, result.deployment.tensor_parallel):
        assert isinstance(count, int) and not isinstance(count, bool) and count >= 1
    assert isinstance(eng.chunked_prefill, bool) and isinstance(eng.prefix_caching, bool)
    assert math.isfinite(eng.memory_utilization) and 0 <= eng.memory_utilization <= 1


def _corpus_settings(examples: int):
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def run_corpus(examples: int) -> None:
    texts = st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
    before = peak_bytes()
    _corpus_settings(examples)(given(text=texts)(lambda text: check_outcome({"vllm_args": text})))()
    _corpus_settings(examples)(given(engine=engines)(check_outcome))()
    _corpus_settings(examples)(given(flags=mutated_flags())(lambda flags: check_outcome({"vllm_args": flags})))()
    assert peak_bytes() - before < MAX_GROWTH_BYTES


def test_corpus_ends_in_a_scenario_or_a_config_error():
    run_corpus(QUICK_EXAMPLES)


@pytest.mark.slow
def test_corpus_ends_in_a_scenario_or_a_config_error_2000_examples():
    run_corpus(SLOW_EXAMPLES)
