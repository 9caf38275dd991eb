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
import tempfile
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
    they go into cannot be written (:func:`check_writable_folder`)."""
    paths = list(paths)
    for folder in {path.parent for path in paths}:
        check_writable_folder(folder)
    existing = [str(path) for path in paths if path.exists()]
    if existing and not overwrite:
        raise ConfigError(f"would replace existing results: {', '.join(existing)}", key="--out",
                          value=str(Path(existing[0]).parent if len(existing) > 1 else existing[0]),
                          allowed="--overwrite to replace them, or another --out")


def check_writable_folder(folder: Path, key: str = "--out") -> None:
    """Stop (ConfigError, exit 2), before any work, if ``folder`` or the nearest of its parents that
    exists is a file, or cannot be written to: the results would be lost at the end of the run."""
    folder = Path(folder)
    try:
        existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    except OSError as error:            # a name longer than the file system allows, a loop of links
        raise ConfigError(f"cannot be a folder here ({error.strerror or error})", key=key, value=str(folder),
                          allowed="a shorter path of a folder you can write to") from None
    if existing is None:                # a relative path whose parents do not exist yet: the cwd
        existing = Path.cwd()
    longest = os.pathconf(existing, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    too_long = [part for part in folder.parts if len(os.fsencode(part)) > longest]
    if too_long:
        raise ConfigError(f"a folder name is longer than the {longest} bytes the file system allows", key=key,
                          value=str(folder), allowed="a shorter path of a folder you can write to")
    if not existing.is_dir():
        raise ConfigError("is a file, not a folder" if existing == folder else f"{existing} is a file, not a folder",
                          key=key, value=str(folder), allowed="a folder, or a path under one")
    try:        # a file made and removed: permissions, a read-only disk, /proc, whatever the user is
        descriptor, probe = tempfile.mkstemp(prefix=".llmsim-probe-", dir=existing)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"cannot write into {existing} ({error.strerror or error})", key=key, value=str(folder),
                          allowed="a folder you can write to") from None


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
