"""Small collectives carry over between GPUs of one NVLink fabric, not between fabrics: B200's measured custom
all-reduce (vLLM 0.24, in CUDA graphs, HGX baseboard) against the fit to B300's (the same HGX fabric) and to B300's
and GB200's pooled (GB200: an NVL72 rack of Grace hosts, about 5 us a call where both HGX boards take 7 us).
Needs the whole operator database (skipped without it)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest

from llmsim import lookup_hardware
from llmsim.calibration import database as db
from llmsim.calibration.database_fit import SMALL_MESSAGE_BYTES, summary, with_device
from llmsim.calibration.database_profile import GROUPS, fit_group, predict

pytest.importorskip("pyarrow")
pytestmark = pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                                reason="needs pip install 'llmsim[measured]'")


def _custom_all_reduce(database: db.Database, gpu: str) -> pd.DataFrame:
    table = database.table(gpu, "comm", "vllm", "custom_allreduce_perf", "0.24.0")
    return with_device(db.custom_all_reduce_rows(table), lookup_hardware(gpu))


def test_the_fabric_table_names_every_gpu_the_database_has():
    assert set(db.GPU_FOLDERS) == set(db.FABRICS) == set(db.ARCHITECTURES)


def test_b200_small_custom_all_reduce_is_predicted_by_the_same_fabric_not_by_another():
    database = db.Database(db.installed_root())
    b200 = _custom_all_reduce(database, "B200")
    small = (b200["bytes"] < SMALL_MESSAGE_BYTES).to_numpy()
    group = GROUPS["custom_all_reduce"]

    def held_out(donors: list[str]) -> dict[str, float]:
        pooled = pd.concat([_custom_all_reduce(database, gpu) for gpu in donors], ignore_index=True)
        signed = predict(group, fit_group(group, pooled), b200)
        return summary(signed[small & ~np.isnan(signed)])

    same_fabric = held_out(["B300"])
    assert same_fabric["mape"] <= 0.10 and abs(same_fabric["median_error"]) <= 0.05, same_fabric
    mixed = held_out(["B300", "GB200"])
    assert mixed["median_error"] < -0.05, mixed


def test_custom_all_reduce_switches_to_two_shot_where_vllm_does_and_carries_to_b200():
    """vLLM's ``CustomAllreduce::allreduce`` (csrc/custom_all_reduce.cuh) runs its one-shot kernel on 4 GPUs below
    512 KiB and on 8 below 256 KiB, the two-shot kernel from there. Fitted to B300's table alone, the switch lands
    between the measured sizes that bracket those thresholds, and B200's rows from 64 KiB (never fitted) are
    predicted within the acceptance (MAPE <= 10%, |median| <= 5%); the faster of two smooth lines missed it."""
    database = db.Database(db.installed_root())
    group = GROUPS["custom_all_reduce"]
    values = fit_group(group, _custom_all_reduce(database, "B300"))
    assert 256 * 1024 < values[4]["two_shot_from_bytes"] <= 512 * 1024
    assert 128 * 1024 < values[8]["two_shot_from_bytes"] <= 256 * 1024
    b200 = _custom_all_reduce(database, "B200")
    signed = predict(group, values, b200)
    large = summary(signed[(b200["bytes"] >= SMALL_MESSAGE_BYTES).to_numpy()])
    assert large["mape"] <= 0.10 and abs(large["median_error"]) <= 0.05, large
