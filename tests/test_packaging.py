"""Packaging: what a non-editable install ships, and where hardware profiles are looked up.

The editable install the other tests run under reads everything from the checkout, so it cannot see a
file missing from the wheel; these tests read pyproject.toml, build a wheel from a copy of the sources
and import llmsim from the unpacked wheel, outside the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from llmsim import hardware_catalog, load_scenario, lookup_hardware
from llmsim.catalog.hardware import profile_dirs, shipped_profile_dir

REPO = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
SHIPPED_PROFILES = sorted(path.name for path in (REPO / "hardware_profiles").glob("*.yaml"))


def test_the_package_list_names_every_subpackage():
    """setuptools installs only the listed packages: a new subpackage left out of pyproject.toml would be
    missing from every non-editable install while the editable one keeps working."""
    on_disk = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "llmsim").rglob("__init__.py")}
    mapped = {name for name in SETUPTOOLS["package-dir"] if name}
    assert set(SETUPTOOLS["packages"]) == on_disk | mapped
    for name in mapped:
        assert (REPO / SETUPTOOLS["package-dir"][name] / "__init__.py").is_file(), name


def test_the_shipped_profiles_are_the_packaged_ones():
    assert sorted(path.name for path in shipped_profile_dir().glob("*.yaml")) == SHIPPED_PROFILES
    assert profile_dirs()[-1] == shipped_profile_dir()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (a build in the checkout would leave build/ behind,
    whose stale files a later wheel would pick up)."""
    root = tmp_path_factory.mktemp("wheel")
    source = _mkdir(root / "source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("llmsim", "hardware_profiles"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (built,) = (root / "dist").glob("llmsim-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_every_profile_and_the_model_catalog(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"llmsim/hardware_profiles/{name}" for name in SHIPPED_PROFILES} <= names
    assert "llmsim/catalog/data/models.yaml" in names


@pytest.mark.slow
def test_the_installed_wheel_runs_a_scenario_outside_the_checkout(wheel, tmp_path):
    """A wheel is importable once unpacked: llmsim comes from there (PYTHONPATH is searched before the
    editable install), and `llmsim run` finds H100-SXM among the installed profiles."""
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    elsewhere = _mkdir(tmp_path / "elsewhere")
    env = {key: value for key, value in os.environ.items() if key != "LLMSIM_PROFILE_PATH"}
    env["PYTHONPATH"] = str(installed)
    check = ("import llmsim, sys; from llmsim.catalog.hardware import shipped_profile_dir; "
             "print(llmsim.__file__); print(shipped_profile_dir()); "
             "from llmsim.cli.main import main; sys.exit(main(sys.argv[1:]))")
    scenario = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"
    run = subprocess.run([sys.executable, "-c", check, "run", str(scenario), "--out", "out"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    module_file, profile_dir = run.stdout.splitlines()[:2]
    assert Path(module_file).is_relative_to(installed)
    assert Path(profile_dir).is_relative_to(installed)
    assert "Llama-3.1-8B on 1 x H100-SXM" in run.stdout
    assert (elsewhere / "out" / "summary.json").is_file()


def _own_h100(directory: Path, price: float) -> Path:
    """A copy of the shipped H100-SXM profile with another price: same name, told apart by its price."""
    profile = yaml.safe_load((shipped_profile_dir() / "h100-sxm.yaml").read_text())
    profile["price_per_hour_usd"]["value"] = price
    path = _mkdir(directory) / "h100-sxm.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_profiles_on_llmsim_profile_path_are_found_first(tmp_path, monkeypatch):
    first = _own_h100(tmp_path / "first", 7.0)
    _own_h100(tmp_path / "second", 8.0)
    monkeypatch.setenv("LLMSIM_PROFILE_PATH", os.pathsep.join([str(tmp_path / "first"), str(tmp_path / "second")]))
    assert profile_dirs()[:2] == [tmp_path / "first", tmp_path / "second"]
    for name in ("H100-SXM", "h100-sxm"):            # by the profile's name and by the file's stem
        assert lookup_hardware(name).price_per_hour_usd == 7.0
        assert lookup_hardware(name).path == str(first)
    assert hardware_catalog()["H100-SXM"].price_per_hour_usd == 7.0
    assert hardware_catalog()["H200"].path.startswith(str(shipped_profile_dir()))


def test_a_profile_is_loaded_by_path_relative_to_the_scenario(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMSIM_PROFILE_PATH", raising=False)
    _own_h100(tmp_path / "chips", 9.0)
    scenario = yaml.safe_load((REPO / "scenarios" / "llama3-8b-h100-chat.yaml").read_text())
    scenario["hardware"] = "chips/h100-sxm.yaml"
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    monkeypatch.chdir(REPO)                          # the path resolves from the scenario's folder, not here
    assert load_scenario(path).hardware.price_per_hour_usd == 9.0
    assert lookup_hardware(str(tmp_path / "chips" / "h100-sxm.yaml")).price_per_hour_usd == 9.0
