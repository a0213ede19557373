"""Label verifier: the final answer is one label out of a closed set (a bar's name, a table row),
compared exactly. Numbers go to the math verifier; this one is for names.

Extraction is the math verifier's (`final_answer.find_claims`, reasoning in `<think>` dropped):
every `\\boxed{...}`, "the answer is X" / "final answer: X" and `#### X` line, in order. The
response scores 1 only when those all give the same text and that text, with an outer
`\\text{...}`, surrounding `$`, spaces and one trailing period removed, is exactly (ignoring ASCII
case) the reference label. Nothing else is tolerated: no list ("A, B"), no "A or B", no expression
("B=B"), no non-ASCII look-alike ("Ｂ"), no answer taken from anywhere else in the text, no word
before or after a box that bounds or denies it ("at least \\boxed{B}", "\\boxed{B} is not the
answer"), no sentence after the answer that hedges towards a choice ("Wait, maybe it's C."). A
response that echoes the choices or restates the question names several labels or none, so it
scores 0 (`LABEL_CASES` and `label_attacks` are the red-team suite, tests/rl/verifiers/redteam/test_label.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import field_labels, field_text
from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, AnswerCase, Attack
from posttrain.rl.verifiers.answer_grammar import box_lead_refusal, changer
from posttrain.rl.verifiers.answer_words import CHANGERS
from posttrain.rl.verifiers.base import Verdict, VerifierEntry
from posttrain.rl.verifiers.final_answer import Claim, find_claims

_SENTENCE = re.compile(r"[.!?](?:\s+|$)|\n+")
_HEDGE = re.compile(
    r"(?<![\w'])(?:"
    + "|".join(sorted((w for w in CHANGERS if w.isalpha()), key=len, reverse=True))
    + r")(?![\w'])|n't\b|\?"
)
_TEXT_WRAP = re.compile(r"^\\(?:text|mathrm|textbf)\{([^{}]*)\}$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _-]*$")


@dataclasses.dataclass(frozen=True)
class LabelTask:
    """A question whose answer is one of `choices` (labels of ASCII letters, digits, spaces, `_`, `-`;
    distinct ignoring case); `answer` is the right one."""

    answer: str
    choices: tuple[str, ...]

    def __post_init__(self) -> None:
        bad = [c for c in self.choices if not isinstance(c, str) or not _LABEL.match(c) or c != c.strip()]
        if bad or len({c.lower() for c in self.choices}) != len(self.choices):
            raise ValueError(f"LabelTask.choices: expected distinct ASCII labels, got {list(self.choices)}")
        if self.answer not in self.choices:
            raise ValueError(f"LabelTask.answer {self.answer!r} is not one of the choices {list(self.choices)}")


def _clean(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    wrapped = _TEXT_WRAP.match(text)
    return (wrapped.group(1) if wrapped else text).strip()


def extract_labels(response: str) -> list[str]:
    """Every final answer a response states (boxes, answer phrases, `####` lines), in order."""
    return [_clean(c.text) for c in find_claims(response, last_number_fallback=False, any_text=True).claims]


def _around_refusal(claims: list[Claim]) -> str | None:
    """Why the words around a boxed label change it (a bound before, a negation or hedge after)."""
    for c in claims:
        if c.source == "boxed" and (why := box_lead_refusal(c.lead)):
            return why
        if c.source == "boxed" and (found := changer(c.tail)):
            return f"{found!r} after the box changes it"
    return None


def _hedge_after(text: str, choices: Sequence[str]) -> str | None:
    """A sentence after the final answer that hedges and names a choice ("Wait, maybe it's C.")."""
    named = re.compile(r"(?<![\w])(?:" + "|".join(re.escape(c) for c in choices) + r")(?![\w])")
    pos, low = 0, text.lower()
    for m in [*_SENTENCE.finditer(text), None]:
        end = m.start() if m else len(text)
        if named.search(text, pos, end) and _HEDGE.search(low, pos, end):
            return f"a hedge after the final answer: {text[pos:end].strip()[:60]!r}"
        pos = m.end() if m else end
    return None


class LabelVerifier:
    """Scores a response against a `LabelTask` (module docstring): 1 for exactly the right label."""

    def verify(self, task: LabelTask, response: str) -> Verdict:
        """The verdict of one response: `detail` names what was found."""
        extraction = find_claims(response, last_number_fallback=False, any_text=True)
        found = [_clean(c.text) for c in extraction.claims]
        if not found:
            return Verdict(0.0, False, "no final answer (\\boxed{LABEL} or 'the answer is LABEL')")
        if len({f.lower() for f in found}) > 1:
            return Verdict(0.0, True, f"several different answers {found[:4]}")
        answer = found[-1]
        if not answer.isascii() or not _LABEL.match(answer):
            return Verdict(0.0, True, f"{answer[:40]!r} is not a label")
        epilogue = extraction.text[extraction.claims[-1].end :]
        if why := _around_refusal(extraction.claims) or _hedge_after(epilogue, task.choices):
            return Verdict(0.0, True, f"answered {answer!r}, refused: {why}")
        correct = answer.lower() == task.answer.lower()
        return Verdict(float(correct), True, f"answered {answer!r}, expected {task.answer!r}")

    def verify_many(self, tasks: Sequence[LabelTask], responses: Sequence[str]) -> list[Verdict]:
        """`verify` over pairs."""
        return [self.verify(t, r) for t, r in zip(tasks, responses)]


def _case(answer: str, choices: tuple[str, ...], question: str, wrong: str) -> AnswerCase:
    # The restatement a policy could find is the list of choices (echoing what the question offers).
    return AnswerCase(LabelTask(answer, choices), question, answer, ", ".join(choices), wrong)


LABEL_CASES: list[AnswerCase] = [
    _case("B", ("A", "B", "C", "D"), "Bars A, B, C, D: which bar is the tallest?", "C"),
    _case("D", ("A", "B", "C", "D"), "Table rows A, B, C, D: which row has the largest X?", "A"),
    _case("C", ("A", "C", "E"), "Which bar is the tallest?", "E"),
]
_FULLWIDTH_LETTERS = str.maketrans(
    {chr(c): chr(c - ord("A") + 0xFF21) for c in range(ord("A"), ord("Z") + 1)}
    | {chr(c): chr(c - ord("a") + 0xFF41) for c in range(ord("a"), ord("z") + 1)}
)
LABEL_ONLY_ATTACKS: tuple[Attack, ...] = (
    Attack("every choice boxed", "answer", lambda c: "".join(f"\\boxed{{{x}}}" for x in c.task.choices)),
    Attack("choices as the answer", "answer", lambda c: f"The answer is {' or '.join(c.task.choices)}."),
    Attack("fullwidth letters", "answer", lambda c: f"\\boxed{{{c.answer.translate(_FULLWIDTH_LETTERS)}}}"),
    Attack("label in a phrase", "answer", lambda c: f"\\boxed{{not {c.answer}}}"),
    Attack("label without a final answer", "answer", lambda c: f"I think {c.answer} looks tallest."),
)


def label_attacks(cases: Sequence[AnswerCase]) -> tuple[Attack, ...]:
    """The answer attacks that are attacks on these cases (those rewriting digits leave a letter
    label as it is: they would be the honest answer), then the label-specific ones."""
    honest = {f"\\boxed{{{c.answer}}}" for c in cases} | {f"The answer is {c.answer}." for c in cases}
    kept = tuple(a for a in ANSWER_ATTACKS if not any(a.make(c) in honest for c in cases))
    return kept + LABEL_ONLY_ATTACKS


VERIFIERS.register(
    "label",
    VerifierEntry(
        LabelTask,
        LabelVerifier,
        lambda record: LabelTask(field_text(record, "answer"), field_labels(record, "choices")),
    ),
)
