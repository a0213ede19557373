"""The reasoning-gym verifier's contract (issue 44 item 4): the guard reads the committed integer,
the dataset's scorer judges its canonical text, scores are clipped to [0, 1] and only full credit
pays, a scorer failure is an error (no verdict) while whatever the response gets wrong is a 0."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from posttrain.config.registry import VERIFIERS  # noqa: E402
from posttrain.rl.verifiers import rg  # noqa: E402
from posttrain.rl.verifiers.rg import RGTask, RGVerifier, guarded_answer  # noqa: E402

TASK = RGTask("basic_arithmetic", "{}", "Calculate 600 + 634.", "1234", {})


def test_the_guard_hands_the_scorer_a_canonical_integer_or_refuses():
    assert guarded_answer("\\boxed{1,234}").text == "1234"
    assert guarded_answer("<think>maybe 12</think>The answer is $-4$.").text == "-4"
    assert guarded_answer("\\boxed{x = 7} and so \\boxed{7}").text == "7"
    for response, why in (
        ("Adding it up, the total is 1234.", "no answer found"),  # unmarked: not read (rg.py says why)
        ("\\boxed{1234}. \\boxed{1235}", "different values"),
        ("\\boxed{600+634}", "operation"),
        ("\\boxed{2.5}", "not an integer"),
        ("\\boxed{１２３４}", ""),
    ):
        guarded = guarded_answer(response)
        assert guarded.text is None and why in guarded.refusal, (response, guarded)


def test_scores_are_clipped_full_credit_pays_and_scorer_failures_are_errors(monkeypatch):
    v = RGVerifier()
    assert v.verify(TASK, "The answer is \\boxed{1234}.") == rg.Verdict(
        1.0, True, "'1234' scored 1 by rg:basic_arithmetic", parts={"rg_score": 1.0}
    )
    policy_fault = v.verify(TASK, "The answer is 1234 or more.")
    assert policy_fault.correct == 0 and policy_fault.error is None
    for returned, correct, score in ((1.7, 1.0, 1.0), (0.5, 0.0, 0.5), (-3, 0.0, 0.0)):
        monkeypatch.setattr(rg, "raw_score", lambda task, answer, r=returned: r)
        verdict = v.verify(TASK, "\\boxed{1234}")
        assert (verdict.correct, verdict.parts["rg_score"], verdict.error) == (correct, score, None), returned
    for returned in (float("nan"), None, "1"):
        monkeypatch.setattr(rg, "raw_score", lambda task, answer, r=returned: r)
        verdict = v.verify(TASK, "\\boxed{1234}")
        assert verdict.correct == 0 and "not a finite number" in verdict.error, returned

    def broken(task, answer):
        raise KeyError("metadata")

    monkeypatch.setattr(rg, "raw_score", broken)
    verdict = v.verify(TASK, "\\boxed{1234}")
    assert verdict.correct == 0 and verdict.error == "KeyError: 'metadata'" and v.errors == 4


def test_task_records_name_the_rg_verifier():
    entry = VERIFIERS["rg"]
    task = entry.from_record({"dataset": "chain_sum", "question": "1 + 2 =", "answer": "3", "metadata": {}})
    assert isinstance(task, entry.task) and entry.make().verify(task, "\\boxed{3}").correct == 1.0
    with pytest.raises(ValueError, match=r"needs string fields \['answer'\]"):
        entry.from_record({"dataset": "chain_sum", "question": "1 + 2 ="})
