"""A sweep's journal: ``results.csv``, one verifiable line per finished point, under a lock (also
the journal of the runs a report or recommendation has simulated: :func:`llmsim.search.sweeps.reusing_runs`).

Every line ends with a ``checksum`` cell: the first 16 hex digits of a SHA-256 over the
header's column names and the line's other cells. On opening, each line is parsed on its own
(a cell never holds a newline, so a line is a record) and kept only if its checksum matches;
a line that does not (torn by a crash, edited, flipped by the disk, a header that no longer
fits, a journal written before checksums) is dropped with a warning and the file rewritten
without it (to a new temporary file, then renamed over it), so its point is simulated again. A
finished point is appended as one ``write`` on a file opened for appending and synced; a crash
mid-write leaves a torn last line, which the next opening drops like any other.

One sweep at a time per folder: :func:`Journal.open` takes an exclusive ``flock`` on
``results.csv.lock`` next to the journal and writes its pid there; a second sweep on the same
folder does not wait but stops at once with a :class:`~llmsim.errors.ConfigError` (exit 2)
naming the holder's pid. The kernel releases the lock when its holder exits, however it exits.

No file is written through a link: the lock and the journal are opened without following one (a
link under either name is exit 2), and the rewrite's temporary file is made exclusively
(:func:`llmsim.config.files.create_exclusive`).
"""
from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from llmsim.config.files import create_exclusive, open_no_follow
from llmsim.errors import ConfigError

CHECKSUM = "checksum"


class Journal:
    """``results.csv`` of one folder, held under its lock from :func:`open` to :func:`close`.

    ``records`` are the verified rows (column -> cell text, without the checksum), in file order.
    A point with columns the header lacks rewrites the file with the wider header.
    """

    def __init__(self, path: Path, lock_fd: int):
        self.path = path
        self._lock_fd: int | None = lock_fd
        self.columns: list[str] = []
        self.records: list[dict[str, str]] = []
        self.dropped = 0
        try:
            descriptor = open_no_follow(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        with os.fdopen(descriptor, "rb") as handle:
            self._load(handle.read().decode("utf-8", errors="replace"))

    @classmethod
    def open(cls, path: Path) -> Journal:
        """Lock the folder of ``path`` for this process, then read the journal's verified rows."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(path, _lock(path.with_name(path.name + ".lock")))

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)     # also for copies of the descriptor in forked workers
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finished(self) -> set[str]:
        return {r["point_id"] for r in self.records if "point_id" in r and not r.get("error")}

    def append(self, row: dict) -> None:
        record = {key: cell_text(value) for key, value in row.items()}
        self.records.append(record)
        if any(key not in self.columns for key in record):
            self.columns = ([c for c in self.columns if c != CHECKSUM]
                            + [key for key in record if key not in self.columns])
            self._rewrite()
            return
        descriptor = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(descriptor, self._line(record).encode())
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def read(self, order: list[str]) -> pd.DataFrame:
        """The rows of these points, the last record of each, in this order (no checksum column)."""
        if not self.records:
            return pd.DataFrame(columns=["point_id", "seed", "error"])
        frame = pd.read_csv(self.path, dtype={"error": object}).drop(columns=CHECKSUM)
        frame["error"] = frame["error"].fillna("")
        frame = frame.drop_duplicates("point_id", keep="last").set_index("point_id", drop=False)
        return frame.loc[[p for p in order if p in frame.index]].reset_index(drop=True)

    def _load(self, text: str) -> None:
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()                 # the newline that ends the last complete line
        header = _parse(lines[0]) if lines else None
        if header is None or CHECKSUM not in header or len(set(header)) != len(header):
            self.dropped = len(lines)   # nothing in the file can be verified
        else:
            self.columns = header
            for line in lines[1:]:
                cells = _parse(line)
                record = dict(zip(header, cells)) if cells is not None and len(cells) == len(header) else None
                if record is not None and record.pop(CHECKSUM) == checksum(header, record):
                    self.records.append(record)
                else:
                    self.dropped += 1
        if self.dropped:
            warnings.warn(f"{self.path}: {self.dropped} line(s) failed their checksum (torn, edited or corrupt); "
                          "dropped, and their points will be simulated again", stacklevel=4)
            self._rewrite()

    def _line(self, record: dict[str, str]) -> str:
        named = {column: record.get(column, "") for column in self.columns if column != CHECKSUM}
        row = [named[c] if c != CHECKSUM else checksum(self.columns, named) for c in self.columns]
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(row)
        return buffer.getvalue()

    def _rewrite(self) -> None:
        """The whole journal, written to a temporary file and renamed over it (never half a file)."""
        if not self.records:
            self.columns = []
            self.path.unlink(missing_ok=True)
            return
        if CHECKSUM not in self.columns:
            self.columns = self.columns + [CHECKSUM]
        descriptor, temporary = create_exclusive(self.path.parent, f".{self.path.name}.", ".tmp")
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(self.columns)
        try:
            with os.fdopen(descriptor, "w", newline="") as handle:
                handle.write(buffer.getvalue())
                handle.writelines(self._line(record) for record in self.records)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        finally:
            temporary.unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Remove a journal whose work is done, and its lock file."""
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".lock").unlink(missing_ok=True)


def checksum(columns: list[str], record: dict[str, str]) -> str:
    """16 hex digits of SHA-256 over the column names and the cells of one row (checksum excluded)."""
    pairs = [[column, record.get(column, "")] for column in columns if column != CHECKSUM]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


def cell(value) -> Any:
    """A CSV cell: mappings, lists and None as JSON (``null``), text on one line."""
    if isinstance(value, (dict, list, tuple)) or value is None:
        return json.dumps(value, default=str)
    if isinstance(value, str):
        return value.replace("\n", " ").replace("\r", " ")
    return value


def cell_text(value) -> str:
    """A cell as the text written to the file: what the csv module writes (floats by ``repr``)."""
    value = cell(value)
    if isinstance(value, float):
        return float.__repr__(value)
    return value if isinstance(value, str) else str(value)


def _parse(line: str) -> list[str] | None:
    """One line's cells, or None if it is not one well-formed CSV record."""
    try:
        rows = list(csv.reader([line], strict=True))
    except csv.Error:
        return None
    return rows[0] if len(rows) == 1 else None


def _lock(path: Path) -> int:
    """An exclusive lock on ``path`` for this process, its pid written in it; held by another: ConfigError."""
    descriptor = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(descriptor)
        os.close(descriptor)
        raise ConfigError(f"another sweep, report or recommendation (pid {holder}) is writing to this folder; "
                          "wait for it to finish or choose another folder", key="out", value=str(path.parent),
                          allowed="a folder no running command uses") from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor


def _holder(descriptor: int) -> str:
    """The pid the lock's holder wrote (it writes it just after locking: wait a moment for it)."""
    for _ in range(20):
        text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "unknown"
