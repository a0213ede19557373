"""Red team of the answer-checking verifiers (arithmetic, GSM8K-style, MATH-style): every attack
scores 0 and the honest solution 1; the helper finds the holes of a naive user verifier."""

from __future__ import annotations

import re
import sys

import pytest

from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, ANSWER_CASES
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from posttrain.rl.verifiers.redteam import AnswerCase, builtin_cases, markdown_table, redteam
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def math_verifier():
    v = MathVerifier()
    yield v
    v._checker.close()


@pytest.mark.parametrize("domain", ["arithmetic", "gsm8k", "math"])
def test_every_answer_attack_scores_zero(domain, math_verifier):
    kind, _, cases = builtin_cases(domain)
    report = redteam(math_verifier, cases, kind=kind)
    assert {name: [o.detail for o in outs] for name, outs in report.won().items()} == {}
    assert report.honest_failed() == []
    assert len(report.attacks()) == len(ANSWER_ATTACKS) >= 25


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 85.",
        "\\boxed{85}",
        "#### 85",
        "x = 85",
        "\\boxed{x = 85}",
        "37+48=85. The answer is 85.",
        "\\boxed{85} so again \\boxed{85}",
        "<think>37+48, maybe 84?</think> The answer is \\boxed{85}.",
        "The answer is 85, because 37+48=85.",
        "We add 37 and 48 to get 85",
        "\\boxed{85 \\text{ apples}}",
        "\\boxed{85.0}",
    ],
)
def test_honest_forms_keep_scoring(response, math_verifier):
    assert math_verifier.verify(MathTask("85"), response).correct == 1.0


def test_the_issue_examples_score_zero(math_verifier):
    """Issue 25's report: each of these scored 1.0 on main."""
    for ref, response in [
        ("85", "The answer is 37+48."),
        ("85", "\\boxed{48+37}"),
        ("85", "\\boxed{(37+48)}"),
        ("85", "\\boxed{85=85}"),
        ("42", "The answer is 6*7"),
        ("85", "\\boxed{84}\\boxed{85}"),
    ]:
        assert math_verifier.verify(MathTask(ref), response).correct == 0.0, response


def naive_score(prompt: str, response: str, record: dict) -> float:
    """A user verifier that evaluates the last boxed expression: the hole the red team must find."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", response)
    try:
        return float(bool(found) and abs(eval(found[-1], {}) - float(record["answer"])) < 1e-9)
    except Exception:
        return 0.0


def test_helper_reports_the_holes_of_a_user_verifier_given_as_a_spec():
    """`rl.verifiers="mod:fn"` user verifiers go through the same helper (here by its spec)."""
    cases = [dataclasses_replace_task(c) for c in ANSWER_CASES["arithmetic"]]
    report = redteam(f"naive={__name__}:naive_score", cases, kind="answer")  # rl.verifiers' form
    assert report.honest_failed() == []
    won = set(report.won())
    assert {"restate the question (boxed)", "restate, operands commuted", "restate in parentheses"} <= won
    assert "fullwidth digits" not in won and not report.ok
    assert "WON" in report.summary()
    table = markdown_table({"naive": report})
    assert "| restate the question (boxed) | answer | 1 |" in table


def dataclasses_replace_task(case: AnswerCase) -> AnswerCase:
    import dataclasses

    return dataclasses.replace(case, task={"prompt": case.question, "answer": case.answer})


def test_helper_refuses_bad_input():
    with pytest.raises(ValueError, match="kind 'code'"):
        redteam(MathVerifier(symbolic=False), ANSWER_CASES["arithmetic"], kind="code")
    with pytest.raises(ValueError, match="at least one case"):
        redteam(MathVerifier(symbolic=False), [], kind="answer")
    with pytest.raises(TypeError, match="neither a verifier"):
        redteam(42, ANSWER_CASES["arithmetic"], kind="answer")


def test_cli_runs_a_user_verifier(tmp_path):
    """tools/redteam.py --verifier mod:fn --kind answer: exit 1 and the holes named."""
    import os
    import subprocess

    root = ROOT
    (tmp_path / "naive_mod.py").write_text(
        "def score(prompt, response, record):\n    return float(record['answer'] in response)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    out = subprocess.run(
        [sys.executable, str(root / "tools" / "redteam.py"), "--verifier", "naive_mod:score", "--kind", "answer"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "HOLES" in out.stdout and "WON  tautology answer=answer" in out.stdout


def test_hostile_sizes_are_refused_quickly_not_errors(math_verifier):
    """Answers built to make the checker compute for ever score 0 at once (no verifier error)."""
    import time

    hostile = [
        "\\boxed{1e999999999}",
        "\\boxed{1.5\\times10^{999999999}}",
        "\\boxed{" + "(" * 5000 + "85" + ")" * 5000 + "}",
        "\\boxed{2^{2^{2^{2^{99}}}}}",
        "\\boxed{\\sqrt[99999999]{2}}",
        "\\boxed{" + "9" * 5000 + "}",
    ]
    t = time.monotonic()
    for ref in ("85", "2\\sqrt{2}"):
        verdicts = math_verifier.verify_many([MathTask(ref)] * len(hostile), hostile)
        assert [(v.correct, v.error) for v in verdicts] == [(0.0, None)] * len(hostile)
    assert time.monotonic() - t < 2
