"""The report's aggregated-vs-disaggregated section: every layout's latencies and attainment over the report's
seeds, with their intervals, never a zero-width one."""
from __future__ import annotations

import re

from llmsim.report.build import ReportBuilder, traffic_from_rate
from tests.helpers import make_scenario

SPLIT = {"deployment": {"replicas": 1, "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                                         "link": "nvlink4"}},
         "workload": {"num_requests": 60, "arrival": {"rate": 2.0}}, "slo": {"ttft": "1 s", "tpot": "50 ms"}}


def test_the_layout_comparison_runs_on_the_reports_seeds_with_intervals():
    builder = ReportBuilder(make_scenario(SPLIT), traffic_from_rate(2.0), seeds=[3, 4], requests=60, workers=1)
    builder._disaggregation()
    section = builder.sections[-1]
    layouts = next(table for table in section.tables if table.key == "disaggregation-layouts")
    assert "2 seeds" in " ".join(section.paragraphs) and "2 seeds" in layouts.note
    columns = [layouts.columns.index(name) for name in ("P95 TTFT", "P95 TPOT", "SLO attainment")]
    cells = [row[i] for row in layouts.rows for i in columns]
    for cell in cells:
        assert "±" in cell, cell                       # an interval, or the words saying why there is none
        assert not re.search(r"± 0(\.0+)?( |%|$)", cell), cell
