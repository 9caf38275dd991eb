"""llmsim calibrate / validate: a quick calibration on this machine's CPU, end to end.

The measuring tests need torch (``pip install -e ".[calibrate]"``) and are skipped
without it; the rest check the shipped calibrated profile, the held-out grids and
that the simulator itself never imports torch.
"""
from __future__ import annotations

from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest
import yaml

from llmsim import CostModel, load_profile
from llmsim.calibration.calibrate import calibrate, validate
from llmsim.calibration.fit import uncalibrated
from llmsim.calibration.design import DESIGNS, model_spec, shared_values
from llmsim.calibration.plot import scatter
from llmsim.calibration.profile_yaml import transfer_document, write_document
from llmsim.cli.main import build_parser
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import hardware_catalog, profile_from_node, shipped_profile_dir
from llmsim.cli.main import main

from tests.helpers import roofline_document, roofline_only

PROFILE_DIR = shipped_profile_dir()
SHIPPED = PROFILE_DIR / "cpu-calibrated.yaml"
TARGET = PROFILE_DIR / "h100-sxm.yaml"
# Issue 5's acceptance: held-out MAPE of the calibrated model under 15%.
TARGET_MAPE = 0.15


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A quick bf16 calibration of this CPU, written and loaded back: (document, profile)."""
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("calibration") / "cpu-quick.yaml"
    document = calibrate("cpu", "cpu-quick", quick=True, dtypes=("bf16",))
    write_document(document, path)
    return document, load_profile(path)


def _predicted_s(rows, profile) -> np.ndarray:
    """Decode-step time of each recorded shape, from a CostModel of the loaded profile."""
    return np.array([CostModel(model_spec(r["hidden"], r["layers"], r["dtype"]), profile)
                     .decode_time(batch=r["batch"], context=r["context"]) for r in rows])


def _mape(rows, profile) -> float:
    measured = np.array([r["median_s"] for r in rows])
    return float(np.mean(np.abs(_predicted_s(rows, profile) / measured - 1)))


def test_opening_the_device_puts_torchs_process_wide_settings_back():
    torch = pytest.importorskip("torch")
    from llmsim.calibration.bench import open_device
    subnormal = torch.tensor([1e-39], dtype=torch.float32)
    threads_before = torch.get_num_threads()
    with open_device("cpu", threads=1):
        assert torch.get_num_threads() == 1
        assert (subnormal * 1.0).item() == 0.0        # flushed while measuring
    assert torch.get_num_threads() == threads_before
    assert (subnormal * 1.0).item() > 0.0             # IEEE-754 gradual underflow again


def test_the_simulator_never_imports_torch():
    code = "import llmsim, sys; llmsim.simulate; import llmsim.calibration.calibrate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_held_out_grids_share_no_value_with_any_fit_grid():
    for (kind, _), design in DESIGNS.items():
        assert not shared_values(design.holdout, [p.fit for (k, _), p in DESIGNS.items() if k == kind])
        assert design.holdout.shapes(("bf16",)), f"{kind} {design.name}: empty held-out grid"


def _profile_with(**changes):
    document = roofline_document(yaml.safe_load(TARGET.read_text()))
    for key, value in changes.items():
        document["efficiency"][key] = value
    return profile_from_node(Node(document, file="test.yaml"))


def test_decode_attention_efficiency_follows_its_context_law():
    """attention_half_context h: decode attention over c tokens (the new one included) runs at
    attention_efficiency * c / (c + h) of the bf16 peak, so its compute time is
    4 q_dim c layers / (peak * efficiency * c / (c + h)); other operators do not change."""
    half = 300.0
    figure = {"value": half, "source": "test", "confidence": "assumption"}
    plain, with_half = roofline_only(load_profile(TARGET)), _profile_with(attention_half_context=figure)
    spec = model_spec(1024, 2, "bf16")
    for batch, context in ((1, 127), (8, 2047), (32, 8191)):
        x = CostModel(spec, with_half).features(decode_context=[context] * batch)
        rows = CostModel(spec, with_half).breakdown(x).set_index("operator")
        plain_rows = CostModel(spec, plain).breakdown(x).set_index("operator")
        c = context + 1
        efficiency = plain.attention_efficiency * c / (c + half)
        expected = 4 * spec.q_dim * c * batch * spec.num_layers / (plain.peak_for("bf16") * efficiency)
        assert rows.loc["layer.attention_decode", "compute_s"] == pytest.approx(expected, rel=1e-9)
        assert rows.loc["layer.attention_decode", "flops"] == plain_rows.loc["layer.attention_decode", "flops"]
        others = rows.index != "layer.attention_decode"
        assert (rows.loc[others, "time_s"] == plain_rows.loc[others, "time_s"]).all()


def test_efficiencies_by_dtype_apply_to_models_in_that_dtype_only():
    figure = {"value": 0.2, "source": "test", "confidence": "assumption"}
    profile = _profile_with(by_dtype={"fp8": {"compute": figure}})
    plain = roofline_only(load_profile(TARGET))
    assert profile.efficiencies_for("fp8") == (0.2, plain.attention_efficiency, plain.memory_efficiency)
    assert profile.efficiencies_for("bf16") == plain.efficiencies_for("bf16")
    x = CostModel(model_spec(1024, 2, "bf16"), plain).features(decode_context=[100] * 256)
    assert CostModel(model_spec(1024, 2, "bf16"), profile).step_time(x) == CostModel(
        model_spec(1024, 2, "bf16"), plain).step_time(x)
    with pytest.raises(ConfigError, match=r"efficiency\.by_dtype\.fp64.*no peak_flops entry"):
        _profile_with(by_dtype={"fp64": {"compute": figure}})


@pytest.mark.slow
def test_quick_profile_loads_with_measured_efficiencies(quick):
    document, profile = quick
    for value in (profile.compute_efficiency, profile.attention_efficiency, profile.memory_efficiency):
        assert 0.0 < value <= 1.0
    assert profile.kv_read_penalty >= 1.0
    assert profile.per_step_overhead_s >= 0.0 and profile.per_layer_overhead_s >= 0.0
    assert profile.attention_half_context >= 0.0
    assert profile.efficiencies_for("bf16") == (profile.compute_efficiency, profile.attention_efficiency,
                                                profile.memory_efficiency)
    for key in ("efficiency.compute", "efficiency.attention", "efficiency.memory_bandwidth",
                "efficiency.kv_read_penalty", "efficiency.attention_half_context", "efficiency.by_dtype.bf16.compute",
                "overhead.per_step", "overhead.per_layer", "peak_flops.bf16", "memory_bandwidth"):
        assert profile.figures[key].confidence == "measured"
        assert "llmsim calibrate" in profile.figures[key].source
    assert profile.calibration["torch_version"] in profile.figures["efficiency.compute"].source


@pytest.mark.slow
def test_quick_profile_predicts_every_held_out_step_better_than_the_roofline(quick):
    """Each held-out step (a width, depth, batches and contexts the fit never saw) is predicted
    closer by the calibrated profile than by the uncalibrated roofline of the same measured peaks.

    The quick design is a check that the pipeline works on this machine, not the accuracy claim:
    its fit sees batches 1, 16 and 64 only, and on this CPU batch 1 runs faster kernels than a
    straight line through the larger batches allows (7.8 ms at batch 1, 11.4 at 2, 14.4 at 4 on
    width 768, two layers), so its held-out MAPE is 18-20% on a quiet machine against about 55%
    for the roofline. The accuracy target is checked on the full calibration the project ships
    (below). A fit pinned at its bounds misses by several hundred percent and fails here."""
    _, profile = quick
    held_out = profile.calibration["held_out_same_session"]["measurements"]
    measured_s = np.array([row["median_s"] for row in held_out])
    calibrated = np.abs(_predicted_s(held_out, profile) / measured_s - 1)
    roofline = np.abs(_predicted_s(held_out, uncalibrated(profile)) / measured_s - 1)
    assert (calibrated < roofline).all(), list(zip(calibrated, roofline))


@pytest.mark.slow
def test_validate_measures_fresh_held_out_steps_and_plots(quick, tmp_path):
    _, profile = quick
    report = validate(profile, quick=True)
    fitted = {(m["hidden"], m["batch"], m["context"]) for m in profile.calibration["measurements"]}
    assert not fitted & {(s.hidden, s.batch, s.context) for s in report["shapes"]}
    calibrated = np.mean(np.abs(report["calibrated_s"] / report["measured_s"] - 1))
    roofline = np.mean(np.abs(report["roofline_s"] / report["measured_s"] - 1))
    assert calibrated < roofline
    assert scatter(report, tmp_path / "validate.png").stat().st_size > 0


@pytest.mark.slow
def test_transfer_keeps_the_target_peaks_and_takes_the_calibrated_efficiencies(quick, tmp_path):
    document, profile = quick
    target = load_profile(TARGET)
    path = tmp_path / "h100-transfer.yaml"
    write_document(transfer_document(document, yaml.safe_load(TARGET.read_text()), "cpu-quick"), path)
    moved = load_profile(path)
    assert moved.peak_flops_per_s == target.peak_flops_per_s
    assert moved.memory_bandwidth_bytes_per_s == target.memory_bandwidth_bytes_per_s
    assert moved.per_step_overhead_s == target.per_step_overhead_s
    for attribute, key in (("compute_efficiency", "compute"), ("attention_efficiency", "attention"),
                           ("memory_efficiency", "memory_bandwidth"), ("kv_read_penalty", "kv_read_penalty")):
        assert getattr(moved, attribute) == pytest.approx(getattr(profile, attribute), rel=1e-3)
        figure = moved.figures[f"efficiency.{key}"]
        assert figure.confidence == "assumption" and figure.source.startswith("assumption: transferred")


def test_the_shipped_cpu_profile_is_a_full_calibration_that_explains_its_record():
    profile = load_profile(SHIPPED)
    record = profile.calibration
    assert record["tool"] == "llmsim calibrate" and record["design"] == "full"
    for value in (profile.compute_efficiency, profile.attention_efficiency, profile.memory_efficiency):
        assert 0.0 < value <= 1.0
    assert profile.kv_read_penalty >= 1.0
    for figure in profile.figures.values():
        assert figure.source.strip()
        if figure.confidence == "assumption":
            assert figure.source.startswith("assumption")
    # The recorded errors are those of this profile's own CostModel on the recorded medians.
    assert _mape(record["measurements"], profile) == pytest.approx(record["fit"]["mape"], abs=0.005)
    held_out = record["held_out_same_session"]
    assert _mape(held_out["measurements"], profile) == pytest.approx(held_out["mape"], abs=0.005)
    assert held_out["mape"] <= TARGET_MAPE          # issue 5's acceptance, on steps the fit never saw


def test_the_shipped_cpu_profile_transfers_to_a_datasheet_profile(tmp_path):
    calibrated = yaml.safe_load(SHIPPED.read_text())
    path = tmp_path / "h100-cpu-transfer.yaml"
    moved = write_document(transfer_document(calibrated, yaml.safe_load(TARGET.read_text()), "cpu-calibrated"), path)
    assert moved.peak_flops_per_s == load_profile(TARGET).peak_flops_per_s
    assert moved.compute_efficiency == calibrated["efficiency"]["compute"]["value"]


def _run(*argv) -> int:
    args = build_parser(only=argv[0]).parse_args(list(argv))
    return args.func(args)


def test_bad_calibrate_and_validate_arguments_are_configuration_errors():
    with pytest.raises(ConfigError, match="--from only goes with --transfer-to"):
        _run("calibrate", "--from", str(SHIPPED))
    with pytest.raises(ConfigError, match="no calibration record"):
        _run("validate", str(TARGET))
    with pytest.raises(ConfigError, match="was calibrated on cpu"):
        _run("validate", str(SHIPPED), "--device", "cuda")


def test_profiles_are_taken_by_name_as_every_other_command_takes_them(tmp_path):
    """validate, --transfer-to and --from take a profile's name or alias as well as its file."""
    with pytest.raises(ConfigError, match="no calibration record") as by_name:
        _run("validate", "H100")
    assert by_name.value.file == str(TARGET)
    with pytest.raises(ConfigError, match="was calibrated on cpu") as calibrated:
        _run("validate", "cpu-calibrated", "--device", "cuda")
    assert calibrated.value.file == str(SHIPPED)
    with pytest.raises(ConfigError, match="unknown hardware profile") as unknown:
        _run("validate", "nonesuch")
    assert unknown.value.key == "profile"
    out = tmp_path / "h100-from-cpu.yaml"
    assert _run("calibrate", "--transfer-to", "H100", "--from", "cpu-calibrated", "--out", str(out)) == 0
    expected = transfer_document(yaml.safe_load(SHIPPED.read_text()), yaml.safe_load(TARGET.read_text()),
                                 "cpu-calibrated")
    assert yaml.safe_load(out.read_text())["efficiency"] == expected["efficiency"]


@pytest.mark.parametrize("path", sorted(PROFILE_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_efficiency_says_whether_a_calibration_measured_it(path):
    """Issue 5: an efficiency or overhead either comes from a calibration, whose source names the
    device and the date recorded by it, or says it is an assumption or names another measurement."""
    profile = load_profile(path)
    for key, figure in profile.figures.items():
        if not key.startswith(("efficiency.", "overhead.")):
            continue
        if figure.confidence == "measured" and "llmsim calibrate" in figure.source:
            record = profile.calibration
            assert record.get("tool") == "llmsim calibrate", key
            assert record["device_name"] in figure.source and record["date"] in figure.source, key
        else:
            assert figure.confidence == "assumption" or figure.source.startswith("measured:"), key
            assert "llmsim calibrate" not in figure.source or figure.source.startswith("assumption"), key


# -- a machine-specific profile ---------------------------------------------------------------------

def _cpu_model_of_this_machine() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    pytest.skip("no /proc/cpuinfo model name on this system")


def test_a_calibrated_profile_names_the_machine_it_was_measured_on(quick):
    document, profile = quick
    assert profile.machine == document["machine"] == _cpu_model_of_this_machine()
    shipped = load_profile(SHIPPED)
    assert shipped.machine == shipped.calibration["device_name"] and "Xeon" in shipped.machine
    assert all(profile.machine is None for profile in hardware_catalog().values() if profile.name != shipped.name)


@pytest.mark.parametrize("here, warned", [("Another CPU Model", True), ("Intel(R) Xeon(R) Processor", False)])
def test_validate_warns_when_this_machine_is_not_the_profiles(monkeypatch, capsys, here, warned):
    """The warning comes before any measuring (here replaced by a stop), on stderr."""
    import llmsim.cli.calibrate as command

    def stop(*args, **kwargs):
        raise ConfigError("stopped before measuring", has_value=False)
    monkeypatch.setattr(command, "machine_name", lambda kind: here)
    monkeypatch.setattr(command, "require_torch", lambda: None)
    monkeypatch.setattr(command, "validate", stop)
    assert main(["validate", str(SHIPPED)]) == 2
    err = capsys.readouterr().err
    warning = ("warning: cpu-calibrated is machine-specific: it was measured on Intel(R) Xeon(R) Processor, "
               f"and this machine is {here}")
    assert (warning in err) == warned and "stopped before measuring" in err


def test_the_hardware_listing_marks_machine_specific_profiles(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "cpu-calibrated: measured on Intel(R) Xeon(R) Processor" in out
    assert "H100-SXM: machine-specific" not in out
