"""The shared test helpers check what they promise (tests/conftest.py)."""
import numpy as np

from conftest import rel_err


def test_rel_err_sees_a_wrong_small_entry_beside_a_large_one():
    want = np.array([1000.0, 1.0, 0.5])
    got = want.copy()
    got[1] = 1.01                                          # 1 % wrong, but 1e-5 of the largest entry
    assert 0.0099 < rel_err(got, want) < 0.0100            # whole-tensor scaling would say 1e-5
    assert rel_err(want, want) == 0.0 and rel_err(np.zeros(0), np.zeros(0)) == 0.0


def test_rel_err_compares_entries_near_zero_with_the_floor():
    want = np.array([1.0, 1e-9])
    assert rel_err(want + [0.0, 1e-8], want) == 1e-8 / 1e-4          # float64: the floor is 1e-4 of the largest
    assert rel_err((want + [0.0, 1e-8]).astype(np.float32), want) < 1e-6 / 1e-2 + 1e-9  # float32: 1e-2
    assert rel_err(want + [0.0, 1e-8], want, floor=1e-300) > 0.9       # no floor: every entry against itself
