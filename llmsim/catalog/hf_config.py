"""A Hugging Face ``config.json`` in llmsim's model fields (see :class:`~llmsim.catalog.models.ModelSpec`).

Each supported ``model_type`` names its fields differently; :func:`config_fields` reads
them all into one mapping that :func:`~llmsim.catalog.models.model_from_config_json`
validates like a model YAML. Every key is read through :class:`HFConfig`, a
:class:`~llmsim.config.reader.Node`: a value of the wrong type (a string, boolean, list, NaN
or fraction for a count), out of range, or not one of the values listed is a ConfigError naming
the file, the key (``text_config.KEY`` inside a multimodal wrapper), the value and what is
allowed; keys the model does not use are not read. What it reads beyond the dense shape:

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

import math
import re
from pathlib import Path

from llmsim.config.reader import Node, load_json
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
# Fields that may be 0 (as in ModelSpec: 0 means "none" or "derived"); the other counts are at least 1.
_MAY_BE_ZERO = ("head_dim", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                "mtp_modules")
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}
QUANT_METHODS = ("fp8", "awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4")
LAYER_TYPES = ("sliding_attention", "full_attention")
_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
_HUB_FOLDER = re.compile(r"models--([^/\\]+?)--([^/\\]+)")


class HFConfig(Node):
    """A config.json, read key by key with :class:`~llmsim.config.reader.Node`'s strict accessors (no
    string, boolean, NaN or fraction taken for a count). A multimodal wrapper's ``text_config`` is
    laid over it, and its keys are named ``text_config.KEY`` in errors."""

    def __init__(self, data: dict, file: str, text_keys=()):
        super().__init__(data, file=file)
        self.text_keys = frozenset(text_keys)

    def key_path(self, key: str) -> str:
        return f"text_config.{key}" if key in self.text_keys else key

    def count(self, key: str, default=None, *, minimum: int = 1, maximum: float | None = None):
        """A whole number >= ``minimum`` (``default`` when the key is absent or null)."""
        return self.number(key, default, integer=True, minimum=minimum, maximum=maximum, exclusive_minimum=False)

    def first_key(self, keys) -> str | None:
        """The first of ``keys`` the config sets (not null)."""
        return next((key for key in keys if self.has(key)), None)


def mapping(node: Node, key: str) -> Node:
    """``key`` of ``node``: a JSON object, as a Node."""
    value = node.raw(key)
    if not isinstance(value, dict):
        raise node.key_error(key, "expected a JSON object", value, "a JSON object ({...})")
    return node.child(key)


def read_config(path: Path) -> dict:
    """The JSON object of a config.json (a ConfigError if missing, not a regular file, or not JSON)."""
    config = load_json(path)                    # the front door: size, encoding, devices, nesting
    if not isinstance(config, dict):
        raise ConfigError("expected a JSON object", file=str(path), has_value=False,
                          allowed="a Hugging Face config.json: one JSON object")
    return config


def config_fields(path: Path, name: str | None = None) -> tuple[dict, dict]:
    """The config.json at ``path`` as ModelSpec fields (validated by the caller), and for each field
    the config.json key it came from (for the caller's errors to name)."""
    raw = read_config(path)
    top = HFConfig(raw, str(path))
    model_type = _model_type(top)
    config = top
    if top.has("text_config"):                       # a multimodal wrapper (Gemma-3): its language model
        text = mapping(top, "text_config").data
        config = HFConfig({**raw, **text}, str(path), text_keys=text)
    missing = [key for key in REQUIRED if not config.has(key)]
    if missing:
        raise ConfigError(f"lacks {', '.join(missing)}", file=str(path), key=config.key_path(missing[0]),
                          has_value=False, allowed="a Hugging Face config.json of a decoder-only language model")
    fields: dict[str, object] = {}
    origin: dict[str, str] = {}
    for ours, theirs in _FIELDS.items():
        key = config.first_key(theirs)
        if key is None:
            continue
        origin[ours] = config.key_path(key)
        fields[ours] = config.boolean(key) if ours == "tie_word_embeddings" else \
            config.count(key, minimum=0 if ours in _MAY_BE_ZERO else 1)
    if "num_kv_heads" not in fields:
        fields["num_kv_heads"], origin["num_kv_heads"] = fields["num_heads"], origin["num_heads"]
    fields.setdefault("tie_word_embeddings", model_type in TIED_BY_DEFAULT)
    fields["qkv_bias"] = config.boolean("attention_bias", model_type in QKV_BIAS_BY_DEFAULT)
    _moe(config, fields, origin)
    if fields.get("kv_lora_rank"):
        fields["head_dim"] = config.count("qk_nope_head_dim", 0, minimum=0) + fields.get("qk_rope_head_dim", 0)
        origin["head_dim"] = config.key_path("qk_nope_head_dim")
    note = _sliding_window(config, fields, origin)
    fields.update(_dtypes(config))
    fields["name"] = name or model_name(config, path)
    fields["source"] = f"config.json at {path}" + note
    return fields, origin


def _model_type(config: HFConfig) -> str:
    """``model_type``, else the first supported class in ``architectures``."""
    model_type = config.raw("model_type", None)
    if model_type is None and config.has("architectures"):
        classes = config.raw("architectures")
        if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
            raise config.key_error("architectures", "expected a list of class names", classes,
                                   'a list of strings, e.g. ["LlamaForCausalLM"]')
        by_class = {cls.split(" ")[0]: mt for mt, cls in SUPPORTED.items()}
        model_type = next((by_class[name] for name in classes if name in by_class), None)
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        key = "model_type" if config.has("model_type") or not config.has("architectures") else "architectures"
        raise config.error("unsupported model architecture (its layers' shapes are not known to llmsim)",
                           key=config.key_path(key), value=config.raw(key, None), has_value=config.has(key),
                           allowed=", ".join(f"{mt} ({cls})" for mt, cls in SUPPORTED.items())
                           + "; or the model's fields inline in the scenario")
    return model_type


def _moe(config: HFConfig, fields: dict, origin: dict) -> None:
    """Shared experts and dense layers of an MoE model."""
    if fields.get("num_experts", 1) <= 1:
        return
    layers = fields["num_layers"]
    shared = config.count("n_shared_experts", 0, minimum=0)
    if shared:
        if "moe_intermediate_size" not in fields:
            raise config.error("n_shared_experts counts experts of moe_intermediate_size, which is missing",
                               key=config.key_path("moe_intermediate_size"), has_value=False,
                               allowed="moe_intermediate_size: the width of each routed and shared expert")
        fields["shared_expert_intermediate_size"] = shared * fields["moe_intermediate_size"]
        origin["shared_expert_intermediate_size"] = config.key_path("n_shared_experts")
    elif config.has("shared_expert_intermediate_size"):
        fields["shared_expert_intermediate_size"] = config.count("shared_expert_intermediate_size", minimum=0)
        origin["shared_expert_intermediate_size"] = config.key_path("shared_expert_intermediate_size")
    first_dense = config.count("first_k_dense_replace", 0, minimum=0, maximum=layers)
    if first_dense:
        fields["dense_layers"], origin["dense_layers"] = first_dense, config.key_path("first_k_dense_replace")
        return
    # Qwen-MoE: layer i is sparse unless listed in mlp_only_layers, and only if (i + 1) % step == 0.
    step = config.count("decoder_sparse_step", 1)
    dense_only = _layer_indices(config, "mlp_only_layers", layers)
    if dense_only or step > 1:
        fields["dense_layers"] = layers - layers // step + sum(1 for i in dense_only if (i + 1) % step == 0)
        origin["dense_layers"] = config.key_path("mlp_only_layers" if dense_only else "decoder_sparse_step")


def _layer_indices(config: HFConfig, key: str, layers: int) -> set[int]:
    """``key``: a list of distinct layer indices (0 .. layers - 1); empty when absent."""
    value = config.raw(key, [])
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value):
        raise config.key_error(key, "expected a list of layer indices", value,
                               f"a list of integers 0..{layers - 1} (num_hidden_layers is {layers})")
    return set(value)


def _sliding_window(config: HFConfig, fields: dict, origin: dict) -> str:
    """Sets ``sliding_window`` (and ``sliding_window_layers`` unless every layer slides); returns a
    note for the source when only some layers do."""
    enabled = config.boolean("use_sliding_window") if config.has("use_sliding_window") else None
    if enabled is False:
        return ""
    window = config.count("sliding_window", 0, minimum=0)           # 0 or null: no window
    if not window:
        return ""
    layers = fields["num_layers"]
    model_type = config.string("model_type", None)
    if config.has("layer_types"):
        kinds = config.raw("layer_types")
        if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in LAYER_TYPES for kind in kinds):
            raise config.key_error("layer_types", "expected one attention kind per layer", kinds,
                                   f"a list of {layers} entries (num_hidden_layers), each one of "
                                   + ", ".join(LAYER_TYPES))
        sliding, by = kinds.count("sliding_attention"), "layer_types"
    elif model_type == "gemma2":
        sliding, by = math.ceil(layers / 2), "model_type"           # even layers are local
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = config.count("sliding_window_pattern", 6)
        sliding, by = layers - layers // pattern, "sliding_window_pattern"   # every pattern-th layer is global
    elif enabled and config.has("max_window_layers"):
        sliding, by = max(layers - config.count("max_window_layers", minimum=0), 0), "max_window_layers"
    else:
        sliding, by = layers, "sliding_window"
    if sliding == 0:
        return ""
    fields["sliding_window"], origin["sliding_window"] = window, config.key_path("sliding_window")
    if sliding == layers:
        return ""
    fields["sliding_window_layers"], origin["sliding_window_layers"] = sliding, config.key_path(by)
    return f"; {sliding} of {layers} layers use a {window:,}-token sliding window, the others global attention"


def _dtypes(config: HFConfig) -> dict:
    """weight/kv dtypes from torch_dtype (or dtype), and the quantization_config."""
    stored = None
    key = config.first_key(("torch_dtype", "dtype"))
    if key is not None:
        text = config.string(key)
        stored = TORCH_DTYPES.get(text.removeprefix("torch."))
        if stored is None:
            raise config.key_error(key, "unknown dtype of the stored weights", text,
                                   ", ".join(TORCH_DTYPES) + " (or with a torch. prefix); a quantized checkpoint "
                                   "says so in quantization_config")
    out = {"weight_dtype": stored, "kv_dtype": stored} if stored else {}
    if not config.has("quantization_config"):
        return out
    quant = mapping(config, "quantization_config")
    if not quant.data:
        return out
    base = stored or "bf16"
    method = quant.string("quant_method").lower()
    if method == "fp8":
        dtype = "fp8"
    elif method in ("awq", "gptq"):
        dtype = _integer_bits(quant, "bits", quant.number("bits", 4, integer=True))
    elif method == "bitsandbytes":
        dtype = "int4" if quant.boolean("load_in_4bit", False) else "int8"
    elif method == "compressed-tensors":
        dtype = _compressed_tensors(quant)
    elif method == "mxfp4":             # gpt-oss: the MoE experts only (attention, router, embeddings not converted)
        return {**out, "weight_dtype": base, "expert_dtype": "fp4"}
    else:
        raise quant.key_error("quant_method", "unsupported quantization method", quant.raw("quant_method"),
                              ", ".join(QUANT_METHODS))
    return {**out, "weight_dtype": dtype, "embedding_dtype": base, "kv_dtype": out.get("kv_dtype", base)}


def _integer_bits(node: Node, key: str, bits: int) -> str:
    dtype = {4: "int4", 8: "int8"}.get(bits)
    if dtype is None:
        raise node.key_error(key, "unsupported quantization bits", bits, "4, 8")
    return dtype


def _compressed_tensors(quant: Node) -> str:
    """The weights' type of the first config group with weight settings (``num_bits`` and ``type``:
    float or int)."""
    groups = mapping(quant, "config_groups") if quant.has("config_groups") else None
    for name in groups.data if groups is not None else ():
        assert groups is not None
        group = mapping(groups, name)
        if group.has("weights"):
            weights = mapping(group, "weights")
            bits = weights.number("num_bits", integer=True)
            kind = weights.choice("type", ["int", "float"], "int")
            if kind == "float" and bits in (4, 8):
                return {8: "fp8", 4: "fp4"}[bits]
            return _integer_bits(weights, "num_bits", bits)
    raise quant.error("a compressed-tensors quantization_config without weight settings",
                      key=quant.key_path("config_groups"), has_value=False,
                      allowed="config_groups: {NAME: {weights: {num_bits: 4 or 8, type: int or float}}}")


def model_name(config: HFConfig, path: Path) -> str:
    """``_name_or_path`` (ORG/NAME from a Hub cache folder), else the folder's name unless it is a
    snapshot hash, else ``model_type``."""
    raw = config.string("_name_or_path", "")
    for candidate in (raw, str(path.resolve().parent)):
        hub = _HUB_FOLDER.search(candidate)
        if hub:
            return f"{hub.group(1)}/{hub.group(2).split('/')[0]}"
    raw = raw.rstrip("/")
    if raw and not _SNAPSHOT.fullmatch(Path(raw).name):
        return raw if not Path(raw).is_absolute() else Path(raw).name
    folder = path.resolve().parent.name
    return folder if folder and not _SNAPSHOT.fullmatch(folder) else config.string("model_type", "model")
