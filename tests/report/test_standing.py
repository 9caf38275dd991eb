"""The report says what each chip's figures rest on, and its error table agrees with its hardware table.

The truth here is the profile files, read with PyYAML independently of the report: a chip whose kernel
terms the hardware appendix marks ``measured`` must not be called unmeasured in the cost model's
error table, and its held-out error is the one its calibration record holds.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from llmsim.report.build import ReportBuilder, hardware_appendix, traffic_from_rate
from llmsim.report.standing import chip_standing
from llmsim.scenario.scenario import load_scenario
from tests.helpers import REPO

SCENARIO = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
CHIPS = {"H100-SXM": "h100-sxm", "A100-80GB": "a100-80gb", "MI300X": "mi300x", "CS-3": "cs3"}


def profile(stem: str) -> dict:
    return yaml.safe_load((REPO / "hardware_profiles" / f"{stem}.yaml").read_text())


def kernel_confidences(document: dict) -> list[str]:
    found = []

    def walk(node):
        if isinstance(node, dict) and "value" in node and "source" in node:
            found.append(node.get("confidence"))
        elif isinstance(node, dict):
            for key, child in node.items():
                if key != "engines":               # the default (vLLM) engine's terms
                    walk(child)
    walk(document.get("kernels", {}))
    return found


@pytest.mark.parametrize("chip, stem", CHIPS.items())
def test_the_standing_is_what_the_profile_says(chip, stem):
    scenario = load_scenario(SCENARIO)
    document = profile(stem)
    standing = chip_standing(chip, scenario)
    confidences = kernel_confidences(document)
    if not confidences:                                         # no kernel terms: peaks x efficiencies
        assert standing.confidence == "assumption"
        assert all(node["confidence"] != "measured" for node in document["efficiency"].values())
        assert standing.held_out.startswith("none")
        return
    measured = confidences.count("measured")
    if measured > len(confidences) / 2:
        assert standing.confidence == "measured"
        assert f"{measured} of {len(confidences)}" in standing.basis
        rows = document["calibration"]["database"]["engines"]["vllm"]["validation"]
        for group, label in (("gemm_bf16", "GEMM"), ("decode_attention", "decode attention"),
                             ("prefill_attention", "prefill attention")):
            mape = next(r["mape"] for r in rows if r["group"] == group and r["split"] == "held_out")
            assert f"{label} {100 * mape:.1f}%" in standing.held_out
    else:                                      # carried over from another chip by a stated rule
        assert standing.confidence == "derived"
        assert standing.held_out.startswith("none")
    assert standing.price == document["price_per_hour_usd"]["confidence"]


def test_error_table_agrees_with_the_hardware_table():
    builder = ReportBuilder(SCENARIO, traffic_from_rate(30.0), hardware=list(CHIPS), workers=1)
    builder.choices = [SimpleNamespace(hardware=chip) for chip in CHIPS]
    builder.standings = {chip: chip_standing(chip, builder.original) for chip in CHIPS}
    builder._assumptions()
    errors = next(t for t in builder.sections[-2].tables if t.key == "cost-model-error")
    hardware_rows, _ = hardware_appendix(list(CHIPS), builder.original)
    for chip in CHIPS:
        kernels = [row[3] for row in hardware_rows if row[0] == chip and row[1].startswith("kernels.")]
        row = next(r for r in errors.rows if r[0].startswith(f"{chip}:"))
        if kernels and kernels.count("measured") > len(kernels) / 2:
            assert "measured" in row[0] and "MAPE" in row[1], row
        else:
            assert "not measured" in row[1], row
    assert not any("GPU and SRAM-chip profiles" in r[0] for r in errors.rows)     # the contradicting line is gone
