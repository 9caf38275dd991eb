"""Fixtures shared across test folders: the shipped H100 profile and the Vidur-fitted cross-check of it.

A fixture used by one file stays in that file; one used by several lives here (session-scoped: each is
read-only and takes a fit or a file read to build)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from llmsim import lookup_hardware
from llmsim.calibration.kernel_profile import calibrate_from_measurements
from llmsim.calibration.operators import Measurements, read_measurements
from llmsim.catalog.hardware import HardwareProfile

from tests.helpers import REPO

VIDUR_DATA = REPO / "llmsim" / "calibration" / "data" / "vidur"


@pytest.fixture(scope="session")
def h100() -> HardwareProfile:
    """The shipped H100-SXM profile, measured kernel terms included."""
    return lookup_hardware("H100-SXM")


@pytest.fixture(scope="session")
def vidur_measurements() -> Measurements:
    """Vidur's A100 and H100 operator timings, shipped in llmsim/calibration/data/vidur."""
    return read_measurements(VIDUR_DATA)


@pytest.fixture(scope="session")
def vidur_h100(vidur_measurements: Measurements, h100: HardwareProfile) -> HardwareProfile:
    """The H100 with the terms fitted to Vidur's timings: the shipped profile's GEMM, attention and all-reduce
    figures come from NVIDIA's operator database, and these stay the cross-check (and the source the MI300X
    and GH200 terms were derived from)."""
    return replace(h100, kernels=calibrate_from_measurements(vidur_measurements, "h100", h100)[0])
