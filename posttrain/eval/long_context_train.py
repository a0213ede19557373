"""SFT records of the long-context problems (`posttrain.eval.long_context`), from its `train` split
only: what `data.synthetic = long_context` writes. Recall, kv and kvchain records are
conversations asking every fact (chain) of one context, one turn each.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from posttrain.eval.long_context import (
    KINDS,
    RECALL_SEPARATORS,
    SPLITS,
    chain_problems,
    generate_problem,
    recall_facts,
    recall_problems,
)


def training_records(
    n: int,
    min_length: int,
    max_length: int,
    *,
    seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
    hops: int = 2,
    count: Callable[[str], int] = lambda s: len(s.encode()),
    recall_density: float = 0.0,
) -> list[dict]:
    """`n` SFT records ({"prompt", "response"}) of the `train` split — names disjoint from every
    evaluation problem — with prompt lengths spread over [min_length, max_length] tokens and
    depths over [0, 1], kinds alternating: data that teaches retrieval at every length. Lengths
    are log-uniform, so short problems (an early, short stage of a staged run) are common. A
    recall record is a conversation ({"messages"}) asking every fact of its context, one turn
    each, so each context teaches several retrievals; its turns fit the same token budget, and its
    answers restate the key ("QZX=4821": the answer checked is the number). `recall_density` > 0:
    each recall context holds a number of facts drawn uniformly from `recall_facts(length)` up to
    `recall_density` per 64 tokens (`dense_recall_facts`): more distractors to tell apart and more
    questions per context."""
    if not 0 < min_length <= max_length:
        raise ValueError(f"training_records: need 0 < min_length={min_length} <= max_length={max_length}")
    rng = np.random.default_rng([len(SPLITS), seed])  # a namespace of its own
    out = []
    for i in range(n):
        length = int(round(np.exp(rng.uniform(np.log(min_length), np.log(max_length)))))
        if kinds[i % len(kinds)] in (*RECALL_SEPARATORS, "kvchain"):
            depth, kind = float(rng.random()), kinds[i % len(kinds)]
            out.append(_recall_record(length, max_length, depth, i, seed, count, recall_density, kind, hops))
            continue
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


def dense_recall_facts(length: int, density: float, rng: np.random.Generator, fact_tokens: int = 10) -> int:
    """A fact count for a training recall context of `length` tokens, uniform from
    `recall_facts(length)` to `density` facts per 64 tokens, at most what fills 70% of the context
    with facts of `fact_tokens` tokens ("QZX=4821. ")."""
    lo = recall_facts(length)
    hi = max(lo, min(int(density * length / 64), int(0.7 * length) // fact_tokens))
    return int(rng.integers(lo, hi + 1))


RECALL_TURN_TOKENS = 18  # a further question and answer turn: "KEY=?", "KEY=1234" and 4 chat markers, with room


def _recall_record(
    length: int,
    max_length: int,
    depth: float,
    index: int,
    seed: int,
    count: Callable[[str], int],
    density: float = 0.0,
    kind: str = "recall",
    hops: int = 2,
) -> dict:
    """A training conversation over one recall context of `length` tokens (as an evaluation
    problem's), asking its facts in turn (random order), as many as fit in `max_length`: every
    one in short contexts, at least one in the longest, so contexts as long as the evaluated ones
    are trained too. A kvchain context (`hops` facts a chain) asks each chain's first key, its
    answer the chain written out; `density` sets its facts as a recall context's."""
    facts = dense_recall_facts(length, density, np.random.default_rng([len(SPLITS), seed, index, 1])) if density else 0
    if kind == "kvchain":
        chains = max(facts // hops, 1) if facts else 0
        problems = chain_problems(
            length, depth, hops=hops, index=index, seed=seed, split="train", count=count, chains=chains
        )
    else:
        problems = recall_problems(
            length, depth, index=index, seed=seed, split="train", count=count, facts=facts, kind=kind
        )
    per_turn = RECALL_TURN_TOKENS + (4 * (hops - 1) if kind == "kvchain" else 0)  # ">BDW" a pointer
    turns = min(len(problems), 1 + max(max_length - length, 0) // per_turn)
    order = np.random.default_rng([len(SPLITS), seed, index]).permutation(len(problems))[:turns]
    messages = []
    for j, k in enumerate(order):
        context, question = problems[k].prompt.rsplit("\n", 1)
        answer = problems[k].response or f"{question.removesuffix('?')}{problems[k].answer}"  # "QZX=4821"
        messages += [
            {"role": "user", "content": problems[k].prompt if j == 0 else question},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}
