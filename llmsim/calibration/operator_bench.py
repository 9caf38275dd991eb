"""Timing one transformer layer's operators on this device, written as the Vidur profiler's CSVs.

``llmsim calibrate --operators DIR`` measures, for a few catalog models at each tensor-parallel
size, the per-layer operators that :mod:`llmsim.calibration.operators` reads (the fused QKV, output,
gate+up and down projections at the shard's shapes; RMSNorm, SiLU-and-multiply, rotary embedding and
the residual add) and the attention kernels (decode: a batch of single-token queries over equal
contexts; prefill: one chunk over the context before it, causal), so that ``llmsim calibrate
--from-measurements DIR`` can fit this device's kernel terms and ``llmsim validate --measurements DIR``
can hold any profile against them.

How a figure is taken. On a GPU every operator is captured ``reps`` times into one CUDA graph,
cycling through enough copies of its operands that they cannot stay in the L2 cache (each call
reads its weights from HBM, as in serving), and the graph is replayed several times between CUDA
events: a figure is the median replay time over ``reps``. That is the time a CUDA-graph engine pays per
kernel, including the graph's gap between kernels; the same protocol timed on an empty kernel is
written to the metadata (``empty_kernel_s``), so that it can be taken off to compare with profilers
that time kernels alone (Vidur's medians are kernel durations, CUDA graphs off). On a CPU a figure is
the median wall time of a loop of calls. Streaming operators are compiled with ``torch.compile`` into
one fused kernel each where the compiler works (as serving engines fuse them); the metadata says which.

torch is imported only here and only when a measurement runs.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from llmsim.calibration.operators import DEVICE_PROFILES
from llmsim.catalog.models import ModelSpec, lookup_model, model_catalog
from llmsim.config.files import write_file
from llmsim.cost.kernels import layer_gemm_shapes

# Models whose shapes the Vidur measurements cover (7B/8B/70B) plus two others (13B; Qwen's 28/4 heads).
DEFAULT_MODELS = ("Llama-2-7B", "Llama-3.1-8B", "Llama-2-13B", "Qwen2.5-7B", "Llama-3.1-70B")
DEFAULT_TP = (1, 2, 4, 8)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (256, 1024, 4096, 16384)
PREFILL_CHUNKS = (128, 512, 2048, 4096)
PREFILL_CONTEXTS = (0, 2048, 8192)
QUICK_MODELS, QUICK_TP, QUICK_TOKENS = ("llama-68m",), (1, 2), (1, 16, 128)
QUICK_BATCHES, QUICK_CONTEXTS, QUICK_CHUNKS, QUICK_PREFILL_CONTEXTS = (1, 4), (256,), (128,), (0, 128)
MAX_KV_BYTES = 16 * 2 ** 30           # decode rows whose KV cache would exceed this are skipped
TARGET_GRAPH_S = 3e-4                 # a replay long enough that the events' resolution does not matter
MIN_REPS, MAX_REPS, REPLAYS = 3, 200, 7
CPU_SAMPLES = 5
LINEAR_FILE, ATTENTION_FILE = "{tag}_linear_ops_ms_per_layer.csv", "{tag}_attention.csv"
META_FILE = "{tag}_operators.json"


@dataclass(frozen=True)
class Grid:
    models: tuple[str, ...] = DEFAULT_MODELS
    tp: tuple[int, ...] = DEFAULT_TP
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    prefill_chunks: tuple[int, ...] = PREFILL_CHUNKS
    prefill_contexts: tuple[int, ...] = PREFILL_CONTEXTS


QUICK_GRID = Grid(QUICK_MODELS, QUICK_TP, QUICK_TOKENS, QUICK_BATCHES, QUICK_CONTEXTS, QUICK_CHUNKS,
                  QUICK_PREFILL_CONTEXTS)


class Timer:
    """Seconds per call of an operator built over ``copies`` sets of operands (see the module docstring)."""

    def __init__(self, device: str):
        import torch
        self.torch, self.device = torch, device
        self.l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0

    def copies_for(self, operand_bytes: float) -> int:
        """Operand copies to cycle through so that together they overflow the L2 cache twice."""
        if self.device != "cuda":
            return 1
        return int(min(MAX_REPS, max(1, math.ceil(2 * self.l2_bytes / max(operand_bytes, 1.0)))))

    def seconds(self, calls) -> float:
        """``calls``: one zero-argument callable per operand copy."""
        if self.device != "cuda":
            return self._cpu_seconds(calls)
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):           # warm up (and compile) outside the capture, as CUDA graphs need
            for call in calls[:3]:
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls[:3]:
            call()
        end.record()
        end.synchronize()
        one_s = start.elapsed_time(end) * 1e-3 / min(3, len(calls))
        reps = int(min(MAX_REPS, max(MIN_REPS, len(calls), TARGET_GRAPH_S / max(one_s, 1e-7))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for index in range(reps):
                calls[index % len(calls)]()
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(REPLAYS):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3 / reps)
        del graph
        return statistics.median(samples)

    def _cpu_seconds(self, calls) -> float:
        calls[0]()
        samples = []
        for _ in range(CPU_SAMPLES):
            begin = time.perf_counter()
            calls[0]()
            samples.append(time.perf_counter() - begin)
        return statistics.median(samples)

    def empty_kernel_s(self) -> float | None:
        """The protocol's figure for a kernel that does nothing (the graph's gap per kernel), GPU only."""
        if self.device != "cuda":
            return None
        try:
            return self.seconds([lambda: self.torch.cuda._sleep(0)])
        except RuntimeError:             # a private torch call: its absence only loses this reference figure
            return None


def _streaming_functions(torch, compile_them: bool):
    """RMSNorm, SiLU-and-multiply, rotary embedding (GPT-NeoX halves) and residual add, each fused by
    torch.compile where it works; returns (functions, "compiled" | "eager: <why>")."""
    def rms_norm(x, weight):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype) * weight

    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def rotary(q, k, cos, sin):
        def rotate(x):
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotate(q), rotate(k)

    def add(a, b):
        return a + b

    functions = {"norm": rms_norm, "activation": silu_and_mul, "rotary": rotary, "residual": add}
    if not compile_them:
        return functions, "eager: torch.compile not used on this device"
    for option in ("cache_size_limit", "recompile_limit"):   # every model and TP size is a new shape to guard
        if hasattr(torch._dynamo.config, option):
            setattr(torch._dynamo.config, option, 256)
    try:
        compiled = {name: torch.compile(fn, dynamic=True, fullgraph=True) for name, fn in functions.items()}
        probe = torch.ones(4, 64, device="cuda", dtype=torch.float16)
        compiled["residual"](probe, probe)
        return compiled, "compiled: torch.compile (Inductor/Triton), one fused kernel per operator"
    except Exception as exc:             # the compiler is optional: eager kernels are still honest figures
        return functions, f"eager: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]})"


def _layer_rows(model: ModelSpec, tp: int, tokens: int, timer: Timer, streaming, dtype, device) -> dict:
    """Milliseconds of each operator of one layer of ``model`` at ``tokens`` rows on one of ``tp`` GPUs."""
    torch = timer.torch
    row = {}
    element_bytes = torch.finfo(dtype).bits // 8
    columns = {"qkv": "attn_pre_proj_ms", "out_proj": "attn_post_proj_ms", "mlp_up": "mlp_up_proj_ms",
               "mlp_down": "mlp_down_proj_ms"}
    for shape in layer_gemm_shapes(model, tp):
        n, k = int(round(shape.n)), int(round(shape.k))
        copies = timer.copies_for((n * k + tokens * (n + k)) * element_bytes)
        xs = [torch.randn(tokens, k, device=device, dtype=dtype) for _ in range(copies)]
        ws = [torch.randn(k, n, device=device, dtype=dtype) / math.sqrt(k) for _ in range(copies)]
        outs = [torch.empty(tokens, n, device=device, dtype=dtype) for _ in range(copies)]
        calls = [lambda x=x, w=w, o=o: torch.matmul(x, w, out=o) for x, w, o in zip(xs, ws, outs)]
        row[columns[shape.name]] = timer.seconds(calls) * 1e3
        del xs, ws, outs, calls
    hidden, head_dim = model.hidden_size, model.head_dim
    inter = int(model.intermediate_size // tp)
    q_width, kv_width = int(model.num_heads // tp) * head_dim, max(1, int(model.num_kv_heads // tp)) * head_dim
    per_copy = {"norm": 2 * tokens * hidden, "activation": 3 * tokens * inter, "residual": 3 * tokens * hidden,
                "rotary": 2 * tokens * (q_width + kv_width)}
    operands = {
        "norm": lambda: (torch.randn(tokens, hidden, device=device, dtype=dtype),
                         torch.ones(hidden, device=device, dtype=dtype)),
        "activation": lambda: (torch.randn(tokens, 2 * inter, device=device, dtype=dtype),),
        "residual": lambda: (torch.randn(tokens, hidden, device=device, dtype=dtype),
                             torch.randn(tokens, hidden, device=device, dtype=dtype)),
        "rotary": lambda: (torch.randn(tokens, q_width // head_dim, head_dim, device=device, dtype=dtype),
                           torch.randn(tokens, kv_width // head_dim, head_dim, device=device, dtype=dtype),
                           torch.randn(tokens, 1, head_dim // 2, device=device, dtype=dtype),
                           torch.randn(tokens, 1, head_dim // 2, device=device, dtype=dtype)),
    }
    kinds = (("norm", "input_layernorm_ms"), ("norm", "post_attention_layernorm_ms"), ("activation", "mlp_act_ms"),
             ("rotary", "attn_rope_ms"), ("residual", "add_ms"))
    for kind, column in kinds:
        copies = timer.copies_for(per_copy[kind] * element_bytes)
        args = [operands[kind]() for _ in range(copies)]
        calls = [functools.partial(streaming[kind], *a) for a in args]
        row[column] = timer.seconds(calls) * 1e3
        del args, calls
    return row


def _attention_seconds(timer: Timer, q_heads: int, kv_heads: int, head_dim: int, batch: int, queries: int,
                       context: int, dtype, device, backend_choice: str = "flash") -> tuple[float, str]:
    """One attention call: ``batch`` sequences of ``queries`` new tokens each over ``context`` cached ones
    plus themselves (causal within the chunk). ``backend_choice``: "flash" forces SDPA's FlashAttention-2 kernel
    (falling back to the memory-efficient and math ones where it refuses the shapes); "default" lets SDPA pick
    (cuDNN's fused kernel on Hopper, as torch 2.11 ranks them). Returns seconds and the backend's label."""
    torch = timer.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    keys = context + queries
    # A chunk after cached context needs the causal mask aligned to the lower right, which SDPA takes as a
    # CausalBias without grouped-query heads: there the K/V heads are repeated up front (prefill is
    # compute-bound, so the repeated reads cost little); decode and a first chunk use GQA directly.
    chunk_after_context = queries > 1 and context > 0
    stored_kv_heads = q_heads if chunk_after_context else kv_heads
    per_copy = (batch * (q_heads * queries + 2 * stored_kv_heads * keys)) * head_dim * torch.finfo(dtype).bits // 8
    copies = timer.copies_for(per_copy)
    tensors = [(torch.randn(batch, q_heads, queries, head_dim, device=device, dtype=dtype),
                torch.randn(batch, stored_kv_heads, keys, head_dim, device=device, dtype=dtype),
                torch.randn(batch, stored_kv_heads, keys, head_dim, device=device, dtype=dtype))
               for _ in range(copies)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    options: dict[str, Any]
    if chunk_after_context:
        mask = causal_lower_right(queries, keys)
        options = {"attn_mask": mask}
    else:
        options = {"is_causal": queries > 1, "enable_gqa": stored_kv_heads != q_heads}
    last_error = None
    choices = ((None, "default"),) if backend_choice == "default" else (
        (SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.EFFICIENT_ATTENTION, "efficient"), (SDPBackend.MATH, "math"))
    for backend, name in choices:
        def call(q, k, v, backend=backend):
            if backend is None:
                return sdpa(q, k, v, **options)
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, **options)
        try:
            seconds = timer.seconds([lambda t=t: call(*t) for t in tensors])
        except RuntimeError as exc:      # this backend does not take these shapes: the next one
            last_error = exc
            continue
        return seconds, name + ("-kv-repeated" if chunk_after_context and stored_kv_heads != kv_heads else "")
    raise RuntimeError(f"no SDPA backend ran attention of {q_heads}/{kv_heads} heads: {last_error}")


def _attention_kernel_names(torch, dtype) -> dict:
    """The CUDA kernels SDPA runs by default for a GQA decode call and a first prefill chunk (Llama-3.1-8B's
    heads), read with torch.profiler: which library "default" means on this device."""
    names: dict[str, list[str] | str] = {}
    shapes = {"decode": (64, 1, 1024, False), "prefill": (1, 512, 512, True)}
    for phase, (batch, queries, keys, causal) in shapes.items():
        q = torch.randn(batch, 32, queries, 128, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, 8, keys, 128, device="cuda", dtype=dtype) for _ in range(2))
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                torch.cuda.synchronize()
            names[phase] = sorted({event.key for event in prof.key_averages()
                                   if event.device_type == torch.autograd.DeviceType.CUDA})
        except RuntimeError as exc:      # the profiler is a reference, not a measurement: note why it is missing
            names[phase] = f"not read: {str(exc)[:200]}"
    return names


def profile_operators(out_dir: str | Path, tag: str, device: str = "cuda", grid: Grid = Grid(),
                      progress=None, attention_backend: str = "flash") -> dict:
    """Measure ``grid`` on ``device`` and write the linear-operator CSV, the attention CSV and the metadata
    into ``out_dir`` (files named by ``tag``); rows are written as they are taken, so a run stopped part-way
    keeps what it finished. Returns the metadata."""
    import torch
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dtype, dtype_name = _dtype(torch, device)
    timer = Timer(device)
    streaming, streaming_note = _streaming_functions(torch, compile_them=device == "cuda")
    meta = {"tag": tag, "device": device, "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "cuda": torch.version.cuda if device == "cuda" else None, "l2_cache_bytes": timer.l2_bytes,
            "dtype": dtype_name, "streaming_kernels": streaming_note, "empty_kernel_s": timer.empty_kernel_s(),
            "protocol": (f"CUDA graph of >= {MIN_REPS} calls cycling through operand copies over 2x the L2, "
                         f"median of {REPLAYS} replays" if device == "cuda" else f"median of {CPU_SAMPLES} calls"),
            "grid": {key: list(value) for key, value in grid.__dict__.items()},
            "attention_backend": attention_backend,
            "attention_kernels": _attention_kernel_names(torch, dtype) if device == "cuda" else None}
    _write_meta(meta, out / META_FILE.format(tag=tag))
    linear_path, attention_path = out / LINEAR_FILE.format(tag=tag), out / ATTENTION_FILE.format(tag=tag)
    catalog = model_catalog()
    models = [lookup_model(name, catalog, key="models") for name in grid.models]
    # (sequences, new tokens each, cached context) of every attention call, the same for each model and TP size.
    cases = [(batch, 1, context) for batch in grid.decode_batches for context in grid.decode_contexts]
    cases += [(1, chunk, context) for chunk in grid.prefill_chunks for context in grid.prefill_contexts]
    per_tp = len(grid.tokens) + len(cases)
    total = len(models) * len(grid.tp) * per_tp
    done = 0
    linear_rows, attention_rows, failures = [], [], []
    for model in models:
        layer = _layer_model(model)
        for tp in grid.tp:
            if model.num_heads % tp:          # engines refuse a TP size that does not divide the heads
                done += per_tp
                continue
            for tokens in grid.tokens:
                row = {"device": tag, "model": model.name, "num_tokens": tokens, "tp": tp,
                       "n_embd": layer.hidden_size, "n_expanded_embd": layer.intermediate_size,
                       "n_head": layer.num_heads, "n_kv_head": layer.num_kv_heads, "vocab_size": model.vocab_size}
                try:
                    row.update(_layer_rows(layer, tp, tokens, timer, streaming, dtype, device))
                    linear_rows.append(row)
                except RuntimeError as exc:      # e.g. out of memory: reported in the metadata, the rest goes on
                    failures.append(f"{model.name} tp {tp} tokens {tokens}: {str(exc)[:300]}")
                done += 1
                _report(progress, done, total)
            if linear_rows:
                _write_csv(linear_rows, linear_path)
            q_heads, kv_heads = model.num_heads // tp, max(1, model.num_kv_heads // tp)
            for batch, queries, context in cases:
                done += 1
                kv_bytes = batch * 2 * kv_heads * (context + queries) * model.head_dim * torch.finfo(dtype).bits // 8
                if kv_bytes > MAX_KV_BYTES:
                    continue
                try:
                    seconds, backend = _attention_seconds(timer, q_heads, kv_heads, model.head_dim, batch, queries,
                                                          context, dtype, device, attention_backend)
                except RuntimeError as exc:
                    failures.append(f"{model.name} tp {tp} attention batch {batch} queries {queries} context "
                                    f"{context}: {str(exc)[:300]}")
                    continue
                prefill = queries > 1
                attention_rows.append({
                    "device": tag, "model": model.name, "n_embd": model.hidden_size, "n_q_head": model.num_heads,
                    "n_kv_head": model.num_kv_heads, "num_tensor_parallel_workers": tp, "batch_size": batch,
                    "prefill_chunk_size": queries if prefill else 0, "kv_cache_size": context,
                    "is_prefill": prefill, "attention_backend": f"torch-sdpa-{backend}",
                    "time_stats.attn_prefill.median": seconds * 1e3 if prefill else 0.0,
                    "time_stats.attn_decode.median": 0.0 if prefill else seconds * 1e3})
                _report(progress, done, total)
            _write_csv(attention_rows, attention_path)
            meta["failures"] = failures
            _write_meta(meta, out / META_FILE.format(tag=tag))
    return meta


def _dtype(torch, device: str):
    """(torch dtype, name) of the rows: Vidur's measurements are fp16; a CPU has no fast fp16 GEMM, so there
    the rows are fp32 (the metadata says)."""
    return (torch.float16, "fp16") if device == "cuda" else (torch.float32, "fp32")


def device_tag(device: str) -> str:
    """h200 / h100 / a100 from the GPU's name (the tags the measurement reader knows), else the device kind."""
    if device != "cuda":
        return device
    import torch
    name = torch.cuda.get_device_name(0).lower()
    return next((tag for tag in DEVICE_PROFILES if tag in name), "cuda")


def _layer_model(model: ModelSpec) -> ModelSpec:
    """The dense 16-bit layer of ``model`` the linear-operator rows describe."""
    return replace(model, weight_dtype="fp16", kv_dtype="fp16", activation_dtype="fp16")


def _report(progress, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


# -- whole model steps and FP8 GEMMs (GPU) --------------------------------------------------------

STEP_FILE, FP8_FILE = "{tag}_steps.csv", "{tag}_fp8_gemm.csv"
STEP_MODEL, STEP_BATCHES = "Llama-3.1-8B", (1, 8, 32, 128)
STEP_CONTEXTS, STEP_CHUNKS = (512, 2048), (256, 1024, 4096, 8192)
FP8_MODELS, FP8_TP = ("Llama-3.1-8B", "Llama-3.1-70B"), (1, 2, 4, 8)
FP8_TOKENS = (1, 16, 64, 256, 1024, 4096)


class ModelStep:
    """One iteration of a whole model at one TP shard's shapes (here TP 1): ``batch`` sequences of ``new`` tokens
    each after ``context`` cached ones (one token: a decode step; one sequence of many: a prefill chunk).
    Embedding; per layer RMSNorm, fused QKV, rotary, the new K/V written into a contiguous cache, SDPA
    attention over the cache (decode: SDPA's own kernel choice; a first prefill chunk: its FlashAttention-2
    kernel, causal, as the profile's prefill backend), output projection, residual, RMSNorm, gate+up,
    SiLU-and-multiply, down, residual; final norm, the LM head on each sequence's last token, greedy sampling.
    The same operators as the per-operator rows, chained."""

    def __init__(self, model: ModelSpec, batch: int, context: int, streaming, dtype, device, new: int = 1):
        import torch
        if new > 1 and (batch > 1 or context > 0):
            raise ValueError("a prefill step here is one sequence's first chunk (batch 1, context 0)")
        self.torch, self.model, self.streaming = torch, model, streaming
        hidden, head_dim = model.hidden_size, model.head_dim
        self.q_heads, self.kv_heads = model.num_heads, model.num_kv_heads

        def weight(k, n):
            return torch.randn(k, n, device=device, dtype=dtype) / math.sqrt(k)

        def cache():
            return torch.randn(batch, self.kv_heads, context + new, head_dim, device=device, dtype=dtype)
        self.layers = [dict(qkv=weight(hidden, (self.q_heads + 2 * self.kv_heads) * head_dim),
                            out=weight(self.q_heads * head_dim, hidden),
                            gate_up=weight(hidden, 2 * model.intermediate_size),
                            down=weight(model.intermediate_size, hidden),
                            norm=torch.ones(hidden, device=device, dtype=dtype), k_cache=cache(), v_cache=cache())
                       for _ in range(model.num_layers)]
        self.embedding = torch.randn(model.vocab_size, hidden, device=device, dtype=dtype)
        self.final_norm = torch.ones(hidden, device=device, dtype=dtype)
        self.lm_head = weight(hidden, model.vocab_size)
        rows = batch * new
        self.tokens = torch.randint(0, model.vocab_size, (rows,), device=device)
        self.cos = torch.randn(rows, 1, head_dim // 2, device=device, dtype=dtype)
        self.sin = torch.randn(rows, 1, head_dim // 2, device=device, dtype=dtype)
        self.batch, self.new, self.context, self.head_dim = batch, new, context, head_dim

    def _attend(self, q, layer):
        f = self.torch.nn.functional
        gqa = self.q_heads != self.kv_heads
        if self.new == 1:
            return f.scaled_dot_product_attention(q.view(self.batch, self.q_heads, 1, self.head_dim),
                                                  layer["k_cache"], layer["v_cache"], enable_gqa=gqa)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return f.scaled_dot_product_attention(q.view(1, self.new, self.q_heads, self.head_dim).transpose(1, 2),
                                                  layer["k_cache"], layer["v_cache"], is_causal=True,
                                                  enable_gqa=gqa).transpose(1, 2)

    def __call__(self):
        torch, f, s = self.torch, self.torch.nn.functional, self.streaming
        rows, head_dim, at = self.batch * self.new, self.head_dim, slice(self.context, self.context + self.new)
        x = f.embedding(self.tokens, self.embedding)
        for layer in self.layers:
            h = s["norm"](x, layer["norm"])
            q, k, v = (h @ layer["qkv"]).split([self.q_heads * head_dim, self.kv_heads * head_dim,
                                                  self.kv_heads * head_dim], dim=-1)
            q, k = s["rotary"](q.view(rows, self.q_heads, head_dim), k.view(rows, self.kv_heads, head_dim),
                               self.cos, self.sin)
            # [batch, new, kv_heads, head_dim] -> the cache's [batch, kv_heads, positions, head_dim]
            layer["k_cache"][:, :, at] = k.view(self.batch, self.new, self.kv_heads, head_dim).transpose(1, 2)
            layer["v_cache"][:, :, at] = v.view(self.batch, self.new, self.kv_heads, head_dim).transpose(1, 2)
            x = s["residual"](x, self._attend(q, layer).reshape(rows, -1) @ layer["out"])
            h = s["norm"](x, layer["norm"])
            x = s["residual"](x, s["activation"](h @ layer["gate_up"]) @ layer["down"])
        last = x.view(self.batch, self.new, -1)[:, -1]
        return torch.argmax(s["norm"](last, self.final_norm) @ self.lm_head, dim=-1)


def profile_steps(out_dir: str | Path, tag: str, device: str = "cuda", model_name: str = STEP_MODEL,
                  batches=STEP_BATCHES, contexts=STEP_CONTEXTS, chunks=STEP_CHUNKS, progress=None) -> Path:
    """Whole iterations of ``model_name`` (TP 1, fp16 on a GPU): decode steps at each batch and context, and
    first prefill chunks of each length: the check of the summed per-operator terms against real steps.
    Writes and returns ``{tag}_steps.csv`` (``new_tokens`` 1: decode)."""
    import torch
    dtype = _dtype(torch, device)[0]
    timer = Timer(device)
    streaming, note = _streaming_functions(torch, compile_them=device == "cuda")
    model = lookup_model(model_name, model_catalog(), key="model")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    rows, path = [], Path(out_dir) / STEP_FILE.format(tag=tag)
    cases = [(batch, context, 1) for batch in batches for context in contexts] + [(1, 0, chunk) for chunk in chunks]
    for index, (batch, context, new) in enumerate(cases):
        step = ModelStep(model, batch, context, streaming, dtype, device, new)
        rows.append({"device": tag, "model": model.name, "tp": 1, "batch_size": batch, "new_tokens": new,
                     "kv_cache_size": context, "step_ms": timer.seconds([step]) * 1e3, "streaming_kernels": note})
        del step
        _write_csv(rows, path)
        _report(progress, index + 1, len(cases))
    return path


def profile_fp8_gemms(out_dir: str | Path, tag: str, models=FP8_MODELS, tps=FP8_TP, tokens=FP8_TOKENS,
                      progress=None) -> Path:
    """Each linear layer's GEMM with FP8 (e4m3) weights and activations, per-tensor scales and fp16 output
    (``torch._scaled_mm``, the kernel class FP8 serving calls), at the shard's shapes. The rows are padded to a
    multiple of 16 as that kernel requires (``padded_tokens``). Writes and returns ``{tag}_fp8_gemm.csv``."""
    import torch
    timer = Timer("cuda")
    catalog = model_catalog()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    rows, path = [], Path(out_dir) / FP8_FILE.format(tag=tag)
    cases = [(lookup_model(name, catalog, key="models"), tp, m) for name in models for tp in tps for m in tokens]
    one = torch.ones((), device="cuda")
    for index, (model, tp, m) in enumerate(cases):
        padded = -(-m // 16) * 16
        for shape in layer_gemm_shapes(model, tp):
            n, k = int(round(shape.n)), int(round(shape.k))
            copies = timer.copies_for(n * k + padded * k)
            a = [torch.randn(padded, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(copies)]
            b = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t() for _ in range(copies)]
            calls = [lambda x=x, w=w: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.float16)
                     for x, w in zip(a, b)]
            rows.append({"device": tag, "model": model.name, "tp": tp, "gemm": shape.name, "num_tokens": m,
                         "padded_tokens": padded, "n": n, "k": k, "time_ms": timer.seconds(calls) * 1e3})
            del a, b, calls
        _write_csv(rows, path)
        _report(progress, index + 1, len(cases))
    return path


def _write_csv(rows: list[dict], path: Path) -> None:
    """Checkpoint the rows measured so far (renamed into place: an interrupted run keeps the last whole file)."""
    write_file(path, lambda partial: pd.DataFrame(rows).to_csv(partial, index=False))


def _write_meta(meta: dict, path: Path) -> None:
    write_file(path, lambda partial: partial.write_text(json.dumps(meta, indent=1)))
