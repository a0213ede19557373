"""pass@k with the unbiased estimator (Chen et al. 2021)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples, drawn without replacement from n with c correct, is correct)
    = 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems, each given as its samples' correctness."""
    return sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / max(len(correct), 1)
