"""``plan:`` is read and checked with the scenario, into Scenario.plan."""
import pytest

from llmsim.errors import ConfigError
from llmsim.scenario.scenario import PLAN, PlanConfig
from tests.helpers import make_scenario


def test_the_plan_section_is_read_with_the_scenario():
    assert make_scenario().plan == PLAN == PlanConfig(hardware=())
    assert make_scenario({"plan": {"hardware": ["H200", "h100-sxm"]}}).plan.hardware == ("H200", "h100-sxm")


@pytest.mark.parametrize("plan, key, value", [
    ({"hardware": "H100-SXM"}, "plan.hardware", "H100-SXM"),
    ({"hardware": []}, "plan.hardware", []),
    ({"hardware": ["H200", 3]}, "plan.hardware", ["H200", 3]),
    ({"hardware": ["H900"]}, "plan.hardware", "H900"),
    ({"hardware": ["H200"], "chips": 2}, "plan.chips", 2),
])
def test_a_bad_plan_section_names_file_key_value_and_what_is_allowed(plan, key, value):
    with pytest.raises(ConfigError) as error:
        make_scenario({"plan": plan})
    assert (error.value.file, error.value.key, error.value.value) == ("<test>", key, value)
    assert error.value.allowed
