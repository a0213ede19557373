"""Long-context problems generated at any length, with exact answers: needle retrieval and
multi-hop reasoning hidden in filler text.

    needle    "... The magic number of Vekora is 4821. ..."        → "What is the magic number of Vekora?"  4821
    multihop  "... The code of Vekora is 17. ... The code of Zumith is the code of Vekora plus 3. ..."
                                                                    → "What is the code of Zumith?"  20
    recall    "... QZX=4821. ... BDW=7730. ..."                     → "QZX=?"  4821
              (key-value recall among 1 + length/64 facts; short all-caps keys. Training
              answers restate the key, "QZX=4821", so the value follows a copy of "QZX=" as in
              the context: an induction-head match a small byte model learns at length)
    kv        "... QZX4821. ... BDW7730. ..."                       → "QZX?"  4821
              (recall with the value right after the key: the first digit follows the key's
              last letter, as every later digit follows the one before, so one induction
              match reads it; with "=" between, every fact's value follows the same "=")
    kvchain   "... QZX>BDW. ... BDW4821. ..."                      → "QZX?"  4821
              (multi-hop: a chain of `hops` facts, pointers then a value, each hop one
              retrieval; training answers write the chain, "QZX>BDW4821": `chain_problems`)

Problems are a pure function of (kind, split, seed, index, length, depth): the same arguments
give the same text on any machine. The `train` and `eval` splits draw names from disjoint
syllable sets (recall, kv and kvchain keys, intermediate hops included: by a hash of the key,
`recall_key_split`), so no evaluation name (the thing retrieved) can occur in training data
generated here (`long_context_train.training_records`), whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import string
from collections.abc import Callable
from typing import TypedDict, Unpack

import numpy as np

KINDS = ("needle", "multihop", "recall", "kv", "kvchain")
RECALL_SEPARATORS = {"recall": "=", "kv": ""}  # between a recall key and its value
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
    response: str = ""  # a training answer that shows the work ("QZX>BDW4821"); "" = the answer


def byte_count(text: str) -> int:
    """Tokens of `text` for a byte tokenizer: the default token counter."""
    return len(text.encode())


class Draw(TypedDict, total=False):
    """Which problem of a kind, length and depth to draw (defaults in `_draw`): its `index`, `seed`
    and `split` ("train" or "eval"), and `count`, the tokens of a text (default `byte_count`)."""

    index: int
    seed: int
    split: str
    count: Callable[[str], int]


def _draw(
    kind: str,
    length: int,
    depth: float,
    hops: int = 1,
    *,
    index: int = 0,
    seed: int = 0,
    split: str = "eval",
    count: Callable[[str], int] = byte_count,
) -> tuple[np.random.Generator, str, Callable[[str], int]]:
    """(a generator for one problem, its split, its token counter); split and kind are part of the
    seed namespace. `hops`: facts per chain, at least 1."""
    if hops < 1:
        raise ValueError(f"hops={hops}: need at least 1")
    if kind not in KINDS or split not in SPLITS:
        raise ValueError(f"kind={kind!r}, split={split!r}: expected kind in {KINDS} and split in {SPLITS}")
    rng = np.random.default_rng([KINDS.index(kind), SPLITS.index(split), seed, index, length, int(round(depth * 1000))])
    return rng, split, count


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


def needle(length: int, depth: float, **draw: Unpack[Draw]) -> Problem:
    """One fact ("The magic number of X is N.") at fraction `depth` (0 = start, 1 = end) of a
    context of about `length` tokens, asked for at the end."""
    rng, split, count = _draw("needle", length, depth, **draw)
    target, *others = names(rng, split, 3)
    number = int(rng.integers(1000, 10000))
    fact = f"The magic number of {target} is {number}."
    question = f"What is the magic number of {target}? Answer with the number."
    prompt, achieved = place([fact], [depth], question, length, rng, count)
    return Problem("needle", prompt, str(number), length, depth, achieved)


def multihop(length: int, depth: float, *, hops: int = 3, **draw: Unpack[Draw]) -> Problem:
    """A chain of `hops` facts — a base code, then each code the previous one plus or minus a
    small number — spread evenly from fraction `depth` to the end of the context; the question
    asks for the last code, so every fact must be found and combined."""
    rng, split, count = _draw("multihop", length, depth, hops, **draw)
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


RECALL_EVAL_PERCENT = 25  # of the 26^3 recall keys, about this share is held out for evaluation


def recall_key_split(key: str) -> str:
    """The split ("train" or "eval") of recall key `key`, by a hash of its canonical (upper-case)
    form: a key and its other spellings are held out together, whatever generator drew them."""
    bucket = int.from_bytes(hashlib.sha256(key.strip().upper().encode()).digest()[:8], "little") % 100
    return "eval" if bucket < RECALL_EVAL_PERCENT else "train"


def recall_keys(rng: np.random.Generator, split: str, n: int) -> list[str]:
    """`n` distinct three-letter upper-case keys of `split` (by `recall_key_split`)."""
    out: list[str] = []
    while len(out) < n:
        key = "".join(rng.choice(list(string.ascii_uppercase), 3))
        if recall_key_split(key) == split and key not in out:
            out.append(key)
    return out


def recall_facts(length: int) -> int:
    """Facts in a recall context of `length` tokens: 1 + length // 64 (5 at 256, 17 at 1024), dense
    enough that a training context asking each of them teaches many retrievals per token."""
    return 1 + length // 64


def recall_problems(
    length: int, depth: float, *, facts: int = 0, kind: str = "recall", **draw: Unpack[Draw]
) -> list[Problem]:
    """Key-value recall: `facts` ("KEY=1234.", default `recall_facts(length)`) in filler text, the
    first at fraction `depth`, the others at random depths; one Problem per fact, all with the same
    context and each asking its key ("KEY=?"). The first is the evaluation problem (`recall`);
    training asks them all, one turn each (`training_records`). `kind` "kv": no "=" ("KEY1234.",
    "KEY?")."""
    sep = RECALL_SEPARATORS[kind]
    rng, split, count = _draw(kind, length, depth, **draw)
    n = facts or recall_facts(length)
    keys = recall_keys(rng, split, n)
    values = [str(int(v)) for v in rng.integers(1000, 10000, n)]
    depths = [depth] + [float(d) for d in rng.random(n - 1)]
    questions = [f"{k}{sep}?" for k in keys]
    longest = max(questions, key=count)
    context, achieved = place([f"{k}{sep}{v}." for k, v in zip(keys, values)], depths, longest, length, rng, count)
    context = context.rsplit("\n", 1)[0]
    return [Problem(kind, f"{context}\n{q}", v, length, depth, (a,)) for q, v, a in zip(questions, values, achieved)]


def recall(length: int, depth: float, **kw) -> Problem:
    """One key-value recall problem: the fact asked sits at fraction `depth` of the context, among
    `recall_facts(length)` facts (see `recall_problems`)."""
    return recall_problems(length, depth, **kw)[0]


def chain_count(length: int) -> int:
    """Chains in a context of `length` tokens: 1 + length // 256 (2 at 256, 3 at 512, 5 at 1024)."""
    return 1 + length // 256


def chain_problems(length: int, depth: float, *, hops: int = 2, chains: int = 0, **draw: Unpack[Draw]) -> list[Problem]:
    """`chains` (default `chain_count(length)`) chains of `hops` facts in filler text, one Problem
    per chain, all with the same context, each asking its chain's first key ("QZX?"); the first is
    the evaluation problem. `Problem.response` is the chain written out ("QZX>BDW4821")."""
    rng, split, count = _draw("kvchain", length, depth, hops, **draw)
    n = chains or chain_count(length)
    keys = recall_keys(rng, split, n * hops)
    values = [str(int(v)) for v in rng.integers(1000, 10000, n)]
    facts, depths, asked = [], [], []
    for c in range(n):
        chain = keys[c * hops : (c + 1) * hops]
        facts += [f"{a}>{b}." for a, b in zip(chain, chain[1:])] + [f"{chain[-1]}{values[c]}."]
        depths += [float(d) for d in rng.random(hops)]
        asked.append((chain[0], ">".join(chain) + values[c], len(facts) - hops))
    depths[0] = depth
    order = rng.permutation(len(facts))  # chains interleaved, not in runs of their own facts
    longest = max((f"{k}?" for k, _, _ in asked), key=count)
    context, achieved = place([facts[i] for i in order], [depths[i] for i in order], longest, length, rng, count)
    context = context.rsplit("\n", 1)[0]
    where = {int(i): a for i, a in zip(order, achieved)}
    return [
        Problem("kvchain", f"{context}\n{key}?", value, length, depth, (where[first],), response)
        for (key, response, first), value in zip(asked, values)
    ]


def chain(length: int, depth: float, **kw) -> Problem:
    """One `hops`-fact chain problem whose first fact sits at fraction `depth` (`chain_problems`)."""
    return chain_problems(length, depth, **kw)[0]


def generate_problem(kind: str, length: int, depth: float, **kw) -> Problem:
    """`needle(...)`, `multihop(...)`, `recall(...)`, kv (`recall(..., kind="kv")`) or kvchain
    (`chain(...)`) by name."""
    if kind == "kvchain":
        return chain(length, depth, **kw)
    if kind in ("needle", "recall", "kv"):
        kw.pop("hops", None)
        return needle(length, depth, **kw) if kind == "needle" else recall(length, depth, kind=kind, **kw)
    if kind == "multihop":
        return multihop(length, depth, **kw)
    raise ValueError(f"kind={kind!r}: expected one of {KINDS}")


_NUMBER = re.compile(r"-?\d+")


def is_correct(completion: str, answer: str) -> bool:
    """Exact-answer check: the first integer in the completion is the answer."""
    m = _NUMBER.search(completion)
    return m is not None and m.group(0) == answer
