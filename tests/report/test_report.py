"""``llmsim report``: the page opens in a real browser, its claims hold when simulated again.

One reduced report (``scenarios/llama3-8b-h100-short-turns.yaml``: short chat turns at 200 requests/s on
H100s, two seeds) is written through the command line once for the module. Then:

- headless Chromium (Debian's ``chromium``, installed by ``.ci/run``) screenshots it, logs no
  console message, lays out every figure with a non-empty box and shows every section; the
  page loads nothing (no script, stylesheet link or remote source);
- the Markdown holds the same tables, cell for cell, as the HTML, and links its figures as SVG files;
- every summary figure is the text of the section table cell it names;
- the recommended deployment, read back from the page, meets the SLO targets on seeds the
  report never used, judged as the searches judge (:mod:`llmsim.search.window`); one replica
  fewer behaves as the N+1 row says;
- bad input exits 2 and writes nothing.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from llmsim.cli.main import main
from llmsim.scenario.variants import variant
from llmsim.scenario.scenario import load_scenario
from llmsim.search.window import Judged, measurement_window, simulate_until_decided, typical_latency_s

from tests.helpers import REPO, markdown_tables

SMALL = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
RATE = 200.0          # above one replica's goodput (tp2: about 173/s), so N+1 has a replica to lose
SECTIONS = ("summary", "workload", "candidates", "settings", "load", "peak", "sensitivity", "monitoring",
            "assumptions", "hardware")
FIGURES = ("workload-figure", "candidates-figure", "attainment-figure", "frontier-figure", "peak-figure",
           "sensitivity-figure", "monitoring-figure")
REPORT_ARGS = ["--target-rate", str(RATE), "--hardware", "H100-SXM", "--seeds", "2"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "out"
    assert main(["report", str(SMALL), *REPORT_ARGS, "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    return {"out": out, "html": html, "md": (out / "report.md").read_text(), "tables": html_tables(html)}


# -- reading the page back -----------------------------------------------------------------

class _Tables(HTMLParser):
    """Every <table data-table=KEY> as rows of cell texts, and the summary rows' references."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.summary: list[tuple[dict, str]] = []
        self._table = self._row = self._cell = None
        self._summary_ref = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and "data-table" in attrs:
            self._table = self.tables.setdefault(attrs["data-table"], [])
        elif tag == "tr":
            self._row = []
            self._summary_ref = attrs if "data-column" in attrs else None
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._summary_ref is not None:
                self.summary.append((self._summary_ref, self._row[1]))
            elif self._table is not None:
                self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None


def html_tables(html: str) -> _Tables:
    parser = _Tables()
    parser.feed(html)
    return parser


def cell(tables: _Tables, key: str, row: str, column: str) -> str:
    header, *rows = tables.tables[key]
    return next(r for r in rows if r[0] == row)[header.index(column)]


def recommended_overrides(tables: _Tables) -> dict:
    """The deployment the page recommends, as scenario overrides (read from its tables, not the code)."""
    tp, pp = re.fullmatch(r"tp(\d+) x pp(\d+)", cell(tables, "deployment", "layout", "recommended")).groups()
    k = cell(tables, "settings", "speculation k", "recommended")
    assert k == "off"                                   # the chat scenario has no draft
    timeout = cell(tables, "settings", "queue timeout", "recommended").replace(",", "")    # '1,000 ms' as shown
    return {"hardware": cell(tables, "deployment", "chip", "recommended"),
            "deployment.tensor_parallel": int(tp), "deployment.pipeline_parallel": int(pp),
            "deployment.replicas": int(cell(tables, "deployment", "replicas", "recommended")),
            "engine.max_batch_tokens": int(cell(tables, "settings", "max batch tokens", "recommended")
                                           .replace(",", "")),
            "engine.queue_timeout": None if timeout == "none" else timeout}


def judged_at(point: dict, seeds: list[int], rate: float = RATE) -> Judged:
    """``point`` at ``rate`` on ``seeds``, judged as plan does (whole runs: no run stops early)."""
    scenario = load_scenario(SMALL)
    at_point = variant(scenario, {**point, "workload.arrival.rate": rate})
    window = measurement_window(scenario, rate, typical_latency_s(at_point, rate))
    judged, = simulate_until_decided(scenario, [{**point, "workload.arrival.rate": rate}], [window], [rate],
                                     seeds=seeds)
    return judged


def judged_met(point: dict, seeds: list[int]) -> bool:
    """Whether ``point`` at the target rate meets the SLO targets on ``seeds``."""
    return judged_at(point, seeds).verdict.met


# -- the browser -----------------------------------------------------------------------------

def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """Headless Chromium with nothing running in the background and a throwaway profile."""
    if CHROMIUM is None:      # a failure, not a skip: the README's test command is CI's, browser tests included
        pytest.fail("chromium is not installed: these tests open the report in a real browser. Install Debian's "
                    "chromium (`apt-get install chromium`, as .ci/run does), or deselect them knowingly with "
                    "-m 'not browser'", pytrace=False)
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                               "--disable-background-networking", "--no-first-run", "--disable-component-update",
                               "--disable-sync",
                               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args],
                              capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


needs_chromium = pytest.mark.browser


@needs_chromium
def test_console_check_sees_a_script_error(tmp_path):
    """The console check can fail: a page that logs an error is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><script>console.error('boom'); missing();</script></body></html>")
    found = console_messages(chromium("--virtual-time-budget=2000", "--dump-dom", page.as_uri()).stderr)
    assert any("boom" in line for line in found) and any("missing" in line for line in found)


@needs_chromium
def test_screenshot_without_console_messages(report, tmp_path):
    shot = tmp_path / "report.png"
    run = chromium("--hide-scrollbars", "--window-size=1200,4000", f"--screenshot={shot}",
                   (report["out"] / "report.html").as_uri())
    assert console_messages(run.stderr) == []
    from PIL import Image
    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.shape == (4000, 1200)
    assert len(np.unique(pixels)) > 50 and pixels.std() > 10      # text, tables and plots, not a blank page
    kept = os.environ.get("LLMSIM_KEEP_SCREENSHOT")               # to look at it by eye
    if kept:
        shutil.copy(shot, kept)


@needs_chromium
def test_every_section_and_figure_renders(report, tmp_path):
    """Laid out by Chromium: each figure's SVG has a box of real size and drawn shapes in it."""
    probe = tmp_path / "probe.html"
    script = """<script>
      window.addEventListener('load', () => {
        const out = [];
        for (const f of document.querySelectorAll('figure[data-figure]')) {
          const svg = f.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
          out.push(f.dataset.figure + ' ' + Math.round(box.width) + ' ' + Math.round(box.height) + ' '
                   + (svg ? svg.querySelectorAll('path, use, rect, text').length : 0));
        }
        for (const s of document.querySelectorAll('main > section')) {
          const box = s.getBoundingClientRect(); out.push('section ' + s.id + ' ' + Math.round(box.height));
        }
        const pre = document.createElement('pre'); pre.id = 'render-check'; pre.textContent = out.join('\\n');
        document.body.appendChild(pre);
      });
    </script>"""
    probe.write_text(report["html"].replace("</body>", script + "</body>"))
    run = chromium("--window-size=1200,4000", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    assert console_messages(run.stderr) == []
    check = re.search(r'<pre id="render-check">(.*?)</pre>', run.stdout, re.S).group(1).split("\n")
    figures = {line.split()[0]: list(map(int, line.split()[1:])) for line in check if not line.startswith("section")}
    sections = {line.split()[1]: int(line.split()[2]) for line in check if line.startswith("section")}
    assert set(figures) == set(FIGURES)
    for name, (width, height, shapes) in figures.items():
        assert width > 200 and height > 100 and shapes > 10, name
    assert set(sections) == set(SECTIONS) and all(height > 50 for height in sections.values())


def test_page_is_self_contained(report):
    html = report["html"]
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert not re.search(r'\s(src|href)="(?!#)', html), "the page must load nothing"
    assert not re.search(r"url\((?!#)", html)


def test_markdown_has_the_same_tables(report):
    html_rows = [rows for key, rows in report["tables"].tables.items()]
    md = markdown_tables(report["md"])
    summary, sections = md[0], md[1:]
    assert sections == html_rows
    assert [row[1] for row in summary[1:]] == [value for _, value in report["tables"].summary]
    # the figures are SVG files beside it, linked by relative paths; no line is a wall of base64
    linked = re.findall(r"!\[[^\n]*?\]\(([^)]+)\)", report["md"])
    assert sorted(linked) == sorted(f"figures/{key}.svg" for key in FIGURES)
    for path in linked:
        assert (report["out"] / path).read_text().startswith("<svg")
    assert "data:" not in report["md"] and max(map(len, report["md"].splitlines())) <= 2000


def test_summary_figures_are_the_sections_figures(report):
    tables = report["tables"]
    assert len(tables.summary) >= 15
    for ref, value in tables.summary:
        assert value == cell(tables, ref["data-table"], ref["data-row"], ref["data-column"])
    # and they are the deployment the section describes, with its cost and energy
    labels = [ref["data-row"] for ref, _ in tables.summary]
    for needed in ("chip", "layout", "replicas", "USD/month", "USD per M output tokens", "kWh per M output tokens",
                   "TTFT margin", "TPOT margin"):
        assert needed in labels


def test_recommended_deployment_meets_the_targets_on_fresh_seeds(report):
    assert judged_met(recommended_overrides(report["tables"]), seeds=[901, 902])


def test_n_plus_one_matches_one_replica_fewer(report):
    tables = report["tables"]
    point = recommended_overrides(tables)
    replicas = point["deployment.replicas"]
    assert replicas >= 2, "pick a target rate that needs two replicas or more"
    down_row = f"one replica down ({replicas - 1} of {replicas})"
    claim = cell(tables, "capacity", down_row, "value")
    met = judged_met({**point, "deployment.replicas": replicas - 1}, seeds=[42, 43])   # the report's seeds
    assert claim.startswith("meets" if met else "misses")
    spare = cell(tables, "capacity", "replicas for N+1", "value")
    assert spare.startswith(str(replicas if met else replicas + 1))


NOTES = {"stopped": "stopped: the runs stopped once more of the measured requests had missed a limit",
         "over capacity": "over capacity: the fluid model's capacity bound, less its measured error"}


def test_a_load_point_past_capacity_says_so_and_its_whole_runs_miss(report):
    """Twice the target rate is past the recommendation's capacity: its runs stop once sure to miss the targets
    ("stopped"), or the fluid model's capacity bound proves the replicas too few and it is not simulated ("over
    capacity"); its row shows that label for the figures it cannot give and "no" for the targets, the table's note
    says why, and whole runs at that rate on the report's seeds miss the targets beyond doubt."""
    tables = report["tables"]
    _, *rows = tables.tables["load-points"]
    past = [row for row in rows if row[2] in NOTES]
    assert past and past[-1] == rows[-1], "twice the target rate should be past the deployment's capacity"
    for row in past:
        assert row[2:6] == [row[2]] * 4 and row[6] == "no"
        assert NOTES[row[2]] in report["md"]
    rate = float(past[-1][0].removesuffix(" req/s"))
    whole = judged_at(recommended_overrides(tables), [42, 43], rate)
    assert not whole.stopped and not whole.verdict.met and whole.verdict.decided


@pytest.mark.parametrize("args, key", [
    (["--hardware", "H900-imaginary"], "--hardware"),
    (["--trace", str(REPO / "scenarios" / "traces" / "synthetic-burst.csv"), "--growth", "0"], "--growth"),
    (["--growth", "2x"], "--growth"),
    (["--target-rate", "-3"], "--target-rate"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, key):
    out = tmp_path / "out"
    assert main(["report", str(SMALL), *args, "--out", str(out)]) == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_unwritable_output_folder_exits_2(tmp_path, capsys):
    inside_a_file = tmp_path / "a-file"
    inside_a_file.write_text("x")
    for out in (inside_a_file / "report", Path("/proc/llmsim-report")):
        assert main(["report", str(SMALL), "--out", str(out)]) == 2
        assert "--out" in capsys.readouterr().err
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_traffic_classes_are_shown(tmp_path):
    """A scenario with traffic classes gets a table of them in the workload section."""
    scenario = tmp_path / "classes.yaml"
    scenario.write_text(SMALL.read_text().replace(
        "  output_tokens: {distribution: lognormal, mean: 48, sigma: 0.5, max: 256}\n",
        "  output_tokens: {distribution: lognormal, mean: 48, sigma: 0.5, max: 256}\n"
        "  classes:\n    interactive: {share: 0.3}\n    batch: {share: 0.7, output_tokens: 96}\n"))
    from llmsim.report.build import ReportBuilder, traffic_from_rate
    builder = ReportBuilder(scenario, traffic_from_rate(30.0), hardware=["H100-SXM"], workers=1)
    builder._workload()
    classes = next(t for t in builder.sections[0].tables if t.key == "classes")
    assert [row[0] for row in classes.rows] == ["interactive", "batch"]
    assert [row[1] for row in classes.rows] == ["30%", "70%"]
    assert [row[-1] for row in classes.rows] == ["48.0", "96.0"]          # the class's own output length
