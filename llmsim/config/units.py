"""Quantities with units, as people write them in YAML: '200 ms', '80 GB', '3.35 TB/s', '5/s'.

A bare number is taken in the base SI unit of the quantity (seconds, bytes, bytes/s,
FLOP/s, requests/s, watts). Decimal prefixes are powers of 1000 and binary prefixes
(KiB, MiB, GiB, TiB) are powers of 1024, as on datasheets.
"""
from __future__ import annotations

import math
import re

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z/%µ]*[A-Za-z/%µ0-9]*)?\s*$")

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0,
                  "min": 60.0, "h": 3600.0, "hr": 3600.0}


def _prefixed(base_units: tuple[str, ...]) -> dict[str, float]:
    table: dict[str, float] = {}
    for base in base_units:
        for prefix, factor in {**_DECIMAL, **_BINARY}.items():
            table[prefix + base] = factor
    return table


BYTES_UNITS = _prefixed(("B",))
BANDWIDTH_UNITS = {k + "/s": v for k, v in BYTES_UNITS.items()} | {
    k.replace("B", "Bps"): v for k, v in BYTES_UNITS.items()}
FLOPS_UNITS = _prefixed(("FLOP/s", "FLOPS", "OP/s", "OPS"))
POWER_UNITS = _prefixed(("W",))
RATE_UNITS = {"/s": 1.0, "req/s": 1.0, "rps": 1.0, "/min": 1 / 60.0, "req/min": 1 / 60.0,
              "/h": 1 / 3600.0, "req/h": 1 / 3600.0}

KINDS = {
    "duration": (DURATION_UNITS, "a duration such as '200 ms', '1.5 s' or a number of seconds"),
    "bytes": (BYTES_UNITS, "a size such as '80 GB', '44 GiB' or a number of bytes"),
    "bandwidth": (BANDWIDTH_UNITS, "a bandwidth such as '3.35 TB/s' or a number of bytes/s"),
    "flops": (FLOPS_UNITS, "a compute rate such as '989 TFLOP/s' or a number of FLOP/s"),
    "power": (POWER_UNITS, "a power such as '700 W' or '23 kW'"),
    "rate": (RATE_UNITS, "a rate such as '5/s', '300 req/min' or a number of requests per second"),
}


class UnitError(ValueError):
    """The text is not a quantity of the expected kind; ``allowed`` says what is."""

    def __init__(self, allowed: str):
        super().__init__(allowed)
        self.allowed = allowed


def parse_quantity(value: object, kind: str) -> float:
    """Return ``value`` in the base unit of ``kind``; raise UnitError if it is not one."""
    units, allowed = KINDS[kind]
    if isinstance(value, bool):
        raise UnitError(allowed)
    if isinstance(value, (int, float)):
        try:
            result = float(value)
        except OverflowError:          # an integer of hundreds of digits
            raise UnitError(allowed) from None
    elif isinstance(value, str):
        match = _QUANTITY.match(value.replace("_", ""))
        if not match:
            raise UnitError(allowed)
        number, unit = float(match.group(1)), (match.group(2) or "")
        if unit == "":
            factor = 1.0
        elif unit in units:
            factor = units[unit]
        else:
            raise UnitError(f"{allowed}; unit '{unit}' is not one of "
                            f"{', '.join(sorted(_headline_units(units)))}")
        result = number * factor
    else:
        raise UnitError(allowed)
    if not math.isfinite(result):
        raise UnitError(allowed)
    return result


def _headline_units(units: dict[str, float]) -> list[str]:
    """A short list of the units worth naming in an error message."""
    return [u for u in units if not any(u.startswith(p) for p in ("E", "P", "Ki", "Pi", "K"))][:12]
