"""Bounds of the math verifier (issue 42): extraction is linear (no response of up to 100,000
characters takes more than 50 ms, adversarial shapes included), and every GSM8K reference solution
(train and test, the worked solution with its `####` line) scores 1 against its own answer."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from posttrain.rl.verifiers.math import MathTask, MathVerifier

LIMIT_CHARS = 100_000
LIMIT_S = 0.050
DATA = Path(os.environ.get("POSTTRAIN_DATA", Path(__file__).parents[4] / "shared" / "data"))


def _fill(unit: str, head: str = "", tail: str = "") -> str:
    """`head`, then `unit` repeated, then `tail`: LIMIT_CHARS characters in all."""
    n = LIMIT_CHARS - len(head) - len(tail)
    return head + (unit * (n // len(unit) + 1))[:n] + tail


SHAPES = {
    "5,000 unclosed boxes": ("\\boxed{" * 5000).ljust(LIMIT_CHARS, "x"),
    "unclosed boxes": _fill("\\boxed{"),
    "nested boxes": ("\\boxed{" * 12000) + "85" + "}" * (LIMIT_CHARS - 7 * 12000 - 2),
    "closed boxes": _fill("\\boxed{1}"),
    "open braces": _fill("{", "\\boxed"),
    "close braces": _fill("}", "\\boxed{"),
    "spaces": _fill(" ", "The answer is", "85"),
    "newlines": _fill("\n", "#### ", "85"),
    "tabs before a box": _fill("\t", "\\boxed", "85"),
    "hash runs": _fill("#"),
    "hash markers": _fill("####"),
    "hash lines": _fill("#### 85\n"),
    "answer phrases": _fill("The answer is "),
    "answer statements": _fill("the answer is 85. "),
    "answer words": _fill("answer "),
    "final answer headings": _fill("Final Answer\n"),
    "think opens": _fill("<think>"),
    "think closes": _fill("</think>"),
    "unclosed think": _fill("x", "<think>"),
    "dollars": _fill("$"),
    "bold": _fill("**"),
    "backslashes": _fill("\\"),
    "fractions": _fill("\\frac{"),
    "text wrappers": _fill("\\text{"),
    "parentheses": _fill("(", "The answer is "),
    "digits": _fill("1"),
    "digits and commas": _fill("1,"),
    "digits and spaces": _fill("1 "),
    "decimals": _fill("9."),
    "minus signs": _fill("-"),
    "unicode minus signs": _fill("\u2212"),
    "letters": _fill("a"),
    "calculator annotations": _fill("<<1+1=2>>"),
    "hedges after the box": _fill("maybe 84 ", "\\boxed{85}\n"),
    "one long hedging sentence": _fill("maybe ", "\\boxed{85} ", " 84"),
    "scientific notation": _fill("1.5\\times10^{3} "),
    "prose then the answer": _fill("She had 37 apples and got 48 more. ", "", "\nThe answer is 85."),
    "the answer far from the end": _fill(" ", "85"),
}


def test_extraction_is_linear_in_the_response():
    """Each shape is timed three times (the best counts: the machine is shared); the verifier is
    the whole numeric path (extraction, reading, comparison), no symbolic worker."""
    verifier = MathVerifier(symbolic=False)
    slow = {}
    for name, response in SHAPES.items():
        assert len(response) <= LIMIT_CHARS, name
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            verdict = verifier.verify(MathTask("85"), response)
            best = min(best, time.perf_counter() - start)
        assert verdict.error is None, (name, verdict.error)
        if best > LIMIT_S:
            slow[name] = f"{best * 1000:.0f} ms"
    assert slow == {}


def _gsm8k(split: str) -> list[dict]:
    path = DATA / "gsm8k" / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"data set {path} is absent (set POSTTRAIN_DATA to the shared data folder)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("split,size", [("train", 7473), ("test", 1319)])
def test_every_gsm8k_reference_solution_scores_one(split, size):
    rows = _gsm8k(split)
    assert len(rows) == size
    verifier = MathVerifier(symbolic=False)
    wrong = []
    for i, row in enumerate(rows):
        verdict = verifier.verify(MathTask.from_gsm8k(row), row["answer"])
        if verdict.correct != 1.0 or not verdict.format_ok:
            wrong.append((i, verdict.detail))
    assert wrong == []
