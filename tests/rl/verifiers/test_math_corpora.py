"""The math verifier on its two corpora (issue 42, posttrain/rl/verifiers/corpora/): every gaming answer
scores 0 and every honest answer, in the formats real models write, scores 1. Each row is a case; each
corpus must reach GOAL with every failure listed, and beat math-verify alone (its README's usage)."""

from __future__ import annotations

import logging

import pytest

from posttrain.rl.verifiers.corpus import EXPECTED, load_corpus
from posttrain.rl.verifiers.math import MathTask, MathVerifier

GOAL = 0.98
ROWS = {name: load_corpus(name) for name in EXPECTED}
# Rows the verifier may get wrong, with the reason (a concession is listed here, never made by
# editing the corpus). None today.
KNOWN_MISSES: dict[str, str] = {}
ISSUE_FAMILIES = {  # the families issue 42 names, each in the attack corpus
    "words: comparative",
    "words: range",
    "words: negation",
    "words: hedge",
    "words: magnitude",
    "two answers",
    "#### and box disagree",
    "percent read both ways",
    "decimal tolerance covers a neighbour",
    "unicode minus read as no sign",
    "computation forms",
    "equation with the reference on one side",
    "unsimplified quotient",
    "root of a power",
    "red-team suite",
}


@pytest.fixture(scope="module")
def graded():
    """Every row's verdict, per corpus (one verifier, one symbolic worker)."""
    verifier = MathVerifier()
    try:
        yield {
            name: {r.id: verifier.verify(MathTask(r.reference), r.response) for r in rows}
            for name, rows in ROWS.items()
        }
    finally:
        verifier._checker.close()


def _failures(name: str, graded: dict) -> list[str]:
    out = []
    for r in ROWS[name]:
        verdict = graded[name][r.id]
        if verdict.error is not None or verdict.correct != EXPECTED[name]:
            out.append(f"{r.id} [{r.family}] {r.reason}: {verdict.detail} {verdict.error or ''}")
    return out


@pytest.mark.parametrize("row", [r for rows in ROWS.values() for r in rows], ids=lambda r: r.id)
def test_row(row, graded):
    corpus = row.id.rsplit("-", 1)[0]
    if row.id in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[row.id])
    verdict = graded[corpus][row.id]
    assert verdict.error is None, f"no verdict (a failure the response causes must be a 0): {verdict.error}"
    assert verdict.correct == EXPECTED[corpus], f"[{row.family}] {row.reason}: {verdict.detail}"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_corpus_reaches_the_goal(name, graded):
    rows, failures = ROWS[name], _failures(name, graded)
    assert len(rows) >= {"attacks": 120, "honest": 300}[name]
    rate = 1 - len(failures) / len(rows)
    assert rate >= GOAL, f"{name}: {rate:.1%} < {GOAL:.0%}; failures:\n" + "\n".join(failures)
    assert len(failures) <= len(KNOWN_MISSES), "failures outside KNOWN_MISSES:\n" + "\n".join(failures)


def test_the_corpora_cover_the_issue_and_say_why():
    assert ISSUE_FAMILIES <= {r.family for r in ROWS["attacks"]}
    for rows in ROWS.values():
        assert len({r.id for r in rows}) == len(rows)
        assert all(r.reason and r.family and r.reference for r in rows)
    assert sum(r.source.startswith("gsm8k/") for r in ROWS["honest"]) >= 200  # real problems, real solutions


def test_math_verify_alone_does_worse_on_both(graded):
    """The peer, as its README uses it: parse the reference and the whole response, then verify."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for name, rows in ROWS.items():
        peer = 0
        for r in rows:
            try:
                peer += float(bool(verify(parse(f"${r.reference}$"), parse(r.response)))) == EXPECTED[name]
            except Exception:
                peer += EXPECTED[name] == 0.0
        ours = len(rows) - len(_failures(name, graded))
        assert ours > peer, f"{name}: posttrain {ours} vs math-verify {peer} of {len(rows)}"
