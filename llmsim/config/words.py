"""Counts in sentences: "1 replica", "2 replicas", "1,024 sequences"."""
from __future__ import annotations


def counted(count: float, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun plural unless the count is exactly one (thousands separated)."""
    word = noun if count == 1 else (plural or noun + "s")
    text = f"{count:,}" if isinstance(count, int) or float(count).is_integer() else f"{count:,.3g}"
    return f"{text.removesuffix('.0')} {word}"
