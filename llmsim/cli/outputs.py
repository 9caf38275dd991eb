"""Where the commands write: only where the user said, never over results without being told.

- A folder or file comes from ``--out``; without it, a default under ``runs/`` in the current
  folder, to which a scenario's ``name`` adds at most one folder name (:func:`folder_name`).
- A command refuses, before doing any work, to replace files that already exist unless given
  ``--overwrite`` (:func:`refuse_to_replace`): exit 2 naming them.
- Each file is written under a temporary name in its own folder and renamed when complete
  (:func:`write_file`), so a crash or Ctrl-C never leaves half a file under the final name.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterable

from llmsim.errors import ConfigError

RUNS = Path("runs")
OVERWRITE_HELP = "replace results already there (without it the command stops with exit 2, before running)"
_UNSAFE = re.compile(r"[^\w.-]+")       # anything but letters, digits, '_', '.' and '-'
_LONGEST = 100


def folder_name(name: str, key: str, file: str | None = None) -> str:
    """``name`` as one folder name: every run of other characters than letters, digits, '_', '.'
    and '-' (path separators, spaces) becomes '-', leading and trailing dots and dashes go (so
    never '..'), at most 100 characters. Nothing left (an empty name, '/', '..'): ConfigError."""
    leaf = _UNSAFE.sub("-", name).strip(".-")[:_LONGEST].rstrip(".-")
    if not leaf:
        raise ConfigError("cannot name an output folder (nothing is left once path separators, dots and "
                          "spaces are taken out)", file=file, key=key, value=name,
                          allowed="a name with a letter or digit, or --out FOLDER")
    return leaf


def refuse_to_replace(paths: Iterable[Path], overwrite: bool) -> None:
    """Stop (ConfigError, exit 2) if any of ``paths`` exists, unless ``overwrite``, or if a folder
    they go into is a file."""
    paths = list(paths)
    for folder in {path.parent for path in paths}:
        if folder.exists() and not folder.is_dir():
            raise ConfigError("is a file, not a folder", key="--out", value=str(folder), allowed="a folder")
    existing = [str(path) for path in paths if path.exists()]
    if existing and not overwrite:
        raise ConfigError(f"would replace existing results: {', '.join(existing)}", key="--out",
                          value=str(Path(existing[0]).parent if len(existing) > 1 else existing[0]),
                          allowed="--overwrite to replace them, or another --out")


def write_file(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(temporary)``, then the temporary file renamed to ``path`` (same folder, same suffix,
    so a writer that reads the format from the suffix still can)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
