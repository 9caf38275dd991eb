"""A warm-up as long as the arrivals leaves nothing to measure: ``llmsim run`` says so, naming the keys."""
from __future__ import annotations

import yaml

from llmsim.cli.main import main
from tests.helpers import BASE, merge


def test_a_warmup_longer_than_the_arrivals_is_named(tmp_path, capsys):
    # 60 requests at 100/s arrive within about 0.6 s; the warm-up is 30 s
    document = merge(BASE, {"workload": {"num_requests": 60, "arrival": {"rate": 100}},
                            "simulation": {"warmup": "30 s"}})
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(document))
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "warning" in err
    for key in ("simulation.warmup", "workload.num_requests", "workload.arrival.rate"):
        assert key in err


def test_a_warmup_within_the_arrivals_is_not_warned(tmp_path, capsys):
    document = merge(BASE, {"workload": {"num_requests": 60, "arrival": {"rate": 100}},
                            "simulation": {"warmup": "0.1 s"}})
    path = tmp_path / "fine.yaml"
    path.write_text(yaml.safe_dump(document))
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "warning" not in capsys.readouterr().err
