"""Measured operator timings (the Vidur profiler's CSVs): reading them, and pricing them with kernel terms.

A measurements folder holds

- linear-operator files (``*linear_ops*.csv``): one row per device, model, TP size ``tp`` and
  ``num_tokens``, with the model's shapes (``n_embd``, ``n_expanded_embd``, ``n_head``,
  ``n_kv_head``) and the median time in ms of each operator of one layer on one GPU
  (:data:`OPERATOR_COLUMNS`);
- all-reduce files (``*all_reduce*.csv``, Vidur's ``all_reduce.csv`` columns): ``size`` bytes over
  ``num_workers`` GPUs, ``devices_per_node`` of them per node, median time in ms; the device is
  the one named in the file name (``vidur_all_reduce_h100_dgx.csv``);
- attention files (``*attention*.csv``, Vidur's ``attention.csv`` columns): per device, model shape
  (``n_embd``, ``n_q_head``, ``n_kv_head``), TP size ``num_tensor_parallel_workers``, ``batch_size``
  sequences of ``prefill_chunk_size`` new tokens (prefill, ``is_prefill``) or one (decode) each over
  ``kv_cache_size`` cached ones, the median ms of ``time_stats.attn_prefill`` or ``time_stats.attn_decode``
  (one layer's attention kernel on one GPU). ``llmsim calibrate --operators`` writes them;
- FP8 GEMM files (``*fp8_gemm*.csv``, written by ``llmsim calibrate --operators`` on a GPU): one GEMM of
  a layer (``gemm``) with FP8 weights and activations at ``num_tokens`` rows (run as ``padded_tokens``), the
  shard's ``n`` and ``k``, median ``time_ms``.

Bad input (a missing column, an unknown device, a non-numeric or non-positive timing) is a
:class:`~llmsim.errors.ConfigError` naming the file, the row and the column. Every prediction
here comes from :mod:`llmsim.cost.kernels`, the formulas the cost model prices iterations with.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.catalog.kernel_terms import KernelTerms
from llmsim.catalog.models import ModelSpec
from llmsim.cost.kernels import (all_reduce_time_s, elementwise_bytes_per_token, gemm_time_s, layer_gemm_shapes,
                                 stream_time_s)
from llmsim.errors import ConfigError

# Device tags of the measurements -> the shipped profile whose peaks and shapes they refine.
DEVICE_PROFILES = {"a100": "A100-80GB", "h100": "H100-SXM", "h200": "H200"}
SHAPE_COLUMNS = ("num_tokens", "tp", "n_embd", "n_expanded_embd", "n_head", "n_kv_head")
# In the order of llmsim.cost.kernels.layer_gemm_shapes.
GEMM_COLUMNS = {"attn_pre_proj_ms": "qkv", "attn_post_proj_ms": "out_proj", "mlp_up_proj_ms": "mlp_up",
                "mlp_down_proj_ms": "mlp_down"}
ELEMENTWISE_COLUMNS = {"input_layernorm_ms": "norm", "post_attention_layernorm_ms": "norm", "mlp_act_ms": "activation",
                       "attn_rope_ms": "rotary", "add_ms": "residual"}
OPERATOR_COLUMNS = tuple(GEMM_COLUMNS) + tuple(ELEMENTWISE_COLUMNS)
# A layer runs each listed operator once, except the residual add (after attention and after the MLP).
LAYER_COUNT = {column: 2 if column == "add_ms" else 1 for column in OPERATOR_COLUMNS}
ALL_REDUCE_COLUMNS = ("num_workers", "size", "devices_per_node", "time_stats.all_reduce.median")
ATTENTION_SHAPE_COLUMNS = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size",
                           "prefill_chunk_size", "kv_cache_size")
ATTENTION_POSITIVE_COLUMNS = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size")
ATTENTION_TIME_COLUMNS = ("time_stats.attn_prefill.median", "time_stats.attn_decode.median")
ATTENTION_COLUMNS = ("device", "model", *ATTENTION_SHAPE_COLUMNS, "is_prefill", *ATTENTION_TIME_COLUMNS)
ATTENTION_REQUIRED_COLUMNS = ATTENTION_COLUMNS[2:]          # device and model may come from elsewhere (Vidur's files)
FP8_SHAPE_COLUMNS = ("tp", "num_tokens", "padded_tokens", "n", "k")
FP8_COLUMNS = ("device", "model", "gemm", *FP8_SHAPE_COLUMNS, "time_ms")
FP16_BYTES = 2.0
DECODE_TOKENS, PREFILL_TOKENS = (1, 256), (128, 4096)   # the regimes, as the acceptance defines them


class Measurements:
    """The rows of one folder: ``linear`` (one row per layer measurement) and ``all_reduce`` (intra-node)."""

    def __init__(self, linear: pd.DataFrame, all_reduce: pd.DataFrame, files: list[str],
                 attention: pd.DataFrame | None = None, fp8: pd.DataFrame | None = None):
        self.linear, self.all_reduce, self.files = linear, all_reduce, files
        self.attention = attention if attention is not None else pd.DataFrame(columns=[*ATTENTION_COLUMNS, "file"])
        self.fp8 = fp8 if fp8 is not None else pd.DataFrame(columns=[*FP8_COLUMNS, "file"])

    def devices(self) -> list[str]:
        return sorted(set().union(*(table["device"] for table in (self.linear, self.all_reduce, self.attention,
                                                                   self.fp8))))

    def for_device(self, device: str) -> Measurements:
        mine = [table[table["device"] == device].reset_index(drop=True)
                for table in (self.linear, self.all_reduce, self.attention, self.fp8)]
        return Measurements(mine[0], mine[1], self.files, mine[2], mine[3])


def read_measurements(folder: str | Path, key: str = "measurements") -> Measurements:
    """Every linear-operator and all-reduce CSV of ``folder``, checked; ``key`` names where the folder came from."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError("not a folder of measurements", key=key, value=str(folder),
                          allowed="a folder with *linear_ops*.csv and/or *all_reduce*.csv files")
    linear_files = sorted(folder.glob("*linear_ops*.csv"))
    reduce_files = sorted(folder.glob("*all_reduce*.csv"))
    attention_files = sorted(folder.glob("*attention*.csv"))
    fp8_files = sorted(folder.glob("*fp8_gemm*.csv"))
    if not linear_files and not reduce_files and not attention_files:
        raise ConfigError("holds no *linear_ops*.csv, *all_reduce*.csv or *attention*.csv file", file=str(folder),
                          has_value=False)
    linear = [_read_linear(path) for path in linear_files]
    reduce = [_read_all_reduce(path) for path in reduce_files]
    attention = pd.concat([_read_attention(path) for path in attention_files], ignore_index=True) \
        if attention_files else None
    fp8 = pd.concat([_read_fp8(path) for path in fp8_files], ignore_index=True) if fp8_files else None
    empty_linear = pd.DataFrame(columns=["device", "model", *SHAPE_COLUMNS, *OPERATOR_COLUMNS])
    empty_reduce = pd.DataFrame(columns=["device", "gpus", "size_bytes", "time_s", "file"])
    return Measurements(pd.concat(linear, ignore_index=True) if linear else empty_linear,
                        pd.concat(reduce, ignore_index=True) if reduce else empty_reduce,
                        [str(path) for path in linear_files + reduce_files + attention_files + fp8_files],
                        attention, fp8)


def _read_csv(path: Path, columns) -> pd.DataFrame:
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read this CSV ({exc})", file=str(path), has_value=False) from None
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ConfigError(f"row 1 (the header) has no column '{missing[0]}'", file=str(path), key=missing[0],
                          has_value=False, allowed="columns " + ", ".join(columns))
    return table


def _refuse_first(bad, table: pd.DataFrame, path: Path, column, expected: str) -> None:
    """Raise for the first row of ``bad`` (a mask), naming its row, its column (one name, or one per row) and
    its value. Rows are counted as in a spreadsheet: the header is row 1, the first data row row 2."""
    bad = np.asarray(bad)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        name = column if isinstance(column, str) else column[row]
        raise ConfigError(f"row {row + 2}, column '{name}': {expected}", file=str(path), key=name,
                          value=table[name].iloc[row])


def _numbers(table: pd.DataFrame, path: Path, columns, positive: bool) -> None:
    """Every value of ``columns`` a finite number (> 0 where ``positive``), in place; else name row and column."""
    for column in columns:
        values = pd.to_numeric(table[column], errors="coerce")
        bad = values.isna() | ~np.isfinite(values) | ((values <= 0) if positive else (values < 0))
        _refuse_first(bad, table, path, column, f"expected a {'positive ' if positive else ''}number")
        table[column] = values.astype(float)


def _device(value, path: Path, row: int, column: str) -> str:
    device = str(value).strip().lower()
    if device not in DEVICE_PROFILES:
        raise ConfigError(f"row {row + 2}, column '{column}': unknown device", file=str(path), key=column, value=value,
                          allowed=", ".join(DEVICE_PROFILES) + " (the devices with a shipped profile to calibrate)")
    return device


def _read_linear(path: Path) -> pd.DataFrame:
    table = _read_csv(path, ("device", "model", *SHAPE_COLUMNS, *OPERATOR_COLUMNS))
    table["device"] = [_device(value, path, row, "device") for row, value in enumerate(table["device"])]
    _numbers(table, path, SHAPE_COLUMNS, positive=True)
    _numbers(table, path, OPERATOR_COLUMNS, positive=True)
    table["file"] = path.name
    return table[["device", "model", *SHAPE_COLUMNS, *OPERATOR_COLUMNS, "file"]]


def _read_attention(path: Path) -> pd.DataFrame:
    """One attention file. Vidur's own ``attention.csv`` has no ``device`` or ``model`` column (the device is its
    folder's; here: the file or folder name must name it) and leaves the other phase's timing blank; each row's
    own phase column must hold a positive number of ms."""
    table = _read_csv(path, ATTENTION_REQUIRED_COLUMNS)
    if "device" in table.columns:
        table["device"] = [_device(value, path, row, "device") for row, value in enumerate(table["device"])]
    else:
        table["device"] = _device_of_path(path)
    if "model" not in table.columns:
        table["model"] = [f"{int(e)}/{int(q)}/{int(kv)}" for e, q, kv in
                          zip(*(pd.to_numeric(table[c], errors="coerce").fillna(0) for c in ("n_embd", "n_q_head",
                                                                                             "n_kv_head")))]
    _numbers(table, path, ATTENTION_POSITIVE_COLUMNS, positive=True)
    _numbers(table, path, ("prefill_chunk_size", "kv_cache_size"), positive=False)
    flags = table["is_prefill"].astype(str).str.strip().str.lower()
    _refuse_first(~flags.isin(("true", "false", "1", "0")), table, path, "is_prefill", "expected true or false")
    table["is_prefill"] = flags.isin(("true", "1"))
    own = np.where(table["is_prefill"], ATTENTION_TIME_COLUMNS[0], ATTENTION_TIME_COLUMNS[1])
    times = {column: pd.to_numeric(table[column], errors="coerce") for column in ATTENTION_TIME_COLUMNS}
    table["time_s"] = np.where(table["is_prefill"], times[ATTENTION_TIME_COLUMNS[0]],
                               times[ATTENTION_TIME_COLUMNS[1]]) * 1e-3
    _refuse_first(~(np.isfinite(table["time_s"]) & (table["time_s"] > 0)), table, path, own,
                  "expected a positive number")
    _refuse_first(table["is_prefill"] & (table["prefill_chunk_size"] <= 0), table, path, "prefill_chunk_size",
                  "a prefill row needs a positive chunk")
    table["file"] = path.name
    return table[[*ATTENTION_COLUMNS, "time_s", "file"]]


def _device_of_path(path: Path) -> str:
    """The one known device tag in a file's name or its folder's (Vidur keeps ``a100/attention.csv``)."""
    for name in (path.stem, path.parent.name):
        tags = [tag for tag in DEVICE_PROFILES if tag in name.lower()]
        if len(tags) == 1:
            return tags[0]
    raise ConfigError("has no device column, and neither the file name nor its folder names a known device",
                      file=str(path), key="file name", value=path.name,
                      allowed="a device column, or a name containing one of " + ", ".join(DEVICE_PROFILES))


def _read_fp8(path: Path) -> pd.DataFrame:
    table = _read_csv(path, FP8_COLUMNS)
    table["device"] = [_device(value, path, row, "device") for row, value in enumerate(table["device"])]
    _numbers(table, path, (*FP8_SHAPE_COLUMNS, "time_ms"), positive=True)
    table["file"] = path.name
    return table[[*FP8_COLUMNS, "file"]]


def fp8_errors(fp8: pd.DataFrame, kernels: KernelTerms) -> pd.DataFrame:
    """Relative errors of ``kernels`` on FP8 GEMM rows (1-byte weights, 16-bit activations as the cost model
    prices an FP8 checkpoint), by model, TP size and token count."""
    predicted = gemm_time_s(fp8["padded_tokens"].to_numpy(), fp8["n"].to_numpy(), fp8["k"].to_numpy(), 1.0,
                            FP16_BYTES, kernels, "fp8")
    table = fp8[["model", "tp", "gemm", "num_tokens"]].copy()
    table["measured_s"], table["predicted_s"] = fp8["time_ms"].to_numpy() * 1e-3, predicted
    table["error"] = table["predicted_s"] / table["measured_s"] - 1
    table["regime"] = np.where(table["num_tokens"] >= PREFILL_TOKENS[0], "prefill", "decode")
    return table


def _read_all_reduce(path: Path) -> pd.DataFrame:
    """One all-reduce file; groups that span nodes (InfiniBand) are dropped: tensor parallelism stays in a node."""
    table = _read_csv(path, ALL_REDUCE_COLUMNS)
    tags = [tag for tag in DEVICE_PROFILES if tag in path.stem.lower()]
    if len(tags) != 1:
        raise ConfigError("the file name names no known device (or several)", file=str(path), key="file name",
                          value=path.name, allowed="a name containing one of " + ", ".join(DEVICE_PROFILES))
    _numbers(table, path, ALL_REDUCE_COLUMNS, positive=True)
    table = table[table["devices_per_node"] == table["num_workers"]]
    return pd.DataFrame({"device": tags[0], "gpus": table["num_workers"].astype(int).to_numpy(),
                         "size_bytes": table["size"].to_numpy(),
                         "time_s": table["time_stats.all_reduce.median"].to_numpy() * 1e-3, "file": path.name})


# -- shapes and predictions ---------------------------------------------------------------------

def measured_layer(hidden, heads, kv_heads, intermediate) -> ModelSpec:
    """One fp16 layer of the shape a measured row gives."""
    return ModelSpec(name=f"measured-{int(hidden)}", num_layers=1, hidden_size=int(hidden), num_heads=int(heads),
                     num_kv_heads=int(kv_heads), intermediate_size=int(intermediate), vocab_size=1,
                     weight_dtype="fp16", kv_dtype="fp16", activation_dtype="fp16")


def shape_groups(linear: pd.DataFrame):
    """(row index, ModelSpec of one fp16 layer, TP size) for each distinct model shape and TP size of ``linear``."""
    shape_columns = ["n_embd", "n_expanded_embd", "n_head", "n_kv_head", "tp"]
    for (hidden, inter, heads, kv_heads, tp), index in linear.groupby(shape_columns, sort=False).groups.items():
        yield index, measured_layer(hidden, heads, kv_heads, inter), int(tp)


def predict_operators(linear: pd.DataFrame, kernels: KernelTerms, dtype: str = "fp16") -> pd.DataFrame:
    """Predicted seconds of every operator column of ``linear`` (same index and columns), from the shapes
    and bytes the cost model itself uses (:mod:`llmsim.cost.kernels`)."""
    predicted = pd.DataFrame(index=linear.index, columns=list(OPERATOR_COLUMNS), dtype=float)
    for index, model, tp in shape_groups(linear):
        tokens = linear.loc[index, "num_tokens"].to_numpy()
        for shape, column in zip(layer_gemm_shapes(model, tp), GEMM_COLUMNS):
            predicted.loc[index, column] = gemm_time_s(tokens, shape.n, shape.k, FP16_BYTES, FP16_BYTES, kernels, dtype)
        moved = elementwise_bytes_per_token(model, tp)
        for column, kind in ELEMENTWISE_COLUMNS.items():
            predicted.loc[index, column] = stream_time_s(tokens, moved[kind], kernels.elementwise[kind])
    return predicted


def gemm_rows(linear: pd.DataFrame) -> pd.DataFrame:
    """One row per measured GEMM: tokens, the shard's N and K, measured seconds (for fitting)."""
    frames = []
    for index, model, tp in shape_groups(linear):
        tokens = linear.loc[index, "num_tokens"].to_numpy()
        for shape, column in zip(layer_gemm_shapes(model, tp), GEMM_COLUMNS):
            frames.append(pd.DataFrame({"tokens": tokens, "n": shape.n, "k": shape.k,
                                        "measured_s": linear.loc[index, column].to_numpy() * 1e-3}))
    return pd.concat(frames, ignore_index=True)


def elementwise_rows(linear: pd.DataFrame) -> pd.DataFrame:
    """One row per measured streaming kernel: its kind, tokens, bytes per token, measured seconds (for fitting)."""
    frames = []
    for index, model, tp in shape_groups(linear):
        tokens = linear.loc[index, "num_tokens"].to_numpy()
        moved = elementwise_bytes_per_token(model, tp)
        for column, kind in ELEMENTWISE_COLUMNS.items():
            frames.append(pd.DataFrame({"kind": kind, "tokens": tokens, "bytes_per_token": moved[kind],
                                        "measured_s": linear.loc[index, column].to_numpy() * 1e-3}))
    return pd.concat(frames, ignore_index=True)


def measured_operators(linear: pd.DataFrame) -> pd.DataFrame:
    """Measured seconds of every operator column."""
    return linear[list(OPERATOR_COLUMNS)] * 1e-3


def predict_all_reduce(all_reduce: pd.DataFrame, kernels: KernelTerms) -> np.ndarray:
    groups = all_reduce["gpus"].to_numpy()
    return np.array([all_reduce_time_s(size, group, kernels.all_reduce_for(group))
                     for size, group in zip(all_reduce["size_bytes"].to_numpy(), groups)])


def regimes(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Masks of the decode (1-256 tokens) and prefill (128-4096 tokens) regimes; they overlap at 128-256."""
    return {"decode": (tokens >= DECODE_TOKENS[0]) & (tokens <= DECODE_TOKENS[1]),
            "prefill": (tokens >= PREFILL_TOKENS[0]) & (tokens <= PREFILL_TOKENS[1])}


SIZE_CLASSES = (("small (< 64 KiB)", 0, 2 ** 16), ("medium (64 KiB - 4 MiB)", 2 ** 16, 2 ** 22),
                ("large (>= 4 MiB)", 2 ** 22, float("inf")))


def error_table(errors: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """MAPE, median and mean signed error of relative ``errors['error']`` per group of ``by``."""
    grouped = errors.groupby(by, sort=True)["error"]
    return pd.DataFrame({"rows": grouped.size(), "mape": grouped.apply(lambda e: float(np.mean(np.abs(e)))),
                         "median_error": grouped.median(), "bias": grouped.mean()}).reset_index()


def layer_errors(linear: pd.DataFrame, kernels: KernelTerms) -> pd.DataFrame:
    """Per-layer and per-operator-group relative errors of ``kernels`` on ``linear``, one row per
    (measurement, group, regime) with columns model, tp, num_tokens, group, regime, measured_s, predicted_s, error."""
    predicted, measured = predict_operators(linear, kernels), measured_operators(linear)
    groups = {"layer": list(OPERATOR_COLUMNS), "gemm": list(GEMM_COLUMNS), "elementwise": list(ELEMENTWISE_COLUMNS)}
    frames = []
    for group, columns in groups.items():
        counts = pd.Series({column: LAYER_COUNT[column] for column in columns})
        measured_s, predicted_s = measured[columns] @ counts, predicted[columns] @ counts
        for regime, mask in regimes(linear["num_tokens"].to_numpy()).items():
            frames.append(pd.DataFrame({"device": linear["device"][mask], "model": linear["model"][mask],
                                        "tp": linear["tp"][mask].astype(int),
                                        "num_tokens": linear["num_tokens"][mask].astype(int), "group": group,
                                        "regime": regime, "measured_s": measured_s[mask],
                                        "predicted_s": predicted_s[mask]}))
    table = pd.concat(frames, ignore_index=True)
    table["error"] = table["predicted_s"] / table["measured_s"] - 1
    return table


def attention_errors(attention: pd.DataFrame, hardware) -> pd.DataFrame:
    """Relative errors of ``hardware``'s cost model on measured attention rows (one layer's kernel on one GPU):
    columns model, tp, phase (decode / prefill), batch_size, chunk, context, measured_s, predicted_s, error."""
    from llmsim.cost.roofline import CostModel
    predicted = np.zeros(len(attention))
    keys = ["n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers"]
    for (hidden, heads, kv_heads, tp), index in attention.groupby(keys, sort=False).groups.items():
        # Attention reads no MLP: the intermediate width is a placeholder (the hidden one).
        model = CostModel(measured_layer(hidden, heads, kv_heads, hidden), hardware, tensor_parallel=int(tp))
        rows = attention.loc[index]
        features = [model.features([int(r.prefill_chunk_size)], [int(r.kv_cache_size)], []) if r.is_prefill
                    else model.features([], [], [int(r.kv_cache_size)] * int(r.batch_size))
                    for r in rows.itertuples()]
        predicted[attention.index.get_indexer(index)] = model.attention_time_s(np.array(features))
    table = pd.DataFrame({"model": attention["model"], "tp": attention["num_tensor_parallel_workers"].astype(int),
                          "phase": np.where(attention["is_prefill"], "prefill", "decode"),
                          "batch_size": attention["batch_size"].astype(int),
                          "chunk": attention["prefill_chunk_size"].astype(int),
                          "context": attention["kv_cache_size"].astype(int),
                          "measured_s": attention["time_s"], "predicted_s": predicted})
    table["error"] = table["predicted_s"] / table["measured_s"] - 1
    return table


def all_reduce_errors(all_reduce: pd.DataFrame, kernels: KernelTerms) -> pd.DataFrame:
    table = all_reduce[["device", "gpus", "size_bytes", "time_s"]].copy()
    table["predicted_s"] = predict_all_reduce(all_reduce, kernels)
    table["error"] = table["predicted_s"] / table["time_s"] - 1
    table["size_class"] = ""
    for name, low, high in SIZE_CLASSES:
        table.loc[(table["size_bytes"] >= low) & (table["size_bytes"] < high), "size_class"] = name
    return table
