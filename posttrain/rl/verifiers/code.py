"""Code verifier: run a completion against pristine unit tests inside the sandbox.

Tasks are HumanEval-style (`prompt`, `test` defining `check(candidate)`, `entry_point`) or
plain unit tests (asserts that call the functions named in `functions`). The program is
`prompt + completion`. A completion passes only when the trusted harness
(`code_harness.py`, run in the sandbox) prints this run's random token followed by PASS;
see that module for why exiting early, printing fake success or patching the checker
cannot produce it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import RecordError, field_text, get_field
from posttrain.rl.verifiers.base import Lazy, Verdict, VerifierEntry
from posttrain.sandbox import ExecResult, Job, Limits, Sandbox, Status, sandbox_python

HARNESS_SOURCE = (Path(__file__).parent / "code_harness.py").read_text()
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """A function-writing task. `test` is trusted code: either it defines `check(candidate)`,
    called with the solution's `entry_point`, or it asserts directly on the `functions` it
    calls by name. `prompt` is trusted code the completion continues (also run, with the
    tested functions swapped for proxies, so the test can use its helpers)."""

    test: str
    entry_point: str | None = None
    prompt: str = ""
    functions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self.tested():
            if not _IDENTIFIER.fullmatch(name):
                raise ValueError(f"CodeTask function name {name!r} is not a Python identifier")
        if not self.tested():
            raise ValueError("CodeTask needs an entry_point or functions to test")

    def tested(self) -> tuple[str, ...]:
        """Names of the solution's functions that the test calls."""
        return tuple(dict.fromkeys(((self.entry_point,) if self.entry_point else ()) + self.functions))

    @classmethod
    def from_humaneval(cls, row: Mapping[str, Any]) -> CodeTask:
        """Task from a HumanEval record (fields prompt, test, entry_point)."""
        try:
            return cls(test=row["test"], entry_point=row["entry_point"], prompt=row["prompt"])
        except KeyError as e:
            raise KeyError(f"HumanEval record {row.get('task_id', '?')} lacks field {e}") from e


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Outcome of running one completion: passed, the sandbox status, and why."""

    passed: bool
    status: Status
    detail: str


def extract_code(response: str) -> tuple[str, bool]:
    """The code in a model response: the last fenced block if there is one (format_ok=True),
    else the whole response (format_ok=False, e.g. a raw HumanEval continuation)."""
    blocks = _FENCE.findall(response)
    return (blocks[-1], True) if blocks else (response, False)


class CodeVerifier:
    """Runs completions against CodeTasks in a Sandbox (concurrently for many)."""

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, python: str | None = None) -> None:
        self.sandbox = sandbox or Sandbox()
        self.limits = limits or Limits(cpu_s=5, wall_s=10.0)
        self.python = python or sandbox_python()

    def job(self, task: CodeTask, completion: str) -> tuple[Job, str]:
        """The sandbox job for one completion and the token its harness prints on success."""
        token = secrets.token_hex(16)
        payload = {
            "token": token,
            "program": task.prompt + completion,
            "setup": task.prompt,
            "test": task.test,
            "entry_point": task.entry_point,
            "functions": list(task.tested()),
        }
        job = Job(
            argv=(self.python, "-I", "-c", HARNESS_SOURCE), stdin=json.dumps(payload).encode(), limits=self.limits
        )
        return job, token

    def check_many(self, tasks: Sequence[CodeTask], completions: Sequence[str]) -> list[CodeResult]:
        """Run every (task, completion) pair on the sandbox pool; results in input order."""
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
        jobs = [self.job(t, c) for t, c in zip(tasks, completions)]
        futures = [self.sandbox.submit(job) for job, _ in jobs]
        return [_judge(f.result(), token) for f, (_, token) in zip(futures, jobs)]

    def check(self, task: CodeTask, completion: str) -> CodeResult:
        """Run one completion (already extracted from the response) against its task."""
        return self.check_many([task], [completion])[0]

    def verify_many(self, tasks: Sequence[CodeTask], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts for model responses: code extracted from each, then run."""
        extracted = [extract_code(r) for r in responses]
        results = self.check_many(tasks, [code for code, _ in extracted])
        return [
            Verdict(float(r.passed), ok, r.detail, error=r.detail if r.status is Status.ERROR else None)
            for r, (_, ok) in zip(results, extracted)
        ]

    def verify(self, task: CodeTask, response: str) -> Verdict:
        """Verdict for one model response."""
        return self.verify_many([task], [response])[0]


def _judge(result: ExecResult, token: str) -> CodeResult:
    """Pass only if the harness exited cleanly and printed exactly "<token> PASS"."""
    lines = result.stdout.decode(errors="replace").splitlines()
    verdicts = [line[len(token) + 1 :] for line in lines if line.startswith(token + " ")]
    if result.status is Status.PASS and verdicts == ["PASS"]:
        return CodeResult(True, result.status, "passed")
    if result.status is not Status.PASS:
        detail = f"sandbox {result.status.value}" + (f" ({result.limit})" if result.limit else "")
        detail += f": {result.error}" if result.error else ""
    else:
        detail = verdicts[0] if verdicts else "harness printed no verdict"
    return CodeResult(False, result.status, detail)


def _task_of(record: dict) -> CodeTask:
    entry_point = get_field(record, "entry_point")
    if not isinstance(entry_point, str):
        raise RecordError(f"field 'entry_point': expected a function name, got {entry_point!r}")
    return CodeTask(test=field_text(record, "tests", joinable=True), entry_point=entry_point)


VERIFIERS.register("code", VerifierEntry(CodeTask, lambda: Lazy(CodeVerifier), _task_of))
