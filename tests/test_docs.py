"""The documentation: the generated references match the code, the README's commands are CI's, and
what the docs and the package point a user to exists in a clone."""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from llmsim.cli import reference
from llmsim.cli.main import build_parser
from llmsim.scenario import keys
from llmsim.scenario.scenario import CPUOffload, Deployment, EngineConfig

from tests.helpers import REPO


@pytest.fixture(scope="module")
def scenario_keys():
    return {doc.path: doc for doc in reference.scenario_keys()}


@pytest.mark.parametrize("name", sorted(reference.GENERATED))
def test_the_committed_references_are_current(name):
    committed = (REPO / "docs" / "reference" / name).read_text()
    assert reference.GENERATED[name]() == committed, \
        f"docs/reference/{name} is stale: run python -m llmsim.cli.reference and commit the result"


def test_the_check_command_finds_a_stale_reference(tmp_path):
    for name, build in reference.GENERATED.items():
        (tmp_path / name).write_text(build())
    assert reference.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "cli.md").write_text("an old reference\n")
    assert reference.main(["--out", str(tmp_path), "--check"]) == 1


def test_the_recorded_defaults_are_the_dataclasses_own(scenario_keys):
    """The reference's defaults come from the reader's calls; the dataclasses are where they live."""
    engine, deployment, offload = EngineConfig(), Deployment(), CPUOffload()
    expected = {
        "engine.max_num_seqs": str(engine.max_num_seqs), "engine.max_batch_tokens": str(engine.max_batch_tokens),
        "engine.block_size": str(engine.block_size), "engine.memory_utilization": f"{engine.memory_utilization:g}",
        "engine.batching": engine.batching, "engine.admission": engine.admission,
        "engine.chunked_prefill": str(engine.chunked_prefill).lower(),
        "engine.runtime_reserve": f"{engine.runtime_reserve_bytes / 2**30:g} GiB",
        "deployment.router": deployment.router, "deployment.replicas": str(deployment.replicas),
        "deployment.load_bound": f"{deployment.load_bound:g}",
        "engine.cpu_offload.idle_timeout": f"{offload.idle_timeout_s:g} s",
    }
    assert {key: scenario_keys[key].defaults for key in expected} == {key: {v} for key, v in expected.items()}


def test_every_allowed_value_and_range_is_the_readers(scenario_keys):
    from llmsim.config.policies import Admission, RouterPolicy, SchedulingPolicy
    for key, kind in (("engine.admission", Admission), ("deployment.router", RouterPolicy),
                      ("engine.scheduling_policy", SchedulingPolicy)):
        assert scenario_keys[key].options == list(kind.names())
    assert scenario_keys["engine.memory_utilization"].allowed == ">= 0 and <= 1"
    seqs = scenario_keys["engine.max_num_seqs"]
    assert seqs.allowed == ">= 1" and seqs.type == "integer"
    assert scenario_keys["slo.ttft"].type == "duration"


def test_a_key_without_a_description_or_a_description_without_a_key_fails(monkeypatch):
    help_text = dict(keys.KEY_HELP)
    del help_text["engine.max_num_seqs"]
    monkeypatch.setattr(reference, "KEY_HELP", help_text)
    with pytest.raises(KeyError, match="without a description: engine.max_num_seqs"):
        reference.scenario_reference()
    help_text["engine.max_num_seqs"] = "restored"
    help_text["engine.max_num_seq"] = "a key no reader takes"
    with pytest.raises(KeyError, match="does not take: engine.max_num_seq"):
        reference.scenario_reference()


def test_the_cli_reference_names_every_command_and_flag():
    text = (REPO / "docs" / "reference" / "cli.md").read_text()
    (group,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in group.choices.items():
        assert f"\n## llmsim {name}\n" in text
        section = text.split(f"\n## llmsim {name}\n", 1)[1].split("\n## llmsim ", 1)[0]
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in section or f" / {option}" in section, (name, option)


def _ci_test_command() -> str:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    (command,) = [line for line in lines if line.startswith("python3 -m venv") and "pytest" in line]
    return command


def test_the_readme_is_short_and_its_test_command_is_cis():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert commands[0] == ("python3 -m venv .venv && .venv/bin/pip install -e . && "
                           ".venv/bin/llmsim run scenarios/llama3-8b-h100-chat.yaml")
    assert commands[1] == _ci_test_command()


def test_every_relative_link_of_the_readme_exists():
    readme = (REPO / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme) if "://" not in link]
    assert links and [link for link in links if not (REPO / link).exists()] == []


def _tracked_text_files():
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in listed
            if name.endswith((".py", ".yaml", ".md", ".j2", ".ipynb", ".sh", ".toml")) and (REPO / name).exists()]


def test_nothing_points_into_a_folder_outside_the_clone():
    """Citations go to docs/reference/sources/, which a clone has, not to the development tree's shared/."""
    pointing = [str(path.relative_to(REPO)) for path in _tracked_text_files()
                if path != Path(__file__) and "shared/reference" in path.read_text(errors="replace")]
    assert pointing == []


def test_no_output_names_a_project_issue():
    """What a user reads (the package's messages and data, the shipped profiles) says what a figure is, not
    which development issue produced it; GitHub issues of other projects (`NVIDIA/nccl issue 1264`) are sources."""
    found = []
    for folder in ("llmsim", "hardware_profiles", "scenarios", "docs"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".md", ".j2") and path.is_file():
                for match in re.finditer(r"(\S*)\s+issues?[ -]\d+", path.read_text(), re.I):
                    if "/" not in match.group(1):
                        found.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert found == []
