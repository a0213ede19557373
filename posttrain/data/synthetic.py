"""Built-in synthetic data for the CPU quickstart and tests: arithmetic text, byte tokens.

Held-out problems are reserved by construction: a problem belongs to the "test" split when a hash
of its canonical form ('37+48') falls in the first `TEST_PERCENT` of 100 buckets, and every
generator of training data ("train" split: SFT, preference, RL training tasks, the lm task) draws
only the others. The split of a problem depends on nothing else (not the seed, not the operand
range), so no seed or size choice can leak an evaluation problem into training data.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLITS = ("train", "test")
TEST_PERCENT = 10


def arithmetic_split(question: str) -> str:
    """The split ("train" or "test") of a problem, by a hash of its canonical form ('37+48')."""
    canonical = question.rstrip("=").replace(" ", "")
    bucket = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "little") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS} (or None for both)")


def arithmetic_problem(rng: np.random.Generator, max_value: int = 99, split: str | None = None) -> tuple[str, str]:
    """One addition or subtraction problem: ('37+48=', '85'), drawn from `split` (None: either),
    by rejection: a draw of the other split is thrown away and drawn again."""
    _check_split(split)
    while True:
        a, b = rng.integers(0, max_value + 1, size=2)
        if rng.random() < 0.5:
            q, ans = f"{a}+{b}=", str(a + b)
        else:
            a, b = max(a, b), min(a, b)
            q, ans = f"{a}-{b}=", str(a - b)
        if split is None or arithmetic_split(q) == split:
            return q, ans


def arithmetic_problem_count(max_value: int, split: str | None = None) -> int:
    """How many distinct problems operands 0..max_value give (in `split`, None: both)."""
    _check_split(split)
    qs = [f"{a}{op}{b}=" for a in range(max_value + 1) for b in range(max_value + 1)
          for op in "+-" if op == "+" or a >= b]
    return sum(1 for q in qs if split is None or arithmetic_split(q) == split)


def arithmetic_lm_batch(seed: int, step: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """A language-modelling batch of concatenated problems ('37+48=85;12-3=9;...') as bytes.

    Deterministic in (seed, step), so a resumed run sees the same data. Keys: inputs, targets,
    loss_mask, positions, segment_ids — each [batch_size, seq_len].
    """
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(batch_size):
        text = ""
        while len(text) <= seq_len:
            q, a = arithmetic_problem(rng, split="train")
            text += q + a + ";"
        rows.append(np.frombuffer(text[:seq_len + 1].encode(), np.uint8).astype(np.int32))
    tokens = np.stack(rows)
    return {
        "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
        "loss_mask": np.ones((batch_size, seq_len), np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy(),
        "segment_ids": np.ones((batch_size, seq_len), np.int32),
    }


def arithmetic_records(kind: str, n: int, seed: int, *, max_value: int = 99, error_rate: float = 0.0,
                       split: str = "train", distinct: bool = False) -> list[dict]:
    """Generated arithmetic records over operands 0..max_value: kind 'sft' ({"prompt", "response"}
    with a worked answer; with `error_rate` > 0 that fraction of answers comes from a sloppy
    teacher who overshoots by one — the setting where RL with a verifier beats imitation),
    'preference' ({"prompt", "chosen", "rejected"}: the rejected response works the sum out right
    but then states a different final answer, a consistency preference a small model can learn)
    or 'rl' ({"prompt", "answer"}). Problems come from `split` ("train" for anything trained on,
    "test" for held-out evaluation; see `arithmetic_split`); with `distinct`, no problem twice."""
    if kind not in ("sft", "preference", "rl"):
        raise ValueError(f"synthetic kind {kind!r}: expected sft, preference or rl")
    _check_split(split)
    if distinct and n > (available := arithmetic_problem_count(max_value, split)):
        raise ValueError(f"{n} distinct arithmetic problems requested from split {split!r} with operands "
                         f"0..{max_value}, which has only {available}: ask for fewer or raise max_value")
    rng = np.random.default_rng([seed, n, len(kind)])
    out, seen = [], set()
    while len(out) < n:
        q, a = arithmetic_problem(rng, max_value, split)
        if distinct:
            if q in seen:
                continue
            seen.add(q)
        prompt = f"What is {q[:-1]}?"
        if kind == "sft":
            shown = str(int(a) + 1) if rng.random() < error_rate else a
            out.append({"prompt": prompt, "response": f"{q}{shown}. The answer is {shown}."})
        elif kind == "preference":
            wrong = int(a) + int(rng.choice([-10, -2, -1, 1, 2, 10]))
            out.append({"prompt": prompt, "chosen": f"{q}{a}. The answer is {a}.",
                        "rejected": f"{q}{a}. The answer is {wrong}."})
        else:
            out.append({"prompt": prompt, "answer": a})
    return out


def ensure_arithmetic_file(path: str, kind: str, n: int, seed: int, **kw) -> None:
    """Write `path` (JSONL, local or fsspec URL) with generated records (`arithmetic_records`
    options in `kw`) unless it exists; an existing file must hold only problems of the requested
    split (a file written before the splits existed may hold held-out problems: an error)."""
    import json

    import fsspec
    fs, p = fsspec.core.url_to_fs(path)
    if fs.exists(p):
        _check_file_split(path, kw.get("split", "train"))
        return
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fsspec.open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in arithmetic_records(kind, n, seed, **kw))


def _check_file_split(path: str, split: str) -> None:
    """Raise if a generated arithmetic file holds a problem from outside `split`."""
    import json
    import re

    import fsspec
    with fsspec.open(path, "r") as f:
        for line, text in enumerate(f, 1):
            m = re.fullmatch(r"What is (\d+[+-]\d+)\?", json.loads(text).get("prompt", "")) if text.strip() else None
            if m and arithmetic_split(m.group(1)) != split:
                raise ValueError(f"{path}:{line}: problem {m.group(1)!r} belongs to the arithmetic "
                                 f"{arithmetic_split(m.group(1))!r} split but this file should hold only "
                                 f"{split!r} problems (written by an older version?): delete it to regenerate")
