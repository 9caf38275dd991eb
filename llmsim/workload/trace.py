"""Request traffic: arrival times and prompt/output lengths, drawn once per scenario seed, or replayed.

A :class:`Trace` is the whole arrival sequence, sampled up front with numpy from
independent streams (arrivals, prompt lengths, output lengths) spawned from the
scenario seed, so two configurations that differ in anything but the workload see
the same requests in the same order: common random numbers. A recorded trace is
replayed instead (:mod:`llmsim.workload.trace_formats` reads the production formats,
:mod:`llmsim.workload.trace_transforms` windows, filters, samples and rescales it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.config.reader import Node
from llmsim.config.tables import read_csv_text


@dataclass(frozen=True)
class Trace:
    """What arrives: sorted arrival times and the token counts of each request.

    A production trace may say more per request: ``hash_ids``, the hashes of the prompt's
    KV blocks (Mooncake traces; equal hashes are shared prefixes, for prefix caching),
    and the ``model`` and ``log_type`` labels a trace can be filtered on (BurstGPT).
    ``description`` says where the requests come from and what was done to them.
    Requests of multi-turn sessions say which session they belong to (``session_id``, -1 for
    none: each turn's prompt is its session's history plus new input) and which shared system
    prompt they start with (``system_prompt_id``, -1 for none, of ``system_prompt_tokens``
    tokens): what prefix caching can reuse (see ``llmsim.sim.prefix_cache.PrefixKeys``).
    """
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    model: np.ndarray | None = None
    log_type: np.ndarray | None = None
    description: str = ""
    class_index: np.ndarray | None = None     # with traffic classes: each request's class (its index)
    class_label: np.ndarray | None = None     # a replayed trace's class column, as written (mapped to class_index)
    session_id: np.ndarray | None = None
    system_prompt_id: np.ndarray | None = None
    system_prompt_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)

    def to_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                              "output_tokens": self.output_tokens})
        if self.class_index is not None:
            frame["class_index"] = self.class_index
        return frame

    def take(self, index: np.ndarray, description: str | None = None) -> Trace:
        """The requests at ``index`` (an integer array, in order), every per-request field kept."""
        index = np.asarray(index, dtype=np.int64)
        pick = lambda values: None if values is None else values[index]   # noqa: E731
        hash_ids = None if self.hash_ids is None else tuple(self.hash_ids[i] for i in index)
        return replace(self, arrival_s=self.arrival_s[index], prompt_tokens=self.prompt_tokens[index],
                       output_tokens=self.output_tokens[index], hash_ids=hash_ids, model=pick(self.model),
                       log_type=pick(self.log_type), class_index=pick(self.class_index),
                       class_label=pick(self.class_label),
                       description=self.description if description is None else description,
                       session_id=pick(self.session_id), system_prompt_id=pick(self.system_prompt_id),
                       system_prompt_tokens=pick(self.system_prompt_tokens))

    def cut(self, num_requests: int | None, duration_s: float | None) -> Trace:
        """The first ``num_requests`` requests arriving within ``duration_s`` (None: no limit)."""
        keep = np.ones(len(self), dtype=bool)
        if duration_s is not None:
            keep &= self.arrival_s <= duration_s
        return self.take(np.flatnonzero(keep)[:num_requests])


# -- reading ------------------------------------------------------------------------------

def read_csv(path: Path, node: Node, key: str) -> pd.DataFrame:
    """A CSV file named by ``key`` of ``node``, with a header and at least one row, read through the
    front door (:func:`llmsim.config.tables.read_csv_text`: size cap, UTF-8); cells are text."""
    return read_csv_text(path, key_errors(node, key))


def key_errors(node: Node, key: str):
    """Errors about a CSV named by ``key`` of ``node``: they name the scenario file and key too."""
    return lambda message, value, allowed: node.key_error(key, message, value, allowed)
