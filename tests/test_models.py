"""The model catalog against published sizes, and config.json loading."""
from __future__ import annotations

import json
import math

import pytest

from llmsim import model_catalog, model_from_config_json
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.catalog.models import model_from_node

CATALOG = model_catalog()
# KV bytes per token (bf16) from shared/reference/models.md, in KiB.
PUBLISHED_KV_KIB = {"Llama-2-7B": 512, "Llama-2-13B": 800, "Llama-2-70B": 320, "Llama-3.1-8B": 128,
                    "Llama-3.1-70B": 320, "Llama-3.1-405B": 504, "Mistral-7B-v0.1": 128, "Mixtral-8x7B": 128,
                    "Qwen2.5-7B": 56, "Qwen2.5-72B": 320, "Llama-3.2-1B": 32, "TinyLlama-1.1B": 22,
                    "llama-68m": 6}


@pytest.mark.parametrize("name", list(CATALOG))
def test_parameter_count_matches_published_size(name):
    model = CATALOG[name]
    published = model.params_published
    # The table gives three significant figures: the derived count must round to it.
    half_unit = 0.5 * 10 ** (math.floor(math.log10(published)) - 2)
    assert abs(model.param_count - published) <= half_unit, (model.param_count, published)


@pytest.mark.parametrize("name", list(CATALOG))
def test_kv_bytes_per_token_match_the_table(name):
    assert CATALOG[name].kv_bytes_per_token == PUBLISHED_KV_KIB[name] * 1024


def test_mixtral_active_parameters():
    mixtral = CATALOG["Mixtral-8x7B"]
    assert round(mixtral.active_param_count / 1e9, 1) == 12.9


def test_config_json_gives_the_same_model(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rope_theta": 500000.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = model_from_config_json(path, name="my-llama")
    assert model.param_count == CATALOG["Llama-3.1-8B"].param_count
    assert model.kv_bytes_per_token == CATALOG["Llama-3.1-8B"].kv_bytes_per_token
    assert model.name == "my-llama"


def test_config_json_moe_and_qwen_bias(tmp_path):
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2}
    qwen = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064}
    (tmp_path / "m.json").write_text(json.dumps(mixtral))
    (tmp_path / "q.json").write_text(json.dumps(qwen))
    assert model_from_config_json(tmp_path / "m.json").param_count == CATALOG["Mixtral-8x7B"].param_count
    assert model_from_config_json(tmp_path / "q.json").param_count == CATALOG["Qwen2.5-7B"].param_count


def test_scenario_model_overrides_and_inline_fields():
    fp8 = model_from_node(Node({"base": "Llama-3.1-70B", "weight_dtype": "fp8", "kv_dtype": "fp8"}))
    assert fp8.weight_bytes == CATALOG["Llama-3.1-70B"].weight_bytes / 2
    assert fp8.kv_bytes_per_token == CATALOG["Llama-3.1-70B"].kv_bytes_per_token / 2
    inline = model_from_node(Node({"name": "tiny", "num_layers": 2, "hidden_size": 768, "num_heads": 12,
                                   "intermediate_size": 3072, "vocab_size": 32000}))
    assert inline.param_count == CATALOG["llama-68m"].param_count


def test_bad_model_fields_are_config_errors():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        model_from_node(Node({"name": "x", "num_layers": 2, "hidden_size": 768, "num_heads": 12,
                              "num_kv_heads": 5, "intermediate_size": 3072, "vocab_size": 32000}))
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        model_from_node(Node({"name": "x", "num_layers": 2, "hiden_size": 768}))
