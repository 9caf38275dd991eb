"""Plan's candidate chips come from the typed scenario: a Scenario changed with dataclasses.replace plans for
its own plan section and chip, not for those of the file it was read from."""
from dataclasses import replace

from llmsim.catalog.hardware import lookup_hardware
from llmsim.scenario.scenario import PlanConfig, load_scenario
from llmsim.search.plan import _placement_overrides, candidates
from tests.helpers import REPO

CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"


def test_candidates_follow_a_replaced_plan_section_and_chip():
    scenario = load_scenario(CHAT)
    assert candidates(scenario, None) == ["H100-SXM"]
    assert candidates(replace(scenario, plan=PlanConfig(("H200", "B200"))), None) == ["H200", "B200"]
    on_h200 = replace(scenario, hardware=lookup_hardware("H200"))
    assert candidates(on_h200, None) == ["H200"]
    assert _placement_overrides(on_h200, "H200") == {}          # its own chip keeps its layout
    assert _placement_overrides(on_h200, "H100-SXM")["hardware"] == "H100-SXM"
    assert candidates(scenario, ["B200"]) == ["B200"]           # --hardware wins over both


def test_a_profile_file_keeps_the_name_the_scenario_gave_it(tmp_path):
    profile = (REPO / "hardware_profiles" / "h100-sxm.yaml").read_text()
    (tmp_path / "gpu.yaml").write_text(profile)
    text = CHAT.read_text().replace("hardware: H100-SXM", "hardware: gpu.yaml")
    assert "hardware: gpu.yaml" in text
    (tmp_path / "chat.yaml").write_text(text)
    scenario = load_scenario(tmp_path / "chat.yaml")
    assert candidates(scenario, None) == ["gpu.yaml"] and _placement_overrides(scenario, "gpu.yaml") == {}
