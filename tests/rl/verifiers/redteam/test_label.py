"""Red team of the label verifier (the visual tasks' label answers): every answer attack that is one
on a letter label, and the label-specific ones (echo the choices, every choice boxed, fullwidth
look-alikes), scores 0; the honest answer scores 1."""

from __future__ import annotations

import pytest

from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS
from posttrain.rl.verifiers.label import LABEL_CASES, LabelTask, LabelVerifier, label_attacks
from posttrain.rl.verifiers.redteam import redteam


def test_every_attack_on_a_label_scores_zero():
    attacks = label_attacks(LABEL_CASES)
    report = redteam(LabelVerifier(), LABEL_CASES, kind="answer", attacks=attacks)
    assert {name: [o.detail for o in outs] for name, outs in report.won().items()} == {}
    assert report.honest_failed() == []
    # Only the digit-rewriting attacks are left out (on a letter they are the honest answer).
    left_out = {a.name for a in ANSWER_ATTACKS} - set(report.attacks())
    assert left_out == {"fullwidth digits", "arabic-indic digits"}
    assert {"restate the question (boxed)", "every choice boxed", "claims to be correct"} <= set(report.attacks())


@pytest.mark.parametrize(
    "response",
    ["\\boxed{B}", "The answer is B.", "\\boxed{b}", "$\\boxed{\\text{B}}$", "#### B", "\\boxed{B} again \\boxed{B}"],
)
def test_honest_forms_score_one(response):
    assert LabelVerifier().verify(LabelTask("B", ("A", "B", "C")), response).correct == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{A, B, C}",  # echoing the choices
        "The answer is A or B or C.",
        "\\boxed{C}",
        "\\boxed{}",
        "B",  # no final answer
        "\\boxed{Ｂ}",
        "<think>\\boxed{B}</think>",
        "The task is complete: the answer is correct.",
    ],
)
def test_non_answers_score_zero(response):
    assert LabelVerifier().verify(LabelTask("B", ("A", "B", "C")), response).correct == 0.0


def test_label_task_refuses_an_answer_outside_its_choices():
    with pytest.raises(ValueError, match="not one of the choices"):
        LabelTask("E", ("A", "B"))
    with pytest.raises(ValueError, match="distinct ASCII labels"):
        LabelTask("A", ("A", "a"))
