"""The report reads well: hardware figures in an appendix citing numbered sources, both latencies on
the frontier figure, and Markdown that links its figures as files instead of embedding them.

Quick checks on the builder's and the renderer's parts with small inputs; the whole report is
checked end to end in ``test_report.py`` (slow).
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import yaml

from llmsim.report import figures
from llmsim.report.build import hardware_appendix
from llmsim.report.document import Figure, Report, Section, Table
from llmsim.report.render import figure_files, to_html, to_markdown
from llmsim.scenario.variants import variant
from llmsim.scenario.scenario import load_scenario

from tests.helpers import REPO
from tests.helpers import markdown_literal, markdown_tables

SCENARIO = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"


def profile_figures(path, engine: str = "vllm") -> dict[str, tuple[str, str]]:
    """Every ``{value, source}`` figure of a profile file that ``engine`` prices with (of the
    other engines' kernel terms under ``kernels.engines``, only its own), read here independently of
    the report: dotted key -> (value, source with its whitespace collapsed)."""
    found = {}

    def walk(node, path):
        if isinstance(node, dict) and "value" in node and "source" in node:
            found[path] = (str(node["value"]), " ".join(str(node["source"]).split()))
        elif isinstance(node, dict):
            for key, value in node.items():
                if key != "calibration" and not (path == "kernels.engines" and key != engine):
                    walk(value, f"{path}.{key}" if path else key)

    walk(yaml.safe_load(path.read_text()), "")
    return found


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_appendix_lists_each_figure_once_and_each_source_once(engine):
    # H100 and H100-SXM are one chip under two names: its figures appear once
    scenario = variant(load_scenario(SCENARIO), {"engine.kernels": engine})
    rows, sources = hardware_appendix(["H100", "H200", "H100-SXM"], scenario)
    expected = {("H100-SXM", key): figure for key, figure in
                profile_figures(REPO / "hardware_profiles" / "h100-sxm.yaml", engine).items()}
    expected |= {("H200", key): figure for key, figure in
                 profile_figures(REPO / "hardware_profiles" / "h200.yaml", engine).items()}
    # the figures of the engines the scenario does not run are not listed
    assert any(".engines." in key for _, key in expected) == (engine != "vllm")
    listed = [(chip, figure) for chip, figure, *_ in rows]
    assert len(listed) == len(set(listed)) and set(listed) == set(expected)
    # each distinct source text once, and every row's number is the source its profile names
    assert len(sources) == len(set(sources)) and set(sources) == {source for _, source in expected.values()}
    for chip, figure, value, _confidence, number in rows:
        assert 1 <= int(number) <= len(sources)
        assert (value, sources[int(number) - 1]) == expected[(chip, figure)]
    # the appendix is shorter than the old table repeating a source per row
    assert len(sources) < len(rows) / 2


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a":
            self.hrefs.append(attrs["href"])
        if "id" in attrs:
            self.ids.add(attrs["id"])


def appendix_report() -> Report:
    rows, sources = hardware_appendix(["H100", "H200"], load_scenario(SCENARIO))
    table = Table("hardware-figures", "Hardware figures", ["chip", "figure", "value", "confidence", "source"], rows,
                  cites="source")
    return Report("t", "s", [], [Section("hardware", "Appendix", tables=[table], sources=sources)])


def test_every_cited_source_resolves_in_the_html_and_the_markdown():
    report = appendix_report()
    rows, sources = report.sections[0].tables[0].rows, report.sections[0].sources
    anchors = _Anchors()
    anchors.feed(to_html(report))
    cited = [href for href in anchors.hrefs if "source" in href]
    assert len(cited) == len(rows)
    assert all(href.startswith("#") and href[1:] in anchors.ids for href in cited)
    assert {f"#hardware-source-{row[-1]}" for row in rows} == set(cited)
    md = to_markdown(report)
    _, table = markdown_tables(md)            # the (empty) summary, the appendix
    assert [row[-1] for row in table[1:]] == [f"[{row[-1]}]" for row in rows]
    numbered = [markdown_literal(line.split(". ", 1)[1]) for line in md.splitlines() if re.match(r"\d+\. ", line)]
    assert numbered == sources


def test_markdown_links_figure_files_and_keeps_lines_short():
    svg = "<svg>" + "<path d='M 0 0 L 1 1'/>" * 10_000 + "</svg>"     # as long as a real dashboard
    report = Report("t", "s", [], [Section("s", "S", figures=[Figure("monitoring-figure", "dashboard", svg),
                                                               Figure("load-figure", "load", svg)])])
    md = to_markdown(report)
    assert "data:" not in md and max(map(len, md.splitlines())) <= 2000
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    files = figure_files(report)
    assert linked == ["figures/monitoring-figure.svg", "figures/load-figure.svg"] and set(files) == set(linked)
    assert all(text == svg for text in files.values())
    assert svg in to_html(report)                       # the page still holds its figures inline


def test_the_frontier_plots_ttft_and_tpot_each_against_its_limit():
    svg = figures.frontier([100, 150, 190, 220, 230, 231],
                           {"ttft": [0.1, 0.12, 0.2, 5.6, 9, 12], "tpot": [0.01, 0.012, 0.015, 0.03, 0.04, 0.041]},
                           {"ttft": [True] * 4 + [False] * 2, "tpot": [True] * 6}, (0.5, 0.75, 1, 1.25, 1.5, 2),
                           {"ttft": 0.5, "tpot": 0.03}, "frontier-figure")
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert "P95 TTFT (ms)" in texts and "P95 TPOT (ms)" in texts
    # the load factors are a legend, each once, not a label per point per panel
    assert all(texts.count(f"x{factor:g}") == 1 for factor in (0.5, 0.75, 1, 1.25, 1.5, 2))
    assert "SLO limit 500 ms" in texts and "SLO limit 30 ms" in texts
