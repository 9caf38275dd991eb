"""Entry points (llmsim.compiled): a kernel's specialization, compiled on first read, called without the
dispatcher, and giving what the dispatcher gives."""
from __future__ import annotations

import numba
import numpy as np

from llmsim.compiled import EntryPoint


@numba.njit
def _weighted_sum(values, weight):
    total = 0.0
    for value in values:
        total += value * weight
    return total


_SIGNATURE = (numba.float64[::1], numba.float64)


class _Holder:
    weighted_sum = EntryPoint(_weighted_sum, _SIGNATURE)

    def total(self, values):
        return self.weighted_sum(values, 0.5)


def test_an_entry_point_is_compiled_on_first_read_and_then_a_plain_class_attribute():
    assert isinstance(vars(_Holder)["weighted_sum"], EntryPoint)          # importing compiled nothing
    values = np.arange(5.0)
    assert _Holder().total(values) == _weighted_sum(values, 0.5) == 5.0  # through an instance: not bound
    compiled = vars(_Holder)["weighted_sum"]
    assert not isinstance(compiled, EntryPoint) and _Holder.weighted_sum is compiled
    assert _Holder().weighted_sum is compiled                            # read again: the same function


def test_a_subclass_reading_it_first_compiles_it_for_the_class_that_declared_it():
    class Declaring:
        entry = EntryPoint(_weighted_sum, _SIGNATURE)

    class Child(Declaring):
        pass

    assert Child().entry(np.ones(3), 2.0) == 6.0
    assert "entry" not in vars(Child) and not isinstance(vars(Declaring)["entry"], EntryPoint)
