"""The named links: every figure names its source and says how sure it is; the transfer time is the closed
form bytes / (bandwidth x efficiency x lanes) + latency."""
from __future__ import annotations

import math

import pytest

from llmsim.catalog.links import LINKS, lookup_link

CONFIDENCE = {"datasheet", "measured", "assumption"}


@pytest.mark.parametrize("name", sorted(LINKS))
def test_every_figure_is_sourced(name):
    link = LINKS[name]
    assert set(link.figures) == {"bandwidth", "efficiency", "latency"}
    for figure in link.figures.values():
        assert figure.confidence in CONFIDENCE and len(figure.source) > 20
        # An assumption says it is one; a measurement names where it was measured.
        assert figure.source.startswith(figure.confidence) or figure.confidence == "datasheet"
    assert 0 < link.efficiency <= 1 and link.bandwidth_bytes_per_s > 0 and link.latency_s >= 0


def test_line_rates_follow_from_the_signalling_rates():
    """400 Gb/s ports carry 50 GB/s, 800 Gb/s ports 100 GB/s; PCIe 5.0 x16 is 32 GT/s x 16 x 128/130 / 8."""
    assert LINKS["infiniband_ndr"].bandwidth_bytes_per_s == 400e9 / 8
    assert LINKS["roce_400g"].bandwidth_bytes_per_s == 400e9 / 8
    assert LINKS["infiniband_xdr"].bandwidth_bytes_per_s == 800e9 / 8
    assert LINKS["pcie_gen5"].bandwidth_bytes_per_s == pytest.approx(32e9 * 16 * 128 / 130 / 8, rel=0.01)


@pytest.mark.parametrize("name", sorted(LINKS))
def test_transfer_time_is_bytes_over_effective_bandwidth_plus_latency(name):
    link = LINKS[name]
    nbytes, lanes = 2.5e9, 8
    assert link.transfer_s(nbytes, lanes) == pytest.approx(
        nbytes / (link.bandwidth_bytes_per_s * link.efficiency * lanes) + link.latency_s, rel=1e-12)
    assert link.transfer_s(0.0) == link.latency_s


def test_names_are_looked_up_loosely_and_unknown_ones_refused():
    assert lookup_link("InfiniBand-NDR") is LINKS["infiniband_ndr"]
    with pytest.raises(ValueError, match="unknown link; did you mean 'nvlink"):
        lookup_link("nvlink3")
    assert not math.isinf(LINKS["nvlink5"].transfer_s(1e9))
