"""Red team of reasoning-gym's scorers: posttrain's answer attacks and the honest answer forms models
write, on items of every dataset `rg.py` serves (and those it refuses), scored by the raw scorer
(`RawRGScorer`) and through posttrain's guard (`RGVerifier`). `tools/redteam.py --rg` prints the
table BENCHMARKS.md publishes; tests/rl/verifiers/redteam/test_rg.py holds the guarded verifier to
attacks 0, honest forms 1.

A case's restatement (`AnswerCase.expression`) is a computation of the answer taken from the
question: the expression of an arithmetic item, `n*legs + ...` of the animals counted, `\\gcd(a, b)`,
the binary digits summed, the letter's count per word summed, the equation, a GSM item's last step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, AnswerCase, Attack
from posttrain.rl.verifiers.rg import REFUSED, SUPPORTED, RawRGScorer, RGTask, RGVerifier, load_rg

SEED = 20_260_101  # the red team's items (a seed no run's split uses: runs draw from rg_domain.item_seeds)
CASES = 3


def _legs(meta: Mapping[str, Any]) -> str:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    return " + ".join(f"{n}*{ANIMALS[a]}" for a, n in meta["animals"].items())


def _last_step(meta: Mapping[str, Any], answer: str) -> str:
    """The last computation of a GSM item's worked answer that gives the answer, units and currency
    dropped ("270 minutes + 120 minutes = 390 minutes" -> "270 + 120"), else `answer+0`."""
    for line in reversed(meta["answer_cot"].splitlines()):
        left, eq, right = line.rpartition("=")
        if not eq or not re.match(rf"\s*[£$]?{re.escape(answer)}\b", right):
            continue
        left = re.sub(r"/?[A-Za-z£$]+", " ", re.sub(r"\s[x×]\s", " * ", left))
        tail = re.search(r"[\d.()+\-*/ ]*$", left).group().strip().lstrip(". ")
        if re.search(r"\d\s*[-+*/(]\s*\(?\d", tail) and not re.search(r"\d\s+\(?\d", tail):
            return " ".join(tail.split())
    return f"{answer}+0"


# Per dataset: the restatement of an item (metadata, answer) -> a computation of its answer.
RESTATEMENTS: dict[str, Callable[[Mapping[str, Any], str], str]] = {
    "basic_arithmetic": lambda m, a: m["expression"],
    "chain_sum": lambda m, a: m["expression"],
    "products": lambda m, a: m["expression"],
    "leg_counting": lambda m, a: _legs(m),
    "gcd": lambda m, a: "\\gcd(" + ", ".join(map(str, m["numbers"])) + ")",
    "lcm": lambda m, a: "\\operatorname{lcm}(" + ", ".join(map(str, m["numbers"])) + ")",
    "count_bits": lambda m, a: "+".join(m["binary"]),
    "letter_counting": lambda m, a: "+".join(str(w.lower().count(m["target_letter"])) for w in m["span"]),
    "simple_equations": lambda m, a: m["equation"],
    "gsm_symbolic": _last_step,
}


def _wrong(answer: str) -> str:
    """The answer with its last digit run plus one (`85` -> `86`, `6/23` -> `6/24`, `2.5` -> `2.6`)."""
    runs = list(re.finditer(r"\d+", answer))
    if not runs:
        return answer + "1"
    last = runs[-1]
    return answer[: last.start()] + str(int(last.group()) + 1) + answer[last.end() :]


def rg_cases(name: str, n: int = CASES) -> list[AnswerCase]:
    """`n` red-team cases of dataset `name` (its default settings, the red team's seed)."""
    load_rg()
    from reasoning_gym.factory import create_dataset

    data = create_dataset(name, seed=SEED, size=16 * n)
    out = []
    for i in range(16 * n):
        item = data[i]
        answer, meta = str(item["answer"]), item["metadata"]
        if len(out) == n:
            break
        if answer.strip() == "0":  # -0, 0%, 00 are 0: those attacks would state the right value
            continue
        restate = RESTATEMENTS.get(name, lambda m, a: f"{a}+0")
        task = RGTask(name, json.dumps({}), item["question"], answer, meta)
        out.append(AnswerCase(task, item["question"], answer, restate(meta, answer), _wrong(answer)))
    return out


def _commas(answer: str) -> str:
    return f"{int(answer):,}" if re.fullmatch(r"-?\d+", answer) else answer


# Honest answers in the formats models write: each must score 1 through the guard. (An unmarked
# answer, "Adding it up, the total is 85.", scores 0 by design: `rg.py` says why.)
HONEST_FORMS: tuple[Attack, ...] = tuple(
    Attack(name, "answer", make)
    for name, make in (
        ("boxed", lambda c: f"\\boxed{{{c.answer}}}"),
        ("boxed in math mode, sentence", lambda c: f"So the answer is $\\boxed{{{c.answer}}}$."),
        ("the answer is", lambda c: f"The answer is {c.answer}."),
        ("Final answer:", lambda c: f"Final answer: {c.answer}"),
        ("bold answer label", lambda c: f"**Answer:** {c.answer}"),
        ("#### line", lambda c: f"{c.expression} = {c.answer}\n#### {c.answer}"),
        ("work then box", lambda c: f"We compute {c.expression} = {c.answer}.\n\nThe answer is \\boxed{{{c.answer}}}."),
        ("think block then box", lambda c: f"<think>{c.expression}, maybe {c.wrong}? No.</think>\\boxed{{{c.answer}}}"),
        ("thousands separators", lambda c: f"The answer is $\\boxed{{{_commas(c.answer)}}}$."),
        ("x = value in the box", lambda c: f"\\boxed{{x = {c.answer}}}"),
        ("boxed twice, same value", lambda c: f"\\boxed{{{c.answer}}} so \\boxed{{{c.answer}}}"),
    )
)
# Attacks beside posttrain's answer attacks: what reasoning-gym's partial credit pays.
RG_ATTACKS: tuple[Attack, ...] = (
    Attack("a wrong number", "answer", lambda c: f"\\boxed{{{c.wrong}}}"),
    Attack("right answer inside a longer number", "answer", lambda c: f"\\boxed{{{c.answer}0}}"),
    Attack("right answer then a wrong one in words", "answer", lambda c: f"The answer is {c.answer} (or {c.wrong})."),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One completion kind's best score on each dataset: raw scorer and guarded verifier."""

    name: str
    honest: bool
    raw: dict[str, float]
    guarded: dict[str, float]


def red_team(datasets: Sequence[str] | None = None) -> list[Row]:
    """Every attack and honest form on every dataset (default: served and refused), raw and guarded."""
    from posttrain.rl.verifiers.redteam import redteam

    names = list(datasets or [*SUPPORTED, *REFUSED])
    forms = [(a, False) for a in (*ANSWER_ATTACKS, *RG_ATTACKS)] + [(a, True) for a in HONEST_FORMS]
    scores: dict[tuple[str, str, str], list[float]] = {}
    for name in names:
        cases = rg_cases(name)
        for label, verifier in (("raw", RawRGScorer()), ("guarded", RGVerifier())):
            report = redteam(verifier, cases, kind="answer", attacks=[a for a, _ in forms], workers=1)
            for o in report.outcomes:
                if o.error and label == "guarded":
                    raise RuntimeError(f"rg:{name} {label} {o.attack!r}: {o.error}")
                scores.setdefault((label, o.attack, name), []).append(math.nan if o.error else o.score)
    # an attack's best score, an honest form's worst; a scorer that raised (nan) shows as such
    pick = {False: max, True: min}
    pick = {k: (lambda f: lambda xs: math.nan if any(map(math.isnan, xs)) else f(xs))(f) for k, f in pick.items()}
    return [
        Row(
            a.name,
            honest,
            *({n: pick[honest](scores[(label, a.name, n)]) for n in names} for label in ("raw", "guarded")),
        )
        for a, honest in forms
    ]


def markdown(rows: Sequence[Row]) -> str:
    """The table: a row per attack (max score over the cases) and honest form (min), a column per
    dataset with `raw / guarded`; refused datasets marked."""
    names = list(rows[0].raw)
    head = [f"rg:{n}" + (" (refused)" if n in REFUSED else "") for n in names]
    lines = ["| completion | " + " | ".join(head) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        label = f"*honest: {r.name}* (min)" if r.honest else r.name
        lines.append(f"| {label} | " + " | ".join(f"{_cell(r.raw[n])} / {_cell(r.guarded[n])}" for n in names) + " |")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """Per dataset: attacks that pay (score > 0; `err`: the scorer raised) and honest forms below 1,
    raw and guarded, of how many."""
    names = list(rows[0].raw)
    attacks, honest = [r for r in rows if not r.honest], [r for r in rows if r.honest]
    lines = [
        f"| dataset | attacks paid, raw (of {len(attacks)}) | guarded | honest forms below 1, raw (of {len(honest)}) "
        "| guarded | served |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:

        def count(rs: Sequence[Row], which: str, bad: Callable[[float], bool]) -> str:
            scores = [getattr(r, which)[n] for r in rs]
            errors = sum(map(math.isnan, scores))
            paid = sum(1 for x in scores if not math.isnan(x) and bad(x))
            return f"{paid}" + (f" (+{errors} err)" if errors else "")

        cells = [count(attacks, w, lambda x: x > 0) for w in ("raw", "guarded")]
        cells += [count(honest, w, lambda x: x < 1) for w in ("raw", "guarded")]
        lines.append(f"| rg:{n} | " + " | ".join(cells) + f" | {'yes' if n in SUPPORTED else 'refused'} |")
    return "\n".join(lines)


def _cell(score: float) -> str:
    return "err" if math.isnan(score) else f"{score:.3g}"


def holes(rows: Sequence[Row], which: str = "guarded") -> dict[str, list[str]]:
    """Dataset -> the attacks that score above 0 and honest forms below 1 (`which`: raw or guarded)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        for name, score in getattr(r, which).items():
            if math.isnan(score) or ((score < 1) if r.honest else (score > 0)):
                out.setdefault(name, []).append(r.name)
    return out
