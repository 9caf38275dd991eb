"""No input string reaches report.md (or report.html) as markup.

Markdown viewers render inline HTML, links and images, so every text in report.md is escaped
(:func:`llmsim.report.render.markdown_text`). Checked three ways: every field of a Report holding
``<script>``, ``<img onerror=...>``, a link and a table pipe renders with no tag, link or extra cell;
any text, read back by CommonMark's escaping rules (backslash before punctuation, the three
entities), is the text given; and (slow) a whole ``llmsim report`` whose scenario name, traffic
class names, hardware profile texts and trace file name are hostile.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsim.cli.main import main
from llmsim.report.build import hardware_figures
from llmsim.report.document import Fact, Figure, Report, Section, Table
from llmsim.report.render import markdown_text, to_html, to_markdown
from llmsim.scenario.scenario import load_scenario

from tests.helpers import REPO
from tests.helpers import markdown_literal, markdown_tables

SCRIPT = "<script>alert(1)</script>"
IMAGE = '<img src=x onerror="alert(2)">'
LINK = "[click](javascript:alert(3))"
HOSTILE = [SCRIPT, IMAGE, LINK, "a | b", "# heading", "- item", "`code` *bold* _em_ ~~gone~~", "&lt;b&gt;",
           "line\nbreak", "1. first", "\\[escaped\\]"]
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><text x="0" y="9">fig</text></svg>'


def hostile_report(text: str) -> Report:
    """``text`` in every field a template writes out."""
    table = Table(key="t", title=text, columns=["row", text], rows=[[text, text], ["plain", "1.5 ms"]], note=text)
    figure = Figure(key="f", title=text, svg=SVG, caption=text)
    section = Section(key="s", title=text, paragraphs=[text, text], tables=[table], figures=[figure], sources=[text])
    return Report(title=text, subtitle=text, summary=[Fact(text, "t", text, text)], sections=[section])


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def tags(html: str) -> list[str]:
    parser = _Tags()
    parser.feed(html)
    return parser.tags


@pytest.mark.parametrize("text", HOSTILE)
def test_every_field_of_the_markdown_is_escaped(text):
    md = to_markdown(hostile_report(text))
    # An HTML parser fed the Markdown finds no tag at all: no raw HTML survives (the template writes none).
    assert tags(md) == []
    # No link or image but the figure's own file.
    assert len(re.findall(r"(?<!\\)\]\(", md)) == 1 and "](figures/f.svg)" in md
    # The tables keep their shape (a pipe in the text is a character, not a column) and their text.
    summary, table = markdown_tables(md)
    flat = " ".join(text.splitlines())
    assert summary == [["item", "value"], [flat, flat]]
    assert table == [["row", flat], [flat, flat], ["plain", "1.5 ms"]]
    # Headings, paragraphs and the note read back as the text.
    lines = md.splitlines()
    assert lines[0] == "# " + markdown_text(text) and markdown_literal(lines[0][2:]) == flat
    assert lines.count(markdown_text(text)) == 3          # the subtitle and the two paragraphs
    assert f"_{markdown_text(text)}_" in lines            # the table's note
    assert f"1. {markdown_text(text)}" in lines           # the section's source


@pytest.mark.parametrize("text", HOSTILE)
def test_every_field_of_the_html_is_escaped(text):
    found = tags(to_html(hostile_report(text)))
    assert "script" not in found and "img" not in found
    assert found.count("a") == 1                          # the table of contents' one link


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.text())
def test_markdown_text_reads_back_as_the_text_and_holds_no_markup(text):
    escaped = markdown_text(text)
    assert markdown_literal(escaped) == " ".join(text.splitlines())
    assert "<" not in escaped and ">" not in escaped and "\n" not in escaped
    # Every '[', ']', '|', '`', '*', '_' and '~' is escaped (preceded by an odd number of backslashes).
    for match in re.finditer(r"(\\*)[\[\]|`*_~]", escaped):
        assert len(match[1]) % 2 == 1, escaped


# -- a whole report with hostile inputs (about a minute) ----------------------------------------

def hostile_inputs(tmp_path):
    """A scenario named with a script tag, on a hardware profile (beside it, named by a relative path)
    whose name and sources are tags, with traffic classes named with tags, and a trace file whose name
    holds a tag."""
    profile = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm.yaml").read_text())
    profile["name"] = f"H100{IMAGE}"
    profile["description"] = f"{LINK} {SCRIPT}"
    for value in profile.values():
        if isinstance(value, dict) and "source" in value:
            value["source"] = f"{SCRIPT} {value['source']}"
    (tmp_path / "chip.yaml").write_text(yaml.safe_dump(profile))
    scenario = yaml.safe_load((REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml").read_text())
    scenario["name"] = f"chat{SCRIPT}"
    scenario["hardware"] = "chip.yaml"
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


@pytest.mark.slow
def test_a_report_with_hostile_inputs_has_no_markup_from_them(tmp_path):
    scenario = hostile_inputs(tmp_path)
    out = tmp_path / "out"
    assert main(["report", str(scenario), "--target-rate", "20", "--seeds", "2", "--requests", "100",
                 "--workers", "1", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert tags(md) == []
    assert "script" not in tags(html) and "img" not in tags(html)
    assert markdown_text(f"chat{SCRIPT}") in md and markdown_text(IMAGE) in md


def test_hardware_figures_find_a_profile_named_relative_to_the_scenario(tmp_path, monkeypatch):
    """As ``llmsim run`` does: the scenario's ``hardware: chip.yaml`` is beside the scenario, whatever
    the current folder (the report once looked for it in the current folder, after all its simulations)."""
    scenario = load_scenario(hostile_inputs(tmp_path))
    monkeypatch.chdir(REPO)
    rows = hardware_figures("chip.yaml", scenario)
    assert rows and all(row[0] == f"H100{IMAGE}" for row in rows)
    assert any(row[3].startswith(SCRIPT) for row in rows)           # the sources, as the profile has them
