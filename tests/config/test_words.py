"""Counts in sentences agree in number: one replica, two replicas."""
from __future__ import annotations

import pytest

from llmsim.config.words import counted


@pytest.mark.parametrize("count, noun, expected", [
    (1, "replica", "1 replica"), (2, "replica", "2 replicas"), (0, "replica", "0 replicas"),
    (1.0, "seed", "1 seed"), (3.0, "seed", "3 seeds"), (1024, "sequence", "1,024 sequences"),
    (1.5, "device", "1.5 devices"), (2, "child", "2 children"),
])
def test_a_count_and_its_noun_agree(count, noun, expected):
    assert counted(count, noun, "children" if noun == "child" else None) == expected
