"""The front door for tables of numbers (CSV traces and any other reader of rows).

:func:`read_csv_text` reads a CSV through :func:`~llmsim.config.reader.read_text` (size cap,
UTF-8, no folders or devices) and :func:`checked_numbers` turns one column into a numpy array
only when every value is a finite number within the documented range, naming the first bad
row otherwise. A reader calls both, so a trace with an infinite arrival time or a 10**30 token
count is refused in a clear paragraph instead of being simulated.
"""
from __future__ import annotations

import io
from pathlib import Path
from collections.abc import Callable

import numpy as np
import pandas as pd

from llmsim.config.limits import MAX_TABLE_FILE_BYTES, MAX_TABLE_ROWS
from llmsim.config.reader import range_text, read_text
from llmsim.errors import ConfigError

# fail(message, value, allowed) -> the error to raise, naming the file and key of the caller.
Fail = Callable[[str, object, str], ConfigError]


def read_csv_text(path: str | Path, fail: Fail, max_bytes: int = MAX_TABLE_FILE_BYTES) -> pd.DataFrame:
    """A CSV file with a header and at least one data row, every cell read as text."""
    text = read_text(path, max_bytes)
    lines = text.count("\n")
    if lines > MAX_TABLE_ROWS:
        raise fail(f"CSV {path} has {lines:,} lines, more than the {MAX_TABLE_ROWS:,} rows llmsim reads", str(path),
                   f"a CSV file of at most {MAX_TABLE_ROWS:,} rows")
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as exc:
        raise fail(f"cannot read CSV {path}: {str(exc).strip()}", str(path), "a CSV file with a header row") from None
    if frame.empty:
        raise fail(f"CSV {path} has no rows", str(path), "a CSV file with at least one data row")
    return frame


def checked_numbers(values, what: str, fail: Fail, *, minimum: float, maximum: float,
                    integer: bool = False, exclusive_minimum: bool = False) -> np.ndarray:
    """``values`` (text or numbers) as float64, or int64 when ``integer``; the first that is not a
    finite number within ``minimum``..``maximum`` (or not whole, when ``integer``) is a ConfigError
    naming ``what`` ('column arrival_s') and its data row (1 = the first after the header)."""
    raw = pd.Series(values)
    numbers = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)
    low = numbers <= minimum if exclusive_minimum else numbers < minimum
    bad = ~np.isfinite(numbers) | low | (numbers > maximum)
    if integer:
        bad |= np.isfinite(numbers) & (numbers != np.floor(numbers))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        kind = "an integer" if integer else "a number"
        raise fail(f"{what}, data row {row + 1}: not a valid value", raw.iloc[row],
                   range_text(kind, minimum, maximum, exclusive_minimum))
    return numbers.astype(np.int64) if integer else numbers
