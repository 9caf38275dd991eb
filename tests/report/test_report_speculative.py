"""``llmsim report`` on a speculative scenario: the settings rows name the scenario's own k policy.

The report's end-to-end tests (tests/report/test_report.py) use a scenario without speculation; the settings
table once read a field the k policy does not have and crashed after all the simulation work.
"""
from __future__ import annotations

from llmsim.report.build import ReportBuilder, traffic_from_rate

from tests.helpers import REPO

SMALL = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
SPECULATION = ("speculation:\n  draft: Llama-3.2-1B\n  policy: static\n  k: 3\n"
               "  acceptance: {process: beta, mean: 0.7, concentration: 10}\n")


def test_settings_rows_of_a_speculative_scenario_name_its_policy_and_k(tmp_path):
    scenario = tmp_path / "speculative.yaml"
    scenario.write_text(SMALL.read_text() + SPECULATION)
    builder = ReportBuilder(scenario, traffic_from_rate(40.0), hardware=["H100-SXM"], workers=1)
    assert builder.scenario.speculating
    rows = builder._settings_rows(None, builder.scenario)
    assert rows[0] == ["speculation k", "static:3", "-"]


def test_settings_rows_without_speculation_say_off():
    builder = ReportBuilder(SMALL, traffic_from_rate(40.0), hardware=["H100-SXM"], workers=1)
    assert builder._settings_rows(None, builder.scenario)[0] == ["speculation k", "off", "-"]
