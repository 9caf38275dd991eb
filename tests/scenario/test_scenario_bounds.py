"""Issue 35's scenario faults, each reproduced first: the plain-decoding baseline of a run whose
controller moves the draft length, tracebacks from a few settings, settings whose work the resource
guard did not count (refused before anything runs, naming the key), wrong input accepted, and
``place`` saying "does not fit" as an error."""
from __future__ import annotations

import math
import re
from collections import deque

import numpy as np
import pytest
import yaml

from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.config.policies import SchedulingPolicy
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import load_scenario
from llmsim.search.compare import load_comparison
from llmsim.search.speedup import speedup_over_plain
from llmsim.sim import resources
from llmsim.sim.request import Request
from llmsim.sim.scheduling import CLASS_ORDERS, DRR_QUANTUM_TOKENS, ClassQueue, class_rules
from llmsim.sim.simulate import simulate
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, REPO, make_scenario, merge

SMALL = {"workload": {"num_requests": 40, "arrival": {"rate": 8.0}}}


def refused(capsys, argv, *fragments):
    """``argv`` exits 2 with one paragraph on stderr holding every fragment."""
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    paragraph = captured.err.strip().splitlines()[-1]
    assert "Traceback" not in captured.err and paragraph.startswith("llmsim: "), captured.err
    for fragment in fragments:
        assert fragment in paragraph, (fragment, paragraph)
    return captured


def write(tmp_path, data, name="scenario.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


# -- the plain-decoding baseline of a controlled draft length ------------------------------------

def _controlled_k(controller: bool = True):
    data = merge(BASE, SMALL)
    data["speculation"] = {"draft": "Llama-3.2-1B", "policy": "static", "k": 4,
                           "acceptance": {"process": "bernoulli", "alpha": 0.7}}
    if controller:
        data["controller"] = {"knob": "speculation_k", "interval": "2 s", "bounds": [0, 4]}
    return make_scenario(base=data)


def test_the_plain_baseline_of_a_controlled_draft_length_runs_without_the_controller():
    scenario = _controlled_k()
    result = simulate(scenario)
    ratios = speedup_over_plain(result)          # raised AttributeError: the controller moved a draft that was gone
    assert all(math.isfinite(value) for value in ratios.values()), ratios
    # The baseline is the scenario written without speculation and without a controller, on the same requests.
    written = merge(BASE, SMALL)
    plain = simulate(make_scenario(base=written))
    baseline = simulate(scenario.plain_decoding(), generate_trace(scenario.workload, scenario.seed))
    assert baseline.requests.equals(plain.requests)
    assert ratios["tpot_mean"] == pytest.approx(summarize(plain).to_dict()["latency"]["tpot_s"]["mean"]
                                                / summarize(result).to_dict()["latency"]["tpot_s"]["mean"])


def test_plain_decoding_keeps_a_controller_of_an_engine_knob():
    data = merge(BASE, SMALL)
    data["controller"] = {"knob": "max_num_seqs", "interval": "2 s"}
    data["speculation"] = {"draft": "Llama-3.2-1B", "k": 4}
    scenario = make_scenario(base=data)
    assert scenario.plain_decoding().controller == scenario.controller
    assert scenario.plain_decoding().speculation is None


# -- tracebacks --------------------------------------------------------------------------------

@pytest.mark.parametrize("cv", [1e-200, 1e-160, 1e-4])
def test_a_gamma_cv_below_its_bound_is_refused(cv):
    with pytest.raises(ConfigError) as error:            # 1e-200 squared is 0: ZeroDivisionError before
        make_scenario({"workload": {"arrival": {"process": "gamma", "cv": cv}}})
    assert error.value.key == "workload.arrival.cv" and ">= 0.001" in error.value.allowed


def test_gamma_gaps_at_the_smallest_cv_are_that_even():
    scenario = make_scenario({"workload": {"num_requests": 20_000, "arrival": {"process": "gamma", "cv": 1e-3}}})
    gaps = np.diff(generate_trace(scenario.workload, scenario.seed).arrival_s)
    # A gamma of shape 1/cv^2 = 1e6: its gaps' CV is 1e-3, the sample's within 5% of it (n = 20,000).
    assert gaps.std() / gaps.mean() == pytest.approx(1e-3, rel=0.05)


def test_a_trace_fit_of_even_gaps_proposes_deterministic_arrivals():
    from llmsim.workload.trace import Trace
    from llmsim.workload.trace_fit import fit_workload
    n = 200
    trace = Trace(np.arange(n) * 0.5, np.full(n, 100, np.int64), np.full(n, 20, np.int64))
    arrival = fit_workload(trace).to_workload()["arrival"]
    assert arrival["process"] == "deterministic"
    make_scenario({"workload": {"arrival": arrival}})          # and it is a valid scenario


def test_transfer_from_a_profile_fitted_from_measurements_is_refused(tmp_path, capsys):
    h100 = REPO / "hardware_profiles" / "h100-sxm.yaml"
    refused(capsys, ["calibrate", "--transfer-to", h100, "--from", h100, "--out", tmp_path / "x.yaml"],
            "h100-sxm.yaml", "calibration.tool", "--from-measurements", "llmsim calibrate")
    assert not (tmp_path / "x.yaml").exists()


def test_transfer_from_a_record_without_what_it_cites_is_refused(tmp_path, capsys):
    document = yaml.safe_load((REPO / "hardware_profiles" / "cpu-calibrated.yaml").read_text())
    del document["calibration"]["device_name"]
    source = write(tmp_path, document, "cpu.yaml")
    refused(capsys, ["calibrate", "--transfer-to", REPO / "hardware_profiles" / "h100-sxm.yaml", "--from", source,
                     "--out", tmp_path / "x.yaml"], "calibration.device_name")


def _comparison(loads, variants=None):
    return {"base": merge(BASE, SMALL), "variants": variants or {"a": {}, 7: {"engine": {"max_num_seqs": 64}}},
            "loads": loads}


def test_comparison_labels_mixing_numbers_and_words_keep_the_files_order(tmp_path):
    path = write(tmp_path, _comparison({"low": 2.0, 3: {"rate": 3.0}}), "comparison.yaml")
    runs = load_comparison(path)                      # raised TypeError sorting 'low' against 3
    assert [(variant, load) for variant, load, _ in runs] == [("a", "low"), ("a", "3"), ("7", "low"), ("7", "3")]
    assert [s.workload.arrival.rate_per_s for _, _, s in runs] == [2.0, 3.0, 2.0, 3.0]


def test_an_unknown_key_beside_numeric_labels_is_named(tmp_path):
    path = write(tmp_path, _comparison({"low": {"rate": 2.0, 5: 1}}), "comparison.yaml")
    with pytest.raises(ConfigError) as error:
        load_comparison(path)
    assert error.value.key == "loads.low.5" and "unknown key" in error.value.message


# -- work the guard did not count ------------------------------------------------------------------

def _without_rate(data):
    data["workload"]["arrival"].pop("rate")
    return data


@pytest.mark.parametrize("overrides, key", [
    ({"controller": {"interval": "1 ns"}}, "controller.interval"),
    ({"controller": {"interval": "1 us"}}, "controller.interval"),
    ({"autoscaling": {"max_replicas": 4, "interval": "1 ns"}}, "autoscaling.interval"),
    ({"autoscaling": {"max_replicas": 20_001}}, "autoscaling.max_replicas"),
    ({"rollout": {"groups": {"c": {"role": "canary", "fraction": 0.1, "replicas": 20_000}}}},
     "rollout.groups.c.replicas"),
    ({"workload": {"arrival": {"process": "diurnal", "rate": 10.0, "period": "1 ns"}}}, "workload.arrival.period"),
    ({"workload": {"arrival": {"process": "mmpp", "states": [{"rate": 5.0, "mean_duration": "1 ns"},
                                                             {"rate": 20.0, "mean_duration": "1 ns"}]}}},
     "workload.arrival.states"),
])
def test_work_that_grows_with_a_setting_is_refused_before_the_run_naming_it(tmp_path, capsys, overrides, key):
    data = merge(merge(BASE, SMALL), overrides)
    if "states" in str(overrides):
        data = _without_rate(data)
    path = write(tmp_path, data)
    refused(capsys, ["run", path, "--out", tmp_path / "out"], f"at key '{key}'", "too large", "--force")
    assert not (tmp_path / "out").exists()


def test_the_counted_work_bounds_what_a_run_does():
    """The estimate of a controlled, autoscaled run on a diurnal profile is above what it measures."""
    data = merge(merge(BASE, SMALL), {"controller": {"interval": "1 s"}, "autoscaling": {"max_replicas": 3,
                                                                                           "interval": "2 s"},
                                      "workload": {"arrival": {"process": "diurnal", "rate": 8.0, "period": "3 s"}}})
    scenario = make_scenario(base=data)
    estimate = resources.estimate_run(scenario)
    sources = {key: (events, size) for key, events, size in estimate.sources}
    result = simulate(scenario)
    assert len(result.control) * resources.EVENTS_PER_CONTROL_TICK <= sources["controller.interval"][0]
    assert len(result.scaling) <= sources["autoscaling.interval"][0]
    arrival = scenario.workload.arrival
    times, _ = arrival.knots(np.random.default_rng(0), 2 * float(result.arrival_window_s))
    assert len(times) * resources.BYTES_PER_KNOT <= sources["workload.arrival.period"][1]
    assert estimate.engines == 3


@pytest.mark.parametrize("speculation, key", [
    ({"policy": "goodput", "k_max": 100_000}, "speculation.k_max"),
    ({"k": 300, "k_max": 300}, "speculation.k_max"),
    ({"draft": "eagle", "tree_branching": 10**15, "k": 3}, "speculation.k"),
    ({"draft": "eagle", "tree_branching": 64, "k": 4}, "speculation.k"),
])
def test_a_draft_beyond_what_is_modelled_is_refused(speculation, key):
    with pytest.raises(ConfigError) as error:
        make_scenario({"speculation": {"draft": "Llama-3.2-1B", **speculation}})
    assert error.value.key == key and error.value.allowed


def test_the_largest_draft_is_accepted():
    from llmsim.speculation.config import MAX_DRAFT_LEVELS
    scenario = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "goodput", "k_max": MAX_DRAFT_LEVELS}})
    assert scenario.speculation.policy.k_max == MAX_DRAFT_LEVELS


def _classes(heavy: float, light: float) -> dict:
    return {"engine": {"scheduling_policy": "weighted_fair"},
            "workload": {"classes": {"heavy": {"share": 0.5, "weight": heavy},
                                     "light": {"share": 0.5, "weight": light}}}}


@pytest.mark.parametrize("heavy, light", [(1.0, 1e-300), (9e15, 1.0), (2e6, 1.0)])
def test_class_weights_too_far_apart_are_refused(heavy, light):
    with pytest.raises(ConfigError) as error:
        make_scenario(merge(SMALL, _classes(heavy, light)))
    assert error.value.key == "workload.classes.light.weight" and "1e+06" in error.value.allowed


def test_weights_a_million_apart_finish_a_run():
    """At the bound, with the light class alone for a while (each of its requests needs ~100,000 rounds
    of its quantum): this hung before the rounds were skipped."""
    result = simulate(make_scenario(merge({"workload": {"num_requests": 20, "arrival": {"rate": 2.0}}},
                                          _classes(1e6, 1.0))))
    assert (result.requests["status"] == "finished").all()


def _naive_drr(quanta, queues, picks):
    """The textbook deficit round robin (Shreedhar and Varghese), one round at a time: the order in
    which it serves ``queues`` (lists of request sizes)."""
    queues = [deque(q) for q in queues]
    deficit, turn, order = [0.0] * len(queues), 0, []
    while len(order) < picks:
        if queues[turn] and deficit[turn] >= queues[turn][0]:
            deficit[turn] -= queues[turn].popleft()
            if not queues[turn]:
                deficit[turn] = 0.0
            order.append(turn)
            continue
        turn = (turn + 1) % len(queues)
        if queues[turn]:
            deficit[turn] += quanta[turn]
    return order


def test_skipped_rounds_serve_the_classes_in_the_textbook_order():
    rng = np.random.default_rng(5)
    scenario = make_scenario(merge(SMALL, _classes(40.0, 1.0)))
    queue = ClassQueue(class_rules(scenario), CLASS_ORDERS[SchedulingPolicy.WEIGHTED_FAIR], DRR_QUANTUM_TOKENS)
    sizes = [list(rng.integers(100, 20_000, 30)), list(rng.integers(100, 20_000, 30))]
    for c, lengths in enumerate(sizes):
        for i, length in enumerate(lengths):
            request = Request(100 * c + i, 0.0, int(length), 0)
            request.class_index = c
            queue.push(request, 0.0)
    served = []
    while queue:
        queue.head()
        served.append(queue.pop(0.0).class_index)
    expected = _naive_drr([DRR_QUANTUM_TOKENS, DRR_QUANTUM_TOKENS / 40], sizes, len(served))
    assert served == expected


# -- place: "does not fit" is an error naming what would fit --------------------------------------

def test_place_beyond_every_layout_is_an_error_naming_the_smallest_that_fits(capsys):
    captured = refused(capsys, ["place", "Llama-3.1-8B", "H100-SXM", "--room-for", 10**12], "--room-for",
                       "1 x H100-SXM")
    assert captured.out == ""


def test_place_on_a_chip_where_nothing_fits_says_so(capsys):
    captured = refused(capsys, ["place", "Llama-3.1-405B", "Groq-LPU"], "no layout", "Groq-LPU")
    assert captured.out == ""


def test_place_with_a_fixed_layout_too_small_names_the_smallest(capsys):
    from llmsim import lookup_hardware, model_catalog, place
    paragraph = refused(capsys, ["place", "Llama-3.1-70B", "H100-SXM", "--tp", 1, "--pp", 1], "--tp").err
    devices, tp, pp = map(int, re.search(r"(\d+) x H100-SXM \(tensor parallel (\d+) x pipeline stages (\d+)\)",
                                         paragraph).groups())
    model, hardware = model_catalog()["Llama-3.1-70B"], lookup_hardware("H100-SXM")
    settings = (0.9, 128, 8192, 2.0 ** 30)

    def holds(t, p):
        placement = place(model, hardware, t, p, *settings)
        return placement.fits and not placement.weight_streaming
    assert devices == tp * pp and holds(tp, pp)
    # Brute force: no layout of fewer devices holds it.
    assert not any(holds(t, p) for t in range(1, model.num_heads + 1) if model.num_heads % t == 0
                   for p in range(1, model.num_layers + 1) if t * p < devices)


# -- wrong input accepted --------------------------------------------------------------------------

@pytest.mark.parametrize("detect", ["1e-300", "0.0009"])
def test_a_detection_target_below_its_bound_is_refused(tmp_path, capsys, detect):
    canary = REPO / "scenarios" / "llama3-8b-h100-canary.yaml"
    refused(capsys, ["run", canary, "--detect", detect, "--out", tmp_path / "out"], "--detect", ">= 0.001")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["base", "variant"])
@pytest.mark.parametrize("setting, key", [({"arrival": {"rate": "5 parsecs"}}, "workload.arrival.rate"),
                                          ({"num_requests": "lots"}, "workload.num_requests")])
def test_a_key_every_load_overrides_is_still_checked(tmp_path, where, setting, key):
    comparison = _comparison({"low": {"rate": 2.0, "num_requests": 30}, "high": 4.0}, {"a": {}})
    if where == "base":
        comparison["base"] = merge(comparison["base"], {"workload": setting})
        expected = f"base.{key}"
    else:
        comparison["variants"]["a"] = {"workload": setting}
        expected = f"variants.a.{key}"
    with pytest.raises(ConfigError) as error:       # accepted before: every load replaced it
        load_comparison(write(tmp_path, comparison, "comparison.yaml"))
    assert error.value.key == expected and "comparison.yaml" in error.value.file


def test_a_warmup_as_long_as_the_arrivals_is_said_on_stderr(tmp_path, capsys):
    data = merge(merge(BASE, SMALL), {"workload": {"num_requests": 30, "arrival": {"rate": 100.0}},
                                      "simulation": {"warmup": "30 s"}})
    assert main(["run", str(write(tmp_path, data)), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    # 30 requests at 100/s arrive in about 0.3 s, far inside the 30 s warm-up.
    assert "warning" in err and "simulation.warmup (30 s)" in err and "workload.num_requests" in err


def test_a_warmup_inside_the_arrivals_says_nothing(tmp_path, capsys):
    data = merge(merge(BASE, SMALL), {"simulation": {"warmup": "1 s"}})      # 40 requests at 8/s: about 5 s
    assert main(["run", str(write(tmp_path, data)), "--out", str(tmp_path / "out")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_numeric_variant_label_without_settings_is_named(tmp_path):
    """Found by the property tests: the missing-key hint compared a numeric label as text (TypeError)."""
    path = write(tmp_path, {"base": merge(BASE, SMALL), "variants": {0: None}}, "comparison.yaml")
    with pytest.raises(ConfigError) as error:
        load_comparison(path)
    assert error.value.key == "variants.0"



def test_an_exponent_without_a_decimal_point_is_explained(tmp_path, capsys):
    """PyYAML reads ``5e-1`` (no decimal point) as a string; the error says how to write the number."""
    text = (REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml").read_text().replace(
        "rate: 20/s}", "rate: 20/s, cv: 5e-1}").replace("process: poisson", "process: gamma")
    scenario = tmp_path / "exponent.yaml"
    scenario.write_text(text)
    refused(capsys, ["run", scenario, "--out", tmp_path / "out"], "workload.arrival.cv", "write 5.0e-1")
    scenario.write_text(text.replace("5e-1", "5.0e-1"))
    assert load_scenario(scenario).workload.arrival.cv == 0.5
