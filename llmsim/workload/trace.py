"""Request traffic: arrival times and prompt/output lengths, drawn once per scenario seed, or replayed.

A :class:`Trace` is the whole arrival sequence, sampled up front with numpy from
independent streams (arrivals, prompt lengths, output lengths) spawned from the
scenario seed, so two configurations that differ in anything but the workload see
the same requests in the same order: common random numbers. A recorded trace (CSV)
is replayed instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from llmsim.config.limits import MAX_QUANTITY, MAX_TRACE_TOKENS
from llmsim.config.reader import Node
from llmsim.config.tables import checked_numbers, read_csv_text

if TYPE_CHECKING:
    from llmsim.workload.workload import Workload


@dataclass(frozen=True)
class Trace:
    """What arrives: sorted arrival times and the token counts of each request."""
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                             "output_tokens": self.output_tokens})

    def cut(self, num_requests: int | None, duration_s: float | None) -> "Trace":
        """The first ``num_requests`` requests arriving within ``duration_s`` (None: no limit)."""
        keep = np.ones(len(self), dtype=bool)
        if duration_s is not None:
            keep &= self.arrival_s <= duration_s
        idx = np.flatnonzero(keep)[:num_requests]
        return Trace(self.arrival_s[idx], self.prompt_tokens[idx], self.output_tokens[idx])


def generate_trace(workload: Workload, seed: int) -> Trace:
    """Sample the scenario's requests from ``seed`` (the same seed gives the same trace)."""
    if workload.trace is not None:
        return workload.trace.cut(workload.num_requests, workload.duration_s)
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng(s)
                                            for s in np.random.SeedSequence(seed).spawn(3))
    times = workload.arrival.times(arrivals_rng, workload.num_requests, workload.duration_s)
    n = len(times)
    return Trace(times, workload.prompt_tokens.sample(prompt_rng, n), workload.output_tokens.sample(output_rng, n))


# -- reading ------------------------------------------------------------------------------

def read_trace_csv(path: Path, node: Node, key: str) -> Trace:
    """A trace CSV with columns arrival_s, prompt_tokens, output_tokens (extra columns ignored):
    arrival times finite, 0 to :data:`~llmsim.workload.workload.MAX_ARRIVAL_WINDOW_S` seconds, token
    counts whole, 1 to :data:`~llmsim.config.limits.MAX_TRACE_TOKENS`."""
    required = ("arrival_s", "prompt_tokens", "output_tokens")
    frame = read_csv(path, node, key)
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise node.key_error(key, f"trace {path} lacks column(s) {', '.join(missing)}", str(path),
                             "a CSV with columns " + ", ".join(required))
    fail = key_errors(node, key)
    arrival_s = checked_numbers(frame["arrival_s"], f"trace {path}, column arrival_s (seconds)", fail, minimum=0.0,
                                maximum=MAX_QUANTITY["duration"])
    prompt, output = (checked_numbers(frame[column], f"trace {path}, column {column}", fail, minimum=1,
                                      maximum=MAX_TRACE_TOKENS, integer=True)
                      for column in ("prompt_tokens", "output_tokens"))
    order = np.argsort(arrival_s, kind="stable")
    return Trace(arrival_s[order], prompt[order], output[order])


def read_csv(path: Path, node: Node, key: str) -> pd.DataFrame:
    """A CSV file named by ``key`` of ``node``, with a header and at least one row, read through the
    front door (:func:`llmsim.config.tables.read_csv_text`: size cap, UTF-8); cells are text."""
    return read_csv_text(path, key_errors(node, key))


def key_errors(node: Node, key: str):
    """Errors about a CSV named by ``key`` of ``node``: they name the scenario file and key too."""
    return lambda message, value, allowed: node.key_error(key, message, value, allowed)
