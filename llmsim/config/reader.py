"""Reading YAML into typed settings, once, at the edge.

``Node`` wraps one mapping from a YAML file and hands out its values by key,
each parsed and checked as it is taken. ``Node.done()`` then rejects any key
that nobody asked for, suggesting the closest valid one. Every error is a
:class:`~llmsim.errors.ConfigError` naming the file, the key path, the value
and what is allowed.
"""
from __future__ import annotations

import codecs
import difflib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, TypedDict
from collections.abc import Iterable, Sequence

import yaml

from llmsim.errors import ConfigError
from llmsim.config.limits import (MAX_CONFIG_FILE_BYTES, MAX_JSON_DEPTH, MAX_NUMBER, MAX_QUANTITY,
                                  MAX_YAML_ALIASES, MAX_YAML_DEPTH, MAX_YAML_NODES)
from llmsim.config.units import UnitError, parse_quantity

_MISSING = object()
# 1e-3, which YAML 1.2 reads as a number and PyYAML (YAML 1.1) as a string
_EXPONENT_WITHOUT_POINT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


class Range(TypedDict, total=False):
    """Bounds of :meth:`Node.quantity` (and :meth:`Node.number`), passed as ``**bounds`` when several keys
    share them."""
    minimum: float | None
    maximum: float | None
    exclusive_minimum: bool


class NumberRange(Range, total=False):
    """Bounds of :meth:`Node.number`: a :class:`Range`, and whether the number must be a whole one."""
    integer: bool


def open_file(path: str | Path, max_bytes: int):
    """``path`` opened for reading in binary, once it is known to be a regular file of at most
    ``max_bytes``: a folder, a FIFO, a device (``/dev/zero``), a socket or a larger file is a
    ConfigError naming the file, before a byte is read. Opened without blocking (a FIFO with no
    writer would wait forever) and checked on the opened file, so a name swapped between check
    and open cannot slip past."""
    name = str(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError("file not found", file=name, has_value=False) from None
    except IsADirectoryError:
        raise ConfigError("is a folder, not a file", file=name, has_value=False, allowed="a file") from None
    except (OSError, ValueError) as exc:          # ValueError: a NUL character in the path
        raise ConfigError(f"cannot read file ({getattr(exc, 'strerror', None) or exc})", file=name,
                          has_value=False) from None
    try:
        info = os.fstat(descriptor)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError("is a folder, not a file", file=name, has_value=False, allowed="a file")
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("is not a regular file (a device, FIFO or socket)", file=name, has_value=False,
                              allowed="a regular file")
        if info.st_size > max_bytes:
            raise _too_large(name, max_bytes)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _too_large(name: str, max_bytes: int) -> ConfigError:
    return ConfigError(f"larger than the {max_bytes / 2**20:g} MiB llmsim reads from a file of this kind",
                       file=name, has_value=False, allowed=f"a file of at most {max_bytes / 2**20:g} MiB")


def read_text(path: str | Path, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> str:
    """The UTF-8 text of a file, the one way llmsim reads its inputs: a folder, a device or FIFO, a
    file over ``max_bytes`` (:func:`open_file`: nothing is read), binary data or another encoding
    (Latin-1, UTF-16) is a ConfigError naming the file. A UTF-8 byte-order mark is allowed and
    dropped."""
    name = str(path)
    with open_file(path, max_bytes) as handle:
        try:
            data = handle.read(max_bytes + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read file ({exc.strerror or exc})", file=name, has_value=False) from None
    if len(data) > max_bytes:                     # it grew while being read
        raise _too_large(name, max_bytes)
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ConfigError("is UTF-16 or UTF-32 text (it starts with that byte-order mark)", file=name,
                          has_value=False, allowed="UTF-8 text: save the file as UTF-8")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"is binary, not text (a NUL byte at offset {nul:,})", file=name,
                          has_value=False, allowed="a UTF-8 text file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line} cannot be decoded; "
                          "Latin-1 or another legacy encoding?)", file=name, has_value=False,
                          allowed="UTF-8 text: save the file as UTF-8") from None


def load_json(path: str | Path) -> Any:
    """Read a JSON file through :func:`read_text` and :func:`parse_json`; errors are ConfigErrors."""
    return parse_json(read_text(path), str(path))


def parse_json(text: str, file: str | None = None) -> Any:
    """JSON text as Python values, nesting bounded (:data:`~llmsim.config.limits.MAX_JSON_DEPTH`)
    and every string valid Unicode (JSON's ``\\ud800`` escapes a lone surrogate that no file or
    terminal can be written with). NaN and Infinity are read, for the accessors that take numbers to
    refuse with their key; malformed JSON is a ConfigError naming ``file``."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ConfigError(f"nested more than {MAX_JSON_DEPTH} levels deep", file=file, has_value=False,
                          allowed=f"at most {MAX_JSON_DEPTH} levels of nested objects and arrays") from None
    except ValueError as exc:       # JSONDecodeError, and an integer of more digits than Python converts
        raise ConfigError(f"not valid JSON: {exc}", file=file, has_value=False) from None
    pending = [(data, "", 0)]
    while pending:                  # iterative: a deep document must not recurse in the check itself
        value, where, depth = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError("holds a string that is not valid Unicode (an unpaired surrogate escape)",
                                  file=file, key=where or None, value=value, has_value=bool(where),
                                  allowed="text without \\ud800-\\udfff escapes outside a pair") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ConfigError(f"nested more than {MAX_JSON_DEPTH} levels deep (at {where})", file=file,
                              has_value=False, allowed=f"at most {MAX_JSON_DEPTH} levels of nested objects and arrays")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            path = (f"{where}.{key}" if where else str(key)) if isinstance(value, dict) else f"{where}[{key}]"
            if isinstance(key, str):
                pending.append((key, where, depth))
            pending.append((child, path, depth + 1))
    return data


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file through :func:`read_text` and :func:`parse_yaml`; errors are ConfigErrors."""
    return parse_yaml(read_text(path), str(path))


def parse_yaml(text: str, file: str | None = None) -> Any:
    """YAML text as Python values with the safe loader, nesting and alias expansion bounded
    (:data:`~llmsim.config.limits.MAX_YAML_DEPTH`, ``MAX_YAML_ALIASES``, ``MAX_YAML_NODES``) before
    any object is built; malformed or oversized YAML is a ConfigError naming ``file``."""
    loader = None
    try:
        loader = _BoundedLoader(text)       # reading starts here: a control character fails already
        return loader.get_single_data()
    except _YamlLimit as exc:
        raise ConfigError(exc.message, file=file, has_value=False, allowed=exc.allowed) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                          file=file, has_value=False) from None
    finally:
        if loader is not None:
            loader.dispose()


class _YamlLimit(Exception):
    def __init__(self, message: str, allowed: str):
        super().__init__(message)
        self.message, self.allowed = message, allowed


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts while it composes the node graph, before constructing:
    nesting depth (the composer recurses once per level), uses of aliases, and the number of
    values the document has once every alias is expanded (a "billion laughs" file is a few
    lines whose expansion takes gigabytes in any code that walks it, a deep copy or a hash)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _YamlLimit(f"uses more than {MAX_YAML_ALIASES:,} aliases (*name)",
                                 f"at most {MAX_YAML_ALIASES:,} aliases")
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise _YamlLimit(f"nested more than {MAX_YAML_DEPTH} levels deep (at line {mark.line + 1})",
                             f"at most {MAX_YAML_DEPTH} levels of nested mappings and lists")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, {}, 1)
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, tuple[int, int]], level: int) -> tuple[int, int]:
    """(values, height) of ``node`` with every alias expanded, ``node`` being ``level`` deep in the
    expansion. A node that aliases share is walked once (``sizes``), so this is linear in the file,
    not in its expansion; a chain of aliases (or one naming itself) is refused as soon as it goes
    deeper than the limit."""
    deep = _YamlLimit(f"nested more than {MAX_YAML_DEPTH} levels deep once its aliases (*name) are replaced by "
                      "what they name", f"at most {MAX_YAML_DEPTH} levels of nested mappings and lists")
    if level > MAX_YAML_DEPTH:
        raise deep
    known = sizes.get(id(node))
    if known is None:
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        count, height = 1, 1
        for child in children:
            child_count, child_height = _expanded_size(child, sizes, level + 1)
            count, height = count + child_count, max(height, child_height + 1)
            if count > MAX_YAML_NODES:
                raise _YamlLimit(f"expands to more than {MAX_YAML_NODES:,} values once its aliases (*name) are "
                                 "replaced by what they name",
                                 f"at most {MAX_YAML_NODES:,} values after alias expansion")
        known = sizes[id(node)] = (count, height)
    if level + known[1] - 1 > MAX_YAML_DEPTH:
        raise deep
    return known


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
                typo = _closest(str(key), [str(k) for k in self.data if k != key])
                message = "required key is missing" + (f"; did you mean '{key}' instead of '{typo}'?"
                                                       if typo else "")
                raise self.error(message, key=self.key_path(key), has_value=False)
            return default
        return self.data[key]

    def child(self, key: str, default: Any = _MISSING) -> Node:
        value = self.raw(key, {} if default is _MISSING else default)
        return Node(value, file=self.file, path=self.key_path(key), base_dir=self.base_dir)

    def named_entries(self, key: str, what: str, example: str) -> tuple[Node, list]:
        """``key``: a non-empty mapping of names to their settings (traffic classes, rollout groups).
        Returns the mapping's node and its names, in the file's order."""
        raw = self.raw(key)
        if not isinstance(raw, dict):
            raise self.key_error(key, f"expected a mapping of {what}", raw, example)
        if not raw:
            raise self.key_error(key, f"expected at least one entry in the mapping of {what}", raw,
                                 f"one or more entries, {example}; or leave out {self.key_path(key)}")
        return self.child(key), list(raw)

    def number(self, key: str, default: Any = _MISSING, *, integer: bool = False,
               minimum: float | None = None, maximum: float | None = None,
               exclusive_minimum: bool = False) -> Any:
        """A plain number, finite and within ``minimum``..``maximum`` and the magnitude every number
        must keep (:data:`~llmsim.config.limits.MAX_NUMBER`, checked before any float conversion,
        which a YAML integer of 400 digits would overflow)."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        kind = "an integer" if integer else "a number"
        maximum = MAX_NUMBER if maximum is None else min(maximum, MAX_NUMBER)
        minimum = -MAX_NUMBER if minimum is None else minimum
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, float) and not math.isfinite(value)):
            problem = f"expected {kind}"
            if isinstance(value, str) and _EXPONENT_WITHOUT_POINT.fullmatch(value.strip()):
                mantissa, exponent = re.split("[eE]", value.strip())
                problem += (f"; YAML reads an exponent without a decimal point as text: write "
                            f"{mantissa}.0e{exponent}")
            raise self.key_error(key, problem, value, range_text(kind, minimum, maximum, exclusive_minimum))
        self._check_range(key, value, kind, minimum, maximum, exclusive_minimum)
        if integer and not float(value).is_integer():
            raise self.key_error(key, f"expected {kind}", value, range_text(kind, minimum, maximum, exclusive_minimum))
        return int(value) if integer else float(value)

    def quantity(self, key: str, kind: str, default: Any = _MISSING, *, minimum: float | None = 0.0,
                 exclusive_minimum: bool = True, maximum: float | None = None) -> Any:
        """A quantity with a unit (``'200 ms'``), in its base unit, within ``minimum``..``maximum``
        and the kind's documented maximum (:data:`~llmsim.config.limits.MAX_QUANTITY`)."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        try:
            result = parse_quantity(value, kind)
        except UnitError as exc:
            raise self.key_error(key, f"cannot read this as a {kind}", value, exc.allowed) from None
        maximum = MAX_QUANTITY[kind] if maximum is None else min(maximum, MAX_QUANTITY[kind])
        self._check_range(key, result, kind, minimum, maximum, exclusive_minimum, shown=value)
        return result

    def string(self, key: str, default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            raise self.key_error(key, "expected a string", value, "a string")
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
        # YAML keys may be numbers, booleans or null beside strings: compared as text.
        valid = sorted({str(key) for key in self._used | set(extra_allowed)})
        for key in self.data:
            if key not in self._used and key not in extra_allowed:
                hint = _closest(str(key), valid)
                message = "unknown key" + (f"; did you mean '{hint}'?" if hint else "")
                raise self.key_error(str(key), message, self.data[key],
                                     "keys " + ", ".join(valid) if valid else "no keys here")

    # -- helpers --------------------------------------------------------------------------
    def _check_range(self, key, value, kind, minimum, maximum, exclusive_minimum, shown=None):
        low_bad = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
        high_bad = maximum is not None and value > maximum
        if low_bad or high_bad:
            raise self.key_error(key, "value out of range", value if shown is None else shown,
                                 range_text(kind, minimum, maximum, exclusive_minimum))


def range_text(kind: str, minimum: float | None, maximum: float | None, exclusive_minimum: bool = False) -> str:
    """What a range allows, as an error message says it: 'an integer >= 1 and <= 64'."""
    parts = [kind]
    if minimum is not None:
        parts.append(("> " if exclusive_minimum else ">= ") + _figure(minimum))
    if maximum is not None:
        parts.append(("and <= " if minimum is not None else "<= ") + _figure(maximum))
    return " ".join(parts)


def _figure(bound: float) -> str:
    """A bound as people read it: 2**53 as '9.0072e+15', 100 as '100'."""
    return f"{bound:g}" if abs(bound) < 1e15 else f"{bound:.5g}"


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
