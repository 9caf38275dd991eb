"""The acceptance model against the published points it was fitted to (llmsim/speculation/data/acceptance.yaml)."""
from __future__ import annotations

import pytest

from llmsim.speculation import acceptance_model as model
from llmsim.speculation.acceptance_model import alpha_from, default_model, fit, points

from tests.helpers import make_scenario


def predict(fitted, point):
    return fitted.predict(point.kind, point.workload, 10 ** point.log10_ratio, 1.0).alpha


@pytest.mark.parametrize("point", points(), ids=lambda p: p.id)
def test_reproduces_every_fitted_point_within_its_spread(point):
    assert abs(predict(default_model(), point) - point.alpha) <= point.spread


@pytest.mark.parametrize("point", points(), ids=lambda p: p.id)
def test_predicts_a_point_left_out_of_the_fit_within_twice_its_spread(point):
    """Fit without the point, then predict it: the other points of its kind and workload, and the
    shared terms (size ratio, workload offsets), must carry it."""
    left_out = fit(leave_out=(point.id,))
    assert point.id not in left_out.fitted
    assert abs(predict(left_out, point) - point.alpha) <= 2 * point.spread


def test_published_measures_convert_to_alpha_by_leviathans_formula():
    """tau = (1 - alpha^(k+1)) / (1 - alpha) and r = sum_{j=1..k} alpha^j / k, inverted."""
    alpha = alpha_from("acceptance_length", 3.03, 3)
    assert (1 - alpha ** 4) / (1 - alpha) == pytest.approx(3.03)
    alpha = alpha_from("draft_acceptance_rate", 0.75, 4)
    assert sum(alpha ** j for j in range(1, 5)) / 4 == pytest.approx(0.75)
    assert alpha_from("draft_acceptance_rate", 0.8835, 1) == pytest.approx(0.8835)


def test_the_pair_and_the_workload_move_acceptance_the_way_the_data_and_assumptions_say():
    m = default_model()
    small, large = (m.predict("model", "chat", params, 70e9) for params in (1e9, 8e9))
    assert small.alpha < large.alpha                     # a bigger draft agrees more (fitted slope > 0)
    assert small.low < small.alpha < small.high
    assert m.predict("model", "chat", 1e9, 70e9, distilled=True).alpha > small.alpha
    assert m.predict("model", "chat", 1e9, 70e9, same_family=False).alpha < small.alpha
    assert m.predict("model", "chat", 1e9, 70e9, draft_dtype="int4").alpha < small.alpha
    assert m.predict("model", "code", 1e9, 70e9).alpha > small.alpha
    assert m.predict("ngram", "summarisation").alpha > m.predict("ngram", "chat").alpha
    assert m.predict("ngram", "chat").basis == "assumption" and small.basis == "fit"
    with pytest.raises(ValueError):
        m.predict("model", "poetry", 1e9, 70e9)


def test_a_scenario_can_ask_for_the_predicted_acceptance_and_a_measured_one_overrides_it():
    base = {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4}}
    predicted = make_scenario({**base, "speculation": {"draft": "Llama-3.2-1B",
                                                       "acceptance": {"process": "predicted", "workload": "code"}}})
    spec = predicted.speculation
    expected = default_model().predict("model", "code", spec.draft.param_count, predicted.model.param_count)
    assert spec.acceptance.mean_alpha == pytest.approx(expected.alpha)
    assert spec.acceptance.predicted_range == pytest.approx((expected.low, expected.high))
    measured = make_scenario({**base, "speculation": {"draft": "Llama-3.2-1B", "acceptance": {"alpha": 0.42}}})
    assert measured.speculation.acceptance.mean_alpha == 0.42
    # what the draft search reads: a stated acceptance is a measurement, a prediction names its workload
    assert measured.speculation.acceptance.measured and not spec.acceptance.measured
    assert spec.acceptance.workload == "code" and measured.speculation.acceptance.workload == "chat"
    unstated = make_scenario({**base, "speculation": {"draft": "Llama-3.2-1B"}})
    assert not unstated.speculation.acceptance.measured
    eagle = make_scenario({**base, "speculation": {"draft": "eagle", "acceptance": {"process": "predicted"}}})
    assert eagle.speculation.acceptance.mean_alpha == pytest.approx(default_model().predict("eagle").alpha)


def test_every_point_names_its_source():
    for row in model.reference_table()["points"]:
        assert row["source"] and row["verified"] in ("read", "transcribed")
        assert row["spread_is"] in ("stated", "assumed")
