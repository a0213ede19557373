"""Red team for verifiers: completions a policy could find that must score 0, beside the honest one.

A reward is trusted only after every attack here scores 0 while the honest solution scores 1
(DESIGN principle 7, issue 25). `redteam(verifier, cases, kind=...)` runs the attacks of one kind
on any verifier — a built-in one (`MathVerifier`, `CodeVerifier`), a `Verifier`-like object, a
user function `score(prompt, response, record)` or its `"package.module:function"` spec
(`rl.verifiers`) — concurrently, and returns a `RedTeamReport` saying which attacks scored.

Kinds: "answer" (the verifier checks a final answer: attacks restate the question, hedge, hide
the answer in a think block, use unicode digits, ...; `answer_attacks.py`) and "program" (it runs
code against tests: attacks exit early, print fake success, rig equality, patch the checker,
read the tests, flood output, sleep past the limit, ...; `program_attacks.py`). Cases for the
built-in domains are in `builtin_cases`; `tools/redteam.py` is the command line.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, ANSWER_CASES, AnswerCase, Attack
from posttrain.rl.verifiers.base import Verdict
from posttrain.rl.verifiers.program_attacks import PROGRAM_ATTACKS, ProgramCase, humaneval_cases
from posttrain.rl.verifiers.user import UserTask, UserVerifier, load_callable

KINDS = ("answer", "program")
__all__ = ["AnswerCase", "Attack", "Outcome", "ProgramCase", "RedTeamReport", "builtin_cases", "redteam"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The verdict of one completion on one case."""

    attack: str
    case: int
    score: float
    detail: str = ""
    error: str | None = None


@dataclasses.dataclass
class RedTeamReport:
    """Scores of the honest solutions (`honest`, one per case) and of every attack on every case."""

    kind: str
    honest: list[Outcome]
    outcomes: list[Outcome]

    def won(self) -> dict[str, list[Outcome]]:
        """Attacks that scored above 0 on some case (name -> those outcomes): holes in the verifier."""
        out: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            if o.score > 0:
                out.setdefault(o.attack, []).append(o)
        return out

    def honest_failed(self) -> list[Outcome]:
        """Honest solutions that did not score 1 (the verifier refuses right answers, or the case is wrong)."""
        return [o for o in self.honest if o.score < 1]

    @property
    def ok(self) -> bool:
        """Every attack scored 0 and every honest solution 1."""
        return not self.won() and not self.honest_failed()

    def attacks(self) -> list[str]:
        """Names of the attacks run, in order."""
        return list(dict.fromkeys(o.attack for o in self.outcomes))

    def summary(self) -> str:
        """One line per attack (max score over the cases) and the honest solutions' scores."""
        lines = [f"honest solution: scores {[o.score for o in self.honest]}"]
        for name in self.attacks():
            best = max((o for o in self.outcomes if o.attack == name), key=lambda o: o.score)
            mark = "WON" if best.score > 0 else "0"
            lines.append(f"{mark:>4}  {name}" + (f"  ({best.detail or best.error})"[:160] if best.score > 0 else ""))
        return "\n".join(lines)


def as_verifier(verifier: Any, timeout_s: float = 30.0) -> Any:
    """A verifier object from what a user has: an object with `verify`/`verify_many`, a function
    `score(prompt, response, record)` or its "package.module:function" spec."""
    if isinstance(verifier, str):  # as in rl.verifiers: "[name=]package.module:function"
        verifier = load_callable(verifier.split("=", 1)[-1].strip())
    if hasattr(verifier, "verify_many") or hasattr(verifier, "verify"):
        return verifier
    if callable(verifier):
        return UserVerifier({"user": verifier}, timeout_s=timeout_s)
    raise TypeError(f"redteam: {type(verifier).__name__} is neither a verifier nor a score function")


def user_task(record: Mapping[str, Any]) -> UserTask:
    """A task record (`{"prompt": ..., ...}`) as the UserTask a user verifier scores."""
    prompt = record.get("prompt", "")
    if not isinstance(prompt, str):  # a message list
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return UserTask("user", prompt, record)


def attacks_for(kind: str) -> tuple[Attack, ...]:
    """The attack table of `kind` ("answer" or "program")."""
    if kind == "answer":
        return ANSWER_ATTACKS
    if kind == "program":
        return PROGRAM_ATTACKS
    raise ValueError(f"redteam kind {kind!r}: expected one of {KINDS}")


def redteam(
    verifier: Any,
    cases: Sequence[AnswerCase | ProgramCase],
    *,
    kind: str,
    attacks: Sequence[Attack] | None = None,
    workers: int = 8,
    timeout_s: float = 30.0,
) -> RedTeamReport:
    """Run the honest solution and every attack of `kind` on every case against `verifier`
    (see `as_verifier`; a user function's cases carry record dicts as `task`), `workers` chunks
    at a time (each chunk is one `verify_many`, which a CodeVerifier spreads over its sandbox)."""
    attacks = tuple(attacks if attacks is not None else attacks_for(kind))
    if not cases:
        raise ValueError("redteam needs at least one case")
    wrong_kind = [a.name for a in attacks if a.kind != kind]
    if wrong_kind:
        raise ValueError(f"redteam kind {kind!r}: attacks of another kind {wrong_kind}")
    verifier = as_verifier(verifier, timeout_s)
    user = isinstance(verifier, UserVerifier)
    honest = [(("honest", i), c.task, _honest(c)) for i, c in enumerate(cases)]
    attacked = [((a.name, i), c.task, a.make(c)) for a in attacks for i, c in enumerate(cases)]
    items = [(key, user_task(task) if user else task, response) for key, task, response in honest + attacked]
    chunks = [items[i::workers] for i in range(workers) if items[i::workers]]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        verdicts = list(pool.map(lambda chunk: _verify(verifier, chunk), chunks))
    scored = {key: v for chunk, vs in zip(chunks, verdicts) for (key, _, _), v in zip(chunk, vs)}
    outcomes = [_outcome(key, scored[key]) for key, _, _ in items]
    return RedTeamReport(kind, outcomes[: len(honest)], outcomes[len(honest) :])


def _honest(case: AnswerCase | ProgramCase) -> str:
    if isinstance(case, AnswerCase):
        return f"{case.expression} gives {case.answer}. The answer is \\boxed{{{case.answer}}}."
    return case.solution


def _verify(verifier: Any, chunk: list) -> list[Verdict]:
    tasks, responses = [t for _, t, _ in chunk], [r for _, _, r in chunk]
    if hasattr(verifier, "verify_many"):
        return list(verifier.verify_many(tasks, responses))
    return [verifier.verify(t, r) for t, r in zip(tasks, responses)]


def _outcome(key: tuple[str, int], verdict: Verdict) -> Outcome:
    return Outcome(key[0], key[1], float(verdict.correct), verdict.detail, verdict.error)


def builtin_cases(domain: str) -> tuple[str, Any, list]:
    """(kind, verifier factory, cases) of a built-in domain: "arithmetic", "gsm8k", "math" (answer
    kind, MathVerifier) or "humaneval" (program kind, CodeVerifier)."""
    if domain in ANSWER_CASES:
        from posttrain.rl.verifiers.math import MathTask, MathVerifier

        return "answer", MathVerifier, [dataclasses.replace(c, task=MathTask(c.answer)) for c in ANSWER_CASES[domain]]
    if domain == "humaneval":
        from posttrain.rl.verifiers.code import CodeVerifier

        return "program", CodeVerifier, humaneval_cases()
    raise ValueError(f"redteam domain {domain!r}: expected one of {[*ANSWER_CASES, 'humaneval']}")


def markdown_table(reports: Mapping[str, RedTeamReport]) -> str:
    """Attacks x domains (max score over a domain's cases; blank where the attack is of another
    kind), then the honest solutions' lowest score: the BENCHMARKS red-team table."""
    domains = list(reports)
    names = list(dict.fromkeys(n for r in reports.values() for n in r.attacks()))
    lines = ["| attack | kind | " + " | ".join(domains) + " |", "|---|---|" + "---|" * len(domains)]
    for name in names:
        kind = next(r.kind for r in reports.values() if name in r.attacks())
        cells = []
        for r in reports.values():
            scores = [o.score for o in r.outcomes if o.attack == name]
            cells.append(f"{max(scores):g}" if scores else "")
        lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    lines.append(
        "| *honest solution (min)* | | "
        + " | ".join(f"{min(o.score for o in r.honest):g}" for r in reports.values())
        + " |"
    )
    return "\n".join(lines)
