"""Long-context problems generated at any length, with exact answers: needle retrieval and
multi-hop reasoning hidden in filler text.

    needle    "... The magic number of Vekora is 4821. ..."        → "What is the magic number of Vekora?"  4821
    multihop  "... The code of Vekora is 17. ... The code of Zumith is the code of Vekora plus 3. ..."
                                                                    → "What is the code of Zumith?"  20

Problems are a pure function of (kind, split, seed, index, length, depth): the same arguments
give the same text on any machine. The `train` and `eval` splits draw names from disjoint
syllable sets, so no evaluation name (the thing retrieved) can occur in training data generated
here, whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

KINDS = ("needle", "multihop")
SPLITS = ("train", "eval")
# A name is a first syllable from its split's set and one or two more from the shared ones.
FIRST_SYLLABLES = {
    "train": ("ba", "de", "fi", "go", "ku", "la", "mo", "ni", "pu", "ri"),
    "eval": ("ve", "zu", "xo", "qa", "jy", "wi", "ho", "ty", "sy", "ce"),
}
SYLLABLES = ("ko", "ra", "mith", "len", "dor", "vik", "sa", "tur", "nel", "bas", "quo", "rin")
SUBJECTS = (
    "The river",
    "A small bird",
    "The old clock",
    "Every lantern",
    "The quiet market",
    "A tall tower",
    "The morning train",
    "Each window",
    "The green field",
    "A wooden boat",
)
VERBS = ("passes", "watches", "follows", "remembers", "ignores", "crosses", "carries", "reaches")
OBJECTS = (
    "the distant hills",
    "a grey cloud",
    "the sleeping town",
    "an empty road",
    "the northern sea",
    "a bright lantern",
    "the long bridge",
    "a narrow street",
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One generated problem: `prompt` (context then question), its exact `answer`, and where its
    facts sit (`depth` asked for; `fact_depths`, the achieved fractions of the context)."""

    kind: str
    prompt: str
    answer: str
    length: int
    depth: float
    fact_depths: tuple[float, ...]


def _rng(kind: str, split: str, seed: int, index: int, length: int, depth: float) -> np.random.Generator:
    """A generator for one problem; split and kind are part of the seed namespace."""
    if kind not in KINDS or split not in SPLITS:
        raise ValueError(f"kind={kind!r}, split={split!r}: expected kind in {KINDS} and split in {SPLITS}")
    return np.random.default_rng(
        [KINDS.index(kind), SPLITS.index(split), seed, index, length, int(round(depth * 1000))]
    )


def names(rng: np.random.Generator, split: str, n: int) -> list[str]:
    """`n` distinct capitalised names of `split` (its own first syllables)."""
    out: list[str] = []
    while len(out) < n:
        parts = [rng.choice(FIRST_SYLLABLES[split])] + list(rng.choice(SYLLABLES, int(rng.integers(1, 3))))
        name = "".join(parts).capitalize()
        if name not in out:
            out.append(name)
    return out


def filler_sentence(rng: np.random.Generator) -> str:
    """One sentence of neutral filler text."""
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."


def place(
    facts: list[str],
    depths: list[float],
    question: str,
    length: int,
    rng: np.random.Generator,
    count: Callable[[str], int],
) -> tuple[str, tuple[float, ...]]:
    """Filler sentences with `facts` inserted at the fractions `depths` of the context, then the
    question; the context grows until the prompt would pass `length` tokens by `count` (summed
    per sentence: exact for byte tokens, close for BPE). Returns (prompt, achieved depths)."""
    budget = length - count(question) - sum(count(f) + 1 for f in facts)
    if budget < 0:
        raise ValueError(f"length={length}: too short for the facts and question ({length - budget} tokens)")
    filler: list[str] = []
    while True:
        sentence = filler_sentence(rng)
        budget -= count(sentence) + 1
        if budget < 0:
            break
        filler.append(sentence)
    slots = [min(int(round(d * len(filler))), len(filler)) for d in depths]
    pieces: list[str] = []
    for i in range(len(filler) + 1):
        pieces += [f for f, s in zip(facts, slots) if s == i]
        if i < len(filler):
            pieces.append(filler[i])
    achieved = tuple(s / max(len(filler), 1) for s in slots)
    return " ".join(pieces) + "\n" + question, achieved


def needle(
    length: int,
    depth: float,
    *,
    index: int = 0,
    seed: int = 0,
    split: str = "eval",
    count: Callable[[str], int] = lambda s: len(s.encode()),
) -> Problem:
    """One fact ("The magic number of X is N.") at fraction `depth` (0 = start, 1 = end) of a
    context of about `length` tokens, asked for at the end."""
    rng = _rng("needle", split, seed, index, length, depth)
    target, *others = names(rng, split, 3)
    number = int(rng.integers(1000, 10000))
    fact = f"The magic number of {target} is {number}."
    question = f"What is the magic number of {target}? Answer with the number."
    prompt, achieved = place([fact], [depth], question, length, rng, count)
    return Problem("needle", prompt, str(number), length, depth, achieved)


def multihop(
    length: int,
    depth: float,
    *,
    hops: int = 3,
    index: int = 0,
    seed: int = 0,
    split: str = "eval",
    count: Callable[[str], int] = lambda s: len(s.encode()),
) -> Problem:
    """A chain of `hops` facts — a base code, then each code the previous one plus or minus a
    small number — spread evenly from fraction `depth` to the end of the context; the question
    asks for the last code, so every fact must be found and combined."""
    if hops < 1:
        raise ValueError(f"hops={hops}: need at least 1")
    rng = _rng("multihop", split, seed, index, length, depth)
    chain = names(rng, split, hops)
    value = int(rng.integers(10, 90))
    facts = [f"The code of {chain[0]} is {value}."]
    for prev, name in zip(chain, chain[1:]):
        step = int(rng.integers(1, 10))
        sign = "plus" if rng.random() < 0.5 else "minus"
        value += step if sign == "plus" else -step
        facts.append(f"The code of {name} is the code of {prev} {sign} {step}.")
    depths = [depth + (1.0 - depth) * i / hops for i in range(hops)]
    question = f"What is the code of {chain[-1]}? Answer with the number."
    prompt, achieved = place(facts, depths, question, length, rng, count)
    return Problem("multihop", prompt, str(value), length, depth, achieved)


def generate_problem(kind: str, length: int, depth: float, **kw) -> Problem:
    """`needle(...)` or `multihop(...)` by name."""
    if kind == "needle":
        kw.pop("hops", None)
        return needle(length, depth, **kw)
    if kind == "multihop":
        return multihop(length, depth, **kw)
    raise ValueError(f"kind={kind!r}: expected one of {KINDS}")


_NUMBER = re.compile(r"-?\d+")


def is_correct(completion: str, answer: str) -> bool:
    """Exact-answer check: the first integer in the completion is the answer."""
    m = _NUMBER.search(completion)
    return m is not None and m.group(0) == answer


def training_records(
    n: int,
    min_length: int,
    max_length: int,
    *,
    seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
    hops: int = 2,
    count: Callable[[str], int] = lambda s: len(s.encode()),
) -> list[dict]:
    """`n` SFT records ({"prompt", "response"}) of the `train` split — names disjoint from every
    evaluation problem — with prompt lengths spread over [min_length, max_length] tokens and
    depths over [0, 1], kinds alternating: data that teaches retrieval at every length. Lengths
    are log-uniform, so short problems (an early, short stage of a staged run) are common."""
    if not 0 < min_length <= max_length:
        raise ValueError(f"training_records: need 0 < min_length={min_length} <= max_length={max_length}")
    rng = np.random.default_rng([len(SPLITS), seed])  # a namespace of its own
    out = []
    for i in range(n):
        length = int(round(np.exp(rng.uniform(np.log(min_length), np.log(max_length)))))
        p = generate_problem(
            kinds[i % len(kinds)],
            length,
            float(rng.random()),
            index=i,
            seed=seed,
            split="train",
            hops=hops,
            count=count,
        )
        out.append({"prompt": p.prompt, "response": p.answer})
    return out
