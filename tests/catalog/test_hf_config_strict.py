"""A Hugging Face config.json is read strictly (issue 35): every value of the wrong type, out of
range or not finite is a ConfigError naming the file, the key path (``text_config.KEY`` inside a
multimodal wrapper), the value and what is allowed; never a traceback, never a silently coerced or
ignored value. A config path that is a device or a FIFO is refused without being read. A
property-based corpus (arbitrary bytes, arbitrary JSON trees, mutations of valid configs) ends in a
model or such an error."""
from __future__ import annotations

import copy
import json
import math
import os
import resource
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.catalog.models import ModelSpec, model_catalog, model_from_config_json
from llmsim.errors import ConfigError

from tests.helpers import bounded

# -- valid configs (shapes of the published config.json files) ---------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "rope_theta": 500000.0}
MISTRAL = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096}
QWEN2 = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
         "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "sliding_window": 4096,
         "use_sliding_window": True, "max_window_layers": 21}
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_attention_heads": 16,
             "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60, "num_experts_per_tok": 4,
             "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
             "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
             "mlp_only_layers": [], "sliding_window": None, "use_sliding_window": False}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61, "first_k_dense_replace": 3,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
               "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
          "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
          "sliding_window": 4096, "torch_dtype": "float32"}
GEMMA3 = {"model_type": "gemma3", "text_config": {**GEMMA2, "model_type": "gemma3_text", "num_hidden_layers": 12,
                                                  "sliding_window": 1024, "sliding_window_pattern": 6}}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 36, "num_local_experts": 128,
           "num_experts_per_tok": 4, "vocab_size": 201088, "attention_bias": True, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "mxfp4"}}
AWQ = {**QWEN3_MOE, "torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4}}
BNB = {**LLAMA, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
COMPRESSED = {**LLAMA, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}}

VALID = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE,
         "deepseek_v3": DEEPSEEK_V3, "gemma2": GEMMA2, "gemma3": GEMMA3, "gpt_oss": GPT_OSS, "awq": AWQ,
         "bitsandbytes": BNB, "compressed": COMPRESSED}


def catalog_config(model: ModelSpec) -> dict:
    """A dense catalog model written as the config.json of a Llama-type model (the corpus's seeds)."""
    config = {"model_type": "llama", "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
              "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
              "intermediate_size": model.intermediate_size, "vocab_size": model.vocab_size,
              "head_dim": model.head_dim, "tie_word_embeddings": model.tie_word_embeddings,
              "max_position_embeddings": model.max_context, "attention_bias": model.qkv_bias}
    if model.sliding_window:
        config["sliding_window"] = model.sliding_window
    return config


CATALOG_CONFIGS = {name: catalog_config(model) for name, model in model_catalog().items()
                   if model.num_experts == 1 and not model.is_mla and model.sliding_window_layers is None}


def write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))         # Python's json writes NaN and Infinity as the configs may hold
    return path


def with_changes(base: dict, changes: dict, remove: tuple = ()) -> dict:
    """``base`` with ``changes`` set and ``remove`` dropped; a key ``text_config.X`` goes into text_config."""
    config = copy.deepcopy(base)
    for key, value in changes.items():
        target, _, leaf = key.rpartition(".")
        (config[target] if target else config)[leaf] = value
    for key in remove:
        config.pop(key)
    return config


# -- the faults of issue 35: tracebacks ------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")

TRACEBACKS = [
    ("num_hidden_layers text with a window", MISTRAL, {"num_hidden_layers": "abc"}, "num_hidden_layers"),
    ("num_hidden_layers NaN with a window", MISTRAL, {"num_hidden_layers": NAN}, "num_hidden_layers"),
    ("model_type a list", LLAMA, {"model_type": ["llama"]}, "model_type"),
    ("model_type a mapping", LLAMA, {"model_type": {"llama": 1}}, "model_type"),
    ("architectures of lists", with_changes(LLAMA, {}, ("model_type",)),
     {"architectures": [["LlamaForCausalLM"]]}, "architectures"),
    ("quantization_config a string", LLAMA, {"quantization_config": "fp8"}, "quantization_config"),
    ("quantization_config a list", LLAMA, {"quantization_config": ["fp8"]}, "quantization_config"),
    ("AWQ bits a list", AWQ, {"quantization_config": {"quant_method": "awq", "bits": [4]}},
     "quantization_config.bits"),
    ("GPTQ bits a mapping", AWQ, {"quantization_config": {"quant_method": "gptq", "bits": {"w": 4}}},
     "quantization_config.bits"),
    ("config_groups a list", COMPRESSED, {"quantization_config": {"quant_method": "compressed-tensors",
                                                                  "config_groups": [{"weights": {}}]}},
     "quantization_config.config_groups"),
    ("weights a list", COMPRESSED, {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": [{"num_bits": 8}]}}}}, "quantization_config.config_groups.group_0.weights"),
    ("num_experts a word", QWEN3_MOE, {"num_experts": "many"}, "num_experts"),
    ("num_experts a list", QWEN3_MOE, {"num_experts": [128]}, "num_experts"),
    ("num_experts Infinity", QWEN3_MOE, {"num_experts": INF}, "num_experts"),
    ("num_experts NaN", QWEN3_MOE, {"num_experts": NAN}, "num_experts"),
    ("mlp_only_layers a number", QWEN3_MOE, {"mlp_only_layers": 5}, "mlp_only_layers"),
    ("decoder_sparse_step a word", QWEN3_MOE, {"decoder_sparse_step": "two"}, "decoder_sparse_step"),
    ("shared_expert_intermediate_size a word", QWEN2_MOE, {"shared_expert_intermediate_size": "x"},
     "shared_expert_intermediate_size"),
    ("n_shared_experts without moe_intermediate_size", with_changes(DEEPSEEK_V3, {}, ("moe_intermediate_size",)),
     {}, "moe_intermediate_size"),
    ("n_shared_experts a word", DEEPSEEK_V3, {"n_shared_experts": "one"}, "n_shared_experts"),
    ("first_k_dense_replace a word", DEEPSEEK_V3, {"first_k_dense_replace": "three"}, "first_k_dense_replace"),
    ("qk_nope_head_dim a word", DEEPSEEK_V3, {"qk_nope_head_dim": "abc"}, "qk_nope_head_dim"),
    ("sliding_window_pattern a word", GEMMA3, {"text_config.sliding_window_pattern": "six"},
     "text_config.sliding_window_pattern"),
    ("sliding_window a list", MISTRAL, {"sliding_window": [1024]}, "sliding_window"),
    ("max_window_layers a word", QWEN2, {"max_window_layers": "x"}, "max_window_layers"),
    ("text_config num_hidden_layers a word", GEMMA3, {"text_config.num_hidden_layers": "abc"},
     "text_config.num_hidden_layers"),
]

# -- ... and wrong values accepted -------------------------------------------------------------------------

ACCEPTED = [
    ("torch_dtype a list", LLAMA, {"torch_dtype": ["bfloat16"]}, "torch_dtype"),
    ("torch_dtype int4", LLAMA, {"torch_dtype": "int4"}, "torch_dtype"),
    ("mlp_only_layers a string", QWEN3_MOE, {"mlp_only_layers": "0,1"}, "mlp_only_layers"),
    ("decoder_sparse_step negative", QWEN3_MOE, {"decoder_sparse_step": -2}, "decoder_sparse_step"),
    ("sliding_window a string", MISTRAL, {"sliding_window": "1024"}, "sliding_window"),
    ("sliding_window a fraction", MISTRAL, {"sliding_window": 1024.7}, "sliding_window"),
    ("layer_types a string", GPT_OSS, {"layer_types": "sliding_attention"}, "layer_types"),
    # found alongside: booleans and names that Python's truthiness or str() would take
    ("attention_bias a string", LLAMA, {"attention_bias": "false"}, "attention_bias"),
    ("tie_word_embeddings a number", LLAMA, {"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ("use_sliding_window a string", QWEN2, {"use_sliding_window": "false"}, "use_sliding_window"),
    ("load_in_4bit a string", BNB, {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": "no"}},
     "quantization_config.load_in_4bit"),
    ("_name_or_path a list", LLAMA, {"_name_or_path": ["meta-llama/Llama-3.1-8B"]}, "_name_or_path"),
    ("text_config a string", GEMMA3, {"text_config": "gemma3_text"}, "text_config"),
    ("num_experts a boolean", QWEN3_MOE, {"num_experts": True}, "num_experts"),
    ("decoder_sparse_step zero", QWEN3_MOE, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("sliding_window_pattern zero", GEMMA3, {"text_config.sliding_window_pattern": 0},
     "text_config.sliding_window_pattern"),
    ("mlp_only_layers past the last layer", QWEN3_MOE, {"mlp_only_layers": [48]}, "mlp_only_layers"),
    ("first_k_dense_replace past the last layer", DEEPSEEK_V3, {"first_k_dense_replace": 62},
     "first_k_dense_replace"),
    ("layer_types of another length", GPT_OSS, {"layer_types": ["sliding_attention"] * 35}, "layer_types"),
    ("layer_types naming an unknown attention", GPT_OSS,
     {"layer_types": ["sliding_attention", "ful_attention"] * 18}, "layer_types"),
    ("quant_method a number", LLAMA, {"quantization_config": {"quant_method": 8}},
     "quantization_config.quant_method"),
]


@pytest.mark.parametrize("label, base, changes, key", TRACEBACKS + ACCEPTED, ids=[c[0] for c in TRACEBACKS + ACCEPTED])
def test_a_wrong_value_is_a_config_error_naming_file_key_and_value(tmp_path, label, base, changes, key):
    path = write(tmp_path, with_changes(base, changes))
    with pytest.raises(ConfigError) as error:
        model_from_config_json(path)
    assert error.value.file == str(path) and error.value.key == key, str(error.value)
    text = str(error.value)
    assert str(path) in text and f"'{key}'" in text and "Allowed:" in text


def test_the_valid_configs_still_read(tmp_path):
    for label, config in VALID.items():
        assert isinstance(model_from_config_json(write(tmp_path, config, f"{label}.json")), ModelSpec), label
    # the corpus's catalog seeds read back as the catalog's models
    catalog = model_catalog()
    for name, config in CATALOG_CONFIGS.items():
        model = model_from_config_json(write(tmp_path, config, "catalog.json"))
        assert (model.param_count, model.kv_bytes_per_token, model.sliding_window) == \
            (catalog[name].param_count, catalog[name].kv_bytes_per_token, catalog[name].sliding_window), name


def test_an_error_from_the_model_checks_names_the_config_key(tmp_path):
    """Checks between fields (KV heads dividing heads, top-k within the experts) name the key the
    config.json has, not llmsim's field name."""
    with pytest.raises(ConfigError) as error:
        model_from_config_json(write(tmp_path, {**LLAMA, "num_key_value_heads": 5}))
    assert error.value.key == "num_key_value_heads" and error.value.value == 5
    with pytest.raises(ConfigError) as error:
        model_from_config_json(write(tmp_path, {**QWEN3_MOE, "num_experts_per_tok": 129}))
    assert error.value.key == "num_experts_per_tok"


# -- dense layers: counted in closed form, against transformers' per-layer rule ----------------------------

def dense_by_rule(layers: int, step: int, mlp_only: list[int]) -> int:
    """transformers' Qwen2-MoE decoder layer: sparse iff not in mlp_only_layers and (i + 1) % step == 0."""
    return sum(1 for i in range(layers) if not (i not in mlp_only and (i + 1) % step == 0))


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(layers=st.integers(1, 64), step=st.integers(1, 70), data=st.data())
def test_dense_layers_follow_the_per_layer_rule(tmp_path_factory, layers, step, data):
    mlp_only = data.draw(st.lists(st.integers(0, layers - 1), max_size=6))
    config = {**QWEN3_MOE, "num_hidden_layers": layers, "decoder_sparse_step": step, "mlp_only_layers": mlp_only}
    model = model_from_config_json(write(tmp_path_factory.mktemp("c"), config))
    assert model.dense_layers == dense_by_rule(layers, step, mlp_only)


def test_a_huge_layer_count_is_counted_not_walked(tmp_path):
    layers = 10**15
    config = {**QWEN3_MOE, "num_hidden_layers": layers, "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    with bounded(30):
        model = model_from_config_json(write(tmp_path, config))
    assert model.dense_layers == layers - layers // 2 + 1          # odd layers sparse, but layer 1 dense


# -- the file itself -------------------------------------------------------------------------------------

def test_a_device_or_fifo_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with bounded(30), pytest.raises(ConfigError, match="not a regular file") as error:
            model_from_config_json(path)
        assert error.value.file == str(path)


LLAMA_TEXT = json.dumps(LLAMA)


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000, "nested more than 64"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested more than 64"),
    ('{"a": ' * 64 + "1" + "}" * 64, "unsupported model architecture"),           # 64 levels are allowed
    (LLAMA_TEXT.replace('"num_hidden_layers": 32', '"num_hidden_layers": ' + "9" * 5000), "not valid JSON"),
    (LLAMA_TEXT.replace('"num_hidden_layers": 32', '"num_hidden_layers": 1e999'), "num_hidden_layers"),
    (LLAMA_TEXT.replace('"num_hidden_layers": 32', '"num_hidden_layers": ' + "9" * 400), "num_hidden_layers"),
    (LLAMA_TEXT[:-1] + ', "_name_or_path": "\\ud800"}', "_name_or_path"),
])
def test_malformed_json_is_a_config_error(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as error:
        model_from_config_json(path)
    assert error.value.file == str(path)


# -- the property-based corpus -------------------------------------------------------------------------------

QUICK_EXAMPLES, SLOW_EXAMPLES = 25, 2000
SEEDS = {**VALID, **CATALOG_CONFIGS}

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=300), st.sampled_from([0, 1, 2, 4, 8, 2**53, 2**53 + 1, 10**400, -10**30]),
    st.floats(allow_subnormal=False), st.sampled_from([NAN, INF, -INF, 1e300, 0.5, 4.0]),
    st.text(alphabet=string.printable, max_size=8),
    st.sampled_from(["", "llama", "bfloat16", "int4", "torch.float16", "awq", "gptq", "fp8", "mxfp4",
                     "compressed-tensors", "bitsandbytes", "float", "int", "sliding_attention", "full_attention",
                     "1024", "\ud800", "\x00"]),
)
json_trees = st.recursive(json_scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(alphabet=string.ascii_lowercase + "_", max_size=8),
                                                    children, max_size=4)), max_leaves=12)
KEYS = sorted({key for config in SEEDS.values() for key in config} | set(GEMMA3["text_config"])
              | {"text_config", "n_shared_experts", "first_k_dense_replace", "mlp_only_layers",
                 "sliding_window_pattern", "max_window_layers", "layer_types", "use_sliding_window", "_name_or_path",
                 "dtype", "n_layer"})
QUANT_KEYS = ["quant_method", "bits", "load_in_4bit", "config_groups"]


@st.composite
def mutated_configs(draw) -> dict:
    """A valid config with one to four keys (at the top, in text_config or in quantization_config)
    set to another value, dropped, or another key's value."""
    config = copy.deepcopy(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["top", "top", "text_config", "quantization_config"]))
        mapping = config if where == "top" else config.get(where)
        if not isinstance(mapping, dict):
            mapping = config
        key = draw(st.sampled_from(QUANT_KEYS if where == "quantization_config" else KEYS))
        action = draw(st.sampled_from(["set", "set", "set", "drop", "swap"]))
        if action == "drop":
            mapping.pop(key, None)
        elif action == "swap" and mapping:
            mapping[key] = copy.deepcopy(mapping[draw(st.sampled_from(sorted(mapping, key=str)))])
        else:
            mapping[key] = draw(json_trees)
    return config


EXAMPLE_BOUND_S = 10.0            # a hang bound per example (each takes milliseconds)
MAX_GROWTH_BYTES = 512 * 2**20     # peak memory the corpus may add to the test process


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # kB on Linux


def check_outcome(path, content_is_object: bool) -> None:
    """A model, or a ConfigError naming the file (and the key, when a value of the object was refused)."""
    try:
        with bounded(EXAMPLE_BOUND_S):
            model = model_from_config_json(path)
    except ConfigError as error:
        text = str(error)
        assert error.file == str(path) and str(path) in text, text
        if error.has_value and content_is_object:
            assert error.key and f"'{error.key}'" in text, text
        return
    assert isinstance(model, ModelSpec)
    for count in (model.num_layers, model.hidden_size, model.num_heads, model.vocab_size, model.num_experts):
        assert isinstance(count, int) and not isinstance(count, bool) and count >= 1
    assert math.isfinite(model.weight_bytes) and model.weight_bytes > 0


def _corpus_settings(examples: int):
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def _check_bytes(path, data: bytes):
    path.write_bytes(data)
    check_outcome(path, content_is_object=False)


def _check_tree(path, tree):
    path.write_text(json.dumps(tree))
    check_outcome(path, content_is_object=isinstance(tree, dict))


def _check_mutation(path, config):
    path.write_text(json.dumps(config))
    check_outcome(path, content_is_object=True)


byte_strings = st.one_of(st.binary(max_size=200), st.sampled_from(
    [b"", b"{}", b"[]", b"null", b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b"{" * 70, b'{"a": NaN}']))
trees = st.one_of(json_trees, st.dictionaries(st.sampled_from(KEYS), json_trees, max_size=8))


def run_corpus(folder, examples: int) -> None:
    """Each kind of input, ``examples`` of them, written in turn to one config.json in ``folder``."""
    path = folder / "config.json"
    before = peak_bytes()
    _corpus_settings(examples)(given(data=byte_strings)(lambda data: _check_bytes(path, data)))()
    _corpus_settings(examples)(given(tree=trees)(lambda tree: _check_tree(path, tree)))()
    _corpus_settings(examples)(given(config=mutated_configs())(lambda config: _check_mutation(path, config)))()
    assert peak_bytes() - before < MAX_GROWTH_BYTES


def test_corpus_ends_in_a_model_or_a_config_error(tmp_path):
    run_corpus(tmp_path, QUICK_EXAMPLES)


@pytest.mark.slow
def test_corpus_ends_in_a_model_or_a_config_error_2000_examples(tmp_path):
    run_corpus(tmp_path, SLOW_EXAMPLES)
