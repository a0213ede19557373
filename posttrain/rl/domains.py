"""Task domains: a data set of tasks plus the environment that runs them (the environment's
reward function holds the verifier), ready for the scheduler's mixture.

Ready-made: GSM8K (math word problems) and HumanEval (code with unit tests) from the shared data
folder (`../shared/data` beside the repo, or $POSTTRAIN_DATA; see its README), and the built-in
arithmetic problems. Records are read through the data layer (`read_jsonl`: fsspec paths,
`path:line` in every error, bad records raised or counted and skipped).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from posttrain.data.examples import RecordError, field_key, get_field
from posttrain.data.sources import SkipLog, read_jsonl
from posttrain.data.synthetic import arithmetic_records
from posttrain.rl.envs.base import Env, Task
from posttrain.rl.verifiers.code import CodeTask
from posttrain.rl.verifiers.math import MathTask

MATH_INSTRUCTION = "\n\nGive the final answer as \\boxed{ANSWER}."
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a ```python "
                    "code block.\n\n```python\n{prompt}```")


@dataclasses.dataclass(frozen=True)
class Domain:
    """A named task set and a factory for the environment of one episode (one env per episode:
    environments hold episode state)."""

    name: str
    tasks: Sequence[Task]
    make_env: Callable[[], Env]

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"domain {self.name!r} has no tasks")
        seen: set[str] = set()
        for t in self.tasks:
            if t.id in seen:
                raise ValueError(f"domain {self.name!r} has two tasks with id {t.id!r}")
            seen.add(t.id)


def shared_data_dir() -> str:
    """The shared data folder: $POSTTRAIN_DATA, else `shared/data` beside the repo."""
    return os.environ.get("POSTTRAIN_DATA", str(Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))


def _tasks(path: str, make: Callable[[dict, int], Task], *, limit: int | None, on_error: str) -> list[Task]:
    """Tasks from the records of a JSONL file (the first `limit`): `make(record, line)` builds
    one; a ValueError or KeyError from it makes the record bad (raised or skipped, `on_error`)."""
    skips = SkipLog(on_error)
    out: list[Task] = []
    for rec in itertools.islice(read_jsonl(path, skips=skips), limit):
        try:
            out.append(make(rec.data, rec.line))
        except (ValueError, KeyError) as e:
            skips.bad(f"{rec.path}:{rec.line}", str(e))
    return out


def gsm8k_tasks(data_dir: str | None = None, split: str = "train", *, limit: int | None = None,
                instruction: str = MATH_INSTRUCTION, on_error: str = "raise",
                fields: Mapping[str, str] | None = None) -> list[Task]:
    """GSM8K problems (`question`, `answer` ending in `#### x`) as math tasks, ids `gsm8k/{split}:{line}`."""
    path = f"{data_dir or shared_data_dir()}/gsm8k/{split}.jsonl"

    def make(record: dict, line: int) -> Task:
        question = get_field(record, "question", fields)
        if not isinstance(question, str):
            raise RecordError(f"field {field_key('question', fields)!r}: expected a string, "
                             f"got {type(question).__name__}")
        target = MathTask.from_gsm8k({"answer": get_field(record, "answer", fields)})
        return Task(f"gsm8k/{split}:{line}", ({"role": "user", "content": question + instruction},), target)

    return _tasks(path, make, limit=limit, on_error=on_error)


def humaneval_tasks(data_dir: str | None = None, *, limit: int | None = None,
                    instruction: str = CODE_INSTRUCTION, on_error: str = "raise") -> list[Task]:
    """HumanEval problems as code tasks, ids = task_id; the user message is `instruction`
    (a str.format template) with the problem's code as {prompt}."""
    path = f"{data_dir or shared_data_dir()}/humaneval/HumanEval.jsonl.gz"

    def make(record: dict, line: int) -> Task:
        target = CodeTask.from_humaneval(record)
        task_id = str(get_field(record, "task_id"))
        return Task(task_id, ({"role": "user", "content": instruction.format(prompt=target.prompt)},), target)

    return _tasks(path, make, limit=limit, on_error=on_error)


def arithmetic_tasks(n: int, seed: int, *, instruction: str = MATH_INSTRUCTION, max_value: int = 99) -> list[Task]:
    """The built-in arithmetic problems (`arithmetic_records("rl", n, seed, max_value=...)`),
    ids `arithmetic/{seed}:{i}`."""
    return [Task(f"arithmetic/{seed}:{i}", ({"role": "user", "content": r["prompt"] + instruction},),
                 MathTask(r["answer"]))
            for i, r in enumerate(arithmetic_records("rl", n, seed, max_value=max_value))]


def gsm8k_domain(make_env: Callable[[], Env], **kw) -> Domain:
    """Domain "gsm8k": `gsm8k_tasks(**kw)` run on `make_env()` environments."""
    return Domain("gsm8k", gsm8k_tasks(**kw), make_env)


def humaneval_domain(make_env: Callable[[], Env], **kw) -> Domain:
    """Domain "humaneval": `humaneval_tasks(**kw)` run on `make_env()` environments."""
    return Domain("humaneval", humaneval_tasks(**kw), make_env)


def arithmetic_domain(make_env: Callable[[], Env], n: int = 1000, seed: int = 0, **kw) -> Domain:
    """Domain "arithmetic": `arithmetic_tasks(n, seed, **kw)` run on `make_env()` environments."""
    return Domain("arithmetic", arithmetic_tasks(n, seed, **kw), make_env)
