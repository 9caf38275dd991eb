"""Where the commands write: only where the user said, never over results without being told.

- A folder or file comes from ``--out``; without it, a default under ``runs/`` in the current
  folder, to which a scenario's ``name`` adds at most one folder name (:func:`folder_name`).
- A command refuses, before doing any work, to replace files that already exist unless given
  ``--overwrite`` (:func:`refuse_to_replace`): exit 2 naming them.
- Each file is written under a temporary name in its own folder and renamed when complete
  (:func:`~llmsim.config.files.write_file`), so a crash or Ctrl-C never leaves half a file under
  the final name.
- A link planted in the output folder is never written through (:mod:`llmsim.config.files`, whose
  :func:`~llmsim.config.files.write_file` every command writes with).
- A command that simulates many runs before it writes anything (``report``, ``recommend``) keeps
  each run as it finishes in a journal beside its output (:func:`keeping_runs`): Ctrl-C (exit
  130) or a failed write (exit 1, a full disk) loses nothing, and the same command resumes.
"""
from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterable, Iterator

from llmsim.config.files import write_file  # noqa: F401  (the commands' one writer, imported from here)
from llmsim.errors import ConfigError, Stopped
from llmsim.search.journal import discard
from llmsim.search.sweeps import reusing_runs

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
    if "\0" in str(folder):            # pathlib's exists() says False to it; mkdir raises
        raise ConfigError("cannot be a folder here (embedded null byte)", key=key, value=str(folder),
                          allowed="a path of a folder you can write to")
    try:
        existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    except (OSError, ValueError) as error:      # a name too long, a loop of links, a NUL character
        raise ConfigError(f"cannot be a folder here ({getattr(error, 'strerror', None) or error})", key=key,
                          value=str(folder), allowed="a path of a folder you can write to") from None
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


@contextmanager
def keeping_runs(journal: Path | None, what: str) -> Iterator[None]:
    """Inside this block every simulation finished is kept in ``journal`` as it finishes and those
    already there are reused (:func:`llmsim.search.sweeps.reusing_runs`); the journal is removed
    when the block ends normally (its work is written). Ctrl-C: :class:`Stopped` (130), a write that
    fails (a full disk): :class:`Stopped` (1), each saying what is kept. ``journal`` None: nothing
    is kept, and the message says how to keep it."""
    kept = (f"the simulations finished are kept in {journal}, and the same command resumes the {what}"
            if journal is not None else "nothing is kept (give --out to keep finished simulations and resume)")
    try:
        with reusing_runs(journal):
            yield
    except KeyboardInterrupt:
        raise Stopped(130, f"interrupted: {kept}") from None
    except OSError as error:
        raise Stopped(1, f"the {what} stopped: cannot write {error.filename or journal} "
                         f"({error.strerror or error}); {kept} once the cause is fixed") from None
    if journal is not None:
        discard(journal)
