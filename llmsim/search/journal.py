"""A sweep's journal: ``results.csv``, one complete line per finished point.

Each line is written with a single call and flushed, so an interrupted sweep leaves at most
a torn last line, which has no newline and is dropped on reading; running the sweep again
with the same folder skips the points already recorded.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd


class Journal:
    """``results.csv``, appended one complete line per finished point.

    A point with columns the header lacks rewrites the file with the wider header.
    """

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] = []
        self.records: list[dict] = []
        if path.exists():
            text = path.read_text()
            torn = not text.endswith("\n")
            if torn:
                text = text[:text.rfind("\n") + 1]
            reader = csv.DictReader(io.StringIO(text))
            self.columns = list(reader.fieldnames or [])
            self.records = list(reader)
            if torn:                    # drop the torn line, so appends start on a fresh one
                self._rewrite()

    def finished(self) -> set[str]:
        return {r["point_id"] for r in self.records if not r.get("error")}

    def append(self, row: dict) -> None:
        record = {key: cell(value) for key, value in row.items()}
        self.records.append(record)
        if any(key not in self.columns for key in record):
            self.columns += [key for key in record if key not in self.columns]
            self._rewrite()
            return
        with self.path.open("a", newline="") as handle:
            handle.write(self._line(record))
            handle.flush()
            os.fsync(handle.fileno())

    def read(self, order: list[str]) -> pd.DataFrame:
        """The rows of these points, the last record of each, in this order."""
        frame = pd.read_csv(self.path, dtype={"error": object})
        frame["error"] = frame["error"].fillna("")
        frame = frame.drop_duplicates("point_id", keep="last").set_index("point_id", drop=False)
        return frame.loc[[p for p in order if p in frame.index]].reset_index(drop=True)

    def _line(self, record: dict) -> str:
        buffer = io.StringIO()
        csv.DictWriter(buffer, self.columns, lineterminator="\n").writerow(record)
        return buffer.getvalue()

    def _rewrite(self) -> None:
        if not self.columns:
            return
        temporary = self.path.with_suffix(".csv.tmp")
        with temporary.open("w", newline="") as handle:
            csv.DictWriter(handle, self.columns, lineterminator="\n").writeheader()
            handle.writelines(self._line(record) for record in self.records)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)


def cell(value) -> Any:
    """A CSV cell: mappings, lists and None as JSON (``null``), text on one line."""
    if isinstance(value, (dict, list, tuple)) or value is None:
        return json.dumps(value, default=str)
    if isinstance(value, str):
        return value.replace("\n", " ")
    return value
