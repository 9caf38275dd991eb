"""A Hugging Face ``config.json`` in llmsim's model fields (see :class:`~llmsim.catalog.models.ModelSpec`).

Each supported ``model_type`` names its fields differently; :func:`config_fields` reads
them all into one mapping that :func:`~llmsim.catalog.models.model_from_config_json`
validates like a model YAML. What it reads beyond the dense shape:

- MoE: routed experts (``num_local_experts``, ``num_experts``, ``n_routed_experts``) of width
  ``moe_intermediate_size``; shared experts (DeepSeek ``n_shared_experts`` experts of that
  width, Qwen-MoE ``shared_expert_intermediate_size``); dense layers (DeepSeek
  ``first_k_dense_replace``, Qwen-MoE ``mlp_only_layers`` and ``decoder_sparse_step``).
- MLA (DeepSeek-V2/V3): ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``.
- multi-token-prediction modules shipped with the weights (DeepSeek-V3, GLM-4.5:
  ``num_nextn_predict_layers``), which ``recommend`` offers as a draft (``draft: mtp``).
- dtypes: ``torch_dtype`` (or ``dtype``) for weights and KV cache; a ``quantization_config``
  (FP8, AWQ/GPTQ, bitsandbytes, compressed-tensors, MXFP4) for the linear layers, the
  embedding and LM head staying at ``torch_dtype`` as quantized checkpoints keep them.
- sliding windows per layer: ``layer_types``, Gemma-2's every other layer, Gemma-3's
  ``sliding_window_pattern``, ``use_sliding_window``: ``sliding_window`` and how many layers
  use it (``sliding_window_layers``, left unset when every layer does, as in Mistral); the
  model's ``source`` names the split.
- the name from ``_name_or_path`` or the Hub cache folder (``models--ORG--NAME``), never a
  snapshot hash; else ``model_type``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from llmsim.config.reader import read_text
from llmsim.errors import ConfigError

# model_type -> the architecture class names that go with it, for an error listing what is supported.
SUPPORTED = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration (its text model)",
    "gpt_oss": "GptOssForCausalLM", "phi3": "Phi3ForCausalLM",
}
# transformers' default for tie_word_embeddings where config.json leaves it out.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
QKV_BIAS_BY_DEFAULT = ("qwen2", "qwen2_moe")

_FIELDS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "experts_per_token", "moe_top_k"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "max_context": ("max_position_embeddings",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "mtp_modules": ("num_nextn_predict_layers",),
}
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}
QUANT_METHODS = ("fp8", "awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4")
_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
_HUB_FOLDER = re.compile(r"models--([^/\\]+?)--([^/\\]+)")


def read_config(path: Path) -> dict:
    """The JSON object of a config.json (a ConfigError if missing or not JSON)."""
    try:
        config = json.loads(read_text(path))          # the front door: size, encoding, folders
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=str(path), has_value=False) from None
    if not isinstance(config, dict):
        raise ConfigError("expected a JSON object", file=str(path), has_value=False)
    return config


def config_fields(path: Path, name: str | None = None) -> dict:
    """The config.json at ``path`` as ModelSpec fields (validated by the caller)."""
    config = read_config(path)
    model_type = _model_type(config, path)
    if isinstance(config.get("text_config"), dict):      # a multimodal wrapper (Gemma-3): its language model
        config = {**config, **config["text_config"]}
    missing = [key for key in REQUIRED if config.get(key) is None]
    if missing:
        raise ConfigError(f"lacks {', '.join(missing)}", file=str(path), key=missing[0], has_value=False,
                          allowed="a Hugging Face config.json of a decoder-only language model")
    fields: dict[str, object] = {}
    for ours, theirs in _FIELDS.items():
        for key in theirs:
            if config.get(key) is not None:
                fields[ours] = config[key]
                break
    fields.setdefault("num_kv_heads", fields.get("num_heads"))
    fields.setdefault("tie_word_embeddings", model_type in TIED_BY_DEFAULT)
    fields["qkv_bias"] = bool(config.get("attention_bias", model_type in QKV_BIAS_BY_DEFAULT))
    fields.update(_moe(config, fields))
    if fields.get("kv_lora_rank"):
        fields["head_dim"] = int(config.get("qk_nope_head_dim", 0)) + int(config.get("qk_rope_head_dim", 0))
    note = _sliding_window(config, fields)
    fields.update(_dtypes(config, path))
    fields["name"] = name or model_name(config, path)
    fields["source"] = f"config.json at {path}" + note
    return fields


def _model_type(config: dict, path: Path) -> str:
    model_type = config.get("model_type")
    if model_type is None:
        by_class = {cls.split(" ")[0]: mt for mt, cls in SUPPORTED.items()}
        model_type = next((by_class[a] for a in config.get("architectures") or [] if a in by_class), None)
    if model_type not in SUPPORTED:
        raise ConfigError("unsupported model architecture (its layers' shapes are not known to llmsim)",
                          file=str(path), key="model_type", value=config.get("model_type", config.get("architectures")),
                          allowed=", ".join(f"{mt} ({cls})" for mt, cls in SUPPORTED.items())
                          + "; or the model's fields inline in the scenario")
    return model_type


def _moe(config: dict, fields: dict) -> dict:
    """Shared experts and dense layers of an MoE model."""
    if int(fields.get("num_experts") or 1) <= 1:
        return {}
    out = {}
    shared = config.get("n_shared_experts")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared) * int(config["moe_intermediate_size"])
    elif config.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = int(config["shared_expert_intermediate_size"])
    layers = int(fields["num_layers"])
    if config.get("first_k_dense_replace"):
        out["dense_layers"] = int(config["first_k_dense_replace"])
    elif config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) > 1:
        step, dense_only = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or [])
        out["dense_layers"] = sum(1 for i in range(layers) if i in dense_only or (i + 1) % step)
    return out


def _sliding_window(config: dict, fields: dict) -> str:
    """Sets ``sliding_window`` (and ``sliding_window_layers`` unless every layer slides); returns a
    note for the source when only some layers do."""
    window = config.get("sliding_window")
    layers = int(fields["num_layers"])
    if not window or config.get("use_sliding_window") is False:
        return ""
    model_type = config.get("model_type")
    if isinstance(config.get("layer_types"), list):
        sliding = sum(1 for kind in config["layer_types"] if kind == "sliding_attention")
    elif model_type == "gemma2":
        sliding = math.ceil(layers / 2)                      # even layers are local
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = int(config.get("sliding_window_pattern") or 6)
        sliding = layers - layers // pattern                 # every pattern-th layer is global
    elif config.get("use_sliding_window") and config.get("max_window_layers") is not None:
        sliding = max(layers - int(config["max_window_layers"]), 0)
    else:
        sliding = layers
    if sliding == layers:
        fields["sliding_window"] = int(window)
        return ""
    if sliding == 0:
        return ""
    fields["sliding_window"], fields["sliding_window_layers"] = int(window), sliding
    return f"; {sliding} of {layers} layers use a {int(window):,}-token sliding window, the others global attention"


def _dtypes(config: dict, path: Path) -> dict:
    """weight/kv dtypes from torch_dtype (or dtype), and the quantization_config."""
    stored = TORCH_DTYPES.get(str(config.get("torch_dtype", config.get("dtype"))).replace("torch.", ""))
    out = {"weight_dtype": stored, "kv_dtype": stored} if stored else {}
    quant = config.get("quantization_config")
    if not quant:
        return out
    base = stored or "bf16"
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        dtype = "fp8"
    elif method in ("awq", "gptq"):
        dtype = _integer_bits(quant.get("bits", 4), path)
    elif method == "bitsandbytes":
        dtype = "int4" if quant.get("load_in_4bit") else "int8"
    elif method == "compressed-tensors":
        dtype = _compressed_tensors(quant, path)
    elif method == "mxfp4":             # gpt-oss: the MoE experts only (attention, router, embeddings not converted)
        return {**out, "weight_dtype": base, "expert_dtype": "fp4"}
    else:
        raise ConfigError("unsupported quantization_config.quant_method", file=str(path),
                          key="quantization_config.quant_method", value=quant.get("quant_method"),
                          allowed=", ".join(QUANT_METHODS))
    return {**out, "weight_dtype": dtype, "embedding_dtype": base, "kv_dtype": out.get("kv_dtype", base)}


def _integer_bits(bits: object, path: Path) -> str:
    dtype = {4: "int4", 8: "int8"}.get(bits)
    if dtype is None:
        raise ConfigError("unsupported quantization bits", file=str(path), key="quantization_config.bits",
                          value=bits, allowed="4, 8")
    return dtype


def _compressed_tensors(quant: dict, path: Path) -> str:
    """The weights' type of the first config group (``num_bits`` and ``type``: float or int)."""
    groups = quant.get("config_groups") or {}
    weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None)
    if not weights:
        raise ConfigError("a compressed-tensors quantization_config without weight settings", file=str(path),
                          key="quantization_config.config_groups", has_value=False)
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    if kind == "float" and bits == 8:
        return "fp8"
    if kind == "float" and bits == 4:
        return "fp4"
    return _integer_bits(bits, path)


def model_name(config: dict, path: Path) -> str:
    """``_name_or_path`` (ORG/NAME from a Hub cache folder), else the folder's name unless it is a
    snapshot hash, else ``model_type``."""
    for candidate in (str(config.get("_name_or_path") or ""), str(path.resolve().parent)):
        hub = _HUB_FOLDER.search(candidate)
        if hub:
            return f"{hub.group(1)}/{hub.group(2).split('/')[0]}"
    raw = str(config.get("_name_or_path") or "").rstrip("/")
    if raw and not _SNAPSHOT.fullmatch(Path(raw).name):
        return raw if not Path(raw).is_absolute() else Path(raw).name
    folder = path.resolve().parent.name
    return folder if folder and not _SNAPSHOT.fullmatch(folder) else str(config.get("model_type", "model"))
