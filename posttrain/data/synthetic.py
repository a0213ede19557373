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
