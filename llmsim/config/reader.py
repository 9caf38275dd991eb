"""Reading YAML into typed settings, once, at the edge.

``Node`` wraps one mapping from a YAML file and hands out its values by key,
each parsed and checked as it is taken. ``Node.done()`` then rejects any key
that nobody asked for, suggesting the closest valid one. Every error is a
:class:`~llmsim.errors.ConfigError` naming the file, the key path, the value
and what is allowed.
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from llmsim.errors import ConfigError
from llmsim.config.units import UnitError, parse_quantity

_MISSING = object()


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file with ``yaml.safe_load``; unreadable or malformed files are ConfigErrors."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path), has_value=False) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file ({exc.strerror})", file=str(path), has_value=False) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {getattr(exc, 'problem', exc)}",
                          file=str(path), has_value=False) from None


class Node:
    """One mapping of a configuration file, read key by key."""

    def __init__(self, data: Any, *, file: str | None = None, path: str = "",
                 base_dir: Path | None = None):
        self.file = file
        self.path = path
        self.base_dir = base_dir if base_dir is not None else (Path(file).parent if file else Path.cwd())
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise self.error("expected a mapping of keys to values", value=data,
                             key=path or None, allowed="a YAML mapping (key: value lines)")
        self.data = data
        self._used: set[str] = set()

    # -- errors -------------------------------------------------------------------------
    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, message: str, *, value: object = None, key: str | None = None,
              allowed: str | None = None, has_value: bool = True) -> ConfigError:
        return ConfigError(message, file=self.file, key=key, value=value, allowed=allowed,
                           has_value=has_value)

    def key_error(self, key: str, message: str, value: object, allowed: str | None = None) -> ConfigError:
        return self.error(message, value=value, key=self.key_path(key), allowed=allowed)

    # -- access ---------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self._used.add(key)
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                typo = _closest(key, [str(k) for k in self.data if k != key])
                message = "required key is missing" + (f"; did you mean '{key}' instead of '{typo}'?"
                                                       if typo else "")
                raise self.error(message, key=self.key_path(key), has_value=False)
            return default
        return self.data[key]

    def child(self, key: str, default: Any = _MISSING) -> "Node":
        value = self.raw(key, {} if default is _MISSING else default)
        return Node(value, file=self.file, path=self.key_path(key), base_dir=self.base_dir)

    def number(self, key: str, default: Any = _MISSING, *, integer: bool = False,
               minimum: float | None = None, maximum: float | None = None,
               exclusive_minimum: bool = False) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (integer and not float(value).is_integer()) or not math.isfinite(value):
            raise self.key_error(key, f"expected {kind}", value, self._range_text(kind, minimum, maximum, exclusive_minimum))
        self._check_range(key, value, kind, minimum, maximum, exclusive_minimum)
        return int(value) if integer else float(value)

    def quantity(self, key: str, kind: str, default: Any = _MISSING, *, minimum: float | None = 0.0,
                 exclusive_minimum: bool = True, maximum: float | None = None) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        try:
            result = parse_quantity(value, kind)
        except UnitError as exc:
            raise self.key_error(key, f"cannot read this as a {kind}", value, exc.allowed) from None
        self._check_range(key, result, kind, minimum, maximum, exclusive_minimum, shown=value)
        return result

    def string(self, key: str, default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            raise self.key_error(key, "expected a string", value)
        return value

    def choice(self, key: str, options: Sequence[str], default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if value not in options:
            hint = _closest(str(value), options)
            message = "unknown value" + (f"; did you mean '{hint}'?" if hint else "")
            raise self.key_error(key, message, value, ", ".join(options))
        return value

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.key_error(key, "expected true or false", value, "true, false")
        return value

    def path_value(self, key: str, default: Any = _MISSING, *, must_exist: bool = True) -> Any:
        value = self.string(key, default)
        if value is default and default is not _MISSING:
            return value
        path = Path(value)
        if not path.is_absolute():
            path = self.base_dir / path
        if must_exist and not path.exists():
            raise self.key_error(key, f"file not found (looked for {path})", value,
                                 "a path relative to the scenario file, or absolute")
        return path

    # -- completion -----------------------------------------------------------------------
    def unread(self) -> list:
        """The keys nobody has read yet (what :meth:`done` would refuse)."""
        return [key for key in self.data if key not in self._used]

    def done(self, extra_allowed: Iterable[str] = ()) -> None:
        """Reject keys that were never read: they are typos or settings llmsim does not have."""
        valid = sorted(self._used | set(extra_allowed))
        for key in self.data:
            if key not in self._used and key not in extra_allowed:
                hint = _closest(str(key), valid)
                message = "unknown key" + (f"; did you mean '{hint}'?" if hint else "")
                raise self.key_error(str(key), message, self.data[key],
                                     "keys " + ", ".join(valid) if valid else "no keys here")

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _range_text(kind: str, minimum, maximum, exclusive_minimum) -> str:
        parts = [kind]
        if minimum is not None:
            parts.append(("> " if exclusive_minimum else ">= ") + f"{minimum:g}")
        if maximum is not None:
            parts.append(f"<= {maximum:g}")
        return " ".join(parts)

    def _check_range(self, key, value, kind, minimum, maximum, exclusive_minimum, shown=None):
        low_bad = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
        high_bad = maximum is not None and value > maximum
        if low_bad or high_bad:
            raise self.key_error(key, "value out of range", value if shown is None else shown,
                                 self._range_text(kind, minimum, maximum, exclusive_minimum))


def _closest(word: str, options: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return matches[0] if matches else None



def deep_merge(base: dict, overrides: dict, replace_keys: Iterable[str] = ()) -> dict:
    """``base`` with ``overrides`` laid over it, mapping into mapping; keys in ``replace_keys`` are
    replaced whole (a new length distribution replaces the old one rather than mixing with it)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in replace_keys:
            out[key] = deep_merge(out[key], value, replace_keys)
        else:
            out[key] = value
    return out
