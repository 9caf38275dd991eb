"""The measured kernel terms (profiles' kernels: sections) against independent truths: the measured
timings themselves (shipped in llmsim/calibration/data/vidur), first principles, and the stated rules."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.calibration.operators import DEVICE_PROFILES
from llmsim.cli.main import main
from llmsim.cost.kernels import all_reduce_time_s, gemm_time_s, layer_gemm_shapes
from llmsim.cost.roofline import FEW_ROWS

from tests.helpers import REPO

DATA = REPO / "llmsim" / "calibration" / "data" / "vidur"


@pytest.mark.parametrize("device", ["a100", "h100"])
def test_a_gemm_that_fills_the_device_approaches_the_fitted_peak(vidur_measurements, device):
    """The largest measured GEMMs (4096 tokens through a 70B model's MLP on one GPU) run within 15% of
    the profile's fitted 16-bit rate, and the model prices them at that rate within 5%."""
    kernels = lookup_hardware(DEVICE_PROFILES[device]).kernels
    rows = vidur_measurements.for_device(device).linear
    big = rows[(rows["num_tokens"] == 4096) & (rows["tp"] == 1) & (rows["n_embd"] == 8192)].iloc[0]
    n, k, tokens = 2 * big["n_expanded_embd"], big["n_embd"], 4096
    measured_rate = 2 * tokens * n * k / (big["mlp_up_proj_ms"] * 1e-3)
    assert measured_rate == pytest.approx(kernels.gemm_rate("fp16"), rel=0.15)
    predicted = gemm_time_s(tokens, n, k, 2, 2, kernels, "fp16")
    assert 2 * tokens * n * k / predicted == pytest.approx(kernels.gemm_rate("fp16"), rel=0.05)


def test_the_floors_dominate_at_one_token(vidur_measurements, h100):
    """At one token the streaming kernels take microseconds where their bytes over bandwidth take nanoseconds:
    measured and predicted alike are within 35% of each other and over 50x the roofline's bytes / bandwidth."""
    rows = vidur_measurements.for_device("h100").linear
    one = rows[(rows["num_tokens"] == 1) & (rows["tp"] == 1) & (rows["n_embd"] == 4096)].iloc[0]
    kernels = h100.kernels
    hidden_bytes = 4096 * 2
    for column, kind, moved in (("add_ms", "residual", 3 * hidden_bytes),
                                ("input_layernorm_ms", "norm", 2 * hidden_bytes)):
        measured_s = one[column] * 1e-3
        element = kernels.elementwise[kind]
        predicted_s = (element.floor_s + moved / element.bandwidth_bytes_per_s
                       + moved / element.row_bandwidth_bytes_per_s)
        roofline_s = moved / h100.memory_bandwidth_bytes_per_s
        assert predicted_s == pytest.approx(measured_s, rel=0.35)
        assert measured_s > 50 * roofline_s and predicted_s > 50 * roofline_s


# The profiles' all-reduce terms are fitted to NCCL 2.27.3's rows of the operator database; on A100 4 GPUs those put
# the large-message bus bandwidth at 221 GB/s (slope of the rows >= 32 MiB) where Vidur's DGX A100 measures 183 GB/s:
# the two sources disagree by 17%, which the two-line fit (183 GB/s, 17% off its own rows) had hidden.
A100_SOURCES_DISAGREE = pytest.mark.xfail(strict=True, reason="Vidur's DGX A100 and the database's NCCL 2.27.3 rows "
                                          "disagree by 17% on 4-GPU large all-reduces")


@pytest.mark.parametrize("device", [pytest.param("a100", marks=A100_SOURCES_DISAGREE), "h100"])
def test_the_all_reduce_is_affine_in_size_per_group(vidur_measurements, device):
    """A straight line through the measured large all-reduces (>= 32 MiB) of each group has the slope of the
    profile's large-message bus bandwidth, 2 (g - 1) / g / bus, within 15%, and the profile's time is affine
    there: the large-message protocol's line."""
    reduce = vidur_measurements.for_device(device).all_reduce
    kernels = lookup_hardware(DEVICE_PROFILES[device]).kernels
    for gpus, part in reduce[reduce["size_bytes"] >= 2 ** 25].groupby("gpus"):
        slope, _ = np.polyfit(part["size_bytes"], part["time_s"], 1)
        group = kernels.all_reduce[int(gpus)]
        assert slope == pytest.approx(2 * (gpus - 1) / gpus / group.large_bus_bandwidth_bytes_per_s, rel=0.15)
        sizes = np.array([2.0 ** 25, 2.0 ** 25.5, 2.0 ** 26])
        times = all_reduce_time_s(sizes, int(gpus), group)
        slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
        assert (times[2] - times[1]) / (sizes[2] - sizes[1]) == pytest.approx(slope, rel=1e-9)


def test_decode_at_batch_one_is_still_bandwidth_bound(h100):
    """One token: every GEMM is memory-bound, and the layer GEMMs take their weights over the fitted
    bandwidth plus a floor each, whatever the smooth maximum adds (under 1% at one row)."""
    model = model_catalog()["Llama-3.1-8B"]
    cost = CostModel(model, h100)
    x = cost.features([], [], [512])
    table = cost.breakdown(x).set_index("operator")
    gemms = table.loc[["layer.qkv", "layer.out_proj", "layer.mlp", "lm_head"]]
    assert (gemms["bound"] == "memory").all()
    assert (gemms["compute_s"] < 0.01 * gemms["memory_s"]).all()
    kernels = h100.kernels
    weights = (model.qkv_params + model.out_proj_params + model.expert_params) * model.weight_bytes_per_param
    expected = model.num_layers * (weights / kernels.gemm_bandwidth_bytes_per_s + 4 * kernels.gemm_floor_s)
    layer_gemms = table.loc[["layer.qkv", "layer.out_proj", "layer.mlp"], "time_s"].sum()
    assert layer_gemms == pytest.approx(expected, rel=0.01)


def test_the_cost_model_prices_gemms_by_the_kernel_formula(h100):
    """CostModel's GEMM time (scalar and vectorised paths) is the kernels' formula at the shard's shapes."""
    model = model_catalog()["Llama-3.1-70B"]
    kernels = h100.kernels
    cost = CostModel(model, h100, tensor_parallel=4)
    for tokens in (1, 37, 512, 3000):
        x = cost.features([tokens], [0], [])
        expected = sum(gemm_time_s(tokens, s.n, s.k, 2, 2, kernels, "bf16") for s in layer_gemm_shapes(model, 4))
        table = cost.breakdown(x).set_index("operator")
        assert table.loc[["layer.qkv", "layer.out_proj", "layer.mlp"], "time_s"].sum() == pytest.approx(
            expected * model.num_layers, rel=1e-9)
        assert cost.iteration(x)[0] == pytest.approx(cost.iteration(np.array([x, x]))[0][1], rel=1e-12)


def test_fp8_gemms_have_their_own_terms(h100):
    """An FP8 model's GEMMs are priced by the profile's FP8 terms (their own rate, floor and shape terms, not 2x
    the 16-bit rate) plus the kernel that quantizes each GEMM's 16-bit input: 3 bytes per input element over its
    fitted bandwidth, for the two MLP GEMMs of every layer. (Without vLLM's CUTLASS dispatch, which prices the shipped
    profile's FP8 GEMMs: tests/cost/test_fp8_dispatch.py.)"""
    h100 = replace(h100, kernels=replace(h100.kernels, gemm_by_dtype={
        **h100.kernels.gemm_by_dtype, "fp8": replace(h100.kernels.gemm_by_dtype["fp8"], dispatch=None)}))
    fp8 = h100.kernels.for_dtype("fp8")
    assert fp8.gemm_rate("fp8") != 2 * h100.kernels.gemm_rate("bf16")
    model = model_catalog()["Llama-3.1-8B"].with_dtypes("fp8")
    tokens = 8192
    cost = CostModel(model, h100)
    mlp_s = cost.breakdown(cost.features([tokens], [0], [])).set_index("operator").loc["layer.mlp", "time_s"]
    up, down = (shape for shape in layer_gemm_shapes(model, 1) if shape.name in ("mlp_up", "mlp_down"))
    expected = model.num_layers * sum(gemm_time_s(tokens, s.n, s.k, 1, 2, fp8, "fp8")
                                      + tokens * s.k * 3 / fp8.gemm_quantize_bandwidth_bytes_per_s for s in (up, down))
    assert mlp_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["MI300X", "GH200"])
def test_derived_profiles_follow_their_stated_rule(vidur_h100, name):
    """Bandwidths scale by the datasheet memory bandwidths, GEMM rates by the peaks, bus bandwidths by the links;
    floors stay; every derived figure is an assumption naming the rule (B200 and GB200 have measured terms of their
    own from the operator database now, tests/calibration/test_database_fit.py)."""
    h100 = vidur_h100
    target = lookup_hardware(name)
    memory = target.memory_bandwidth_bytes_per_s / h100.memory_bandwidth_bytes_per_s
    assert target.kernels.gemm_bandwidth_bytes_per_s == pytest.approx(h100.kernels.gemm_bandwidth_bytes_per_s * memory,
                                                                      rel=1e-3)
    assert target.kernels.gemm_rate("bf16") == pytest.approx(
        h100.kernels.gemm_rate("bf16") * target.peak_for("bf16") / h100.peak_for("bf16"), rel=1e-3)
    link = target.interconnect_bandwidth_bytes_per_s / h100.interconnect_bandwidth_bytes_per_s
    assert target.kernels.all_reduce[8].bus_bandwidth_bytes_per_s == pytest.approx(
        h100.kernels.all_reduce[8].bus_bandwidth_bytes_per_s * link, rel=1e-3)
    assert target.kernels.gemm_floor_s == pytest.approx(h100.kernels.gemm_floor_s, rel=1e-3)
    kernel_figures = {key: fig for key, fig in target.figures.items() if key.startswith("kernels.")}
    assert kernel_figures and all(fig.confidence == "assumption" for fig in kernel_figures.values())
    assert all("derived from the H100-SXM" in fig.source or "assumption" in fig.source
               for fig in kernel_figures.values())


def test_calibrated_profiles_name_their_files_and_are_measured():
    """The streaming kernels keep Vidur's fit (the database times no norms or residual adds); the GEMMs are the
    operator database's, each naming its table."""
    for name in ("A100-80GB", "H100-SXM"):
        profile = lookup_hardware(name)
        record = profile.calibration
        assert record["tool"] == "llmsim calibrate --from-measurements"
        assert "vidur_linear_ops_ms_per_layer.csv" in record["files"]
        assert profile.figures["kernels.elementwise.norm.floor"].confidence == "measured"
        assert "vidur" in profile.figures["kernels.elementwise.norm.floor"].source
        assert "gemm_perf.parquet" in profile.figures["kernels.gemm.bandwidth"].source


# -- the CLI: calibrating from a folder, and its errors -----------------------------------------------

def _folder(tmp_path, edit=None):
    """A small copy of the measurements (H100 rows of two models, every fourth token count), edited."""
    folder = tmp_path / "measurements"
    folder.mkdir()
    linear = pd.read_csv(DATA / "vidur_linear_ops_ms_per_layer.csv")
    linear = linear[linear["device"] == "h100"].iloc[::4].reset_index(drop=True)
    reduce = pd.read_csv(DATA / "vidur_all_reduce_h100_dgx.csv").iloc[::8]
    if edit:
        linear = edit(linear)
    linear.to_csv(folder / "vidur_linear_ops_ms_per_layer.csv", index=False)
    reduce.to_csv(folder / "vidur_all_reduce_h100_dgx.csv", index=False)
    return folder


def test_calibrate_from_measurements_writes_a_profile_that_validates(tmp_path, capsys):
    folder = _folder(tmp_path)
    out = tmp_path / "h100-kernels.yaml"
    assert main(["calibrate", "--from-measurements", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held out per-layer" in printed and str(out) in printed
    assert main(["validate", str(out), "--measurements", str(folder), "--plot", str(tmp_path / "v.png")]) == 0
    table = capsys.readouterr().out
    assert "layer  decode   8" in table and "large (>= 4 MiB)" in table
    assert (tmp_path / "v.png").stat().st_size > 10_000


def _set(linear, row, column, value):
    linear[column] = linear[column].astype(object)
    linear.loc[row, column] = value
    return linear


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.drop(columns=["mlp_up_proj_ms"]), r"row 1 \(the header\) has no column 'mlp_up_proj_ms'"),
    (lambda t: _set(t, 5, "device", "tpu-v5"), r"row 7, column 'device': unknown device"),
    (lambda t: _set(t, 9, "attn_rope_ms", "fast"), r"row 11, column 'attn_rope_ms': expected a positive number"),
])
def test_bad_measurements_exit_2_naming_file_row_and_column(tmp_path, capsys, edit, message):
    folder = _folder(tmp_path, edit)
    assert main(["calibrate", "--from-measurements", str(folder), "--out", str(tmp_path / "x.yaml")]) == 2
    error = capsys.readouterr().err
    assert "vidur_linear_ops_ms_per_layer.csv" in error
    assert re.search(message, error), error


def test_few_output_tiles_run_far_above_the_roofline_and_the_occupancy_term_prices_it(vidur_measurements, vidur_h100):
    """Measured (Vidur, H100): Llama-2-7B's gate+up GEMM at TP 8 and 256 tokens (88 output tiles of 64 x 128
    on 132 SMs) takes over 2x the larger of its two roofline bounds at the profile's fitted bandwidth and
    rate, while a 70B layer's at TP 1 and 4096 tokens (28,672 tiles) runs within 10% of its bound. The
    profile prices both within 10% of the measurement; without the occupancy term the small one is 10%+
    too fast."""
    rows = vidur_measurements.for_device("h100").linear
    kernels = vidur_h100.kernels
    for model, tp, tokens, above_bound in (("Llama-2-7b-hf", 8, 256, True), ("Llama-2-70b-hf", 1, 4096, False)):
        row = rows[(rows["model"] == model) & (rows["tp"] == tp) & (rows["num_tokens"] == tokens)].iloc[0]
        n, k = 2 * row["n_expanded_embd"] / tp, row["n_embd"]
        measured_s = row["mlp_up_proj_ms"] * 1e-3
        bound_s = max((n * k + tokens * (n + k)) * 2 / kernels.gemm_bandwidth_bytes_per_s,
                      2 * tokens * n * k / kernels.gemm_rate("fp16"))
        assert (measured_s > 2 * bound_s) if above_bound else (measured_s < 1.1 * bound_s)
        assert gemm_time_s(tokens, n, k, 2, 2, kernels) == pytest.approx(measured_s, rel=0.10)
        if above_bound:
            blind = replace(kernels, gemm_occupancy_half_tiles=0.0, gemm_sharpness_growth=0.0)
            assert gemm_time_s(tokens, n, k, 2, 2, blind) < 0.9 * measured_s


@pytest.mark.slow
@pytest.mark.parametrize("device", ["a100", "h100"])
@pytest.mark.parametrize("split", ["model", "tp"])
def test_held_out_models_and_held_out_tp_sizes_meet_the_acceptance(vidur_measurements, device, split):
    """Issue 11's acceptance on the splits it names: whole models left out (fitted on the other models at every
    TP size) and whole TP sizes left out (fitted on the other TP sizes of every model): per-layer MAPE <= 10% and
    |median| <= 5% in each regime at each TP size."""
    from llmsim.calibration.kernel_fit import held_out_layer_errors
    from llmsim.calibration.kernel_profile import published_base
    from llmsim.calibration.operators import error_table
    held = held_out_layer_errors(vidur_measurements.for_device(device), published_base(device), split)
    table = error_table(held[held["group"] == "layer"], ["regime", "tp"])
    assert len(table) == 8
    assert (table["mape"] <= 0.10).all() and (table["median_error"].abs() <= 0.05).all(), table


def test_cost_models_share_their_gemm_memo_only_with_the_same_terms():
    """A search builds a cost model per run; those with the same GEMM and all-reduce terms share one memo
    of their non-linear terms. Warmed by one model, another with a different GEMM floor (or TP size) keeps
    its own: its memoized iteration time equals the unmemoized vectorized sum, 1 us per GEMM and layer
    above the first model's."""
    model, h100 = model_catalog()["Llama-3.1-8B"], lookup_hardware("H100-SXM")
    slower = replace(h100, kernels=replace(h100.kernels, gemm_floor_s=h100.kernels.gemm_floor_s + 1e-6))
    first, again = CostModel(model, h100), CostModel(model, h100)
    assert first._layer_memo is again._layer_memo
    x = first.features([96], [0], [500] * 31)
    base_s = first.iteration(x)[0]                                   # remembered by `first` ...
    slow = CostModel(model, slower)
    for other in (slow, CostModel(model, h100, tensor_parallel=2)):
        assert other._layer_memo is not first._layer_memo
        vectorized_s = other.iteration(np.vstack([x] * (FEW_ROWS + 1)))[0][0]   # no memo on many rows
        assert other.iteration(x)[0] == pytest.approx(vectorized_s, rel=1e-12)
    gemms = sum(r[4] for r in slow._gemm_rows)
    assert slow.iteration(x)[0] - base_s == pytest.approx(gemms * 1e-6, rel=1e-9)
