"""Which decode steps a calibration measures: a fit grid and a disjoint held-out grid.

A shape is one decode iteration of a small Llama-style model (head dim 64, four
query heads per KV head, SwiGLU MLP 3.5 x hidden, a small vocabulary): ``batch``
sequences each add one token after ``context`` cached ones, through ``layers``
decoder layers of width ``hidden``, in ``dtype``. The held-out grid shares no
batch size, context length, width or layer count with either fit grid (see
:func:`shared_values`), so validation measures genuinely unseen shapes. Grids are
capped in KV tokens (memory) and in FLOPs per step (time on a single CPU core).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from llmsim.catalog.models import ModelSpec

HEAD_DIM = 64
QUERY_HEADS_PER_KV_HEAD = 4
MLP_RATIO = 3.5            # intermediate / hidden, as in Llama-3
VOCAB_SIZE = 4096          # small, so the LM head does not dominate the step
DEVICE_DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("bf16", "fp16")}


@dataclass(frozen=True, order=True)
class Shape:
    """One decode step to measure."""
    hidden: int
    layers: int
    dtype: str
    batch: int
    context: int

    @property
    def kv_tokens(self) -> int:
        """Cached tokens the step attends to, over the whole batch (the new token included)."""
        return self.batch * (self.context + 1)

    def as_dict(self) -> dict:
        return {"hidden": self.hidden, "layers": self.layers, "dtype": self.dtype,
                "batch": self.batch, "context": self.context}


@dataclass(frozen=True)
class Grid:
    """A cross product of widths, layer counts, batches and contexts, capped in KV tokens and FLOPs."""
    hiddens: tuple[int, ...]
    layers: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    max_kv_tokens: int          # keeps the KV cache of one layer within memory and time
    max_step_flops: float       # keeps compute-bound steps of wide models within time

    def shapes(self, dtypes) -> list[Shape]:
        shapes = []
        for hidden, layers, dtype, batch, context in itertools.product(
                self.hiddens, self.layers, dtypes, self.batches, self.contexts):
            shape = Shape(hidden, layers, dtype, batch, context)
            if shape.kv_tokens <= self.max_kv_tokens and step_flops(shape) <= self.max_step_flops:
                shapes.append(shape)
        return shapes


@dataclass(frozen=True)
class Design:
    """Everything one calibration measures, and how often."""
    name: str
    fit: Grid
    holdout: Grid
    rounds: int                 # timed samples per shape, interleaved over the whole run
    warmup: int                 # untimed calls per shape before the first round
    gemm_size: int              # n of the n x n x n roofline GEMM
    stream_bytes: int           # buffer streamed by the bandwidth benchmark
    layout_hidden: int          # width of the KV layout and paging study
    layout_shapes: tuple[tuple[int, int], ...]   # (batch, context) of the layout study


# Held-out values: none of them appears in any fit grid (tests check shared_values).
_HOLDOUT_BATCHES = (2, 8, 32, 128)
_HOLDOUT_CONTEXTS = (256, 1024, 4096)
_HOLDOUT_LAYERS = (2,)

DESIGNS = {
    ("cpu", "quick"): Design(
        "quick",
        fit=Grid((512, 1024), (1, 4), (1, 16, 64), (128, 512, 2048), 2 ** 15, 4e9),
        holdout=Grid((768,), _HOLDOUT_LAYERS, (2, 8, 32), (256, 1024), 2 ** 15, 4e9),
        rounds=7, warmup=1, gemm_size=1024, stream_bytes=2 ** 27,
        layout_hidden=1024, layout_shapes=((16, 2048), (64, 512))),
    ("cpu", "full"): Design(
        "full",
        fit=Grid((512, 1024, 2048), (1, 4), (1, 4, 16, 64, 256), (128, 512, 2048, 8192), 2 ** 16, 3e10),
        holdout=Grid((768, 1536), _HOLDOUT_LAYERS, _HOLDOUT_BATCHES, _HOLDOUT_CONTEXTS, 2 ** 16, 3e10),
        rounds=15, warmup=2, gemm_size=2048, stream_bytes=2 ** 29,
        layout_hidden=2048, layout_shapes=((1, 8192), (16, 2048), (128, 256))),
    ("cuda", "quick"): Design(
        "quick",
        fit=Grid((1024, 2048), (1, 4), (1, 16, 64, 256), (128, 512, 2048, 8192), 2 ** 18, 1e13),
        holdout=Grid((1536,), _HOLDOUT_LAYERS, (8, 32, 128), (256, 1024, 4096), 2 ** 18, 1e13),
        rounds=7, warmup=3, gemm_size=8192, stream_bytes=2 ** 31,
        layout_hidden=2048, layout_shapes=((16, 8192), (256, 2048))),
    ("cuda", "full"): Design(
        "full",
        fit=Grid((1024, 2048, 4096), (1, 4), (1, 4, 16, 64, 256), (128, 512, 2048, 8192), 2 ** 20, 1e14),
        holdout=Grid((1536, 3072), _HOLDOUT_LAYERS, _HOLDOUT_BATCHES, _HOLDOUT_CONTEXTS, 2 ** 20, 1e14),
        rounds=15, warmup=3, gemm_size=8192, stream_bytes=2 ** 31,
        layout_hidden=4096, layout_shapes=((1, 8192), (64, 8192), (256, 2048))),
}


def design_for(device_kind: str, quick: bool) -> Design:
    return DESIGNS[(device_kind, "quick" if quick else "full")]


def shared_values(holdout: Grid, fits: list[Grid]) -> dict[str, set]:
    """Batches, contexts, widths and layer counts a held-out grid shares with fit grids (none, by design)."""
    shared = {}
    for axis in ("hiddens", "layers", "batches", "contexts"):
        common = set().union(*(set(getattr(holdout, axis)) & set(getattr(fit, axis)) for fit in fits))
        if common:
            shared[axis] = common
    return shared


def model_spec(hidden: int, layers: int, dtype: str) -> ModelSpec:
    """The ModelSpec of the torch model the benchmark builds for this width."""
    heads = hidden // HEAD_DIM
    return ModelSpec(name=f"calibration-h{hidden}-l{layers}-{dtype}", num_layers=layers,
                     hidden_size=hidden, num_heads=heads,
                     num_kv_heads=max(heads // QUERY_HEADS_PER_KV_HEAD, 1),
                     intermediate_size=int(MLP_RATIO * hidden), vocab_size=VOCAB_SIZE,
                     head_dim=HEAD_DIM, weight_dtype=dtype, kv_dtype=dtype, activation_dtype=dtype,
                     source="llmsim calibrate benchmark model")


def step_flops(shape: Shape) -> float:
    """Dense FLOPs of the step (2 per parameter per token, plus attention): to cap slow shapes."""
    spec = model_spec(shape.hidden, shape.layers, shape.dtype)
    attention = 4 * spec.q_dim * shape.kv_tokens * shape.layers
    return 2.0 * spec.param_count * shape.batch + attention
