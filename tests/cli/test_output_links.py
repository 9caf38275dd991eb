"""A link planted in an output folder is never written through.

Each test plants symbolic links, under the names of the temporary files the commands once used
(and under the final names), pointing to a file outside the output folder; the command then runs,
and the outside file must be byte for byte what it was. A temporary file is made new under an
unpredictable name; a lock or journal under a fixed name that is a link is refused (exit 2); a
final name that is a link is replaced by the rename, the link itself, never its target.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from llmsim.cli.main import main
from llmsim.config.files import create_exclusive, write_file

from tests.helpers import BASE, merge

SECRET = b"outside the output folder: must never change\n"
TINY = {"workload": {"num_requests": 30, "arrival": {"rate": 4.0}}, "slo": {"ttft": "300 ms", "tpot": "40 ms"}}


@pytest.fixture
def outside(tmp_path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(SECRET)
    return target


def plant(folder: Path, names, target: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).symlink_to(target)


def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, TINY)))
    return path


def test_run_writes_no_temporary_file_through_a_link(tmp_path, outside):
    out = tmp_path / "out"
    plant(out, [".requests.partial.csv", ".summary.partial.json", ".iterations.partial.csv"], outside)
    assert main(["run", str(scenario_file(tmp_path)), "--out", str(out), "--iterations"]) == 0
    assert outside.read_bytes() == SECRET
    assert (out / "summary.json").is_file() and not (out / "summary.json").is_symlink()
    assert len((out / "requests.csv").read_text().splitlines()) == 31         # header and 30 requests
    # The planted links are left as they were (not ours to remove), and no temporary file is left.
    assert sorted(p.name for p in out.iterdir() if p.is_symlink()) == [
        ".iterations.partial.csv", ".requests.partial.csv", ".summary.partial.json"]
    assert not [p for p in out.iterdir() if ".partial" in p.name and not p.is_symlink()]


def test_run_replaces_a_link_under_a_final_name_not_its_target(tmp_path, outside):
    out = tmp_path / "out"
    plant(out, ["requests.csv", "summary.json"], outside)
    # The link's target exists, so without --overwrite the run refuses before simulating.
    assert main(["run", str(scenario_file(tmp_path)), "--out", str(out)]) == 2
    assert main(["run", str(scenario_file(tmp_path)), "--out", str(out), "--overwrite"]) == 0
    assert outside.read_bytes() == SECRET
    assert not (out / "requests.csv").is_symlink() and not (out / "summary.json").is_symlink()


def sweep_args(tmp_path: Path, out: Path) -> list[str]:
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"workload.arrival.rate": [2.0, 4.0]}))
    return ["sweep", str(scenario_file(tmp_path)), "--grid", str(grid), "--out", str(out), "--workers", "1"]


def test_sweep_writes_no_temporary_file_through_a_link(tmp_path, outside):
    out = tmp_path / "out"
    # The journal's first point widens its (empty) header: a rewrite through its temporary file.
    plant(out, ["results.csv.tmp", ".frontier.partial.csv"], outside)
    assert main(sweep_args(tmp_path, out)) == 0
    assert outside.read_bytes() == SECRET
    assert len((out / "results.csv").read_text().splitlines()) == 3
    assert (out / "frontier.csv").is_file()


@pytest.mark.parametrize("name", ["results.csv.lock", "results.csv"])
def test_sweep_refuses_a_link_as_its_lock_or_journal(tmp_path, outside, capsys, name):
    out = tmp_path / "out"
    plant(out, [name], outside)
    assert main(sweep_args(tmp_path, out)) == 2
    assert outside.read_bytes() == SECRET
    message = capsys.readouterr().err
    assert f"{name} is a symbolic link" in message and "Traceback" not in message


def test_write_file_never_follows_a_link(tmp_path, outside):
    """The one writer every command uses: a link under the final name is replaced, links under any
    other name are left alone, and the temporary file is a new regular file."""
    folder = tmp_path / "out"
    plant(folder, ["report.md", ".report.partial.md"], outside)
    seen = {}

    def write(partial: Path):
        seen["partial"] = partial
        assert partial.parent == folder and partial.suffix == ".md"
        assert partial.is_file() and not partial.is_symlink()
        partial.write_text("# report\n")

    write_file(folder / "report.md", write)
    assert outside.read_bytes() == SECRET
    assert (folder / "report.md").read_text() == "# report\n" and not (folder / "report.md").is_symlink()
    assert not seen["partial"].exists()
    assert (folder / ".report.partial.md").is_symlink()


def test_a_writer_that_fails_leaves_no_temporary_file(tmp_path):
    folder = tmp_path / "out"

    def fail(partial: Path):
        partial.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_file(folder / "results.csv", fail)
    assert list(folder.iterdir()) == []


def test_create_exclusive_makes_a_new_file_with_the_umask_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        descriptor, path = create_exclusive(tmp_path, ".x.", ".partial.csv")
    finally:
        os.umask(previous)
    os.close(descriptor)
    assert path.name.startswith(".x.") and path.name.endswith(".partial.csv")
    assert (path.stat().st_mode & 0o777) == 0o644
