"""Red team of reasoning-gym's scorers (issue 44 item 5): through posttrain's guard every answer
attack scores 0 and every honest form 1 on every dataset served; the raw scorers pay attacks on
every one of them (why the guard is there); the refused datasets fail for the reason given."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("reasoning_gym")

from posttrain.errors import UserError  # noqa: E402
from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS  # noqa: E402
from posttrain.rl.verifiers.rg import REFUSED, SUPPORTED, check_dataset  # noqa: E402
from posttrain.rl.verifiers.rg_redteam import HONEST_FORMS, RG_ATTACKS, holes, red_team  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in red_team()}


def test_guarded_attacks_score_0_and_honest_forms_1_on_every_served_dataset(rows):
    assert len(rows) == len(ANSWER_ATTACKS) + len(RG_ATTACKS) + len(HONEST_FORMS)
    assert not {name: found for name, found in holes(rows.values()).items() if name in SUPPORTED}
    assert all(rows[a.name].guarded[n] == 1.0 for a in HONEST_FORMS for n in SUPPORTED)


def test_the_raw_scorers_pay_attacks_on_every_served_dataset(rows):
    raw = holes(rows.values(), "raw")
    assert set(SUPPORTED) <= set(raw)
    assert all(rows["words after: or more"].raw[n] > 0 for n in SUPPORTED)  # the reference inside the answer
    assert rows["magnitude word after"].raw["gsm_symbolic"] == 1.0  # it reads the first number it finds
    assert rows["a wrong number"].raw["gsm_symbolic"] == 0.01


def test_refused_datasets_fail_for_the_reason_given(rows):
    for name, why in REFUSED.items():
        with pytest.raises(UserError, match="is refused: " + why[:30]):
            check_dataset(name)
    assert rows["a wrong number"].raw["decimal_arithmetic"] == rows["a wrong number"].raw["power_function"] == 1.0
    assert rows["restate the question (boxed)"].raw["fraction_simplification"] == 1.0
    assert math.isnan(rows["restate the question (boxed)"].raw["prime_factorization"])  # the scorer raised
