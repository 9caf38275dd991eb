"""Request traffic: arrival times and prompt/output lengths, drawn once per scenario seed, or replayed.

A :class:`Trace` is the whole arrival sequence, sampled up front with numpy from
independent streams (arrivals, prompt lengths, output lengths) spawned from the
scenario seed, so two configurations that differ in anything but the workload see
the same requests in the same order: common random numbers. A recorded trace (CSV)
is replayed instead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from llmsim.config.reader import Node

if TYPE_CHECKING:
    from llmsim.workload.workload import Workload


@dataclass(frozen=True)
class Trace:
    """What arrives: sorted arrival times and the token counts of each request.

    Requests of multi-turn sessions say which session they belong to (``session_id``, -1 for
    none: each turn's prompt is its session's history plus new input) and which shared system
    prompt they start with (``system_prompt_id``, -1 for none, of ``system_prompt_tokens``
    tokens): what prefix caching can reuse (see ``llmsim.sim.prefix_cache.PrefixKeys``).
    """
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    session_id: np.ndarray | None = None
    system_prompt_id: np.ndarray | None = None
    system_prompt_tokens: np.ndarray | None = None

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
        pick = lambda values: None if values is None else values[idx]   # noqa: E731
        return replace(self, arrival_s=self.arrival_s[idx], prompt_tokens=self.prompt_tokens[idx],
                       output_tokens=self.output_tokens[idx], session_id=pick(self.session_id),
                       system_prompt_id=pick(self.system_prompt_id),
                       system_prompt_tokens=pick(self.system_prompt_tokens))


def generate_trace(workload: Workload, seed: int) -> Trace:
    """Sample the scenario's requests from ``seed`` (the same seed gives the same trace)."""
    if workload.trace is not None:
        return workload.trace.cut(workload.num_requests, workload.duration_s)
    if workload.sessions is not None:
        return workload.sessions.trace(workload, seed)
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng(s)
                                            for s in np.random.SeedSequence(seed).spawn(3))
    times = workload.arrival.times(arrivals_rng, workload.num_requests, workload.duration_s)
    n = len(times)
    return Trace(times, workload.prompt_tokens.sample(prompt_rng, n), workload.output_tokens.sample(output_rng, n))


# -- reading ------------------------------------------------------------------------------

def read_trace_csv(path: Path, node: Node, key: str) -> Trace:
    """A trace CSV with columns arrival_s, prompt_tokens, output_tokens (extra columns ignored), and
    optionally session_id: requests with the same (integer) session id are the turns of one
    conversation, each prompt extending the one before (the history plus new input)."""
    required = ("arrival_s", "prompt_tokens", "output_tokens")
    frame = read_csv(path, node, key)
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise node.key_error(key, f"trace {path} lacks column(s) {', '.join(missing)}", str(path),
                             "a CSV with columns " + ", ".join(required))
    for column in required:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() | (values < (0 if column == "arrival_s" else 1))
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise node.key_error(key, f"trace {path}, column {column}, data row {row + 1}: "
                                      f"not a valid value", frame[column].iloc[row],
                                 "arrival_s >= 0 seconds; token counts >= 1")
        frame[column] = values
    frame = frame.sort_values("arrival_s", kind="stable")
    return Trace(frame["arrival_s"].to_numpy(float), frame["prompt_tokens"].to_numpy(np.int64),
                 frame["output_tokens"].to_numpy(np.int64), session_id=_session_ids(frame, path, node, key))


def _session_ids(frame: pd.DataFrame, path: Path, node: Node, key: str) -> np.ndarray | None:
    """The optional session_id column as session numbers 0, 1, ... (None without the column)."""
    if "session_id" not in frame.columns:
        return None
    values = pd.to_numeric(frame["session_id"], errors="coerce")
    bad = values.isna() | (values != values.round())
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise node.key_error(key, f"trace {path}, column session_id, data row {row + 1}: not a valid value",
                             frame["session_id"].iloc[row], "an integer session id per request")
    return pd.factorize(values.astype(np.int64))[0].astype(np.int64)


def read_csv(path: Path, node: Node, key: str) -> pd.DataFrame:
    """A CSV file named by ``key`` of ``node``, with a header and at least one row (else a ConfigError)."""
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise node.key_error(key, f"cannot read CSV {path}: {exc}", str(path), "a CSV file with a header row") from None
    if frame.empty:
        raise node.key_error(key, f"CSV {path} has no rows", str(path), "a CSV file with at least one data row")
    return frame
