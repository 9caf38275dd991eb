"""Shared helpers: scenarios built from plain dicts through the same validation as YAML files."""
from __future__ import annotations

import contextlib
import re
import copy
import dataclasses
import signal
from pathlib import Path

import numpy as np
from llmsim.search.compare import REPLACED_WHOLE
from llmsim.analysis.metrics import summarize
from llmsim.config.reader import Node, deep_merge
from llmsim.cost.features import F, attention_pairs
from llmsim.scenario.scenario import scenario_from_node
from llmsim.sim.invariants import InvariantChecker
from llmsim.sim.simulate import simulate

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))

BASE = {
    "name": "test",
    "seed": 11,
    "model": "Llama-3.1-8B",
    "hardware": "H100-SXM",
    "engine": {"max_model_len": 16384},
    "workload": {
        "arrival": {"process": "poisson", "rate": 10.0},
        "num_requests": 1000,
        "prompt_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.8, "max": 4096},
        "output_tokens": {"distribution": "lognormal", "mean": 128, "sigma": 0.8, "max": 1024},
    },
}


def roofline_only(profile):
    """``profile`` without its measured kernel terms: priced by the plain roofline (peak x efficiency), whose
    first-principles laws (linear decode steps, weights / bandwidth, FLOPs / peak) some tests check."""
    return dataclasses.replace(profile, kernels=None)


def roofline_document(document: dict) -> dict:
    """A profile's YAML mapping without its kernels: section (and the calibration record that goes with it)."""
    return {key: value for key, value in document.items() if key not in ("kernels", "calibration")}


def merge(base: dict, overrides: dict) -> dict:
    return deep_merge(copy.deepcopy(base), overrides, REPLACED_WHOLE)


def make_scenario(overrides: dict | None = None, base: dict = BASE):
    data = merge(base, overrides or {})
    return scenario_from_node(Node(data, file="<test>", base_dir=REPO / "scenarios"))


def simulate_checked(scenario, trace=None, observers=(), **options):
    """``simulate`` with the invariants watched on every iteration (:class:`InvariantChecker`:
    time, KV blocks, queues, tokens, requests) and over the whole run; the engine tests use it."""
    checker = InvariantChecker()
    result = simulate(scenario, trace, [*observers, checker], **options)
    checker.check_result(result)
    return result




# Reference definitions of batch-feature sums, written with numpy, for checking the compiled step.
def chunk_sums(new: np.ndarray, seen: np.ndarray) -> tuple[float, float, float]:
    """Chunks of ``new`` positions after ``seen`` visible tokens (arrays): (tokens, pairs, KV read).

    A speculative verify step is such a chunk of ``k + 1`` positions per sequence, every
    one of which gives logits (so its logit rows equal its tokens).
    """
    return float(new.sum()), float(attention_pairs(new, seen).sum()), float((seen + new).sum())


def add_prefill(row: np.ndarray, tokens, pairs, kv_read, logits=0) -> np.ndarray:
    """Add prefill work to a row (in place): ``tokens`` positions, ``pairs`` attention pairs, ``kv_read``."""
    row[F["tokens"]] += tokens
    row[F["prefill_tokens"]] += tokens
    row[F["prefill_pairs"]] += pairs
    row[F["prefill_kv_read"]] += kv_read
    row[F["logit_tokens"]] += logits
    return row


class Hang(BaseException):
    """Ran past its bound (a BaseException, so that no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def bounded(seconds: float):
    """Turns a hang into a failure (a bound on a fault, not a timing assertion)."""
    def expire(signum, frame):
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def mutated_bytes(draw, data: bytes, alphabet: bytes) -> bytes:
    """``data`` with one to four bytes deleted, replaced or inserted (from ``alphabet``), drawn by a
    hypothesis ``draw``: a valid file made slightly invalid."""
    from hypothesis import strategies as st

    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["delete", "replace", "insert"]))
        byte = draw(st.sampled_from(alphabet))
        if action == "delete" and at < len(data):
            del data[at]
        elif action == "replace" and at < len(data):
            data[at] = byte
        else:
            data.insert(at, byte)
    return bytes(data)


def tiny_model(name: str, layers: int) -> dict:
    return {"name": name, "num_layers": layers, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 4,
            "intermediate_size": 512, "vocab_size": 1000, "max_context": 65536}


def block_transfer_s(scenario) -> float:
    """One block over the host link: its KV bytes (K and V of every layer, bf16) / the link's bandwidth."""
    m = scenario.model
    block_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 * scenario.engine.block_size
    host = scenario.hardware.host_memory
    return block_bytes / host.link_bandwidth_bytes_per_s


def markdown_tables(md: str) -> list[list[list[str]]]:
    """Pipe tables as rows of cells (the separator line dropped, escapes read back as CommonMark reads them)."""
    tables, current = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if re.fullmatch(r"\|(---\|)+", line.strip()):
                continue
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            current.append([markdown_literal(c.strip()) for c in cells])
        else:
            current = None
    return tables


def markdown_literal(text: str) -> str:
    """The characters CommonMark shows for ``text``: a backslash before ASCII punctuation and the
    entities &amp; &lt; &gt; read back as the character (both in one pass, as a parser does)."""
    return re.sub(r"\\([!-/:-@\[-`{-~])|&(amp|lt|gt);",
                  lambda m: m[1] if m[1] is not None else {"amp": "&", "lt": "<", "gt": ">"}[m[2]], text)


def tpot_mean_s(result) -> float:
    """A run's mean TPOT, from its summary."""
    return summarize(result).to_dict()["latency"]["tpot_s"]["mean"]


def same(a, b) -> bool:
    """Equal scenarios (a replayed trace's arrays compared by value; where it came from left out)."""
    ta, tb = a.workload.trace, b.workload.trace
    if (ta is None) != (tb is None):
        return False
    if ta is not None and tb is not None and not all(
            np.array_equal(getattr(ta, name), getattr(tb, name)) for name in ("arrival_s", "prompt_tokens",
                                                                              "output_tokens")):
        return False
    return dataclasses.replace(a, path=None, workload=dataclasses.replace(a.workload, trace=None)) == \
        dataclasses.replace(b, path=None, workload=dataclasses.replace(b.workload, trace=None))


def random_sums(rng: np.random.Generator, n: int) -> list[tuple]:
    """``n`` iterations' sums (prefill tokens, pairs, KV read, logits, decode sequences, decode KV read),
    a third of them decode-only, some with fractional KV reads (the mean over sliding layers)."""
    sums = []
    for _ in range(n):
        prefill = float(rng.integers(1, 8192)) if rng.random() < 0.66 else 0.0
        decode = int(rng.integers(0, 256))
        kv = int(rng.integers(0, 2_000_000)) + (0.5 if rng.random() < 0.2 else 0)
        sums.append((prefill, prefill * rng.integers(0, 4000) + prefill * (prefill + 1) / 2,
                     prefill + float(rng.integers(0, 4000)) if prefill else 0.0, int(rng.integers(0, 4)), decode, kv))
    return sums


def assert_brackets_hold(brackets, capacities, tolerance: float) -> None:
    """Each seed's bisection bracket holds its seed's true capacity: passed at or below it, failed above it, the
    failing rate within ``tolerance`` of the passing one."""
    for bracket, capacity in zip(brackets, capacities):
        assert bracket.passing <= capacity < bracket.failing
        assert bracket.failing <= (1 + tolerance) * bracket.passing
