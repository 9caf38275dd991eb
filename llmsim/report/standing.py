"""What a chip's figures rest on: the confidence of the step times a report prices it with, and the
held-out error of its cost model where one was measured.

A profile prices a step by its kernel terms when it has them (``kernels:``, the scenario's engine's
set) and otherwise by its peaks times efficiencies. Each figure carries a ``confidence``; the
step times are as good as the weakest figure they use:

``measured``
    most kernel terms fitted to timings of this chip (``llmsim calibrate``; the assumed ones, if any,
    are named), or every efficiency measured;
``derived``
    kernel terms carried over from another chip's measured ones by a rule stated in their sources
    (``derived from ... by the rule: ...``): the rule is stated, its error on this chip is not known;
``assumption``
    most figures assumed (efficiencies, overheads, unverified vendor figures).

The held-out error is the profile's own record of its fit (``calibration.database.engines.<engine>
.validation``, the rows of the ``held_out`` split: terms fitted to half of the timings and checked on
the other half) for the kernels that dense models spend their steps in: GEMMs (16-bit) and decode and
prefill attention. A profile fitted without such a record, or priced by assumptions, has none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmsim.catalog.hardware import lookup_hardware, profile_data
from llmsim.config.reader import Node
from llmsim.scenario.scenario import Scenario

MEASURED, DERIVED, ASSUMPTION = "measured", "derived", "assumption"
STEP_GROUPS = {"gemm_bf16": "GEMM", "decode_attention": "decode attention", "prefill_attention": "prefill attention"}
DERIVED_MARK = "derived from"


@dataclass(frozen=True)
class Standing:
    """One chip's: what its step times rest on, in a word and a phrase, and its held-out error (or why none)."""
    chip: str
    confidence: str                # measured, derived or assumption
    basis: str                     # what was measured, derived or assumed, in a few words
    assumed: tuple[str, ...]       # the figures assumed among measured kernel terms (key paths)
    price: str                     # the confidence of its price per device-hour
    held_out: str                  # e.g. "GEMM 7.1%, decode attention 7.4%, prefill attention 15.1% MAPE"
    held_out_source: str           # where that error is recorded

    @property
    def text(self) -> str:
        """The confidence as a table cell: step times and price."""
        return f"step times: {self.confidence} ({self.basis}); price: {self.price}"


def chip_standing(name: str, scenario: Scenario) -> Standing:
    """The standing of chip ``name`` as ``scenario``'s engine prices it (a path resolves as the
    scenario's ``hardware`` key does)."""
    where = Node(None, file=scenario.path, base_dir=Path(scenario.source_dir or "."))
    profile = lookup_hardware(name, where, "hardware")
    data = profile_data(profile.path) if profile.path else {}
    engine = scenario.engine.kernels.value
    kernels = data.get("kernels") if isinstance(data.get("kernels"), dict) else None
    if kernels is not None:
        own = (kernels.get("engines") or {}).get(engine)
        confidence, basis, assumed = _kernel_confidence(
            _figures(own if isinstance(own, dict) else {k: v for k, v in kernels.items() if k != "engines"}))
    else:
        terms = _figures(data.get("efficiency", {})) + _figures(data.get("overhead", {}))
        measured = bool(terms) and all(c == MEASURED for _, c, _ in terms)
        confidence = MEASURED if measured else ASSUMPTION
        basis = "efficiencies measured" if measured else "peaks times assumed efficiencies"
        assumed = ()
    price = data.get("price_per_hour_usd", {})
    held_out, where_recorded = _held_out(data, engine) if confidence == MEASURED else (
        "none: not measured on this chip", "")
    return Standing(profile.name, confidence, basis, assumed,
                    str(price.get("confidence", ASSUMPTION)) if isinstance(price, dict) else ASSUMPTION,
                    held_out, where_recorded)


def _figures(node, path: str = "") -> list[tuple[str, str, str]]:
    """Every ``{value, source, confidence}`` under ``node``: (its key path, confidence, source)."""
    if isinstance(node, dict) and "value" in node and "source" in node:
        return [(path, str(node.get("confidence", ASSUMPTION)), str(node["source"]))]
    if isinstance(node, dict):
        return [figure for key, child in node.items() for figure in _figures(child, f"{path}.{key}" if path else key)]
    return []


def _kernel_confidence(terms: list[tuple[str, str, str]]) -> tuple[str, str, tuple[str, ...]]:
    """What most kernel terms rest on, in a few words, and the assumed ones among them."""
    derived = [path for path, c, source in terms if c != MEASURED and DERIVED_MARK in source]
    assumed = tuple(path for path, c, source in terms if c != MEASURED and DERIVED_MARK not in source)
    measured = len(terms) - len(derived) - len(assumed)
    if derived and len(derived) >= len(assumed):
        return DERIVED, f"{len(derived)} of {len(terms)} kernel terms derived from another chip's by a stated rule", \
            assumed
    if measured >= len(assumed) + len(derived) and measured:
        return MEASURED, f"{measured} of {len(terms)} kernel terms fitted to this chip's timings", assumed
    return ASSUMPTION, f"{len(assumed)} of {len(terms)} kernel terms assumed", assumed


def _held_out(data: dict, engine: str) -> tuple[str, str]:
    """The held-out MAPE of the step's kernel groups, from the profile's calibration record."""
    database = (data.get("calibration") or {}).get("database") or {}
    rows = (((database.get("engines") or {}).get(engine) or {}).get("validation")) or []
    errors = {row["group"]: row["mape"] for row in rows
              if isinstance(row, dict) and row.get("split") == "held_out" and row.get("group") in STEP_GROUPS}
    if not errors:
        return "none recorded in the profile", ""
    text = ", ".join(f"{STEP_GROUPS[g]} {100 * errors[g]:.1f}%" for g in STEP_GROUPS if g in errors) + " MAPE"
    return text, (f"the profile's calibration record ({database.get('tool', 'llmsim calibrate')}, "
                  f"{database.get('database', 'timings')}, {database.get('date', '')}): half of the timings held out")
