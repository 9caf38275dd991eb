"""Transformer architectures: what a model costs to store and to run, per layer.

A :class:`ModelSpec` is built from the fields of a Hugging Face ``config.json``
(layers, hidden size, heads, KV heads, head dim, FFN width, vocabulary, tied
embeddings, MoE experts and top-k). From them it derives parameter counts,
weight and KV-cache bytes. What each operator computes and moves for a batch is
the cost layer's (:mod:`llmsim.cost.work`). Formulas assume a pre-norm decoder
with grouped-query attention and a gated (SwiGLU) MLP, the shape of every model
in the catalog.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

from llmsim.config.reader import Node, load_yaml, parse_yaml, read_text
from llmsim.errors import ConfigError

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp4": 0.5}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, in config.json terms."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0                 # 0 means hidden_size // num_heads
    tie_word_embeddings: bool = False
    num_experts: int = 1              # 1 = dense MLP
    experts_per_token: int = 1
    qkv_bias: bool = False
    sliding_window: int | None = None
    max_context: int = 8192
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    activation_dtype: str = "bf16"
    source: str = ""
    params_published: float | None = None   # the published size, for checking the derivation

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # -- parameters -----------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return self.hidden_size * (self.q_dim + 2 * self.kv_dim) + bias

    @property
    def out_proj_params(self) -> int:
        return self.q_dim * self.hidden_size

    @property
    def expert_params(self) -> int:
        """One gated MLP: gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    @property
    def layer_params(self) -> int:
        norms = 2 * self.hidden_size
        return (self.qkv_params + self.out_proj_params + self.num_experts * self.expert_params
                + self.router_params + norms)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        final_norm = self.hidden_size
        return self.num_layers * self.layer_params + self.embedding_params + self.lm_head_params + final_norm

    @property
    def active_param_count(self) -> int:
        """Parameters one token passes through (top-k experts only)."""
        inactive = (self.num_experts - self.experts_per_token) * self.expert_params
        return self.param_count - self.num_layers * inactive

    # -- bytes ----------------------------------------------------------------------------
    @property
    def weight_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def activation_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def weight_bytes(self) -> float:
        return self.param_count * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        return 2 * self.kv_dim * self.kv_bytes_per_element

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token of context."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def expected_experts_touched(self, tokens):
        """Distinct experts that receive at least one of ``tokens`` tokens, under uniform routing.

        Decode with a small batch reads only the experts it routes to, which is why
        MoE decode is cheaper in bytes than the total parameter count suggests.
        """
        scalar = isinstance(tokens, (int, float))
        if self.num_experts == 1:
            return 1.0 if scalar else np.ones_like(np.asarray(tokens, dtype=float))
        miss = (1.0 - self.experts_per_token / self.num_experts) ** (tokens if scalar else np.asarray(tokens, float))
        return self.num_experts * (1.0 - miss)

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> "ModelSpec":
        return replace(self, weight_dtype=weight_dtype or self.weight_dtype, kv_dtype=kv_dtype or self.kv_dtype)


# -- reading models ---------------------------------------------------------------------

_FIELDS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_local_experts", "num_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_top_k"),
    "sliding_window": ("sliding_window",),
    "max_context": ("max_position_embeddings",),
}


def model_from_config_json(path: str | Path, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (dense or Mixtral-style MoE)."""
    path = Path(path)
    try:
        config = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=str(path), has_value=False) from None
    if not isinstance(config, dict):
        raise ConfigError("expected a JSON object", file=str(path), has_value=False)
    fields: dict[str, object] = {}
    for ours, theirs in _FIELDS.items():
        for key in theirs:
            if config.get(key) is not None:
                fields[ours] = config[key]
                break
    fields.setdefault("num_kv_heads", fields.get("num_heads"))
    fields["qkv_bias"] = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    torch_dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(config.get("torch_dtype")))
    if torch_dtype:
        fields["weight_dtype"] = fields["kv_dtype"] = torch_dtype
    if fields.get("sliding_window") and not config.get("use_sliding_window", True):
        fields["sliding_window"] = None
    fields["name"] = name or config.get("_name_or_path") or path.parent.name
    fields["source"] = f"config.json at {path}"
    node = Node(fields, file=str(path))
    return _model_from_node(node)


def model_from_node(node: Node, catalog: "dict[str, ModelSpec] | None" = None) -> ModelSpec:
    """A model named in a scenario: a catalog name, a config.json path, or inline fields.

    ``base`` (a catalog name) or ``config_json`` may be combined with overrides
    such as ``weight_dtype: fp8``.
    """
    catalog = model_catalog() if catalog is None else catalog
    if node.has("config_json"):
        base = model_from_config_json(node.path_value("config_json"), name=node.string("name", None))
    elif node.has("base"):
        base = lookup_model(node.string("base"), catalog, node, "base")
    else:
        return _model_from_node(node)
    overrides = {}
    for key in ("weight_dtype", "kv_dtype"):
        if node.has(key):
            overrides[key] = node.choice(key, list(DTYPE_BYTES))
    if node.has("max_context"):
        overrides["max_context"] = node.number("max_context", integer=True, minimum=1, exclusive_minimum=False)
    if node.has("name"):
        overrides["name"] = node.string("name")
    node.done()
    return replace(base, **overrides)


def _model_from_node(node: Node) -> ModelSpec:
    def count(key, default=None, minimum=1):
        kwargs = {} if default is None else {"default": default}
        return node.number(key, integer=True, minimum=minimum, exclusive_minimum=False, **kwargs)

    spec = ModelSpec(
        name=node.string("name"),
        num_layers=count("num_layers"),
        hidden_size=count("hidden_size"),
        num_heads=count("num_heads"),
        num_kv_heads=count("num_kv_heads", node.data.get("num_heads")),
        intermediate_size=count("intermediate_size"),
        vocab_size=count("vocab_size"),
        head_dim=count("head_dim", 0, minimum=0),
        tie_word_embeddings=node.boolean("tie_word_embeddings", False),
        num_experts=count("num_experts", 1),
        experts_per_token=count("experts_per_token", 1),
        qkv_bias=node.boolean("qkv_bias", False),
        sliding_window=node.number("sliding_window", None, integer=True, minimum=1, exclusive_minimum=False),
        max_context=count("max_context", 8192),
        weight_dtype=node.choice("weight_dtype", list(DTYPE_BYTES), "bf16"),
        kv_dtype=node.choice("kv_dtype", list(DTYPE_BYTES), "bf16"),
        activation_dtype=node.choice("activation_dtype", list(DTYPE_BYTES), "bf16"),
        source=node.string("source", ""),
        params_published=node.number("params_published", None, minimum=0),
    )
    if spec.num_heads % spec.num_kv_heads:
        raise node.key_error("num_kv_heads", "must divide num_heads", spec.num_kv_heads,
                             f"a divisor of {spec.num_heads}")
    if spec.experts_per_token > spec.num_experts:
        raise node.key_error("experts_per_token", "cannot exceed num_experts", spec.experts_per_token,
                             f"1..{spec.num_experts}")
    node.done()
    return spec


def _load_catalog_file(path: Path | None = None) -> dict[str, ModelSpec]:
    if path is None:
        text = resources.files("llmsim.catalog").joinpath("data/models.yaml").read_text()
        file = "llmsim/catalog/data/models.yaml"
        data = parse_yaml(text, file)
    else:
        data, file = load_yaml(path), str(path)
    root = Node(data, file=file)
    models = {}
    for name in list(root.data):
        node = root.child(name)
        node.data.setdefault("name", name)
        models[name] = _model_from_node(node)
    root.done()
    return models


_CATALOG: dict[str, ModelSpec] | None = None


def model_catalog() -> dict[str, ModelSpec]:
    """The shipped models (``llmsim/catalog/data/models.yaml``), by name."""
    global _CATALOG
    if _CATALOG is None:
        _CATALOG = _load_catalog_file()
    return dict(_CATALOG)


def lookup_model(name: str, catalog: dict[str, ModelSpec], node: Node | None = None,
                 key: str = "model") -> ModelSpec:
    """Find a model by name, case-insensitively; a ConfigError lists the known ones."""
    by_lower = {k.lower(): v for k, v in catalog.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    import difflib
    hints = difflib.get_close_matches(name, list(catalog), n=3, cutoff=0.4)
    message = "unknown model" + (f"; did you mean {' or '.join(repr(h) for h in hints)}?" if hints else "")
    allowed = ", ".join(catalog) + " (or a mapping with config_json: PATH, or inline config fields)"
    if node is not None:
        raise node.key_error(key, message, name, allowed)
    raise ConfigError(message, key=key, value=name, allowed=allowed)

