"""Transformer architectures: what a model costs to store and to run, per layer.

A :class:`ModelSpec` is built from the fields of a Hugging Face ``config.json``
(layers, hidden size, heads, KV heads, head dim, FFN width, vocabulary, tied
embeddings, MoE experts and top-k). From them it derives parameter counts,
weight and KV-cache bytes. What each operator computes and moves for a batch is
the cost layer's (:mod:`llmsim.cost.work`). Formulas assume a pre-norm decoder
with a gated (SwiGLU) MLP and one of two attentions:

- grouped-query attention: K and V of ``num_kv_heads`` heads of ``head_dim`` cached per token;
- multi-head latent attention (MLA, DeepSeek-V2/V3, ``kv_lora_rank > 0``): one compressed
  latent of ``kv_lora_rank`` plus a shared RoPE key of ``qk_rope_head_dim`` cached per token
  (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1: ``(d_c + d_h^R) l`` elements per token),
  the same on every tensor-parallel rank.

A mixture-of-experts MLP has ``num_experts`` routed experts of width
``moe_intermediate_size`` (top ``experts_per_token``), optional always-active shared
experts (``shared_expert_intermediate_size`` in all), and ``dense_layers`` of its layers
may have a dense MLP (width ``intermediate_size``) instead; the cost model averages the
layers, so which layers they are does not matter. Weights may be stored
in three dtypes: the decoder's linear layers (``weight_dtype``), the routed experts
(``expert_dtype``, e.g. MXFP4 experts of gpt-oss) and the embedding and LM head
(``embedding_dtype``; quantized checkpoints keep them at 16 bits); each defaults to
``weight_dtype``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from llmsim.config.reader import Node, load_yaml, parse_yaml
from llmsim.catalog.hf_config import config_fields
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
    sliding_window: int | None = None  # a local attention window (tokens)
    max_context: int = 8192
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    activation_dtype: str = "bf16"
    source: str = ""
    params_published: float | None = None   # the published size, for checking the derivation
    moe_intermediate_size: int = 0    # a routed expert's width; 0 means intermediate_size
    shared_expert_intermediate_size: int = 0   # the always-active shared experts' total width
    dense_layers: int = 0             # MoE models: layers with a dense MLP (DeepSeek first_k_dense_replace)
    q_lora_rank: int = 0              # MLA: the query's low-rank width (0: a full query projection)
    kv_lora_rank: int = 0             # MLA: the cached latent's width; 0 means grouped-query attention
    qk_rope_head_dim: int = 0         # MLA: the RoPE part of a query/key head (cached, shared by heads)
    v_head_dim: int = 0               # MLA: a value head
    expert_dtype: str | None = None   # routed experts' weights; None means weight_dtype
    embedding_dtype: str | None = None  # embedding and LM head; None means weight_dtype
    mtp_modules: int = 0              # multi-token-prediction modules shipped with the weights (DeepSeek-V3's
                                      # num_nextn_predict_layers); not in the parameter count, as published
    sliding_window_layers: int | None = None   # layers that use the window (Gemma-2: half); None: every layer

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # -- attention span -----------------------------------------------------------------------
    @property
    def local_layers(self) -> int:
        """Layers whose attention the sliding window bounds (0 without a window)."""
        if not self.sliding_window:
            return 0
        return self.num_layers if self.sliding_window_layers is None else self.sliding_window_layers

    @property
    def local_attention_share(self) -> float:
        """The share of layers that attend over the window only (1.0 for Mistral, 0.5 for Gemma-2,
        5/6 for Gemma-3); the cost model averages attention over the layers with it."""
        return self.local_layers / self.num_layers

    # -- parameters -----------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of a query/key head without RoPE (``head_dim`` is the whole query head)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def qkv_params(self) -> int:
        if self.is_mla:
            h, heads = self.hidden_size, self.num_heads
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_dim) if self.q_lora_rank \
                else h * self.q_dim
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank   # and its norm
            kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_down + kv_up
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return self.hidden_size * (self.q_dim + 2 * self.kv_dim) + bias

    @property
    def out_proj_params(self) -> int:
        value_dim = self.num_heads * self.v_head_dim if self.is_mla else self.q_dim
        return value_dim * self.hidden_size

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One gated MLP of a routed expert (the whole MLP of a dense model): gate, up and down."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        """The MLP of one of the ``dense_layers``."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is the (routed) expert MLP: all but the first dense ones."""
        return self.num_layers - self.dense_layers

    @property
    def routed_expert_params(self) -> int:
        """All routed experts' parameters, every layer."""
        return self.sparse_layers * self.num_experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        norms, final_norm = 2 * self.hidden_size, self.hidden_size
        attention = self.num_layers * (self.qkv_params + self.out_proj_params + norms)
        mlp = (self.routed_expert_params + self.sparse_layers * (self.router_params + self.shared_expert_params)
               + self.dense_layers * self.dense_mlp_params)
        return attention + mlp + self.embedding_params + self.lm_head_params + final_norm

    @property
    def active_param_count(self) -> int:
        """Parameters one token passes through (top-k experts only)."""
        inactive = (self.num_experts - self.experts_per_token) * self.expert_params
        return self.param_count - self.sparse_layers * inactive

    # -- bytes ----------------------------------------------------------------------------
    @property
    def weight_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def expert_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.expert_dtype or self.weight_dtype]

    @property
    def embedding_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.embedding_dtype or self.weight_dtype]

    @property
    def kv_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def activation_bytes_per_element(self) -> float:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def weight_bytes(self) -> float:
        embeddings = self.embedding_params + self.lm_head_params
        others = self.param_count - embeddings - self.routed_expert_params
        return (others * self.weight_bytes_per_param + self.routed_expert_params * self.expert_bytes_per_param
                + embeddings * self.embedding_bytes_per_param)

    def kv_elements_per_token_per_layer(self, tensor_parallel: int = 1) -> float:
        """Cached elements per token per layer on one tensor-parallel rank: K and V of its share of
        the KV heads (all of them replicated when there are fewer heads than ranks), or MLA's latent
        and RoPE key, which every rank holds whole."""
        if self.is_mla:
            return float(self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * max(self.num_kv_heads / tensor_parallel, 1.0) * self.head_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        if self.is_mla:
            return self.kv_elements_per_token_per_layer() * self.kv_bytes_per_element
        return 2 * self.kv_dim * self.kv_bytes_per_element

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V (or MLA's latent) of every layer for one token of context."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def mla_attention_flops_per_pair(self, decode: bool) -> float:
        """MLA FLOPs per (query, key) pair per layer, all heads, the way vLLM computes it.

        Prefill materialises keys (``head_dim`` wide) and values (``v_head_dim``) per head:
        ``2 H (head_dim + v_head_dim)``. Decode absorbs the up-projections into the query and the
        output and attends in latent space: scores over ``kv_lora_rank + qk_rope_head_dim`` and
        the weighted sum over ``kv_lora_rank``, ``2 H (2 kv_lora_rank + qk_rope_head_dim)``; the
        absorbed projections cost per token what the up-projection does (counted in qkv).
        """
        if decode:
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_heads * (self.head_dim + self.v_head_dim)

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

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
        """The model with other dtypes; a new ``weight_dtype`` applies to every weight (experts and
        embeddings too)."""
        kv = kv_dtype or self.kv_dtype
        if weight_dtype is None:
            return replace(self, kv_dtype=kv)
        return replace(self, kv_dtype=kv, weight_dtype=weight_dtype, expert_dtype=None, embedding_dtype=None)


# -- reading models ---------------------------------------------------------------------

def model_from_config_json(path: str | Path, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (:mod:`llmsim.catalog.hf_config` reads its fields)."""
    path = Path(path)
    fields, origin = config_fields(path, name)
    try:
        return _model_from_node(Node(fields, file=str(path)))
    except ConfigError as error:        # a check between fields: name the config.json key the field came from
        if error.key not in origin:
            raise
        raise ConfigError(error.message, file=error.file, key=origin[error.key], value=error.value,
                          allowed=error.allowed, has_value=error.has_value) from None


def model_from_node(node: Node, catalog: dict[str, ModelSpec] | None = None) -> ModelSpec:
    """A model named in a scenario: a catalog name, a config.json path, or inline fields.

    ``base`` (a catalog name) or ``config_json`` may be combined with overrides
    such as ``weight_dtype: fp8`` or ``sliding_window_layers: 16``.
    """
    catalog = model_catalog() if catalog is None else catalog
    if node.has("config_json"):
        base = model_from_config_json(node.path_value("config_json"), name=node.string("name", None))
    elif node.has("base"):
        base = lookup_model(node.string("base"), catalog, node, "base")
    else:
        return _model_from_node(node)
    overrides: dict[str, Any] = {}
    if node.has("weight_dtype"):         # every weight, unless expert_dtype / embedding_dtype say otherwise
        overrides.update(weight_dtype=node.choice("weight_dtype", list(DTYPE_BYTES)), expert_dtype=None,
                         embedding_dtype=None)
    for key in ("kv_dtype", "expert_dtype", "embedding_dtype"):
        if node.has(key):
            overrides[key] = node.choice(key, list(DTYPE_BYTES))
    if node.has("max_context"):
        overrides["max_context"] = node.number("max_context", integer=True, minimum=1, exclusive_minimum=False)
    if node.has("name"):
        overrides["name"] = node.string("name")
    if node.has("sliding_window"):
        overrides["sliding_window"] = node.number("sliding_window", integer=True, minimum=1, exclusive_minimum=False)
    if node.has("sliding_window_layers"):
        overrides["sliding_window_layers"] = node.number("sliding_window_layers", integer=True, minimum=0,
                                                         exclusive_minimum=False)
    node.done()
    model = replace(base, **overrides)
    _check_sliding_window(model, node)
    return model


def _check_sliding_window(spec: ModelSpec, node: Node) -> None:
    if spec.sliding_window_layers is not None and (spec.sliding_window is None
                                                   or spec.sliding_window_layers > spec.num_layers):
        raise node.key_error("sliding_window_layers", "counts the layers that use sliding_window",
                             spec.sliding_window_layers, f"0..{spec.num_layers}, with sliding_window set")


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
        moe_intermediate_size=count("moe_intermediate_size", 0, minimum=0),
        shared_expert_intermediate_size=count("shared_expert_intermediate_size", 0, minimum=0),
        dense_layers=count("dense_layers", 0, minimum=0),
        q_lora_rank=count("q_lora_rank", 0, minimum=0),
        kv_lora_rank=count("kv_lora_rank", 0, minimum=0),
        qk_rope_head_dim=count("qk_rope_head_dim", 0, minimum=0),
        v_head_dim=count("v_head_dim", 0, minimum=0),
        expert_dtype=node.choice("expert_dtype", list(DTYPE_BYTES), None),
        embedding_dtype=node.choice("embedding_dtype", list(DTYPE_BYTES), None),
        mtp_modules=count("mtp_modules", 0, minimum=0),
        sliding_window_layers=node.number("sliding_window_layers", None, integer=True, minimum=0,
                                          exclusive_minimum=False),
    )
    _check_sliding_window(spec, node)
    if spec.dense_layers > spec.num_layers or (spec.dense_layers and spec.num_experts == 1):
        raise node.key_error("dense_layers", "counts the layers of an MoE model that have a dense MLP",
                             spec.dense_layers, f"0..{spec.num_layers}, with num_experts > 1")
    if spec.is_mla and not (spec.v_head_dim and spec.qk_rope_head_dim and spec.head_dim > spec.qk_rope_head_dim):
        raise node.key_error("kv_lora_rank", "multi-head latent attention needs qk_rope_head_dim, v_head_dim and "
                             "a head_dim (qk_nope_head_dim + qk_rope_head_dim) above qk_rope_head_dim",
                             spec.kv_lora_rank, "all three set, or kv_lora_rank: 0")
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

