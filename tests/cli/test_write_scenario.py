"""``llmsim run --write-scenario``: the scenario as simulated, written beside the records, runs again to the
same records."""
from __future__ import annotations

from llmsim.cli.main import main
from llmsim.scenario.scenario import load_scenario
from llmsim.scenario.variants import with_requests

from tests.helpers import REPO, same

CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"


def test_the_written_scenario_is_the_one_simulated_and_runs_to_the_same_records(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["run", str(CHAT), "--out", str(first), "--requests", "30", "--seed", "4",
                 "--vllm-args", "--max-num-seqs 32", "--write-scenario"]) == 0
    written = load_scenario(first / "scenario.yaml")
    simulated = with_requests(load_scenario(CHAT, seed=4, vllm_args="--max-num-seqs 32"), 30)
    assert same(written, simulated) and written.engine.max_num_seqs == 32
    assert main(["run", str(first / "scenario.yaml"), "--out", str(again)]) == 0
    assert (again / "requests.csv").read_text() == (first / "requests.csv").read_text()


def test_an_existing_scenario_file_is_not_replaced_without_overwrite(tmp_path, capsys):
    (tmp_path / "scenario.yaml").write_text("kept")
    assert main(["run", str(CHAT), "--out", str(tmp_path), "--requests", "5", "--write-scenario"]) == 2
    assert "scenario.yaml" in capsys.readouterr().err and (tmp_path / "scenario.yaml").read_text() == "kept"
