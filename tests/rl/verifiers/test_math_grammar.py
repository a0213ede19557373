"""The grammar of final answers (issue 42): which marker commits, how a value is read, which words
refuse a claim, percent and decimal rules. The whole-response behaviour is measured on the corpora
(test_math_corpora.py); these pin each rule on its smallest example."""

from __future__ import annotations

from fractions import Fraction

import pytest

from posttrain.rl.verifiers.final_answer import find_claims, strip_think
from posttrain.rl.verifiers.math import MathTask, MathVerifier, extract_answer, parse_number, reference_tolerance

MINUS, EN_DASH = "\u2212", "\u2013"


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier()
    yield v
    v._checker.close()


def score(verifier: MathVerifier, ref: str, response: str) -> float:
    verdict = verifier.verify(MathTask(ref), response)
    assert verdict.error is None, verdict.error
    return verdict.correct


@pytest.mark.parametrize(
    "text,value",
    [
        ("85", 85),
        ("-85", -85),
        (f"{MINUS}85", -85),
        (f"{EN_DASH}85", -85),
        ("1,234,567", 1234567),
        ("70{,}000", 70000),
        ("1\\,000", 1000),
        (".5", Fraction(1, 2)),
        ("\\frac34", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("2\\frac{1}{2}", Fraction(5, 2)),
        ("1 1/2", Fraction(3, 2)),
        ("2½", Fraction(5, 2)),
        ("1.5\\times10^{3}", 1500),
        ("1.5 × 10^3", 1500),
        ("2.4e3", 2400),
        ("50\\%", 50),  # a percent is a unit: read one way
        ("$\\mathbf{85}$", 85),
        ("**85**", 85),
        ("\\$18.00", 18),
        ("60 km/h", 60),
        ("85\\ \\text{cm}", 85),
        ("12 m^2", 12),
        ("45^\\circ", 45),
        ("45°", 45),
        ("24 \\text{ ft}^2", 24),
        ("72 cubic inches", 72),
        ("x = 7", 7),
        ("12 apples", 12),
    ],
)
def test_a_value_is_read(text, value):
    assert parse_number(text, strict=True) == [Fraction(value)]


@pytest.mark.parametrize(
    "text",
    [
        "--85",  # a double sign
        "-\\frac{-1}{2}",  # a double negation
        "\\frac{-3}{-4}",
        "\\frac{6}{4}",  # not in lowest terms
        "\\frac{4}{2}",
        "0\\times10^{5}",  # not scientific notation: a product by zero
        "85\\times10^{0}",
        "0.85\\times10^{2}",
        "2^{10}",
        "37+48",
        "85 thousand",  # a magnitude
        "85k",
        "85 or more",  # a bound
        "85 at most",
        "85 or 84",
        "85, 84",
        "80 to 85",
        "85-90",
        "about 85",
        "\\approx 85",
        "85 \\pm 1",
        "not 85",
        "８５",  # non-ASCII digits
        "\\sqrt{4}",
    ],
)
def test_forms_that_are_no_value_are_refused(text):
    assert parse_number(text, strict=True) is None


def test_percent_is_read_one_way(verifier):
    assert score(verifier, "50", "The answer is 50%.") == 1.0  # the number of percent (GSM8K)
    assert score(verifier, "50\\%", "The answer is 50.") == 1.0
    assert score(verifier, "50", "\\boxed{5000\\%}") == 0.0  # never the value: 5000% is not 50
    assert score(verifier, "50\\%", "\\boxed{0.5}") == 0.0


def test_decimal_tolerance_never_covers_a_neighbour(verifier):
    assert reference_tolerance("2.5") == Fraction(1, 20) and reference_tolerance("85") == 0
    assert score(verifier, "2.5", "The answer is 2.54.") == 1.0  # rounds to 2.5 at the reference's precision
    assert score(verifier, "2.5", "The answer is 2.55.") == 0.0  # as near 2.6 as 2.5
    assert score(verifier, "2.5", "The answer is 2.45.") == 0.0
    assert score(verifier, "85", "The answer is 85.4.") == 0.0  # an integer reference is exact


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 85 or more.",
        "The answer is at least 85.",
        "The answer is at least $\\boxed{85}$.",
        "The answer is 85 at most.",
        "The answer is 85, which is not the answer.",
        "\\boxed{85} is not the answer.",
        "The answer is not 85.",
        "The answer is 85 thousand.",
        "The answer is 85, maybe.",
        "The answer is 85?",
        "The answer is 85. No wait, the answer is 84.",
        "The answer is 84. No wait, the answer is 85.",
        "#### 84\n\\boxed{85}",
        "\\boxed{85}\n\nWait, maybe it's 84.",
        "It is from 84 to 85.",
        "Candidates: 84, 85",
        "So the result is \u221285.",
        f"#### {EN_DASH}85",
    ],
)
def test_words_that_change_the_claim_refuse_it(verifier, response):
    assert score(verifier, "85", response) == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{85}",
        "#### 85",
        "The answer is 85.",
        "Final Answer: The final answer is $85$. I hope it is correct.",
        "The final answer is: $\\boxed{85}$",
        "#### Final Answer: 85",
        "**Final Answer**\n\\[\n\\boxed{85}\n\\]",
        "#### Step 1: add the apples\n37 + 48 = 85\n\nThe answer is 85.",
        "She adds 37 and 48.\nThe total is the sum of 37 and 48, which is 85.",
        "She has 85 apples (37 + 48).",
        "So the answer is **85** apples.",
        "The answer is $\\mathbf{85}$.",
        "The answer is 85 because 37 + 48 = 85.",
        "The answer is 85.\n\n\\boxed{85}",
        "\\boxed{85}\n\nI hope this helps! Let me know if you have other questions.",
        "<think>maybe 84? no</think>\nThe answer is \\boxed{85}.",
        "Adding up, 37 + 48 = 85.\n</think>\n\n\\boxed{85}",  # DeepSeek-R1: the opening tag is in the prompt
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 85",  # GSM8K calculator annotations
    ],
)
def test_honest_formats_score_one(verifier, response):
    assert score(verifier, "85", response) == 1.0


def test_the_last_marker_commits_and_all_must_agree():
    claims = find_claims("The answer is 84. Then \\boxed{85} and #### 86").claims
    assert [(c.source, c.text) for c in claims] == [("answer_is", "84"), ("boxed", "85"), ("hash", "86")]
    assert extract_answer("The answer is 84. Then \\boxed{85}").text == "85"
    assert find_claims("#### Step 1: add\n#### 85").claims[-1].text == "85"  # a heading is no marker
    assert find_claims("The answer is correct.", last_number_fallback=False).claims == []  # states nothing


def test_reasoning_is_dropped():
    assert strip_think("<think>84</think>85") == " 85"
    assert strip_think("<think>84") == ""  # an unclosed block runs to the end
    assert strip_think("reasoning 84\n</think>\n85") == "\n85"  # R1: only the closing tag
    assert strip_think("<think>a</think>b<think>c</think>d") == " b d"


def test_markers_beyond_the_limit_commit_to_nothing(verifier):
    assert score(verifier, "85", "The answer is 85. " * 40) == 0.0
    assert score(verifier, "85", "\\boxed{85}" * 40) == 0.0
    assert score(verifier, "85", "The answer is 85. " * 3) == 1.0


@pytest.mark.parametrize(
    "ref,response,expected",
    [
        ("\\pi", "\\boxed{\\sqrt{\\pi^2}}", 0.0),  # a root of a power left to take
        ("2\\pi", "\\boxed{\\sqrt{4\\pi^2}}", 0.0),
        ("\\pi", "\\boxed{\\frac{\\pi^2}{\\pi}}", 0.0),  # a common factor left to cancel
        ("2\\pi", "\\boxed{\\frac{(2\\pi)^2}{2\\pi}}", 0.0),
        ("x+1", "\\boxed{\\frac{x^2-1}{x-1}}", 0.0),  # the symbolic check refuses an unreduced quotient
        ("2x+1", "\\boxed{4x-3 = 2x+1}", 0.0),  # an equation, not a value
        ("2x+1", "\\boxed{y = 2x+1}", 1.0),  # a name and its value
        ("y=2x+1", "\\boxed{y = 2x + 1}", 1.0),  # an equation against an equation
        ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
        ("\\sqrt{8}", "The final answer is $2\\sqrt{2}$.", 1.0),
        ("(-\\infty, 3]", "So the answer is $\\boxed{(-\\infty, 3]}$.", 1.0),
        ("6\\sqrt{2}", "\\boxed{６\\sqrt{２}}", 0.0),  # non-ASCII digits: a 0, not "no verdict"
        ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2} \\text{ or more}}", 0.0),
    ],
)
def test_closed_forms_and_expressions(verifier, ref, response, expected):
    assert score(verifier, ref, response) == expected


def test_garbage_is_a_zero_never_an_error(verifier):
    """Whatever a policy writes is a verdict: random strings over the grammar's own alphabet."""
    import random

    alphabet = ["\\boxed{", "{", "}", "$", "####", "answer is", " ", "\n", "-", "\u2212", "8", "5", ".", ",", "/"]
    alphabet += ["\\frac", "\\times", "10^", "%", "or", "not", "<think>", "</think>", "\\text{", "x", "=", "(", ")"]
    rng = random.Random(0)
    for ref in ("85", "\\frac{3}{2}", "2\\pi"):
        for _ in range(150):
            response = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
            verdict = verifier.verify(MathTask(ref), response)
            assert verdict.error is None, (response, verdict)


ISSUE_42_ATTACKS = {
    "words after: or more",
    "words after: at most",
    "bound before the box",
    "range around the answer",
    "negation after the box",
    "hedge after the value",
    "magnitude word after",
    "two answers, the first kept",
    "#### and box disagree",
    "hedge after the box",
    "percent read as the value",
    "decimal midway to a neighbour",
    "unicode minus sign",
    "en dash as a minus",
    "double negation in a fraction",
    "equation of a wrong and the right answer",
    "quotient with a common factor",
}


def test_the_red_team_has_every_family_of_issue_42(verifier):
    """Each family is an attack of the suite (tests/redteam run them on every built-in case); every
    one of them scored 1 on at least one case with the verifier before issue 42 (b6ec6cc)."""
    from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, ANSWER_CASES

    attacks = {a.name: a for a in ANSWER_ATTACKS}
    assert ISSUE_42_ATTACKS <= set(attacks)
    cases = [c for cs in ANSWER_CASES.values() for c in cs]
    assert {"2.5", "2\\pi", "x^2+2x+1"} <= {c.answer for c in cases}  # a decimal, a constant, an expression
    won = {
        (name, c.answer)
        for name in sorted(ISSUE_42_ATTACKS)
        for c in cases
        if score(verifier, c.answer, attacks[name].make(c)) != 0.0
    }
    assert won == set()
