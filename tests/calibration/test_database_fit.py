"""The measured operator database (aiconfigurator-core): its reader, the fitted forms against rows they were not
fitted to, and the terms the shipped profiles carry in the cost model. An excerpt of the database is committed
(tests/data/aiconfigurator, rows listed in its README) so these run without the wheel; the leave-one-GPU-out
check needs the whole database and is skipped without it."""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pandas as pd
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.calibration import database as db
from llmsim.calibration.database_fit import (ALL_REDUCE, COLLECTIVE, CUSTOM_ALL_REDUCE, DECODE_ATTENTION,
                                             DECODE_ATTENTION_OCCUPIED, EXPONENTIALS_COLUMN, GEMM,
                                             PREFILL_ATTENTION, PREFILL_TILE_TOKENS, errors, exponentials_per_clock,
                                             held_out_split, summary, with_device)
from llmsim.catalog.kernel_terms import EngineKernels
from llmsim.cli.main import main
from llmsim.cost.features import F
from llmsim.cost.kernels import all_reduce_time_s, custom_all_reduce_time_s
from llmsim.errors import ConfigError

from tests.helpers import REPO, make_scenario

pytest.importorskip("pyarrow")
EXCERPT = REPO / "tests" / "data" / "aiconfigurator"
H100 = "H100-SXM"
# hardware_profiles/h100-sxm.yaml, engines.trtllm validation: decode_attention_fp8_kv held out (2197 rows)
PROFILE_FP8_KV_HELD_OUT = {"mape": 0.1441, "median_error": 0.01763}


@pytest.fixture(scope="module")
def excerpt():
    return db.Database(EXCERPT)


def test_the_reader_converts_milliseconds_and_element_counts(excerpt):
    """Latencies are milliseconds, message sizes element counts (2 bytes each in half precision): the first NCCL row
    of h100_sxm/comm/nccl/2.29.2 is a 2-GPU all-reduce of 256 elements in 0.00618 ms."""
    table = excerpt.table(H100, "comm", "nccl", "nccl_perf")
    assert table.version == "2.29.2"                    # the newest of 2.27.3 and 2.29.2
    rows = db.collective_rows(table, "all_reduce")
    first = rows[(rows["group"] == 2)].sort_values("bytes").iloc[0]
    assert first["bytes"] == 512 and first["measured_s"] == pytest.approx(6.18e-6)
    assert "h100_sxm/comm/nccl/2.29.2/nccl_perf.parquet" in table.citation


def test_the_reader_keeps_the_fastest_kernel_of_each_shape(excerpt):
    table = excerpt.table(H100, "gemm", "vllm", "gemm_perf")
    raw = table.frame
    rows = db.gemm_rows(table)
    assert len(rows) == len(raw.groupby(["gemm_dtype", "m", "n", "k"]))
    for row in rows.itertuples():
        same = raw[(raw["m"] == row.m) & (raw["n"] == row.n) & (raw["k"] == row.k)
                   & (raw["gemm_dtype"].map(db.GEMM_DTYPES) == row.dtype)]
        assert row.measured_s == pytest.approx(same["latency"].min() * 1e-3)


def test_versions_sort_numerically(excerpt):
    assert db._version_key("0.5.6.post2") < db._version_key("0.5.14")
    assert db._version_key("1.3.0rc10") < db._version_key("1.3.0rc20")
    assert excerpt.versions(H100, "comm", "vllm", "custom_allreduce_perf") == ["0.19.0", "0.24.0"]


def test_without_the_database_the_command_exits_2_with_the_pip_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == db.DATABASE_PACKAGE else real(name, *a))
    assert main(["calibrate", "--from-database"]) == 2
    assert "pip install 'llmsim[measured]'" in capsys.readouterr().err


def _rows(excerpt, h100, reader, operator, framework, table, *args):
    rows = with_device(reader(excerpt.table(H100, operator, framework, table), *args), h100)
    return rows.assign(**{EXPONENTIALS_COLUMN: exponentials_per_clock(H100)}) if operator == "attention" else rows


@pytest.mark.parametrize("form, reader, operator, framework, table, args, split, mape", [
    (GEMM, db.gemm_rows, "gemm", "vllm", "gemm_perf", (), "m", 0.15),
    (DECODE_ATTENTION, db.decode_attention_rows, "attention", "vllm", "generation_attention_perf", (), "kv_tokens",
     0.15),
    (PREFILL_ATTENTION, db.prefill_attention_rows, "attention", "vllm", "context_attention_perf", (), "tokens", 0.15),
    (ALL_REDUCE, db.collective_rows, "comm", "nccl", "nccl_perf", ("all_reduce",), "bytes", 0.10),
    (COLLECTIVE, db.collective_rows, "comm", "nccl", "nccl_perf", ("alltoall",), "bytes", 0.15),
    (CUSTOM_ALL_REDUCE, db.custom_all_reduce_rows, "comm", "vllm", "custom_allreduce_perf", (), "bytes", 0.10),
])
def test_each_form_predicts_measured_rows_it_was_not_fitted_to(excerpt, h100, form, reader, operator, framework,
                                                              table, args, split, mape):
    """Fitted to every other token count / KV length / message size of the excerpt, each form predicts the rows in
    between (measured, never fitted) within the stated MAPE and without a bias past 5%."""
    rows = _rows(excerpt, h100, reader, operator, framework, table, *args)
    if "dtype" in rows:
        rows = rows[rows["dtype"] == "bf16"]
    groups = rows.groupby("group") if form in (ALL_REDUCE, COLLECTIVE, CUSTOM_ALL_REDUCE) else [(None, rows)]
    signed = []
    for _, part in groups:
        fitted, held = held_out_split(part.reset_index(drop=True), split)
        fixed = {"quantize_share": 1.0} if form is GEMM else None
        signed.append(errors(form, form.fit(fitted, fixed), held))
    result = summary(np.concatenate(signed))
    assert result["mape"] <= mape, result
    assert abs(result["median_error"]) <= 0.05, result


def test_the_shipped_nccl_terms_predict_another_nccl_version(excerpt, h100):
    """The shipped H100 all-reduce terms were fitted to NCCL 2.29.2; NCCL 2.27.3's rows (never fitted) on the same
    machine type are predicted within 12% at every group size and message size class."""
    rows = db.collective_rows(excerpt.table(H100, "comm", "nccl", "nccl_perf", "2.27.3"), "all_reduce")
    for group, part in rows.groupby("group"):
        predicted = all_reduce_time_s(part["bytes"].to_numpy(), int(group), h100.kernels.all_reduce_for(int(group)))
        signed = predicted / part["measured_s"].to_numpy() - 1
        assert np.mean(np.abs(signed)) <= 0.12, (group, summary(signed))


def test_nccls_three_protocol_lines_predict_the_message_sizes_they_were_not_fitted_to(excerpt, h100):
    """The all-reduce form has NCCL's three protocols (LL, LL128, Simple): fitted to every other message size of
    NCCL 2.29.2's H100 rows, it predicts the sizes in between within 6% on average at every group size, and every
    held-out message of 64 MiB and up within 5% (two lines were 16% off at 8 GPUs there: the Simple protocol's
    bandwidth still rises from 64 MiB to 1 GiB)."""
    rows = with_device(db.collective_rows(excerpt.table(H100, "comm", "nccl", "nccl_perf", "2.29.2"), "all_reduce"),
                       h100)
    for group, part in rows.groupby("group"):
        fitted, held = held_out_split(part, "bytes")
        signed = errors(ALL_REDUCE, ALL_REDUCE.fit(fitted), held)
        assert np.mean(np.abs(signed)) <= 0.06, (group, summary(signed))
        large = held["bytes"].to_numpy() >= 64 * 2 ** 20
        assert large.sum() >= 2 and (np.abs(signed[large]) <= 0.05).all(), (group, signed[large])


def test_the_shipped_nccl_terms_price_large_messages_of_another_nccl_version(excerpt, h100):
    """The shipped H100 all-reduce terms (fitted to NCCL 2.29.2) against NCCL 2.27.3's rows of 64 MiB and up (never
    fitted): within 6% at every group size (the two-line terms priced 8 GPUs' 512 MiB 21% too slow)."""
    rows = db.collective_rows(excerpt.table(H100, "comm", "nccl", "nccl_perf", "2.27.3"), "all_reduce")
    for group, part in rows[rows["bytes"] >= 64 * 2 ** 20].groupby("group"):
        predicted = all_reduce_time_s(part["bytes"].to_numpy(), int(group), h100.kernels.all_reduce_for(int(group)))
        signed = predicted / part["measured_s"].to_numpy() - 1
        assert (np.abs(signed) <= 0.06).all(), (group, signed)


def test_the_shipped_custom_all_reduce_predicts_an_older_vllm(excerpt, h100):
    """vLLM 0.19.0's custom all-reduce (never fitted: the profile's is 0.24.0's) below the switch-over size."""
    rows = db.custom_all_reduce_rows(excerpt.table(H100, "comm", "vllm", "custom_allreduce_perf", "0.19.0"))
    for group, part in rows.groupby("group"):
        custom = h100.kernels.custom_all_reduce_for(int(group))
        part = part[part["bytes"] <= custom.switch_over_bytes]
        predicted = custom_all_reduce_time_s(part["bytes"].to_numpy(), int(group), custom)
        signed = predicted / part["measured_s"].to_numpy() - 1
        assert np.mean(np.abs(signed)) <= 0.15, (group, summary(signed))


def test_small_all_reduces_take_the_engines_kernel_and_large_ones_nccl(h100):
    """Two all-reduces per layer at TP 8: a decode step's message (64 rows of 4096 bf16 = 512 KiB) is priced by the
    custom kernel's line when under its switch-over, a 64 MiB one by NCCL's."""
    model = model_catalog()["Llama-3.1-70B"]
    cost = CostModel(model, h100, tensor_parallel=8)
    custom, nccl = h100.kernels.custom_all_reduce_for(8), h100.kernels.all_reduce_for(8)
    for rows in (64, 8192):
        message = rows * model.hidden_size * 2.0
        x = np.zeros(len(F))
        x[F["one"]], x[F["tokens"]] = 1, rows
        once = (custom_all_reduce_time_s(message, 8, custom) if message <= custom.switch_over_bytes
                else all_reduce_time_s(message, 8, nccl))
        expected = 2 * model.num_layers * once
        assert float(cost._all_reduce_time(x)) == pytest.approx(float(expected))
    assert custom.switch_over_bytes >= 64 * model.hidden_size * 2.0


def test_decode_attention_in_the_cost_model_matches_measured_kernels(excerpt, h100):
    """Llama-3.1-8B at TP 1 has the excerpt's shape (32 heads, 8 KV heads of 128): the cost model's decode attention
    over its 32 layers, one layer's worth, against the measured vLLM kernel at every batch and KV length of the
    excerpt (in-sample rows: this checks the wiring of the fitted terms, not their fit)."""
    model = model_catalog()["Llama-3.1-8B"]
    cost = CostModel(model, h100)
    rows = db.decode_attention_rows(excerpt.table(H100, "attention", "vllm", "generation_attention_perf"))
    x = np.zeros((len(rows), len(F)))
    x[:, F["one"]] = 1
    x[:, F["decode_seqs"]] = rows["batch"]
    x[:, F["decode_kv_read"]] = rows["batch"] * rows["kv_tokens"]
    per_layer = cost.attention_time_s(x) / model.num_layers
    signed = per_layer / rows["measured_s"].to_numpy() - 1
    assert np.mean(np.abs(signed)) <= 0.20, summary(signed)
    # The old assumption (1 us per sequence, no floor) was 5-8x too slow at 1,024 sequences of short context.
    big = (rows["batch"] == 1024).to_numpy() & (rows["kv_tokens"] <= 63).to_numpy()
    assert (np.abs(signed[big]) <= 0.3).all()


def test_fp8_models_are_priced_by_the_fp8_gemm_terms(h100):
    fp8 = h100.kernels.gemm_by_dtype["fp8"]
    terms = h100.kernels.for_dtype("fp8")
    assert terms.gemm_flops_per_s["fp8"] == fp8.flops_per_s and terms.gemm_floor_s == fp8.floor_s
    # vLLM's CUTLASS dispatch (the section's engine's) prices the FP8 GEMMs, their input's quantization at its rate.
    assert fp8.dispatch is not None and terms.gemm_dispatch is fp8.dispatch
    assert terms.gemm_quantize_bandwidth_bytes_per_s == fp8.dispatch.sms * fp8.dispatch.quantize_bytes_per_s_per_sm > 0
    assert h100.kernels.for_dtype("bf16") is h100.kernels
    cost = CostModel(model_catalog()["Llama-3.1-8B"].with_dtypes(weight_dtype="fp8"), h100)
    assert cost.kernels.gemm_floor_s == fp8.floor_s


def test_every_database_figure_names_its_table():
    for name in db.GPU_FOLDERS:
        profile = lookup_hardware(name)
        measured = {key: fig for key, fig in profile.figures.items()
                    if key.startswith("kernels.") and "from-database" in fig.source}
        assert measured, name
        for key, fig in measured.items():
            assert fig.confidence == "measured" and ".parquet" in fig.source and "rows" in fig.source, key


def test_the_scenario_picks_the_engines_kernels():
    vllm = make_scenario()
    sglang = make_scenario({"engine": {"kernels": "sglang"}})
    assert vllm.engine.kernels is EngineKernels.VLLM and sglang.engine.kernels is EngineKernels.SGLANG
    assert vllm.hardware.kernels == lookup_hardware(H100).kernels
    assert sglang.hardware.kernels == lookup_hardware(H100).engine_kernels["sglang"] != vllm.hardware.kernels


def test_an_unknown_engine_or_a_profile_without_its_terms_is_refused():
    with pytest.raises(ConfigError, match="engine.kernels"):
        make_scenario({"engine": {"kernels": "tgi"}})
    with pytest.raises(ConfigError, match="no measured kernel terms for this engine"):
        make_scenario({"hardware": "MI300X", "engine": {"kernels": "trtllm"}})


def test_calibrate_from_the_excerpt_writes_a_profile_with_a_validation_table(tmp_path, capsys):
    assert main(["calibrate", "--from-database", str(EXCERPT), "--gpu", H100, "--engine", "vllm",
                 "--out", str(tmp_path)]) == 0
    profile = lookup_hardware(str(tmp_path / "h100-sxm.yaml"))
    assert profile.kernels.custom_all_reduce and profile.kernels.decode_attention_efficiency > 0
    validation = pd.read_csv(tmp_path / "h100-sxm-validation.csv")
    assert {"gemm_bf16", "decode_attention", "all_reduce", "custom_all_reduce"} <= set(validation["group"])
    assert "held-out errors" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
def test_collectives_hold_out_of_gpu():
    """Leave one GPU out (the whole database): NCCL's all-reduce on H100, H200 and B200 predicted by the shares of
    the datasheet link bandwidth fitted to the other GPUs of the same architecture, within MAPE 10%, median 5%."""
    from llmsim.calibration.database_profile import ACCEPTANCE_MAPE, ACCEPTANCE_MEDIAN, leave_one_gpu_out
    table = leave_one_gpu_out(db.Database(db.installed_root()), ("H100-SXM", "H200", "B200"), same_architecture=True)
    reduce = table[table["group"].str.startswith("all-reduce")]
    assert len(reduce) == 6
    assert (reduce["mape"] <= ACCEPTANCE_MAPE).all(), reduce
    assert (reduce["median_error"].abs() <= ACCEPTANCE_MEDIAN).all(), reduce


def test_a_profile_alias_names_the_database_gpu_of_its_profile(tmp_path):
    """``--gpu H100`` (the H100-SXM profile's alias, as the README writes it) fits the same profile as
    ``--gpu H100-SXM``."""
    for gpu, folder in (("H100", "alias"), (H100, "name")):
        assert main(["calibrate", "--from-database", str(EXCERPT), "--gpu", gpu, "--engine", "vllm",
                     "--out", str(tmp_path / folder)]) == 0
    assert (tmp_path / "alias" / "h100-sxm.yaml").read_text() == (tmp_path / "name" / "h100-sxm.yaml").read_text()


def test_a_gpu_the_database_lacks_exits_2_naming_the_ones_it_has(tmp_path, capsys):
    assert main(["calibrate", "--from-database", str(EXCERPT), "--gpu", "MI300X", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "--gpu" in error and "MI300X" in error and H100 in error


def _trtllm_decode_rows(excerpt, kv_dtype: str) -> pd.DataFrame:
    return db.decode_attention_rows(excerpt.table(H100, "attention", "trtllm", "generation_attention_perf"), kv_dtype)


def test_an_fp8_kv_cache_is_fitted_apart_and_predicts_rows_it_was_not_fitted_to(excerpt, h100):
    """TensorRT-LLM's FP8-cache decode kernels are fitted to FP8 rows with one byte per cached element, by the form
    the profiles ship for them (the occupied form): fitted to every other KV length of the excerpt (Llama-3.1-8B's
    shape on H100), it predicts the lengths in between as well as the shipped H100 profile's validation table says it
    predicts the whole database's held-out FP8 rows (engines.trtllm, decode_attention_fp8_kv, 2197 rows: MAPE 14.4%,
    median error +1.8%), within two standard errors of the excerpt's 14 held-out rows.

    Why not a fixed 15%: the form's least-squares optimum on these 16 rows predicts the held-out ones at 16.5% MAPE
    (the one-line form at 15.1%), and least squares does not always reach it: the rate share is flat wherever the
    read, not the arithmetic, is binding, so which local minimum it stops in turns on the last bits of the linear
    algebra (OpenBLAS's kernel for the CPU: the one-line form 10.2% with Sandybridge's kernels, 15.1% with AVX2's; this
    form 11.4% here, 14.3-16.5% from other starts). A 15% bound passed or failed with the machine; the 16-bit rows'
    fit priced over FP8 bytes misses these rows by 91%."""
    rows = with_device(_trtllm_decode_rows(excerpt, "fp8"), h100)
    assert (rows["kv_bytes"] == 1.0).all() and len(rows) == 30
    fitted, held = held_out_split(rows.reset_index(drop=True), "kv_tokens")
    signed = errors(DECODE_ATTENTION_OCCUPIED, DECODE_ATTENTION_OCCUPIED.fit(fitted), held)
    result = summary(signed)
    mape_se = np.std(np.abs(signed), ddof=1) / np.sqrt(len(signed))
    median_se = np.sqrt(np.pi / 2) * np.std(signed, ddof=1) / np.sqrt(len(signed))   # a median's, normal errors
    assert result["mape"] <= PROFILE_FP8_KV_HELD_OUT["mape"] + 2 * mape_se, (result, mape_se)
    assert abs(result["median_error"] - PROFILE_FP8_KV_HELD_OUT["median_error"]) <= 2 * median_se, (result, median_se)


def _decode_per_layer_s(cost: CostModel, rows: pd.DataFrame) -> np.ndarray:
    x = np.zeros((len(rows), len(F)))
    x[:, F["one"]] = 1
    x[:, F["decode_seqs"]] = rows["batch"]
    x[:, F["decode_kv_read"]] = rows["batch"] * rows["kv_tokens"]
    return cost.attention_time_s(x) / cost.model.num_layers


def test_an_fp8_kv_cache_is_priced_by_its_own_decode_kernels():
    """Measured (TensorRT-LLM 1.3 on H100, the excerpt): at 256 and more sequences an FP8 cache's decode attention takes
    a third to a half of a 16-bit cache's, not the half that reading half the bytes would give (its kernels do less
    fixed work per sequence). Priced by the 16-bit terms over the FP8 bytes, the cost model was 1.4-2.3x too slow there;
    priced by the FP8 terms (``attention.by_kv_dtype``, the full read rate of the occupied form, whose held-out MAPE
    the profile's validation table gives as 14%) it is within 15% on average at this shape."""
    model = model_catalog()["Llama-3.1-8B"].with_dtypes(weight_dtype="fp8", kv_dtype="fp8")
    h100 = lookup_hardware(H100)
    trtllm = h100.engine_kernels["trtllm"]
    assert "fp8" in trtllm.decode_by_kv_dtype
    rows = _trtllm_decode_rows(db.Database(EXCERPT), "fp8")
    measured = rows["measured_s"].to_numpy()
    own = _decode_per_layer_s(CostModel(model, dataclasses.replace(h100, kernels=trtllm)), rows) / measured - 1
    assert np.mean(np.abs(own)) <= 0.15, summary(own)
    sixteen_bit = dataclasses.replace(h100, kernels=dataclasses.replace(trtllm, decode_by_kv_dtype={}))
    old = _decode_per_layer_s(CostModel(model, sixteen_bit), rows) / measured - 1
    busy = (rows["batch"] >= 256).to_numpy()
    assert (old[busy] >= 0.4).all() and np.median(old[busy]) >= 0.75, summary(old[busy])


def test_the_same_point_reference_carries_a_donor_measurement_by_the_forms_device_ratio():
    """Closed form: a donor H200 whose all-reduces take exactly the fitted line's time, and a held-out H100 whose
    first half of sizes take the line's H100 time and second half 1.2x it, give reference errors of 0 and +1/1.2 - 1
    (the donor's measurement times the line's H100/H200 ratio over the held-out measurement); a size no donor
    measured gives NaN."""
    from llmsim.calibration.database_profile import GROUPS, same_point_errors
    group = GROUPS["all_reduce"]
    sizes = 2.0 ** np.arange(10, 26)
    values = {8: {"latency_s": 8e-6, "bus_share": 0.05, "large_latency_s": 3e-5, "large_bus_share": 0.8,
                  "medium_latency_s": 1.5e-5, "medium_bus_share": 0.3}}
    frame = pd.DataFrame({"group": 8, "bytes": sizes, "table": "t"})
    donor = with_device(frame, lookup_hardware("H200"))
    donor = donor.assign(measured_s=ALL_REDUCE(values[8], donor))
    held = with_device(frame.assign(bytes=np.append(sizes[:-1], 2.0 ** 40)), lookup_hardware(H100))
    line = ALL_REDUCE(values[8], held)
    slow = np.arange(len(held)) >= len(held) // 2
    held = held.assign(measured_s=np.where(slow, 1.2 * line, line))
    found = same_point_errors(group, values, held, [donor])
    assert np.isnan(found[-1])
    np.testing.assert_allclose(found[:-1], np.where(slow, 1 / 1.2 - 1, 0.0)[:-1], atol=1e-12)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
def test_h100_fp8_gemms_differ_from_h200s_by_more_than_the_datasheets_say():
    """Why no carried-over form meets the target for H100's FP8 GEMMs (docs/accuracy/kernel-terms.md): at M <= 16
    (memory-bound) an H100 takes well under the HBM ratio of an H200's time at the same shape (the datasheets say
    4.8 / 3.35 = 1.43x), and even H200's own measurement of each shape, carried over by the fitted form's device
    ratio, misses H100's by more than the 10% MAPE."""
    from llmsim.calibration.database_profile import ACCEPTANCE_MAPE, GROUPS, fit_group, operator_rows, same_point_errors
    database = db.Database(db.installed_root())
    rows = {gpu: operator_rows(database, gpu, db.EngineKernels.VLLM, lookup_hardware(gpu))["gemm_fp8"]
            for gpu in (H100, "H200")}
    same = rows[H100].merge(rows["H200"], on=["m", "n", "k"], suffixes=("_h100", "_h200"))
    small = same[same["m"] <= 16]
    hbm_ratio = (lookup_hardware("H200").memory_bandwidth_bytes_per_s
                 / lookup_hardware(H100).memory_bandwidth_bytes_per_s)
    assert np.median(small["measured_s_h100"] / small["measured_s_h200"]) < 0.9 * hbm_ratio
    group = GROUPS["gemm_fp8"]
    reference = same_point_errors(group, fit_group(group, rows["H200"]), rows[H100], [rows["H200"]])
    assert np.mean(np.abs(reference[~np.isnan(reference)])) > ACCEPTANCE_MAPE


def test_the_occupied_decode_form_reduces_to_the_line_and_halves_the_read_rate_at_half_blocks(excerpt, h100):
    """Closed form: with ``half_blocks`` 0 the occupied form is the one-line form; with every term but the KV read
    zeroed, a batch of ``b`` sequences over ``h_kv`` KV heads with ``half_blocks = b h_kv`` takes twice as long."""
    rows = with_device(_trtllm_decode_rows(excerpt, "fp8"), h100)
    line = {"floor_s": 5e-6, "per_sequence_s": 1e-8, "per_kv_head_s": 1e-8, "bandwidth_share": 0.8, "rate_share": 0.1}
    np.testing.assert_allclose(DECODE_ATTENTION_OCCUPIED({**line, "half_blocks": 0.0}, rows),
                               DECODE_ATTENTION(line, rows))
    memory_only = {**line, "floor_s": 0.0, "per_sequence_s": 0.0, "per_kv_head_s": 0.0, "rate_share": 1e9}
    one = rows[rows["batch"] == 64]
    np.testing.assert_allclose(DECODE_ATTENTION_OCCUPIED({**memory_only, "half_blocks": 64.0 * 8.0}, one),
                               2.0 * DECODE_ATTENTION(memory_only, one))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
@pytest.mark.parametrize("gpu", [H100, "H200"])
def test_the_fp8_cache_read_rate_follows_the_kernels_thread_blocks(gpu):
    """TensorRT-LLM's FP8-cache decode kernels read the cache faster the more (sequence, KV head) thread blocks a batch
    has (H200, 4 query heads per KV head, 1k+ tokens: 0.23 TB/s with one block, about 4 TB/s with a thousand). One line
    through every grouped-query row is pulled down by the few-block rows and prices a serving batch of Llama-3.1-8B's
    shape (32 query, 8 KV heads, 16+ sequences, 1k+ tokens) 13-18% slow at the median on KV lengths it was not fitted
    to; the occupied form (``blocks / (blocks + half_blocks)`` of the read rate) predicts them within 7%."""
    from llmsim.calibration.database_profile import operator_rows
    rows = operator_rows(db.Database(db.installed_root()), gpu, db.EngineKernels.TRTLLM, lookup_hardware(gpu))
    fitted, held = held_out_split(rows["decode_attention_fp8_kv"].reset_index(drop=True), "kv_tokens")
    serving = ((held["heads"] == 32) & (held["kv_heads"] == 8) & (held["kv_tokens"] >= 1023)
               & (held["batch"] * held["kv_heads"] >= 128)).to_numpy()
    line = summary(errors(DECODE_ATTENTION, DECODE_ATTENTION.fit(fitted), held)[serving])
    occupied = summary(errors(DECODE_ATTENTION_OCCUPIED, DECODE_ATTENTION_OCCUPIED.fit(fitted), held)[serving])
    assert line["median_error"] >= 0.10, line
    assert abs(occupied["median_error"]) <= 0.07 and occupied["mape"] < line["mape"], occupied


@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
@pytest.mark.parametrize("gpu", [H100, "H200", "B200"])
def test_the_engines_quantizer_predicts_tensor_widths_it_was_not_fitted_to(gpu):
    """TensorRT-LLM's FP8 quantizer (``scale_matrix_perf``, inputs of 256 MiB and more: past the L2 cache) fitted to
    every other tensor width ``k`` predicts the widths in between (measured, never fitted) within 3%, and the
    profile's figures hold them too."""
    from llmsim.calibration.database_fit import QUANTIZE
    from llmsim.calibration.database_profile import operator_rows
    database, hardware = db.Database(db.installed_root()), lookup_hardware(gpu)
    rows = operator_rows(database, gpu, db.EngineKernels.TRTLLM, hardware)["quantize"].reset_index(drop=True)
    fitted, held = held_out_split(rows, "k")
    result = summary(errors(QUANTIZE, QUANTIZE.fit(fitted), held))
    assert len(held) >= 20 and result["mape"] <= 0.03, result
    shipped = hardware.for_engine(EngineKernels.TRTLLM).kernels.quantize
    predicted = shipped.floor_s + 3.0 * held["m"] * held["k"] / shipped.bandwidth_bytes_per_s
    assert summary(predicted.to_numpy() / held["measured_s"].to_numpy() - 1.0)["mape"] <= 0.03


def _two_lines(sizes: np.ndarray, group: int = 4) -> pd.DataFrame:
    """All-to-all rows on an NVLink-like link timed exactly by COLLECTIVE's two lines (5 us + 0.2 of the link below,
    20 us + 0.8 of it above)."""
    rows = pd.DataFrame({"group": group, "bytes": sizes.astype(float), "link": 900e9})
    traffic = (group - 1) / group * rows["bytes"].to_numpy()
    return rows.assign(measured_s=np.minimum(5e-6 + traffic / (900e9 * 0.2), 20e-6 + traffic / (900e9 * 0.8)))


def test_two_sizes_timed_at_twice_their_neighbours_move_the_robust_nccl_lines_less_than_least_squares():
    """nccl-tests means jump at single sizes to about twice their neighbours': fitted to rows with two such sizes,
    the robust loss's lines stay within 3% of the exact ones over every size (least squares: 7.9% off)."""
    rows = _two_lines(2.0 ** np.arange(9, 30))
    spiked = rows.copy()
    spiked.loc[[1, 4], "measured_s"] *= 2.0
    robust = np.mean(np.abs(errors(COLLECTIVE, COLLECTIVE.fit(spiked), rows)))
    plain_form = dataclasses.replace(COLLECTIVE, robust_scale=None)
    plain = np.mean(np.abs(errors(plain_form, plain_form.fit(spiked), rows)))
    assert robust < 0.03 < 0.05 < plain
    # Without the spikes both recover the lines.
    assert np.mean(np.abs(errors(COLLECTIVE, COLLECTIVE.fit(rows), rows))) < 1e-3


@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
def test_h200_all_to_all_is_predicted_from_h100s_lines():
    """Leave one GPU out (the whole database): H200's NCCL all-to-all predicted by the lines fitted to H100's (the
    same NVLink fabric), within issue 29's MAPE 10% and median 5%; least squares on the same rows missed (10.1%)."""
    from llmsim.calibration import database_profile as dbp
    database = db.Database(db.installed_root())
    rows = {gpu: dbp.operator_rows(database, gpu, db.EngineKernels.VLLM, lookup_hardware(gpu))["all_to_all"]
            for gpu in (H100, "H200")}
    group = dbp.GROUPS["all_to_all"]
    signed = dbp.predict(group, dbp.fit_group(group, rows[H100]), rows["H200"])
    assert np.mean(np.abs(signed)) <= dbp.ACCEPTANCE_MAPE and abs(np.median(signed)) <= dbp.ACCEPTANCE_MEDIAN
    plain = dataclasses.replace(group, form=dataclasses.replace(group.form, robust_scale=None))
    assert np.mean(np.abs(dbp.predict(plain, dbp.fit_group(plain, rows[H100]), rows["H200"]))) > dbp.ACCEPTANCE_MAPE


def test_prompt_lengths_a_decode_kernel_timed_are_left_out_of_prefill_attention():
    """A Blackwell-style context table: one-token prompts timed by FlashInfer's TensorRT-LLM decode kernel (faster
    than the prefill kernel there) and by the prefill kernel, longer prompts by the prefill kernel alone. The prefill
    rows keep the longer prompts, each at its own measured time, and no one-token prompt."""
    shape = {"batch_size": 4, "step": 0, "num_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "window_size": 0, "kv_cache_dtype": "bfloat16", "attn_dtype": "bfloat16"}
    frame = pd.DataFrame([
        {**shape, "isl": 1, "latency": 0.004, "kernel_source": "vllm_flashinfer_trtllmdecode"},
        {**shape, "isl": 1, "latency": 0.010, "kernel_source": "vllm_flashinfer_trtllmprefill"},
        {**shape, "isl": 512, "latency": 0.050, "kernel_source": "vllm_flashinfer_trtllmprefill"},
        {**shape, "isl": 2048, "latency": 0.400, "kernel_source": "vllm_flashinfer_trtllmprefill"}])
    rows = db.prefill_attention_rows(db.Table(frame, "b200_sxm/attention/vllm/0.24.0/context_attention_perf.parquet",
                                              "0.24.0"))
    assert rows["tokens"].tolist() == [512.0, 2048.0]
    assert rows["measured_s"].tolist() == pytest.approx([50e-6, 400e-6])
    # A table without the column (older releases) keeps every row.
    older = db.Table(frame.drop(columns="kernel_source").iloc[1:], "a/attention/vllm/0.1/x.parquet", "0.1")
    assert sorted(db.prefill_attention_rows(older)["tokens"]) == [1.0, 512.0, 2048.0]


def test_the_query_tile_cost_adds_its_pairs_per_query_tile_of_each_head(h100):
    """The cost model's prefill attention with a query-tile cost of ``q`` pairs, less the same without it: ``q`` pairs
    per query tile of every head on the GPU, ``ceil(s / 64)`` tiles for a prompt of ``s`` tokens, at the 16-bit peak
    times the fitted efficiency, ``4 d`` FLOPs a pair, over every layer (the closed form, critical path off)."""
    model = model_catalog()["Llama-3.1-8B"]
    backend = dataclasses.replace(h100.kernels.prefill_attention, critical_path_blocks=0.0)
    q, tokens = 5000.0, 1000
    times = []
    for pairs in (0.0, q):
        kernels = dataclasses.replace(h100.kernels, prefill_backends={
            h100.kernels.prefill_backend: dataclasses.replace(backend, query_tile_pairs=pairs)})
        cost = CostModel(model, dataclasses.replace(h100, kernels=kernels), tensor_parallel=2)
        times.append(cost.attention_time_s(cost.features([tokens], [0], [])[None])[0])
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    closed = (q * -(-tokens // PREFILL_TILE_TOKENS) * model.num_heads / 2 * 4 * head_dim * model.num_layers
              / (h100.peak_for("bf16") * backend.efficiency))
    assert times[1] - times[0] == pytest.approx(closed, rel=1e-9)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(db.DATABASE_PACKAGE) is None,
                    reason="needs pip install 'llmsim[measured]'")
def test_prefill_attention_holds_out_of_gpu():
    """Leave one GPU out (the whole database): prefill attention on H100, H200 and B200 predicted by the form fitted
    to the other GPUs of the same architecture (rows of the target never fitted), within issue 29's MAPE 10% and
    median 5%; the form without its query-tile cost and softmax bound missed B200 (MAPE 13.6-14.4%)."""
    from llmsim.calibration.database_profile import ACCEPTANCE_MAPE, ACCEPTANCE_MEDIAN, leave_one_gpu_out
    table = leave_one_gpu_out(db.Database(db.installed_root()), ("H100-SXM", "H200", "B200"), same_architecture=True)
    prefill = table[table["group"] == "prefill attention"]
    assert len(prefill) == 3
    assert (prefill["mape"] <= ACCEPTANCE_MAPE).all(), prefill
    assert (prefill["median_error"].abs() <= ACCEPTANCE_MEDIAN).all(), prefill
