"""Built-in synthetic data for the CPU quickstart and tests: arithmetic text, byte tokens."""

from __future__ import annotations

import numpy as np


def arithmetic_problem(rng: np.random.Generator, max_value: int = 99) -> tuple[str, str]:
    """One addition or subtraction problem: ('37+48=', '85')."""
    a, b = rng.integers(0, max_value + 1, size=2)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}=", str(a - b)


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
            q, a = arithmetic_problem(rng)
            text += q + a + ";"
        rows.append(np.frombuffer(text[:seq_len + 1].encode(), np.uint8).astype(np.int32))
    tokens = np.stack(rows)
    return {
        "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
        "loss_mask": np.ones((batch_size, seq_len), np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy(),
        "segment_ids": np.ones((batch_size, seq_len), np.int32),
    }


def arithmetic_records(kind: str, n: int, seed: int, *, max_value: int = 99,
                       error_rate: float = 0.0) -> list[dict]:
    """Generated arithmetic records over operands 0..max_value: kind 'sft' ({"prompt", "response"}
    with a worked answer; with `error_rate` > 0 that fraction of answers comes from a sloppy
    teacher who overshoots by one — the setting where RL with a verifier beats imitation),
    'preference' ({"prompt", "chosen", "rejected"}: the rejected response works the sum out right
    but then states a different final answer, a consistency preference a small model can learn)
    or 'rl' ({"prompt", "answer"})."""
    rng = np.random.default_rng([seed, n, len(kind)])
    out = []
    for _ in range(n):
        q, a = arithmetic_problem(rng, max_value)
        prompt = f"What is {q[:-1]}?"
        if kind == "sft":
            shown = str(int(a) + 1) if rng.random() < error_rate else a
            out.append({"prompt": prompt, "response": f"{q}{shown}. The answer is {shown}."})
        elif kind == "preference":
            wrong = int(a) + int(rng.choice([-10, -2, -1, 1, 2, 10]))
            out.append({"prompt": prompt, "chosen": f"{q}{a}. The answer is {a}.",
                        "rejected": f"{q}{a}. The answer is {wrong}."})
        elif kind == "rl":
            out.append({"prompt": prompt, "answer": a})
        else:
            raise ValueError(f"synthetic kind {kind!r}: expected sft, preference or rl")
    return out


def ensure_arithmetic_file(path: str, kind: str, n: int, seed: int, **kw) -> None:
    """Write `path` (JSONL, local or fsspec URL) with generated records (`arithmetic_records`
    options in `kw`) unless it exists."""
    import json

    import fsspec
    fs, p = fsspec.core.url_to_fs(path)
    if fs.exists(p):
        return
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fsspec.open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in arithmetic_records(kind, n, seed, **kw))
