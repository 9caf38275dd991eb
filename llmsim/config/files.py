"""Files written so that a link never redirects them: every command's and journal's writes go here.

A link planted in an output folder (under a temporary file's name, a lock's, or a result's) must
not make llmsim write into the file it points to, outside the folder:

- a temporary file is a new file under an unpredictable name, created exclusively
  (:func:`create_exclusive`: O_EXCL, O_NOFOLLOW), never an existing file or link;
- a file under a fixed name that is written in place (a lock, a journal appended to) is opened
  without following a link (:func:`open_no_follow`), and a link there is refused (exit 2);
- a final name is replaced only by a rename (:func:`write_file`), which replaces a link itself,
  never the file it points to.
"""
from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from collections.abc import Callable

from llmsim.errors import ConfigError


def create_exclusive(folder: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new empty file ``folder/<prefix><random><suffix>``, open for writing: created by this call
    (O_EXCL, O_NOFOLLOW), so never an existing file or a link someone planted. Like
    ``tempfile.mkstemp``, but with the permissions the umask gives (mkstemp's 0600 would make
    every result private once renamed into place)."""
    for _ in range(100):
        path = Path(folder) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {folder}")


def open_no_follow(path: Path, flags: int, key: str = "out") -> int:
    """``os.open`` of a file under a fixed name (a lock, a journal appended to), refusing a link
    there (ConfigError, exit 2) instead of writing into whatever it points to."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{path.name} is a symbolic link; llmsim writes only files it made itself in its output "
                          "folder, and never through a link", key=key, value=str(path),
                          allowed="remove the link, or choose another folder") from None


def write_file(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(temporary)``, then the temporary file renamed to ``path``. The temporary file is
    made by :func:`create_exclusive` in the same folder with the same suffix (so a writer that
    reads the format from the suffix still can); a link under ``path`` is replaced, not followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial: Path | None = None
    try:        # a Ctrl-C from the moment the temporary file exists leaves nothing behind
        descriptor, partial = create_exclusive(path.parent, f".{path.stem}.", f".partial{path.suffix}")
        os.close(descriptor)
        write(partial)
        os.replace(partial, path)
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
    return path
