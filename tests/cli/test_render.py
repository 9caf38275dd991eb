"""The terminal summary: lines fit a 120-column terminal, and a ratio below one is said as "slower"."""
from __future__ import annotations

import pytest

from llmsim import simulate, summarize
from llmsim.cli.render import WIDTH, _attainment_interval, _times, format_summary
from llmsim.search.speedup import speedup_over_plain

from tests.helpers import make_scenario


@pytest.mark.parametrize("ratio, said", [(2.5, "2.50x faster"), (1.0, "1.00x (the same)"),
                                         (0.998, "1.00x (the same)"), (0.30, "3.33x slower"),
                                         (float("nan"), "-")])
def test_a_ratio_is_said_as_faster_or_slower(ratio, said):
    assert _times(ratio, "faster", "slower") == said


def test_a_speculative_summary_fits_the_terminal_and_says_slower_when_it_is():
    scenario = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "k": 4},
                              "workload": {"num_requests": 60}})
    result = simulate(scenario)
    summary = summarize(result).to_dict()
    summary["speculation"]["speedup_over_plain"] = {**speedup_over_plain(result), "tpot_mean": 0.30, "e2e_p50": 0.5,
                                                    "output_tokens_per_s": 0.8}
    text = format_summary(summary)
    assert max(map(len, text.splitlines())) <= WIDTH
    words = " ".join(text.split())
    assert "TPOT 3.33x slower" in words and "0.30x" not in words
    assert "p50 end-to-end 2.00x slower" in words and "output tok/s 1.25x lower" in words and "0.50x" not in words
    words = " ".join(text.split())       # wrapping moves words to the next line, and loses none
    assert f"acceptance {100 * summary['speculation']['acceptance_rate']:,.1f}%" in words


def test_an_attainment_every_request_met_prints_no_zero_width_interval():
    """At a light load every request meets the SLO: the batch means do not vary, and "+- 0.0" would claim a
    certainty the run lacks, so the line says why there is no interval."""
    summary = summarize(simulate(make_scenario({"workload": {"arrival": {"rate": 2.0}, "num_requests": 300},
                                                "slo": {"ttft": "10 s", "tpot": "1 s"}}))).to_dict()
    assert summary["slo"]["attainment"] == 1.0 and summary["slo"]["attainment_stderr"] == 0.0
    line = next(line for line in format_summary(summary).splitlines() if line.startswith("SLO"))
    assert "+- 0.0" not in line and "every request in the window met it: no interval" in line


def test_an_attainment_interval_is_never_printed_as_zero_wide():
    """A day of 8.6M requests in which 171 missed the SLO: attainment 0.99998 with a standard error of 6e-6.
    At one decimal the interval printed as "+- 0.0"; it is shown to two significant figures instead."""
    shown = _attainment_interval(0.9999802575, 5.970559e-06)
    assert shown == "+- 0.0012 at 95%"
    assert _attainment_interval(0.93, 0.004) == "+- 0.8 at 95%"
    assert "no interval" in _attainment_interval(1.0, 0.0)
