"""reasoning-gym's scorers behind posttrain's verifier interface, with an answer-form guard in front.

reasoning-gym (an optional dependency: `pip install 'posttrain[rg]'`) scores an answer *text* with
each dataset's `score_answer(answer, entry)`. Measured against posttrain's answer attacks
(`tools/redteam.py --rg`, BENCHMARKS.md), the raw scorers pay for attacks: the default scorer
gives `len(reference) / len(answer)` to any answer that contains the reference (`85 or 84`,
`84, 85`: 0.25), gsm_symbolic's takes the first number it finds (`85 or more`, `85 thousand`: 1)
and pays 0.01 for any wrong number, chain_sum's strips signs and commas it should not.

So the answer goes through posttrain's guard first (`guarded_answer`): the final answer is
found as the math verifier finds it (`final_answer.find_claims`: reasoning dropped, boxes,
`####`, "the answer is"), and it must be marked so (the prompt asks for a box): the math
verifier's fallback to the last number of the text would pay "Verdict: PASS. Score: 1.0" on an
item whose answer is 1 (measured on letter_counting). Every marker must state
the same value, read by the math verifier's strict number grammar (`read_number`: no operation
left, no word that changes the claim, no hedge, ASCII digits); the datasets served here
(`SUPPORTED`) have integer answers, so the value must be an integer, and the scorer receives
its canonical text (`-4`, `1234`). The verdict pays full credit only (`correct` is 1 when the
scorer, clipped to [0, 1], gives 1; partial credit pays wrong answers); the raw score is in
`parts["rg_score"]`. A scorer that raises or returns no finite number on that canonical text is
a verifier error (`Verdict.error`), never a 0; whatever the response gets wrong is a 0.

Datasets whose scorer cannot be made safe this way are refused by name with the reason
(`REFUSED`); any other dataset is refused naming the supported ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import RecordError
from posttrain.errors import UserError
from posttrain.rl.verifiers.answer_reading import read_number
from posttrain.rl.verifiers.base import Verdict, VerifierEntry
from posttrain.rl.verifiers.final_answer import find_claims
from posttrain.rl.verifiers.math import extract_answer

EXTRA = "rg"  # setup.py's extra that installs reasoning-gym
MIN_VERSION = "0.1.25"
# Datasets served, each with an integer answer, and what one is.
SUPPORTED: dict[str, str] = {
    "basic_arithmetic": "the value of an expression of + - * / on integers",
    "chain_sum": "the value of a chain of + and - on integers",
    "products": "the value of a product of integers",
    "leg_counting": "the number of legs of a list of animals",
    "gcd": "the greatest common divisor of integers",
    "lcm": "the least common multiple of integers",
    "count_bits": "the number of 1 bits of an integer",
    "letter_counting": "how often a letter occurs in a text",
    "gsm_symbolic": "the integer answer of a templated GSM8K word problem",
    "simple_equations": "the integer solution of a linear equation",
}
# Datasets measured and refused: why their scorer cannot be made safe by a guard on the answer's form.
REFUSED: dict[str, str] = {
    "decimal_arithmetic": (
        "its scorer accepts any value within one unit of the last decimal place: the reference with its "
        "last digit changed scores 1, which no check of the answer's form can refuse"
    ),
    "power_function": (
        "its scorer compares 3 significant figures: the reference with its last digit changed scores 1, "
        "which no check of the answer's form can refuse"
    ),
    "fraction_simplification": (
        "its answer is a fraction in lowest terms (posttrain's guard serves integers) and its scorer reads "
        "a fraction anywhere in the text: restating the question scores 1"
    ),
    "prime_factorization": (
        "its answer is a product of primes, the form the restatement attacks take, and its scorer raises "
        "ValueError on a product written with \\times"
    ),
}


def load_rg() -> Any:
    """The reasoning_gym package, or a UserError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            f"reasoning-gym domains (rl.domains=rg:<dataset>) need the reasoning-gym package: "
            f"pip install 'posttrain[{EXTRA}]' (reasoning-gym>={MIN_VERSION})",
            key="rl.domains",
        ) from None
    return reasoning_gym


def check_dataset(name: str) -> None:
    """Refuse a dataset posttrain does not serve: a measured unsafe one with its reason, any other
    naming the supported ones (and whether reasoning-gym has it at all)."""
    if name in SUPPORTED:
        return
    if name in REFUSED:
        raise UserError(f"rl.domains: rg:{name} is refused: {REFUSED[name]}", key="rl.domains")
    from reasoning_gym.factory import DATASETS

    what = "a reasoning-gym dataset posttrain does not serve" if name in DATASETS else "no reasoning-gym dataset"
    raise UserError(
        f"rl.domains: rg:{name} is {what}; supported: {', '.join(f'rg:{n}' for n in SUPPORTED)}", key="rl.domains"
    )


@dataclasses.dataclass(frozen=True)
class RGTask:
    """One reasoning-gym item: its dataset, the generator's settings (JSON, to rebuild the dataset
    whose `score_answer` judges it), the question, the reference answer and the item's metadata."""

    dataset: str
    settings: str
    question: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def entry(self) -> dict[str, Any]:
        """The item as reasoning-gym's scorers take it."""
        return {"question": self.question, "answer": self.answer, "metadata": dict(self.metadata)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RGTask:
        """A task from a record `{"dataset", "question", "answer"[, "metadata", "settings"]}`."""
        missing = [k for k in ("dataset", "question", "answer") if not isinstance(record.get(k), str)]
        if missing:
            raise RecordError(f"an rg task record needs string fields {missing}")
        settings = record.get("settings", {})
        return cls(
            record["dataset"],
            json.dumps(settings, sort_keys=True),
            record["question"],
            record["answer"],
            record.get("metadata", {}),
        )


@functools.lru_cache(maxsize=256)
def dataset(name: str, settings: str = "{}") -> Any:
    """The reasoning-gym dataset `name` with these generator settings (JSON), for its scorer."""
    load_rg()
    from reasoning_gym.factory import create_dataset

    return create_dataset(name, **json.loads(settings), size=1, seed=0)


def raw_score(task: RGTask, answer: str | None) -> float:
    """The dataset's own `score_answer` on an answer text, as it returns it."""
    return dataset(task.dataset, task.settings).score_answer(answer, task.entry)


@dataclasses.dataclass(frozen=True)
class Guarded:
    """The guard's reading of a response: the canonical answer text for the scorer, or why none."""

    text: str | None
    source: str | None
    refusal: str | None = None


def guarded_answer(response: str) -> Guarded:
    """The integer a response commits to, as canonical text (module docstring), or why it states none."""
    found = find_claims(response, last_number_fallback=False)
    if not found.claims:
        return Guarded(None, None, found.refusal or "no answer found")
    source = found.claims[-1].source
    if found.refusal:
        return Guarded(None, source, found.refusal)
    values = set()
    for claim in found.claims:
        reading = read_number(claim)
        if reading.refusal:
            return Guarded(None, source, f"{claim.text[:60]!r}: {reading.refusal}")
        values.add(reading.value)
    if len(values) > 1:
        return Guarded(None, source, f"the answer markers state {len(values)} different values")
    value = values.pop()
    if value.denominator != 1:
        return Guarded(None, source, f"{float(value):g} is not an integer")
    return Guarded(str(value.numerator), source)


def _clipped(score: Any) -> float:
    """A scorer's number clipped to [0, 1]; TypeError/ValueError when it returned no finite number."""
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise ValueError(f"score_answer returned {score!r}, not a finite number")
    return min(1.0, max(0.0, float(score)))


class RGVerifier:
    """Scores `RGTask`s: the guard, then the dataset's scorer on the canonical answer (module
    docstring). `errors` counts scorer failures (verdicts with `error`)."""

    format_sources = ("boxed", "hash", "answer_is")

    def __init__(self) -> None:
        self.errors = 0
        self._lock = threading.Lock()

    def verify(self, task: RGTask, response: str) -> Verdict:
        """The verdict of one response."""
        guarded = guarded_answer(response)
        format_ok = guarded.source in self.format_sources
        if guarded.text is None:
            return Verdict(0.0, format_ok, f"refused: {guarded.refusal}")
        try:
            score = _clipped(raw_score(task, guarded.text))
        except Exception as e:  # the scorer failed on a well-formed integer: no verdict, counted
            with self._lock:
                self.errors += 1
            logging.getLogger(__name__).warning("rg:%s scorer error: %s: %s", task.dataset, type(e).__name__, e)
            return Verdict(0.0, format_ok, f"{guarded.text!r} not scored", error=f"{type(e).__name__}: {e}")
        correct = 1.0 if score >= 1.0 else 0.0
        return Verdict(
            correct, format_ok, f"{guarded.text!r} scored {score:g} by rg:{task.dataset}", parts={"rg_score": score}
        )

    def verify_many(self, tasks: Sequence[RGTask], responses: Sequence[str]) -> list[Verdict]:
        """`verify` over pairs."""
        if len(tasks) != len(responses):
            raise ValueError(f"{len(tasks)} tasks but {len(responses)} responses")
        return [self.verify(t, r) for t, r in zip(tasks, responses)]


class RawRGScorer:
    """The red team's baseline: the final answer posttrain extracts (`math.extract_answer`), scored
    by the dataset's own scorer with nothing in between (clipped to [0, 1], partial credit kept)."""

    def verify(self, task: RGTask, response: str) -> Verdict:
        """The raw scorer's verdict on one response."""
        found = extract_answer(response)
        text = None if found is None else found.text
        try:
            return Verdict(_clipped(raw_score(task, text)), found is not None, f"extracted {text!r}")
        except Exception as e:  # the scorer fails on what the policy wrote: shown as such in the table
            return Verdict(0.0, found is not None, f"extracted {text!r}", error=f"{type(e).__name__}: {e}")

    def verify_many(self, tasks: Sequence[RGTask], responses: Sequence[str]) -> list[Verdict]:
        """`verify` over pairs."""
        return [self.verify(t, r) for t, r in zip(tasks, responses)]


VERIFIERS.register("rg", VerifierEntry(RGTask, RGVerifier, RGTask.from_record))
