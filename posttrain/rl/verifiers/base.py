"""What every verifier returns, and the interface the reward function calls."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
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


@dataclasses.dataclass(frozen=True)
class VerifierEntry:
    """A verifier as registered (`config.registry.VERIFIERS`, by the name a task record gives in its
    `verifier` field): the `task` type it judges, how a run `make`s it, and the task of a record
    (`from_record(record)`, a RecordError naming a bad field)."""

    task: type
    make: Callable[[], Verifier]
    from_record: Callable[[dict], Any]


class Lazy:
    """A verifier built on first use (the code verifier's sandbox probes the OS: only when code is verified)."""

    def __init__(self, make: Callable[[], Verifier]) -> None:
        self._make, self._made, self._lock = make, None, threading.Lock()

    def _get(self) -> Verifier:
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made

    def verify(self, task, response):
        return self._get().verify(task, response)

    def verify_many(self, tasks, responses):
        return self._get().verify_many(tasks, responses)
