"""Production request traces, read into a :class:`~llmsim.workload.trace.Trace`.

Each format is one reader, chosen by ``format:`` or detected from the file (its columns,
or its first JSON line):

===========  ==============================================  ===========================================
format       file                                            columns / fields used
===========  ==============================================  ===========================================
``llmsim``   CSV                                             arrival_s, prompt_tokens, output_tokens
                                                             (session_id, class: optional)
``azure``    Azure LLM inference trace 2023 / 2024, CSV      TIMESTAMP (date-time), ContextTokens,
                                                             GeneratedTokens
``burstgpt`` BurstGPT, CSV                                   Timestamp (s), Request tokens, Response
                                                             tokens, Model, Log Type
``mooncake`` Mooncake trace, JSON lines                      timestamp (ms), input_length,
                                                             output_length, hash_ids
``sharegpt`` ShareGPT / vLLM benchmark dataset, a JSON      one of three entry shapes (lengths only:
             list or JSON lines                              no arrival times), see below
===========  ==============================================  ===========================================

A dataset entry is one of the shapes ``vllm bench serve``'s datasets use:

- ShareGPT: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``,
  the first two turns (prompt, reply); entries with fewer are skipped, as vLLM skips them;
- OpenAI chat: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}``,
  the first user message and the assistant reply that follows it (a system message before them is
  not counted); entries without such a pair are skipped;
- plain prompt and completion (vLLM's ``custom`` JSONL): ``{"prompt": ..., "completion": ...}``, or an
  ``output_tokens`` count in place of the completion's text.

Arrival times are seconds from the trace's zero: the first request's date-time for
Azure, the recorded offsets for the others. A malformed row is a ConfigError naming the
file, its line, the column, the value and what is allowed (exit 2); timestamps must be
finite, non-negative and sorted, and a JSON field must be a JSON number (``"512"`` and
``true`` are not). A request that generated no token is a failed one: BurstGPT logs its failures
with 0 response tokens (and often 0 request tokens too: a prompt of 0 tokens is accepted only on
such a row), and the Azure and Mooncake traces have a few. ``failed`` (``workload.arrival.failed``)
says what to do with them: ``drop`` (the default: nothing of theirs is simulated; a trace left with
none is an error) or ``replay`` (each arrives and is served as its prompt, at least one token, and
one output token: an assumption, as the logs do not say how far a failed request got). Either way
the trace's description counts them, and ``llmsim run`` prints it.

Every file is opened through :func:`llmsim.config.reader.open_file` before it is hashed or
read: a device, a FIFO or a file over the size cap is refused unread, and the lines of a
CSV or JSON-lines file are counted (at most ``MAX_TABLE_ROWS``) before any is parsed.

ShareGPT text becomes token counts through a tokenizer the user supplies (a Hugging Face
``tokenizer.json``, read by the optional ``tokenizers`` package) or a stated number of
characters per token; nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.config.limits import (MAX_JSON_CONTAINERS, MAX_NUMBER, MAX_QUANTITY, MAX_TABLE_FILE_BYTES,
                                  MAX_TABLE_ROWS, MAX_TOKENIZER_FILE_BYTES, MAX_TRACE_TOKENS)
from llmsim.config.policies import FailedRequests
from llmsim.config.reader import Node, open_file, read_text
from llmsim.config.words import counted
from llmsim.errors import ConfigError
from llmsim.workload.trace import Trace, read_csv

TIMED_FORMATS = ("llmsim", "azure", "burstgpt", "mooncake")
PRODUCTION_FORMATS = ("azure", "burstgpt", "mooncake")     # logs of real services, failed requests included
FORMATS = (*TIMED_FORMATS, "sharegpt")

# The columns each CSV format must have: (arrival, prompt, output).
CSV_COLUMNS = {
    "llmsim": ("arrival_s", "prompt_tokens", "output_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
DATASET_KEYS = ("conversations", "messages", "prompt")   # a dataset entry has one of these
DATASET_SHAPES = ('{conversations: [{from: human, value: ...}, {from: gpt, value: ...}]}, '
                  '{messages: [{role: user, content: ...}, {role: assistant, content: ...}]} or '
                  '{prompt: ..., completion: ... | output_tokens: N}')
MOONCAKE_MS_PER_S = 1000.0          # Mooncake timestamps are milliseconds
MAX_ARRIVAL_S = MAX_QUANTITY["duration"]   # the longest arrival window simulated (llmsim.config.limits)


def row_error(path: Path, line: int, column: str, value: object, allowed: str, message: str) -> ConfigError:
    """A malformed row: the file, its line (1 = the first line of the file), the column."""
    return ConfigError(message, file=str(path), key=f"line {line}, column {column}", value=value, allowed=allowed)


def load_trace(path: str | Path, fmt: str = "auto", failed: str | FailedRequests = FailedRequests.DROP) -> Trace:
    """A trace file in any format llmsim reads (``auto``: detected from the file), read and checked as
    ``llmsim report --trace`` reads it; bad content is a ConfigError naming the file, line and column.
    ``failed``: what to do with its failed requests (see the module doc)."""
    return read_trace(Path(path), Node({"path": str(path)}), "path", fmt, failed=FailedRequests.of(failed, "failed"))


def read_trace(path: Path, node: Node, key: str, fmt: str = "auto", *, tokenizer: Path | None = None,
               chars_per_token: float | None = None,
               failed: FailedRequests = FailedRequests.DROP) -> Trace:
    """The trace at ``path`` (named by ``key`` of ``node``) in format ``fmt`` (``auto``: detected), its
    failed requests dropped or replayed (``failed``, see the module doc).

    A file read before with the same content (hashed: cheap next to parsing) and read the same way
    is not parsed again: plans and sweeps rebuild the scenario at every probe."""
    cache_key = (str(Path(path).resolve()), _content_hash(path), fmt, str(tokenizer), chars_per_token, failed)
    if cache_key not in _READ:
        fmt = detect_format(path, node, key) if fmt == "auto" else fmt
        if fmt == "mooncake":
            trace = read_mooncake(path, failed)
        elif fmt == "sharegpt":
            trace = read_sharegpt(path, node, tokenizer, chars_per_token)
        else:
            trace = read_csv_trace(path, node, key, fmt, failed)
        if len(_READ) >= _READ_CACHE_SIZE:
            _READ.pop(next(iter(_READ)))
        _READ[cache_key] = trace
    return _READ[cache_key]


def _content_hash(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open_file(path, MAX_TABLE_FILE_BYTES) as file:    # a device or an oversized file: refused unread
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_READ: dict[tuple, Trace] = {}        # parsed traces by file identity and reading options, oldest first
_READ_CACHE_SIZE = 8


def detect_format(path: Path, node: Node, key: str) -> str:
    """The format of ``path``: JSON by its first character, CSV by its header."""
    try:
        with open_file(path, MAX_TABLE_FILE_BYTES) as file:   # a folder, a device: the front door says which
            head = file.read(4096).decode("utf-8", errors="replace").lstrip()
    except OSError as exc:
        raise node.key_error(key, f"cannot read trace {path} ({exc.strerror or exc})", str(path),
                             "a readable file") from None
    if head.startswith("["):
        return "sharegpt"
    if head.startswith("{"):
        # JSON lines: a Mooncake trace, or a dataset of prompts (its first record names which).
        first = head.split("\n", 1)[0]
        return "sharegpt" if any(f'"{key}"' in first for key in DATASET_KEYS) else "mooncake"
    header = {name.strip() for name in head.splitlines()[0].split(",")} if head else set()
    # The format sharing the most columns with the header (its reader names any it lacks).
    matched, fmt = max((len(set(columns) & header), fmt) for fmt, columns in CSV_COLUMNS.items())
    if matched:
        return fmt
    described = "; ".join(f"{fmt}: {', '.join(columns)}" for fmt, columns in CSV_COLUMNS.items())
    raise node.key_error(key, f"cannot tell the format of trace {path} from its columns", str(path),
                         f"format: {', '.join(FORMATS)}; or a CSV with the columns of one ({described}), "
                         f"Mooncake JSON lines ({', '.join(MOONCAKE_FIELDS)}) or a ShareGPT JSON list")


# -- CSV formats ------------------------------------------------------------------------------

def read_csv_trace(path: Path, node: Node, key: str, fmt: str,
                   failed: FailedRequests = FailedRequests.DROP) -> Trace:
    """A CSV trace of format ``fmt``; a production trace's failed requests dropped or replayed (``failed``)."""
    frame = read_csv(path, node, key)
    frame.columns = [str(c).strip() for c in frame.columns]
    arrival_col, prompt_col, output_col = CSV_COLUMNS[fmt]
    missing = [c for c in CSV_COLUMNS[fmt] if c not in frame.columns]
    if missing:
        raise ConfigError(f"lacks column(s) {', '.join(missing)} of the {fmt} trace format", file=str(path),
                          key="line 1",
                          value=list(frame.columns), allowed=f"a CSV with columns {', '.join(CSV_COLUMNS[fmt])}")
    lines = np.arange(len(frame)) + 2          # line 1 is the header
    if fmt == "azure":
        arrival = _azure_seconds(frame[arrival_col], path, arrival_col)
    else:
        arrival = _numbers(frame[arrival_col], path, arrival_col, minimum=0.0, maximum=MAX_ARRIVAL_S)
    production = fmt in PRODUCTION_FORMATS
    # A failed request (0 output tokens) may have logged 0 prompt tokens too; any other needs a prompt.
    output = _numbers(frame[output_col], path, output_col, minimum=0.0 if production else 1.0,
                      maximum=MAX_TRACE_TOKENS, integer=True)
    prompt = _numbers(frame[prompt_col], path, prompt_col, minimum=0.0 if production else 1.0,
                      maximum=MAX_TRACE_TOKENS, integer=True)
    empty_prompt = np.flatnonzero((prompt == 0) & (output > 0))
    if len(empty_prompt):
        row = int(empty_prompt[0])
        raise row_error(path, row + 2, prompt_col, frame[prompt_col].iloc[row],
                        "a whole number of tokens >= 1 (0 only on a failed request, one of 0 output tokens)",
                        "a request that generated tokens needs a prompt")
    _check_sorted(arrival, lines, path, arrival_col)
    labels = {name: frame[column].astype(str).str.strip().to_numpy()
              for name, column in (("model", "Model"), ("log_type", "Log Type"), ("class", "class"))
              if column in frame.columns and (name != "class" or fmt == "llmsim")}
    sessions = None
    if fmt == "llmsim" and "session_id" in frame.columns:
        # Turns of one conversation: each prompt extends the one before (history plus new input).
        ids = _numbers(frame["session_id"], path, "session_id", minimum=0.0, maximum=MAX_NUMBER, integer=True)
        sessions = pd.factorize(ids.astype(np.int64))[0].astype(np.int64)
    trace = Trace(arrival, prompt.astype(np.int64), output.astype(np.int64), model=labels.get("model"),
                  log_type=labels.get("log_type"), description=f"{fmt} trace {path.name}", session_id=sessions,
                  class_label=labels.get("class"))
    return failed_requests(trace, path, failed) if production else trace


def _numbers(column: pd.Series, path: Path, name: str, *, minimum: float, maximum: float,
             integer: bool = False) -> np.ndarray:
    """A numeric column, every value finite, ``minimum``..``maximum`` (and whole if ``integer``)."""
    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(values) | (values < minimum) | (values > maximum)
    if integer:
        bad |= np.isfinite(values) & (values != np.round(values))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        kind = "a whole number of tokens" if integer else "a number of seconds"
        raise row_error(path, row + 2, name, column.iloc[row], f"{kind} >= {minimum:g} and <= {maximum:g}",
                        "not a valid value")
    return values


def _azure_seconds(column: pd.Series, path: Path, name: str) -> np.ndarray:
    """Azure TIMESTAMPs (ISO 8601 date-times, with or without a UTC offset) as seconds from the first."""
    times = pd.to_datetime(column.astype(str), format="ISO8601", utc=True, errors="coerce")
    bad = times.isna().to_numpy()
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise row_error(path, row + 2, name, column.iloc[row], "a date-time such as 2023-11-16 18:15:46.6805900",
                        "not a date-time")
    seconds = (times - times.iloc[0]).dt.total_seconds().to_numpy(dtype=float)
    late = np.flatnonzero(np.abs(seconds) > MAX_ARRIVAL_S)
    if len(late):
        row = int(late[0])
        raise row_error(path, row + 2, name, column.iloc[row], f"within {MAX_ARRIVAL_S:g} s of the first request",
                        "too far from the first request's date-time")
    return seconds


def _check_sorted(arrival: np.ndarray, lines: np.ndarray, path: Path, name: str) -> None:
    earlier = np.flatnonzero(np.diff(arrival) < 0)
    if len(earlier):
        row = int(earlier[0]) + 1
        raise row_error(path, int(lines[row]), name, float(arrival[row]),
                        f"timestamps in arrival order: at least the previous line's {arrival[row - 1]:g}",
                        "earlier than the line before (the trace must be sorted by arrival)")


def failed_requests(trace: Trace, path: Path, failed: FailedRequests) -> Trace:
    """The trace with its failed requests (0 output tokens) dropped or replayed (``failed``: one of
    :class:`~llmsim.config.policies.FailedRequests`, see the module doc), its description counting them."""
    empty = trace.output_tokens == 0
    count = int(empty.sum())
    if not count:
        return trace
    if failed is FailedRequests.REPLAY:
        return replace(trace, prompt_tokens=np.maximum(trace.prompt_tokens, 1),
                       output_tokens=np.where(empty, 1, trace.output_tokens),
                       description=f"{trace.description} ({counted(count, 'failed request')}, logged with 0 output "
                                   "tokens, replayed as a prompt and one output token)")
    if empty.all():
        raise ConfigError(f"every one of its {len(trace):,} requests failed, logged with 0 output tokens: none is "
                          "left to simulate", file=str(path), key="workload.arrival.failed", value=failed,
                          allowed="replay (each failed request served as its prompt and one token), or a trace "
                                  "with requests that generated tokens")
    return trace.take(np.flatnonzero(~empty), f"{trace.description} ({counted(count, 'failed request')}, logged "
                                              "with 0 output tokens, dropped; workload.arrival.failed: replay "
                                              "keeps them)")


# -- Mooncake JSON lines -----------------------------------------------------------------------

def read_mooncake(path: Path, failed: FailedRequests = FailedRequests.DROP) -> Trace:
    """One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Fields are gathered column-wise and checked as arrays; a bad one sends every record through
    the per-record check, which names the first bad line."""
    numbered = _json_lines(read_text(path, MAX_TABLE_FILE_BYTES), path, "one JSON object per line")
    if not numbered:
        raise ConfigError("trace has no requests", file=str(path), has_value=False)
    lines, records = zip(*numbered)
    columns = _mooncake_columns(records)
    if columns is None:
        for record, line in zip(records, lines):
            _check_mooncake_record(record, path, line)
        columns = _mooncake_columns(records)
        assert columns is not None              # every record passed its check: the columns gather
    arrival_s = columns["timestamp"] / MOONCAKE_MS_PER_S
    _check_sorted(arrival_s, np.asarray(lines), path, "timestamp")
    hashes = tuple(tuple(record.get("hash_ids", ())) for record in records)
    trace = Trace(arrival_s, columns["input_length"].astype(np.int64), columns["output_length"].astype(np.int64),
                  hash_ids=hashes, description=f"mooncake trace {path.name}")
    return failed_requests(trace, path, failed)


def _mooncake_columns(records: tuple) -> dict[str, np.ndarray] | None:
    """The fields of every record as float arrays when all are valid, else None."""
    try:
        raw = {field: [record[field] for record in records] for field in MOONCAKE_FIELDS}
        hash_lists = [record.get("hash_ids", []) for record in records]
    except (KeyError, TypeError):               # a record that is no object, or lacks a field
        return None
    # A string or a boolean is no number, though numpy would turn "512" and true into ones.
    if not all(type(v) is int or type(v) is float for column in raw.values() for v in column) \
            or not all(type(ids) is list and all(type(h) is int for h in ids) for ids in hash_lists):
        return None
    try:
        columns = {field: np.array(column, dtype=float) for field, column in raw.items()}
    except OverflowError:                       # an integer of 400 digits
        return None
    lengths = [columns["input_length"], columns["output_length"]]
    valid = all(np.isfinite(values).all() for values in columns.values()) \
        and columns["timestamp"].min() >= 0 and columns["timestamp"].max() <= MAX_ARRIVAL_S * MOONCAKE_MS_PER_S \
        and columns["input_length"].min() >= 1 and columns["output_length"].min() >= 0 \
        and all(values.max() <= MAX_TRACE_TOKENS and (np.round(values) == values).all() for values in lengths)
    return columns if valid else None


def _json_lines(text: str, path: Path, allowed: str) -> list[tuple[int, object]]:
    """(line number, value) of each non-blank line of the JSON-lines ``text`` of ``path``, the count of
    lines bounded before any is parsed; a line that is not JSON is a ConfigError naming it."""
    count = text.count("\n")
    if count > MAX_TABLE_ROWS:
        raise ConfigError(f"has {count:,} lines, more than the {MAX_TABLE_ROWS:,} llmsim reads", file=str(path),
                          has_value=False, allowed=f"at most {MAX_TABLE_ROWS:,} lines")
    _check_containers(text, path)
    numbered = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            numbered.append((line_number, json.loads(line)))
        except (ValueError, RecursionError) as exc:     # ValueError: bad JSON, an integer of 4,300+ digits
            raise row_error(path, line_number, str(getattr(exc, "colno", 1)), line.strip()[:80], allowed,
                            f"not valid JSON ({getattr(exc, 'msg', exc)})") from None
    return numbered


def _check_containers(text: str, path: Path) -> None:
    """Refuse JSON text with more objects and lists than llmsim parses (each '{' or '[' counts,
    inside strings too: an upper bound, found without parsing)."""
    count = text.count("{") + text.count("[")
    if count > MAX_JSON_CONTAINERS:
        raise ConfigError(f"has {count:,} '{{' and '[' characters, more JSON objects and lists than the "
                          f"{MAX_JSON_CONTAINERS:,} llmsim reads", file=str(path), has_value=False,
                          allowed=f"at most {MAX_JSON_CONTAINERS:,} JSON objects and lists")


def _check_mooncake_record(record: object, path: Path, line: int) -> None:
    """One Mooncake record, field by field: a ConfigError naming the line and field of the first fault."""
    if not isinstance(record, dict):
        raise row_error(path, line, "1", record, "one JSON object per line", "not a JSON object")
    for field in MOONCAKE_FIELDS:
        if field not in record:
            raise row_error(path, line, field, None, ", ".join(MOONCAKE_FIELDS) + " (and hash_ids)", "missing field")
    _json_number(record, "timestamp", path, line, 0.0, MAX_ARRIVAL_S * MOONCAKE_MS_PER_S, False)
    _json_number(record, "input_length", path, line, 1.0, MAX_TRACE_TOKENS, True)
    _json_number(record, "output_length", path, line, 0.0, MAX_TRACE_TOKENS, True)
    _hash_ids(record.get("hash_ids", []), path, line)


def _json_number(record: dict, field: str, path: Path, line: int, minimum: float, maximum: float,
                 integer: bool) -> None:
    value = record[field]
    # Compared before any float conversion: a JSON integer of 400 digits would overflow it.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and minimum <= value <= maximum \
        and math.isfinite(value) and (not integer or float(value).is_integer())
    if not ok:
        kind = "a whole number of tokens" if integer else "a number of milliseconds"
        raise row_error(path, line, field, value, f"{kind} >= {minimum:g} and <= {maximum:g}", "not a valid value")


def _hash_ids(value: object, path: Path, line: int) -> None:
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise row_error(path, line, "hash_ids", value, "a list of integers (one per prompt block)", "not valid")


# -- ShareGPT / vLLM benchmark datasets -----------------------------------------------------------

def read_sharegpt(path: Path, node: Node, tokenizer: Path | None, chars_per_token: float | None) -> Trace:
    """Prompt and output lengths of a dataset in any of the shapes of the module docstring (a JSON
    list, or one JSON object a line), as ``vllm bench serve`` takes them.

    The arrival times are all 0: a dataset has none, the workload's arrival process sets them.
    """
    count = _token_counter(node, tokenizer, chars_per_token)
    prompts, replies, counted, kept = [], [], [], []  # counted: output lengths given as numbers, else None
    for where, entry in _dataset_entries(path):
        pair = _prompt_and_reply(entry, where, path)
        if pair is None:
            continue                      # too few turns: vLLM's benchmark skips these too
        kept.append(where)
        prompts.append(pair[0])
        replies.append(pair[1] if isinstance(pair[1], str) else "")
        counted.append(None if isinstance(pair[1], str) else pair[1])
    if not prompts:
        raise ConfigError("no entry with a prompt and a reply", file=str(path), has_value=False,
                          allowed=DATASET_SHAPES)
    prompt_tokens = np.maximum(count(prompts), 1)
    output_tokens = np.maximum(count(replies), 1)
    given = np.array([c is not None for c in counted])
    if given.any():
        output_tokens[given] = [c for c in counted if c is not None]
    for what, tokens in (("prompt", prompt_tokens), ("reply", output_tokens)):
        over = np.flatnonzero(tokens > MAX_TRACE_TOKENS)
        if len(over):
            raise ConfigError(f"a {what} of {int(tokens[over[0]]):,} tokens", file=str(path), key=kept[over[0]],
                              value=f"{len((prompts if what == 'prompt' else replies)[over[0]]):,} characters",
                              allowed=f"at most {MAX_TRACE_TOKENS:,} tokens a {what}")
    how = f"tokenizer {tokenizer.name}" if tokenizer is not None else f"{chars_per_token:g} characters per token"
    return Trace(np.zeros(len(prompts)), prompt_tokens, output_tokens.astype(np.int64),
                 description=f"sharegpt dataset {path.name} (lengths by {how})")


def _dataset_entries(path: Path):
    """(where, entry) of a JSON list (``entry i``) or of JSON lines (``line n``)."""
    text = read_text(path, MAX_TABLE_FILE_BYTES)
    if text.lstrip().startswith("["):
        _check_containers(text, path)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:     # ValueError: bad JSON, an integer of 4,300+ digits
            line, column = getattr(exc, "lineno", 1), getattr(exc, "colno", 1)
            raise row_error(path, line, str(column), None, "a JSON list of dataset entries: " + DATASET_SHAPES,
                            f"not valid JSON ({exc})") from None
        yield from ((f"entry {index}", entry) for index, entry in enumerate(data))
        return
    yield from ((f"line {number}", entry) for number, entry in _json_lines(text, path, "one JSON object per line: "
                                                                                 + DATASET_SHAPES))


def _prompt_and_reply(entry: object, where: str, path: Path) -> tuple[str, str | int] | None:
    """An entry's prompt text and its reply (text, or an output token count); None to skip it."""
    def bad(key: str, value: object, message: str, allowed: str) -> ConfigError:
        return ConfigError(message, file=str(path), key=f"{where}{key}", value=value, allowed=allowed)

    if not isinstance(entry, dict) or not any(key in entry for key in DATASET_KEYS):
        raise bad("", list(entry) if isinstance(entry, dict) else entry, "an entry of none of the dataset shapes",
                  DATASET_SHAPES)
    if "conversations" in entry or "messages" in entry:
        key, text_key = ("conversations", "value") if "conversations" in entry else ("messages", "content")
        turns = entry[key]
        if not isinstance(turns, list):
            raise bad(f", {key}", turns, f"{key} is not a list", "a list of turns")
        if key == "messages":         # the first user message and the reply after it
            roles = [turn.get("role") if isinstance(turn, dict) else None for turn in turns]
            first = next((i for i, role in enumerate(roles) if role == "user"), None)
            if first is None or first + 1 >= len(turns) or roles[first + 1] != "assistant":
                return None
        else:
            first = 0
            if len(turns) < 2:
                return None
        pair = []
        for turn in (first, first + 1):
            text = turns[turn].get(text_key) if isinstance(turns[turn], dict) else None
            if not isinstance(text, str):
                raise bad(f", {key}[{turn}].{text_key}", text, "a turn without a text", "a string")
            pair.append(text)
        return pair[0], pair[1]
    prompt = entry["prompt"]
    if not isinstance(prompt, str):
        raise bad(", prompt", prompt, "a prompt that is not text", "a string")
    if isinstance(entry.get("completion"), str):
        return prompt, entry["completion"]
    tokens = entry.get("output_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TRACE_TOKENS:
        raise bad(", output_tokens" if "output_tokens" in entry else ", completion",
                  tokens if "output_tokens" in entry else entry.get("completion"),
                  "a prompt needs its reply: completion text or an output_tokens count",
                  f"completion: a string, or output_tokens: an integer 1..{MAX_TRACE_TOKENS:,}")
    return prompt, tokens


def _token_counter(node: Node, tokenizer: Path | None, chars_per_token: float | None):
    """Texts -> token counts: a user's tokenizer.json, or characters / chars_per_token rounded up."""
    if (tokenizer is None) == (chars_per_token is None):
        raise node.error("say how to count a dataset's tokens", key=node.key_path("tokenizer"), has_value=False,
                         allowed="tokenizer: PATH to a Hugging Face tokenizer.json, or chars_per_token: N "
                                 "(about 4 for English text with Llama-style tokenizers; an approximation)")
    if chars_per_token is not None:
        return lambda texts: np.ceil(np.fromiter(map(len, texts), float, len(texts)) / chars_per_token) \
            .astype(np.int64)
    assert tokenizer is not None            # exactly one of the two is given (checked above)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise node.key_error("tokenizer", "counting tokens with a tokenizer needs the tokenizers package",
                             str(tokenizer), "pip install 'llmsim[datasets]', or chars_per_token: N") from None
    text = read_text(tokenizer, MAX_TOKENIZER_FILE_BYTES)     # a device or an oversized file: refused unread
    try:
        loaded = Tokenizer.from_str(text)
    except Exception as exc:        # the Rust library raises its own exception type
        raise node.key_error("tokenizer", f"cannot read tokenizer ({exc})", str(tokenizer),
                             "a Hugging Face tokenizer.json") from None
    return lambda texts: np.asarray([len(e.ids) for e in loaded.encode_batch(texts, add_special_tokens=True)],
                                    dtype=np.int64)
