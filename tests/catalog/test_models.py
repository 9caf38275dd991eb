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
# KV bytes per token (bf16) from docs/reference/sources/models.md, in KiB.
PUBLISHED_KV_KIB = {"Llama-2-7B": 512, "Llama-2-13B": 800, "Llama-2-70B": 320, "Llama-3.1-8B": 128,
                    "Llama-3.1-70B": 320, "Llama-3.1-405B": 504, "Mistral-7B-v0.1": 128, "Mixtral-8x7B": 128,
                    "Qwen2.5-7B": 56, "Qwen2.5-72B": 320, "Llama-3.2-1B": 32, "TinyLlama-1.1B": 22,
                    "llama-68m": 6,
                    # 2 x layers x kv_heads x head_dim x 2 bytes, from the configs in models.yaml:
                    "Llama-3.3-70B": 320, "Qwen3-30B-A3B": 2 * 48 * 4 * 128 * 2 / 1024,
                    "Qwen3-235B-A22B": 2 * 94 * 4 * 128 * 2 / 1024, "gpt-oss-120b": 2 * 36 * 8 * 64 * 2 / 1024,
                    "Llama-3.2-3B": 2 * 28 * 8 * 128 * 2 / 1024,
                    # MLA: (d_c + d_h^R) x layers elements (DeepSeek-V2 paper, section 2.1), d_c = 512, d_h^R = 64:
                    "DeepSeek-V3": (512 + 64) * 61 * 2 / 1024}


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


# -- issue 14: current models and Hugging Face config.json import ----------------------------------

# Published total sizes (model cards; DeepSeek-V3 technical report without its 14B MTP module).
PUBLISHED_B = {"Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.0, "DeepSeek-V3": 671.0, "Llama-3.3-70B": 70.6,
               "gpt-oss-120b": 116.8}


@pytest.mark.parametrize("name", list(PUBLISHED_B))
def test_new_catalog_models_within_one_percent_of_published_size(name):
    assert CATALOG[name].param_count == pytest.approx(PUBLISHED_B[name] * 1e9, rel=0.01)
    assert CATALOG[name].source


def test_moe_active_parameters_match_the_model_cards():
    # Qwen3 model cards: 3.3B and 22B activated; DeepSeek-V3 report: 37B activated.
    assert CATALOG["Qwen3-30B-A3B"].active_param_count == pytest.approx(3.3e9, rel=0.03)
    assert CATALOG["Qwen3-235B-A22B"].active_param_count == pytest.approx(22e9, rel=0.03)
    assert CATALOG["DeepSeek-V3"].active_param_count == pytest.approx(37e9, rel=0.03)


def test_mla_kv_bytes_and_attention_flops_follow_the_paper():
    from llmsim.cost.work import decode_layer_work, prefill_layer_work
    v3 = CATALOG["DeepSeek-V3"]
    # DeepSeek-V2 paper, table 1: MLA caches (d_c + d_h^R) l = (4 d_h + d_h / 2) l elements, d_h = 128.
    d_h, layers = 128, 61
    assert v3.kv_bytes_per_token == (4 * d_h + d_h // 2) * layers * 2          # bf16 cache
    # ... about 57 times less than multi-head attention with 128 heads would cache (2 n_h d_h l).
    assert 2 * 128 * d_h * layers * 2 / v3.kv_bytes_per_token == pytest.approx(56.9, abs=0.1)
    # The latent is not split by tensor parallelism: every rank holds it whole.
    assert v3.kv_elements_per_token_per_layer(8) == 512 + 64
    # Decode attends in latent space: per pair and head, scores over 512 + 64 and the sum over 512.
    context = 1000
    flops, kv_bytes = decode_layer_work(v3, batch=1, context=context)["attention_decode"]
    assert flops == 2 * 128 * (512 + 64 + 512) * (context + 1)
    assert kv_bytes >= (512 + 64) * 2 * (context + 1)
    # Prefill materialises 192-wide keys and 128-wide values per head.
    flops, _ = prefill_layer_work(v3, tokens=4, context=0)["attention_prefill"]
    assert flops == 2 * 128 * (192 + 128) * (1 + 2 + 3 + 4)


def _write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
             "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
             "mlp_only_layers": [], "sliding_window": None, "use_sliding_window": False,
             "_name_or_path": "/root/.cache/huggingface/hub/models--Qwen--Qwen3-30B-A3B/snapshots/"
                              "0123456789abcdef0123456789abcdef01234567"}

DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
               "num_nextn_predict_layers": 1,
               "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                  "weight_block_size": [128, 128]}}


def test_qwen3_moe_import_counts_its_experts_width_and_takes_the_hub_name(tmp_path):
    model = model_from_config_json(_write(tmp_path, QWEN3_MOE))
    assert model.param_count == pytest.approx(30.5e9, rel=0.01)        # not 233.5B (moe_intermediate_size used)
    assert model.name == "Qwen/Qwen3-30B-A3B"
    assert model.param_count == CATALOG["Qwen3-30B-A3B"].param_count
    # Dense layers named by mlp_only_layers or a sparse step: every other layer dense halves the experts.
    half = model_from_config_json(_write(tmp_path, {**QWEN3_MOE, "decoder_sparse_step": 2}, "h.json"))
    assert half.dense_layers == 24


def test_deepseek_v3_import_mla_moe_and_fp8(tmp_path):
    model = model_from_config_json(_write(tmp_path / "DeepSeek-V3", DEEPSEEK_V3))
    catalog = CATALOG["DeepSeek-V3"]
    assert model.param_count == catalog.param_count and model.kv_bytes_per_token == catalog.kv_bytes_per_token
    assert (model.weight_dtype, model.embedding_dtype, model.kv_dtype) == ("fp8", "bf16", "bf16")
    # FP8 linear layers (1 byte) and bf16 embedding + LM head (2 bytes each).
    embeddings = 2 * 129280 * 7168
    assert model.weight_bytes == (model.param_count - embeddings) * 1 + embeddings * 2
    assert model.name == "DeepSeek-V3"                                   # the folder, no _name_or_path
    # One multi-token-prediction module ships with the weights (num_nextn_predict_layers), outside the 671B.
    assert model.mtp_modules == catalog.mtp_modules == 1
    assert CATALOG["Llama-3.1-70B"].mtp_modules == 0


def test_sliding_window_patterns(tmp_path):
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096}
    assert model_from_config_json(_write(tmp_path, mistral, "m.json")).sliding_window == 4096
    gemma2 = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
              "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
              "sliding_window": 4096, "torch_dtype": "float32"}
    model = model_from_config_json(_write(tmp_path, gemma2, "g.json"))
    # Half of Gemma-2's layers are global: the window applies to the other half only.
    assert (model.sliding_window, model.sliding_window_layers) == (4096, 21) and "21 of 42 layers" in model.source
    assert model.local_attention_share == 0.5
    assert model.tie_word_embeddings and model.weight_dtype == "fp32"
    assert model.param_count == pytest.approx(9.24e9, rel=0.01)          # Gemma-2-9B's published size
    gemma3 = {"model_type": "gemma3", "text_config": {**gemma2, "model_type": "gemma3_text", "num_hidden_layers": 12,
                                                      "sliding_window": 1024, "sliding_window_pattern": 6}}
    model = model_from_config_json(_write(tmp_path, gemma3, "g3.json"))
    assert "10 of 12 layers" in model.source and (model.sliding_window, model.sliding_window_layers) == (1024, 10)
    # Mistral: every layer slides (sliding_window_layers unset means all of them).
    mistral_model = model_from_config_json(_write(tmp_path, mistral, "m.json"))
    assert mistral_model.sliding_window_layers is None and mistral_model.local_attention_share == 1.0


def test_gpt_oss_and_int4_quantization(tmp_path):
    gpt_oss = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 36, "num_local_experts": 128,
               "num_experts_per_tok": 4, "experts_per_token": 4, "vocab_size": 201088, "attention_bias": True,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
               "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    model = model_from_config_json(_write(tmp_path, gpt_oss))
    assert model.param_count == CATALOG["gpt-oss-120b"].param_count
    assert (model.weight_dtype, model.expert_dtype) == ("bf16", "fp4") and "18 of 36 layers" in model.source
    assert (model.sliding_window, model.sliding_window_layers) == (128, 18)
    assert (CATALOG["gpt-oss-120b"].sliding_window, CATALOG["gpt-oss-120b"].sliding_window_layers) == (128, 18)
    awq = {**QWEN3_MOE, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
           "torch_dtype": "float16"}
    model = model_from_config_json(_write(tmp_path, awq, "awq.json"))
    assert (model.weight_dtype, model.embedding_dtype) == ("int4", "fp16")
    with pytest.raises(ConfigError, match="quant_method.*Allowed: fp8, awq"):
        model_from_config_json(_write(tmp_path, {**awq, "quantization_config": {"quant_method": "hqq"}}, "x.json"))


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    with pytest.raises(ConfigError, match="unsupported model architecture.*llama.*deepseek_v3.*gpt_oss"):
        model_from_config_json(_write(tmp_path, {"model_type": "mamba", "hidden_size": 8, "num_hidden_layers": 2}))
