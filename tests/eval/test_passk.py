import math

import pytest

from posttrain.eval.passk import mean_pass_at_k, pass_at_k


def test_pass_at_k_matches_combinatorics():
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    assert pass_at_k(4, 2, 3) == 1.0  # any 3 of 4 include a correct one
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
