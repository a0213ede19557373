"""What every verifier returns, and the interface the reward function calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Correctness of one response in [0, 1], whether it used the expected answer format,
    a short human-readable reason (for logs, never for the reward) and, when the verifier could
    not decide (it failed or timed out; `correct` is then 0), what went wrong. `parts`: named
    numbers a verifier reports beside `correct` (e.g. the fraction of tests passed), for logs."""

    correct: float
    format_ok: bool
    detail: str = ""
    error: str | None = None
    parts: dict[str, float] = dataclasses.field(default_factory=dict)


class Verifier(Protocol):
    """Checks responses against tasks of one domain (math answers, code with tests, ...)."""

    def verify(self, task: Any, response: str) -> Verdict:
        """Verdict for one response."""
        ...

    def verify_many(self, tasks: Sequence[Any], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts for many responses; may run them concurrently."""
        ...
