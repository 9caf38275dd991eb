"""Safe outputs: the commands write only under the folder the user chose (a scenario name adds at
most one safe folder name), refuse to replace results unless told to, and write results before
anything that can fail after them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmsim import ConfigError
from llmsim.cli.main import main
from llmsim.cli.outputs import folder_name

from tests.helpers import BASE, merge

TINY = {"workload": {"num_requests": 40}}


def files(root: Path) -> set[Path]:
    return {path for path in root.rglob("*") if path.is_file()}


def scenario_file(folder: Path, name) -> Path:
    data = merge(BASE, TINY)
    data["name"] = name
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name, leaf", [("chat", "chat"), ("/abs/path", "abs-path"), ("../../x", "x"),
                                        ("a/../../b", "a-..-..-b"), ("my run 2", "my-run-2"), (".hidden", "hidden"),
                                        ("Überlast", "Überlast"), ("x" * 300, "x" * 100)])
def test_a_name_becomes_one_safe_folder_name(name, leaf):
    assert folder_name(name, "name") == leaf
    assert "/" not in leaf and leaf not in (".", "..")


@pytest.mark.parametrize("name", ["", "/", "..", "../..", "  ", "./."])
def test_a_name_with_nothing_left_is_a_configuration_error(name):
    with pytest.raises(ConfigError, match="at key 'name'.*cannot name an output folder"):
        folder_name(name, "name", "s.yaml")


@pytest.mark.parametrize("name", ["/abs/llmsim-test-escape", "../../escape", "", ".."])
def test_run_writes_only_under_the_chosen_folder(tmp_path, monkeypatch, capsys, name):
    """With --out, everything lands under it whatever the name; without, under runs/<safe name>
    in the current folder, or nothing at all (exit 2 naming the key) when the name has no safe part."""
    work = tmp_path / "work" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    path = scenario_file(tmp_path, name)
    before = files(tmp_path)
    assert main(["run", str(path), "--out", str(work / "chosen")]) == 0
    assert {p.relative_to(work / "chosen").as_posix() for p in files(tmp_path) - before} == {
        "requests.csv", "summary.json"}
    capsys.readouterr()
    code = main(["run", str(path)])
    new = files(tmp_path) - before - files(work / "chosen")
    if name.strip("./") == "":
        assert code == 2 and not new
        assert "at key 'name'" in capsys.readouterr().err
    else:
        assert code == 0 and {p.parent for p in new} == {work / "runs" / folder_name(name, "name")}
    assert not Path("/abs/llmsim-test-escape").exists()


def test_results_are_not_replaced_without_overwrite(tmp_path, capsys):
    path = scenario_file(tmp_path, "chat")
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--iterations"]) == 0
    first = {p.name: p.read_bytes() for p in files(out)}
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(out), "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert "would replace existing results" in err and "--overwrite" in err and "summary.json" in err
    assert {p.name: p.read_bytes() for p in files(out)} == first                  # untouched
    assert main(["run", str(path), "--out", str(out), "--seed", "3", "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["seed"] == 3
    assert not (out / "iterations.csv").exists()              # no earlier run's file left beside the new ones
    assert not [p for p in out.iterdir() if p.name.startswith(".")]                # no temporary files


def test_results_are_written_before_the_plot(tmp_path, monkeypatch):
    import llmsim.analysis.plots as plots

    def broken(result, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "timeline", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="no display"):
        main(["run", str(scenario_file(tmp_path, "chat")), "--out", str(out), "--plot"])
    assert {p.name for p in files(out)} == {"requests.csv", "summary.json"}       # no half-written plot


def test_a_table_file_is_not_replaced_without_overwrite(tmp_path, capsys):
    """plan (and recommend, compare, calibrate, validate --plot) check before running anything."""
    existing = tmp_path / "plan.csv"
    existing.write_text("mine\n")
    path = scenario_file(tmp_path, "chat")
    assert main(["plan", str(path), "--target-rate", "5", "--out", str(existing)]) == 2
    assert "would replace existing results" in capsys.readouterr().err and existing.read_text() == "mine\n"
    assert main(["recommend", str(path), "--out", str(existing)]) == 2
    assert existing.read_text() == "mine\n"
    (tmp_path / "folder").write_text("")
    assert main(["run", str(path), "--out", str(tmp_path / "folder")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_sweep_rerun_says_it_replaces_its_frontier(tmp_path, capsys):
    path = scenario_file(tmp_path, "chat")
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"workload.arrival.rate": [5.0, 10.0]}))
    argv = ["sweep", str(path), "--grid", str(grid), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert main(argv) == 0 and "replacing" not in capsys.readouterr().out
    assert main(argv) == 0 and "(replacing the earlier frontier.csv)" in capsys.readouterr().out
