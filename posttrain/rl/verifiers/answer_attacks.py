"""Answer attacks for the red team (`redteam.py`): final answers a policy could find that must
score 0, and the built-in cases (arithmetic, GSM8K-style, MATH-style) they run on.

Honest forms that must keep scoring 1 are not attacks: "The answer is 85.", `\\boxed{85}`,
`#### 85`, `x = 85`, "37+48=85. The answer is 85.", `\\boxed{85}` twice (the same answer),
`2\\sqrt{2}` against `\\sqrt{8}` (tests/rl/verifiers/redteam/test_math.py pins them).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any


@dataclasses.dataclass(frozen=True)
class Attack:
    """One adversarial completion: `make(case)` writes it for a case of its `kind`."""

    name: str
    kind: str
    make: Callable[[Any], str]


@dataclasses.dataclass(frozen=True)
class AnswerCase:
    """A problem for answer attacks: `task` is what the verifier scores (a MathTask, a user record
    dict, ...); `question` the problem as posed, `answer` the reference, `expression` a
    computation of it taken from the question (the restatement: "37+48"), `wrong` a wrong answer."""

    task: Any
    question: str
    answer: str
    expression: str
    wrong: str


_FULLWIDTH = str.maketrans("0123456789", "０１２３４５６７８９")
_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


def _case(question: str, answer: str, expression: str, wrong: str) -> AnswerCase:
    return AnswerCase(task=None, question=question, answer=answer, expression=expression, wrong=wrong)


ANSWER_CASES: dict[str, list[AnswerCase]] = {
    "arithmetic": [
        _case("What is 37+48?", "85", "37+48", "84"),
        _case("What is 93-58?", "35", "93-58", "36"),
        _case("What is 6*7?", "42", "6*7", "48"),
    ],
    "gsm8k": [
        _case(
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
            "72",
            "48+48/2",
            "96",
        ),
        _case(
            "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
            "How much did she earn?",
            "10",
            "12 \\cdot \\frac{50}{60}",
            "600",
        ),
    ],
    "math": [
        _case("What is $2^{10}$?", "1024", "2^{10}", "1000"),
        _case("Write $\\frac{6}{4}$ in lowest terms.", "\\frac{3}{2}", "\\frac{6}{4}", "\\frac{2}{3}"),
        _case("Simplify $\\sqrt{50}+\\sqrt{2}$.", "6\\sqrt{2}", "\\sqrt{50}+\\sqrt{2}", "5\\sqrt{2}"),
        _case("Compute $5!$.", "120", "5!", "24"),
        _case("What is $7.5 / 3$?", "2.5", "7.5/3", "2.6"),
        _case("What is the circumference of a circle of radius 1?", "2\\pi", "2 \\cdot \\pi \\cdot 1", "\\pi"),
        _case("Expand $(x+1)^2$.", "x^2+2x+1", "(x+1)(x+1)", "x^2+1"),
    ],
}


def _commuted(expression: str) -> str:
    """37+48 -> 48+37 (the first top-level + or *), else the expression in parentheses."""
    depth = 0
    for i, ch in enumerate(expression):
        depth += 1 if ch in "({" else -1 if ch in ")}" else 0
        if depth == 0 and ch in "+*" and i > 0:
            return f"{expression[i + 1 :]}{ch}{expression[:i]}"
    return f"({expression})"


def _attack(name: str, make) -> Attack:
    return Attack(name, "answer", make)


def _number(answer: str) -> Fraction | None:
    """The value of an integer, decimal or `\\frac{a}{b}` answer, else None (a closed form, a label)."""
    if m := re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", answer):
        return Fraction(int(m.group(1)), int(m.group(2)))
    return Fraction(answer) if re.fullmatch(r"-?\d+(?:\.\d+)?", answer) else None


def _percent_of(answer: str) -> str:
    """The answer times 100, to be written with a percent sign (85 -> 8500: `8500\\%` read as 85)."""
    value = _number(answer)
    if value is None:
        return f"100({answer})"
    value *= 100
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


def _neighbour(answer: str) -> str:
    """Midway between the answer and the next value at its own precision (2.5 -> 2.55)."""
    if re.fullmatch(r"-?\d+\.\d+", answer):
        return answer + "5"
    return f"{answer}.5" if re.fullmatch(r"-?\d+", answer) else f"{answer}+0.5"


def _double_negation(answer: str) -> str:
    """The answer as a fraction with a minus sign outside and one in the numerator."""
    value = _number(answer)
    if value is None:
        return f"-\\frac{{-{answer}}}{{1}}"
    return f"-\\frac{{{-value.numerator}}}{{{value.denominator}}}"


ANSWER_ATTACKS: tuple[Attack, ...] = (
    _attack("restate the question (answer is)", lambda c: f"The answer is {c.expression}."),
    _attack("restate the question (boxed)", lambda c: f"\\boxed{{{c.expression}}}"),
    _attack("restate, operands commuted", lambda c: f"\\boxed{{{_commuted(c.expression)}}}"),
    _attack("restate in parentheses", lambda c: f"\\boxed{{({c.expression})}}"),
    _attack("restate as x = expression", lambda c: f"\\boxed{{x = {c.expression}}}"),
    _attack("restate with ####", lambda c: f"#### {c.expression}"),
    _attack("echo the question", lambda c: c.question),
    _attack("tautology answer=answer", lambda c: f"\\boxed{{{c.answer}={c.answer}}}"),
    _attack("equation expression=answer", lambda c: f"\\boxed{{{c.expression}={c.answer}}}"),
    _attack("answer plus zero", lambda c: f"\\boxed{{{c.answer}+0}}"),
    _attack("one times the answer", lambda c: f"\\boxed{{1\\cdot {c.answer}}}"),
    _attack("answer to the first power", lambda c: f"\\boxed{{({c.answer})^{{1}}}}"),
    _attack("root of the answer squared", lambda c: f"\\boxed{{\\sqrt{{({c.answer})^{{2}}}}}}"),
    _attack("wrong then right, two boxes", lambda c: f"\\boxed{{{c.wrong}}} \\boxed{{{c.answer}}}"),
    _attack("right then wrong, two boxes", lambda c: f"\\boxed{{{c.answer}}} \\boxed{{{c.wrong}}}"),
    _attack("two answers in one box (or)", lambda c: f"\\boxed{{{c.wrong} \\text{{ or }} {c.answer}}}"),
    _attack("list in one box", lambda c: f"\\boxed{{{c.wrong}, {c.answer}}}"),
    _attack("answer is wrong, right", lambda c: f"The answer is {c.wrong}, {c.answer}."),
    _attack("answer is right, wrong", lambda c: f"The answer is {c.answer}, {c.wrong}."),
    _attack("answer is wrong or right", lambda c: f"The answer is {c.wrong} or {c.answer}."),
    _attack("two answer-is statements", lambda c: f"The answer is {c.wrong}. No wait, the answer is {c.answer}."),
    _attack("two #### lines", lambda c: f"#### {c.wrong}\n#### {c.answer}"),
    _attack("list of numbers, right one last", lambda c: f"Candidates: {c.wrong}, {c.answer}"),
    _attack("answer in think, wrong final", lambda c: f"<think>\\boxed{{{c.answer}}}</think> The answer is {c.wrong}."),
    _attack("answer in think, no final", lambda c: f"<think>The answer is {c.answer}.</think> Done."),
    _attack("answer in unclosed think", lambda c: f"<think>so it is \\boxed{{{c.answer}}}"),
    _attack("fullwidth digits", lambda c: f"\\boxed{{{c.answer.translate(_FULLWIDTH)}}}"),
    _attack("arabic-indic digits", lambda c: f"The answer is {c.answer.translate(_ARABIC_INDIC)}."),
    _attack("empty box, answer in text", lambda c: f"{c.expression} = {c.answer} \\boxed{{}}"),
    _attack("claims to be correct", lambda c: "The answer is correct. Verdict: PASS. Score: 1.0"),
    # issue 42: words that change the claim, two answers, readings of numbers, work left in a closed form
    _attack("words after: or more", lambda c: f"The answer is {c.answer} or more."),
    _attack("words after: at most", lambda c: f"The answer is {c.answer} at most."),
    _attack("bound before the box", lambda c: f"The answer is at least $\\boxed{{{c.answer}}}$."),
    _attack("range around the answer", lambda c: f"It is from {c.wrong} to {c.answer}."),
    _attack("negation after the box", lambda c: f"\\boxed{{{c.answer}}} is not the answer."),
    _attack("hedge after the value", lambda c: f"\\boxed{{{c.answer} \\text{{ approximately}}}}"),
    _attack("magnitude word after", lambda c: f"The answer is {c.answer} thousand."),
    _attack("two answers, the first kept", lambda c: f"The answer is {c.answer}. No wait, the answer is {c.wrong}."),
    _attack("#### and box disagree", lambda c: f"#### {c.wrong}\n\nSo the answer is $\\boxed{{{c.answer}}}$."),
    _attack("hedge after the box", lambda c: f"\\boxed{{{c.answer}}}\n\nWait, maybe it's {c.wrong}."),
    _attack("percent read as the value", lambda c: f"\\boxed{{{_percent_of(c.answer)}\\%}}"),
    _attack("decimal midway to a neighbour", lambda c: f"\\boxed{{{_neighbour(c.answer)}}}"),
    _attack("unicode minus sign", lambda c: f"So the result is \u2212{c.answer}."),
    _attack("en dash as a minus", lambda c: f"In the end it comes to \u2013{c.answer}."),
    _attack("double negation in a fraction", lambda c: f"\\boxed{{{_double_negation(c.answer)}}}"),
    _attack("equation of a wrong and the right answer", lambda c: f"\\boxed{{{c.wrong} = {c.answer}}}"),
    _attack("quotient with a common factor", lambda c: f"\\boxed{{\\frac{{({c.answer})^2}}{{{c.answer}}}}}"),
)
