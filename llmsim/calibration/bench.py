"""Timing a real torch decode step, the device roofline and the KV-cache layouts.

Everything here needs torch, which only ``llmsim calibrate`` / ``validate`` import
(the simulator itself never does). Measurements follow one protocol
(:func:`time_interleaved`): every job is warmed up, then timed once per round, the
rounds visiting the jobs in a fresh random order, each sample starting with a cold
last-level cache and fenced by a device synchronisation; a job's figure is the
median over rounds. Interleaving spreads every job over the whole run, so a slow
spell of a shared machine hits all shapes alike instead of a few.

The decode step (:class:`DecodeModel`) does the work llmsim's cost model prices:
embedding lookup, per layer RMSNorm, fused QKV projection, the new token's K/V
written into a paged KV cache, grouped-query attention of the new tokens over
their cached context, output projection, residual, RMSNorm, SwiGLU MLP,
residual; then a final norm, an LM head over a small vocabulary with fp32
logits, and greedy sampling.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from llmsim.config.progress import QUIET, Progress
from llmsim.scenario.scenario import EngineConfig
from llmsim.calibration.design import Design, Shape, model_spec

STEP_BLOCK_SIZE = EngineConfig().block_size   # the engine's default KV block, in tokens
LAYOUT_BLOCK_SIZES = (16, 128, 256)
UNKNOWN_CACHE_FLUSH_BYTES = 2 ** 28           # when the last-level cache size cannot be read


def torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass
class Device:
    """The local device, set up once: which torch device, how to fence it, how to flush its cache."""
    kind: str                 # "cpu" or "cuda"
    threads: int
    sync: Callable[[], object]       # called for their effect; what they return is dropped
    flush: Callable[[], object]
    name: str
    platform: str
    memory_capacity_bytes: float
    torch_version: str
    power_limit_w: float | None = None     # the board power limit, where the driver reports one


@contextlib.contextmanager
def open_device(kind: str, threads: int) -> Iterator[Device]:
    """Pin torch's intra-op threads, flush denormals to zero, and describe the device, for the ``with`` block.

    Both settings are process-wide, so they are put back on leaving: a notebook or test that calibrates
    and then computes with subnormal floats must not find them flushed (torch's default is not to flush,
    and it offers no getter for the flag)."""
    import torch
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    try:
        yield _describe(torch, kind, threads)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads_before)


def _describe(torch: Any, kind: str, threads: int) -> Device:
    if kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        flush_buffer = torch.empty(2 * props.L2_cache_size // 4 + 1, dtype=torch.float32, device="cuda")
        return Device("cuda", threads, torch.cuda.synchronize, flush_buffer.zero_, props.name,
                      f"CUDA {torch.version.cuda}, {_cpu_model()}", float(props.total_memory),
                      str(torch.__version__), _gpu_power_limit_w())
    flush_buffer = torch.ones(_last_level_cache_bytes() * 2 // 4, dtype=torch.float32)
    return Device("cpu", threads, lambda: None, flush_buffer.sum, _cpu_model(),
                  f"{os.cpu_count()} logical CPUs, {threads} torch thread(s)", _host_memory_bytes(),
                  str(torch.__version__))


def machine_name(kind: str) -> str:
    """The model of this machine's ``kind`` of device ("cpu" or "cuda"), as a calibration records it
    (a profile's ``machine``)."""
    if kind == "cuda":
        import torch
        return torch.cuda.get_device_properties(0).name
    return _cpu_model()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _gpu_power_limit_w() -> float | None:
    """The power limit of GPU 0 from nvidia-smi, or None where it cannot say."""
    import subprocess
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=power.limit", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        return float(text.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _last_level_cache_bytes() -> int:
    """L3 size from sysconf or sysfs; a generous default when neither says."""
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        if size > 0:
            return size
    except (ValueError, OSError):
        pass
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) * 1024
    except (OSError, ValueError):
        return UNKNOWN_CACHE_FLUSH_BYTES


def _host_memory_bytes() -> float:
    try:
        import psutil
        return float(psutil.virtual_memory().total)
    except ImportError:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# -- the protocol ---------------------------------------------------------------------------

def time_interleaved(jobs: dict, device: Device, rounds: int, warmup: int, seed: int = 0,
                     progress: Progress = QUIET) -> dict:
    """Seconds per call of every job: ``{key: [sample per round]}``, cold cache, fenced.
    ``progress`` advances once per call (warm-up calls included)."""
    import numpy as np

    keys = list(jobs)
    samples: dict[str, list[float]] = {key: [] for key in keys}
    rng = np.random.default_rng(seed)
    progress.add(len(keys) * (warmup + rounds))
    for _ in range(warmup):
        for key in keys:
            jobs[key]()
            progress.advance()
    device.sync()
    for _ in range(rounds):
        for index in rng.permutation(len(keys)):
            key = keys[index]
            device.flush()
            device.sync()
            start = time.perf_counter()
            jobs[key]()
            device.sync()
            samples[key].append(time.perf_counter() - start)
            progress.advance()
    return samples


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """Median, and the interquartile range relative to it (the noise of one figure)."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), (q3 - q1) / q2


# -- the roofline ---------------------------------------------------------------------------

TINY_OPS_PER_SAMPLE = 200


def roofline_jobs(design: Design, device: Device, dtypes) -> tuple[dict, dict]:
    """Jobs for the achieved peaks, and the work each does: {key: (kind, work per call)}.

    ``gemm/<dtype>``: an n x n x n ``F.linear`` (x W^T with W stored [out, in], the
    call and layout of the decode step's projections; 2 n^3 FLOPs); ``stream_read``: a
    sum over a buffer far larger than the cache (its bytes); ``copy``: a copy of it
    (read + write bytes); ``dispatch``: TINY_OPS_PER_SAMPLE in-place adds on one
    element (per op).

    The peak must come from the kernel the step runs: on a CPU without native bf16
    matmul (no AVX512-BF16, e.g. AMD EPYC before Zen 4) torch sends a bf16
    ``matmul(a, b)`` to a fallback about 18x slower than the x W^T kernel of
    ``F.linear`` (measured here with oneDNN disabled: 0.9 vs 16.5 GFLOP/s), and a
    peak measured that way leaves the fit no efficiency <= 1 that explains the step.
    """
    import torch
    import torch.nn.functional as F
    n, dev = design.gemm_size, device.kind
    jobs: dict[str, Callable[[], object]] = {}
    work: dict[str, tuple[str, float]] = {}
    for dtype in dtypes:
        x = torch.randn(n, n, dtype=torch_dtype(dtype), device=dev)
        weight = torch.randn(n, n, dtype=torch_dtype(dtype), device=dev)
        jobs[f"gemm/{dtype}"] = functools.partial(F.linear, x, weight)
        work[f"gemm/{dtype}"] = ("flops", 2.0 * n ** 3)
    source = torch.ones(design.stream_bytes // 4, dtype=torch.float32, device=dev)
    target = torch.empty_like(source).fill_(0.0)
    jobs["stream_read"], work["stream_read"] = source.sum, ("bytes", float(design.stream_bytes))
    jobs["copy"] = lambda: target.copy_(source)
    work["copy"] = ("bytes", 2.0 * design.stream_bytes)
    tiny = torch.zeros(1, device=dev)

    def dispatch():
        for _ in range(TINY_OPS_PER_SAMPLE):
            tiny.add_(1.0)
    jobs["dispatch"], work["dispatch"] = dispatch, ("ops", float(TINY_OPS_PER_SAMPLE))
    return jobs, work


def roofline_figures(medians: dict, work: dict) -> dict:
    """Achieved GEMM FLOP/s per dtype, streaming and copy bandwidth, seconds per tiny op."""
    figures: dict[str, Any] = {"gemm_flops_per_s": {}}
    for key, (kind, amount) in work.items():
        rate = amount / medians[key]
        if kind == "flops":
            figures["gemm_flops_per_s"][key.split("/", 1)[1]] = rate
        elif key == "stream_read":
            figures["stream_read_bytes_per_s"] = rate
        elif key == "copy":
            figures["copy_bytes_per_s"] = rate
        else:
            figures["dispatch_s"] = 1.0 / rate
    return figures


# -- the decode step ------------------------------------------------------------------------

class DecodeModel:
    """A Llama-style decoder of one width and dtype, with a paged KV cache per layer.

    Weights are random (timing does not depend on their values). The KV pool of a
    layer holds ``num_blocks`` blocks as ``[kv_heads, blocks, block_size, head_dim]``
    for K and for V; a shape's sequences own random, distinct blocks, listed in a
    block table, so every read goes through the same gather a paged engine does.
    """

    def __init__(self, hidden: int, layers: int, dtype: str, device: Device, num_blocks: int,
                 block_size: int = STEP_BLOCK_SIZE):
        import torch
        self.spec = model_spec(hidden, layers, dtype)
        self.device, self.block_size = device, block_size
        self.dtype = torch_dtype(dtype)
        spec, dev = self.spec, device.kind

        def weight(rows, cols):
            return (torch.randn(rows, cols, device=dev) / math.sqrt(cols)).to(self.dtype)

        qkv_out = spec.q_dim + 2 * spec.kv_dim
        self.layers = [dict(norm1=torch.ones(hidden, dtype=self.dtype, device=dev),
                            qkv=weight(qkv_out, hidden), out=weight(hidden, spec.q_dim),
                            norm2=torch.ones(hidden, dtype=self.dtype, device=dev),
                            gate_up=weight(2 * spec.intermediate_size, hidden),
                            down=weight(hidden, spec.intermediate_size))
                       for _ in range(layers)]
        self.embedding = weight(spec.vocab_size, hidden)
        self.final_norm = torch.ones(hidden, dtype=self.dtype, device=dev)
        self.lm_head = weight(spec.vocab_size, hidden)
        self.num_blocks = num_blocks
        pool_shape = (spec.num_kv_heads, self.num_blocks, block_size, spec.head_dim)
        self.kv_pools = [(torch.empty(pool_shape, dtype=self.dtype, device=dev).normal_(),
                          torch.empty(pool_shape, dtype=self.dtype, device=dev).normal_())
                         for _ in range(layers)]
        # Gathered K and V land in preallocated workspaces (shared by the layers, which run in
        # turn), as in a serving engine; a fresh tensor per call would time the OS's page faults.
        self.workspaces = tuple(torch.zeros(pool_shape, dtype=self.dtype, device=dev) for _ in range(2))

    def step_job(self, shape: Shape, seed: int) -> Callable[[], object]:
        """One decode iteration of ``shape`` (its first ``shape.layers`` layers), as a closure."""
        import torch
        generator = torch.Generator().manual_seed(seed)
        table = torch.randperm(self.num_blocks, generator=generator)[:blocks_needed(shape, self.block_size)]
        slots = slot_index(table.view(shape.batch, -1), self.block_size, shape.context + 1).to(self.device.kind)
        tokens = torch.randint(0, self.spec.vocab_size, (shape.batch,), generator=generator).to(self.device.kind)
        layers = list(zip(self.layers, self.kv_pools))[:shape.layers]
        return lambda: self._step(tokens, slots, shape.batch, shape.context + 1, layers)

    def _step(self, tokens, slots, batch: int, seq: int, layers):
        import torch
        import torch.nn.functional as F
        spec, eps = self.spec, 1e-6
        x = F.embedding(tokens, self.embedding)
        for weights, (k_pool, v_pool) in layers:
            h = F.rms_norm(x, (spec.hidden_size,), weights["norm1"], eps)
            q, k, v = F.linear(h, weights["qkv"]).split([spec.q_dim, spec.kv_dim, spec.kv_dim], dim=-1)
            keys, values = self._append_and_gather(k, v, k_pool, v_pool, slots, batch, seq)
            x = x + F.linear(self._attend(q, keys, values), weights["out"])
            h = F.rms_norm(x, (spec.hidden_size,), weights["norm2"], eps)
            gate, up = F.linear(h, weights["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, weights["down"])
        x = F.rms_norm(x, (spec.hidden_size,), self.final_norm, eps)
        return torch.argmax(F.linear(x, self.lm_head).float(), dim=-1)

    def _append_and_gather(self, k, v, k_pool, v_pool, slots, batch: int, seq: int):
        """Write the new token's K/V into its slot (the last of each sequence), then gather
        every sequence's cached tokens into the workspaces: ``[kv_heads, batch, seq, head_dim]``."""
        spec = self.spec
        new_slots = slots.view(batch, seq)[:, -1]
        for pool, fresh in ((k_pool, k), (v_pool, v)):
            pool.view(spec.num_kv_heads, -1, spec.head_dim)[:, new_slots] = \
                fresh.view(batch, spec.num_kv_heads, spec.head_dim).transpose(0, 1)
        return tuple(gather(pool, slots, workspace, batch, seq)
                     for pool, workspace in zip((k_pool, v_pool), self.workspaces))

    def _attend(self, q, keys, values):
        """Decode attention over ``[kv_heads, batch, seq, head_dim]`` K/V; returns ``[batch, q_dim]``."""
        spec, batch = self.spec, q.shape[0]
        groups = spec.num_heads // spec.num_kv_heads
        q = q.view(batch, spec.num_kv_heads, groups, spec.head_dim).transpose(0, 1)
        out = attend(q, keys, values, spec.head_dim)       # [kv_heads, batch, groups, head_dim]
        return out.transpose(0, 1).reshape(batch, spec.q_dim)


def slot_index(table, block_size: int, seq: int):
    """The pool slot (block * block_size + offset) of each of the ``seq`` tokens of every
    sequence, from its block table ``[batch, blocks]``: the gather index, ``[batch * seq]``."""
    import torch
    offsets = torch.arange(block_size, device=table.device)
    return (table[:, :, None] * block_size + offsets).reshape(table.shape[0], -1)[:, :seq].reshape(-1)


def gather(pool, slots, workspace, batch: int, seq: int):
    """Copy the slots of ``pool`` ([heads, blocks, block, head_dim]) into the front of
    ``workspace``; returns the contiguous ``[heads, batch, seq, head_dim]``."""
    import torch
    heads, blocks, block, head_dim = pool.shape
    out = workspace.view(-1)[:heads * slots.numel() * head_dim].view(heads, slots.numel(), head_dim)
    torch.index_select(pool.view(heads, blocks * block, head_dim), 1, slots, out=out)
    return out.view(heads, batch, seq, head_dim)


def blocks_needed(shape: Shape, block_size: int = STEP_BLOCK_SIZE) -> int:
    """KV blocks the shape's sequences own: each its context plus the new token, rounded up."""
    return shape.batch * math.ceil((shape.context + 1) / block_size)


def attend(q, keys, values, head_dim: int):
    """Softmax(q K^T / sqrt(d)) V batched over the leading two dims; scores in fp32.

    Grouped-query attention as batched matmuls: the query heads that share a KV head
    form the rows of one matmul, so K and V are read once per KV head.
    """
    import torch
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * head_dim ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


# -- KV layouts and paging ------------------------------------------------------------------

LAYOUTS = ("contiguous [batch, head, seq, head_dim]", "contiguous [batch, seq, head, head_dim]") + tuple(
    f"paged {size}" for size in LAYOUT_BLOCK_SIZES)


def layout_jobs(hidden: int, dtype: str, batch: int, context: int, device: Device, seed: int) -> dict:
    """Decode attention of one layer over the same KV tokens stored five ways.

    Contiguous caches are read in place (the [batch, seq, head, head_dim] one as a
    strided view, as a cache appended token-major is); paged caches
    ``[kv_heads, blocks, block, head_dim]`` are first gathered, through the slot
    index of a random block table, into a preallocated contiguous tensor, then
    attended, as in the decode step.
    """
    import torch
    spec = model_spec(hidden, 1, dtype)
    heads, groups, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    dt, dev, seq = torch_dtype(dtype), device.kind, context + 1
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, groups, d, device=dev).to(dt)
    kv_bhsd = [torch.randn(batch, heads, seq, d, device=dev).to(dt) for _ in range(2)]
    kv_bshd = [torch.randn(batch, seq, heads, d, device=dev).to(dt) for _ in range(2)]
    jobs = {LAYOUTS[0]: lambda: attend(q, kv_bhsd[0], kv_bhsd[1], d),
            LAYOUTS[1]: lambda: attend(q, kv_bshd[0].transpose(1, 2), kv_bshd[1].transpose(1, 2), d)}
    q_head_major = q.transpose(0, 1).contiguous()
    for size, name in zip(LAYOUT_BLOCK_SIZES, LAYOUTS[2:]):
        blocks = batch * math.ceil(seq / size)
        slots = slot_index(torch.randperm(blocks, generator=generator).view(batch, -1), size, seq).to(dev)
        pools = [torch.randn(heads, blocks, size, d, device=dev).to(dt) for _ in range(2)]
        workspaces = [torch.zeros_like(pool) for pool in pools]

        def paged(pools=pools, slots=slots, workspaces=workspaces):
            keys, values = (gather(pool, slots, ws, batch, seq) for pool, ws in zip(pools, workspaces))
            return attend(q_head_major, keys, values, d)
        jobs[name] = paged
    return jobs
