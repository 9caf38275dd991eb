"""Reading NVIDIA's measured operator database (PyPI ``aiconfigurator-core``, Apache-2.0).

The wheel ships parquet tables under ``aiconfigurator_core/systems/data``, one folder per
``<gpu>/<operator>/<framework>/<version>/`` with a ``collection_meta.yaml`` saying how they were
collected. Every latency is in milliseconds; collective and custom all-reduce message sizes are
element counts (``half``/``bfloat16``: 2 bytes, ``int8``: 1), as nccl-tests counts them.

:class:`Database` finds the tables; the ``*_rows`` functions turn one table into the columns the fits
of :mod:`llmsim.calibration.database_fit` read, in seconds and bytes, each frame keeping the table it came
from (``table``: the path under the data folder) so every fitted figure can name it. Where the database
times several kernels for one shape (vLLM's FP8 block GEMM: CUTLASS, DeepGEMM, FlashInfer), the fastest
is kept: the engine picks (or autotunes to) the best kernel it has.

The database is optional (``pip install 'llmsim[measured]'``); without it, :func:`installed_root` raises a
ConfigError naming the pip command. A folder of the same layout (a few rows: ``tests/data/aiconfigurator``)
stands in for it anywhere a ``root`` is taken.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from llmsim.catalog.kernel_terms import ENGINE_NAMES, EngineKernels  # noqa: F401 (re-exported)
from llmsim.errors import ConfigError

PIP_COMMAND = "pip install 'llmsim[measured]'   (or: pip install aiconfigurator-core==0.12.0)"
DATABASE_PACKAGE = "aiconfigurator_core"
DATABASE_RELEASE = "aiconfigurator-core 0.12.0"
INSTALLED = "installed"        # --from-database without a folder: the installed package's


# llmsim profile name -> the database's folder for that GPU.
GPU_FOLDERS = {"A100-80GB": "a100_sxm", "H100-SXM": "h100_sxm", "H200": "h200_sxm", "B200": "b200_sxm",
               "B300": "b300_sxm", "L40S": "l40s", "GB200": "gb200"}
# The GPU's architecture (its compute capability, as the tables' collection_meta.yaml records it: 8.0, 8.9, 9.0,
# 10.x): GPUs of one architecture run the same kernels, so their fitted shares of the datasheet figures carry over.
ARCHITECTURES = {"A100-80GB": "ampere", "L40S": "ada", "H100-SXM": "hopper", "H200": "hopper", "B200": "blackwell",
                 "B300": "blackwell", "GB200": "blackwell"}
# The NVLink domain each GPU's tables were timed in: an 8-GPU HGX baseboard (NVSwitch chips on the board, an x86
# host), a GB200 NVL72 rack (NVLink switch trays, Grace hosts) or none (PCIe cards). A small collective's latency
# is the fabric's and the host's more than the GPU's, so collective fits carry over within one fabric.
FABRICS = {"A100-80GB": "hgx", "H100-SXM": "hgx", "H200": "hgx", "B200": "hgx", "B300": "hgx", "GB200": "nvl72",
           "L40S": "pcie"}
GEMM_DTYPES = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block"}
KV_BYTES = {"bfloat16": 2.0, "fp8": 1.0}      # bytes per cached element, by the tables' kv_cache_dtype
MS = 1e-3


def installed_root() -> Path:
    """The installed database's data folder, or a ConfigError with the pip command."""
    spec = importlib.util.find_spec(DATABASE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"needs the measured operator database ({DATABASE_RELEASE}), which is not installed; "
                          f"install it with: {PIP_COMMAND}", has_value=False)
    return Path(list(spec.submodule_search_locations)[0]) / "systems" / "data"


def _version_key(version: str) -> tuple:
    """Numeric order of versions such as 0.5.6.post2 < 0.5.14, 1.3.0rc10 < 1.3.0rc20."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"[.]|(?<=\d)(?=[a-z])|(?<=[a-z])(?=\d)",
                                                                            version) if part)


@dataclass(frozen=True)
class Table:
    """One parquet table: its rows, and where it came from."""
    frame: pd.DataFrame
    path: str             # under the data folder: <gpu>/<operator>/<framework>/<version>/<name>.parquet
    version: str

    @property
    def citation(self) -> str:
        return f"{DATABASE_RELEASE} {self.path} ({len(self.frame)} rows)"


class Database:
    """The tables under ``root`` (the installed database's data folder, or an excerpt of the same layout)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError("is not a folder of the operator database's layout (<gpu>/<operator>/<framework>/"
                              "<version>/)", file=str(root), has_value=False)

    def gpus(self) -> list[str]:
        """llmsim profile names whose GPU the database has tables for."""
        return [name for name, folder in GPU_FOLDERS.items() if (self.root / folder).is_dir()
                and any((self.root / folder).iterdir())]

    def versions(self, gpu: str, operator: str, framework: str, table: str) -> list[str]:
        """Versions of ``framework`` holding ``table`` for ``gpu`` (a profile name), oldest first."""
        folder = self.root / GPU_FOLDERS[gpu] / operator / framework
        if not folder.is_dir():
            return []
        return sorted((d.name for d in folder.iterdir() if (d / f"{table}.parquet").is_file()), key=_version_key)

    def table(self, gpu: str, operator: str, framework: str, table: str, version: str | None = None) -> Table | None:
        """One table (the newest version unless ``version``), or None where the database has none."""
        versions = self.versions(gpu, operator, framework, table)
        if version is None and versions:
            version = versions[-1]
        if version not in versions:
            return None
        path = f"{GPU_FOLDERS[gpu]}/{operator}/{framework}/{version}/{table}.parquet"
        return Table(pd.read_parquet(self.root / path), path, version)

    def kernel_sources(self, path: str, column: str, value: str) -> frozenset[str]:
        """The ``kernel_source`` labels of the rows of the table at ``path`` (under the data folder) whose ``column``
        is ``value``: which kernel the collector timed (e.g. ``gemm_dtype`` ``bfloat16``)."""
        frame = pd.read_parquet(self.root / path, columns=[column, "kernel_source"])
        return frozenset(frame.loc[frame[column] == value, "kernel_source"].astype(str))


def _fastest(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per shape: the fastest kernel the table timed for it."""
    return frame.loc[frame.groupby(keys, sort=False)["latency"].idxmin()].reset_index(drop=True)


def gemm_rows(table: Table) -> pd.DataFrame:
    """GEMM rows ``m x k @ k x n``: m, n, k, dtype (bf16, fp8, fp8_block), measured_s, table."""
    frame = table.frame[table.frame["gemm_dtype"].isin(GEMM_DTYPES)]
    frame = _fastest(frame, ["gemm_dtype", "m", "n", "k"])
    return pd.DataFrame({"m": frame["m"].astype(float), "n": frame["n"].astype(float), "k": frame["k"].astype(float),
                         "dtype": frame["gemm_dtype"].map(GEMM_DTYPES), "measured_s": frame["latency"] * MS,
                         "table": table.path})


# What names a decode kernel in an attention table's ``kernel_source`` (vllm_flashinfer_trtllmdecode,
# vllm_flashinfer_fidecode).
DECODE_KERNEL_MARK = "decode"


def _attention_rows(table: Table, kv_dtype: str = "bfloat16") -> pd.DataFrame:
    """Full attention (no sliding window; older tables time no windows), 16-bit queries, a KV cache of ``kv_dtype``
    (the table's name: ``bfloat16``, ``fp8``): the fastest kernel per shape."""
    frame = table.frame
    full = frame["window_size"] == 0 if "window_size" in frame else True
    frame = frame[full & (frame["kv_cache_dtype"] == kv_dtype) & (frame["attn_dtype"] == "bfloat16")]
    return _fastest(frame, ["batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim"])


def decode_attention_rows(table: Table, kv_dtype: str = "bfloat16") -> pd.DataFrame:
    """Generation attention: ``batch`` sequences each with ``kv_tokens`` cached tokens (the table's ``step``)
    and one new query, ``heads`` query and ``kv_heads`` KV heads of ``head_dim`` on one GPU, a KV cache of
    ``kv_dtype`` (``kv_bytes`` per element). FP8 caches run kernels of their own (TensorRT-LLM's XQA), not the
    16-bit ones reading half the bytes: they are fitted apart."""
    frame = _attention_frame(table, "step", "kv_tokens", kv_dtype)
    return frame.assign(kv_bytes=KV_BYTES[kv_dtype])


def prefill_attention_rows(table: Table) -> pd.DataFrame:
    """Context attention: ``batch`` prompts of ``tokens`` each (causal, nothing cached), heads as above, at the
    prompt lengths a prefill kernel timed: the Blackwell and L40S tables time one-token prompts with decode kernels
    too (``kernel_source`` naming a decode kernel, e.g. FlashInfer's TensorRT-LLM decode kernel
    ``vllm_flashinfer_trtllmdecode``), which run a GQA grouping no prefill kernel does; a one-token prompt is decode
    attention's work, and those lengths are left out of prefill attention."""
    frame = _attention_frame(table, "isl", "tokens")
    if "kernel_source" not in table.frame:
        return frame
    source = table.frame["kernel_source"].astype(str)
    decoded = set(table.frame.loc[source.str.contains(DECODE_KERNEL_MARK), "isl"].astype(float))
    return frame[~frame["tokens"].isin(decoded)].reset_index(drop=True)


def _attention_frame(table: Table, length_column: str, length: str, kv_dtype: str = "bfloat16") -> pd.DataFrame:
    """An attention table's rows as the fits read them: batch, the sequence length named ``length`` (the
    table's ``length_column``), heads, KV heads, head size and the measured seconds."""
    frame = _attention_rows(table, kv_dtype)
    return pd.DataFrame({"batch": frame["batch_size"].astype(float), length: frame[length_column].astype(float),
                         "heads": frame["num_heads"].astype(float),
                         "kv_heads": frame["num_key_value_heads"].astype(float),
                         "head_dim": frame["head_dim"].astype(float), "measured_s": frame["latency"] * MS,
                         "table": table.path})


def collective_rows(table: Table, operation: str) -> pd.DataFrame:
    """nccl-tests rows of ``operation`` (all_reduce, all_gather, reduce_scatter, alltoall): group, bytes."""
    frame = table.frame[table.frame["op_name"] == operation]
    dtype_column = "nccl_dtype" if "nccl_dtype" in frame else "allreduce_dtype"
    frame = frame[frame[dtype_column].isin(("half", "bfloat16"))]
    return pd.DataFrame({"group": frame["num_gpus"].astype(int), "bytes": frame["message_size"] * 2.0,
                         "measured_s": frame["latency"] * MS, "table": table.path}).reset_index(drop=True)


def custom_all_reduce_rows(table: Table) -> pd.DataFrame:
    """The engine's own all-reduce kernel as it runs in decode, inside a CUDA graph where the table has both
    (vLLM, SGLang); TensorRT-LLM's table has one kernel."""
    frame = table.frame
    if "backend" in frame and frame["backend"].notna().any():
        graphs = frame["backend"].astype(str).str.endswith("_graph")
        if graphs.any():
            frame = frame[graphs]
    frame = frame.assign(op_name="all_reduce")
    return collective_rows(Table(frame, table.path, table.version), "all_reduce")


def quantize_rows(table: Table) -> pd.DataFrame:
    """The engine's FP8 quantization kernel with a given scale (``scale_matrix``: an m x k 16-bit tensor read, its
    8-bit copy written): m, k, measured_s."""
    frame = _fastest(table.frame[table.frame["quant_dtype"] == "fp8"], ["m", "k"])
    return pd.DataFrame({"m": frame["m"].astype(float), "k": frame["k"].astype(float),
                         "measured_s": frame["latency"] * MS, "table": table.path})


def moe_rows(table: Table) -> pd.DataFrame:
    """Grouped-GEMM MoE layers on one GPU, tokens balanced over the experts: tokens, hidden, inter (per
    expert, after the MoE TP split), topk, local experts, dtype, measured_s."""
    frame = table.frame
    frame = frame[(frame["distribution"] == "balanced") & frame["moe_dtype"].isin(("bfloat16", "fp8", "fp8_block"))]
    frame = _fastest(frame, ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                             "moe_tp_size", "moe_ep_size"])
    return pd.DataFrame({"tokens": frame["num_tokens"].astype(float), "hidden": frame["hidden_size"].astype(float),
                         "inter": frame["inter_size"] / frame["moe_tp_size"], "topk": frame["topk"].astype(float),
                         "experts": frame["num_experts"] / frame["moe_ep_size"],
                         "all_experts": frame["num_experts"].astype(float),
                         "dtype": frame["moe_dtype"].map(GEMM_DTYPES), "measured_s": frame["latency"] * MS,
                         "table": table.path})


def mla_rows(table: Table) -> pd.DataFrame:
    """MLA attention modules (DeepSeek-V3 shapes, 16-bit KV): batch, tokens (context: the prompt; generation:
    the cached tokens), heads on the GPU, measured_s."""
    frame = table.frame
    frame = frame[(frame["kv_cache_dtype"] == "bfloat16") & (frame["gemm_type"] == "bfloat16")]
    frame = _fastest(frame, ["batch_size", "isl", "step", "num_heads"])
    generation = "generation" in table.path
    return pd.DataFrame({"batch": frame["batch_size"].astype(float),
                         "tokens": (frame["step"] if generation else frame["isl"]).astype(float),
                         "heads": frame["num_heads"].astype(float), "measured_s": frame["latency"] * MS,
                         "table": table.path})
