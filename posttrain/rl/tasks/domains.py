"""Task domains: a data set of tasks plus the environment that runs them (the environment's
reward function holds the verifier), ready for the scheduler's mixture.

Ready-made: GSM8K (math word problems) and HumanEval (code with unit tests) from the shared data
folder (`../shared/data` beside the repo, or $POSTTRAIN_DATA; see its README), and the built-in
arithmetic problems. Records are read through the data layer (`read_jsonl`: fsspec paths,
`path:line` in every error, bad records raised or counted and skipped).

Held-out ("test") tasks are disjoint from training ("train") tasks by construction:
- arithmetic: a problem's split is a hash of its canonical form (`data.synthetic.arithmetic_split`,
  15% test), the same for every spelling of it (48+37 is 37+48); training tasks, SFT and
  preference data are drawn from "train" only, and the held-out tasks are distinct by meaning;
- GSM8K: the official test file; the train split drops any question whose text (whitespace and
  case normalised) is also a test question (none in the official files, checked all the same);
- HumanEval has no train split: a fixed 20% of its problems (by a hash of the task id: 40 of 164)
  is the test split and is never trained on; RL trains on the other 124.
A domain (what RL trains on) defaults to "train"; `arithmetic_tasks` and `humaneval_tasks`
(what evaluation reads) default to "test"; pass `split` explicitly to be clear.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence

import fsspec

from posttrain.data.examples import RecordError, field_key, get_field
from posttrain.data.sources import SkipLog, read_jsonl, shared_data_dir
from posttrain.data.synthetic import SPLITS, arithmetic_records
from posttrain.rl.envs.base import Env, Task
from posttrain.rl.verifiers.code import CodeTask
from posttrain.rl.verifiers.math import MathTask

MATH_INSTRUCTION = "\n\nGive the final answer as \\boxed{ANSWER}."
HUMANEVAL_TEST_PERCENT = 20
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python "
    "code block.\n\n```python\n{prompt}```"
)


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


def _tasks(path: str, make: Callable[[dict, int], Task], *, limit: int | None, on_error: str) -> list[Task]:
    """Tasks from the records of a JSONL file (the first `limit`): `make(record, line)` builds
    one (None: the record is of another split); a ValueError or KeyError from it makes the record
    bad (raised or skipped, `on_error`)."""
    skips = SkipLog(on_error)
    out: list[Task] = []
    for rec in read_jsonl(path, skips=skips):
        if limit is not None and len(out) >= limit:
            break
        try:
            task = make(rec.data, rec.line)
        except (ValueError, KeyError) as e:
            skips.bad(f"{rec.path}:{rec.line}", str(e))
            continue
        if task is not None:
            out.append(task)
    return out


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")


def gsm8k_tasks(
    data_dir: str | None = None,
    split: str = "train",
    *,
    limit: int | None = None,
    instruction: str = MATH_INSTRUCTION,
    on_error: str = "raise",
    fields: Mapping[str, str] | None = None,
) -> list[Task]:
    """GSM8K problems (`question`, `answer` ending in `#### x`) as math tasks, ids `gsm8k/{split}:{line}`.

    The train split leaves out (and logs the count of) questions that are also in the test file."""
    _check_split(split)
    root = data_dir or shared_data_dir()
    held_out = _gsm8k_test_questions(root, fields) if split == "train" else frozenset()
    dropped = 0

    def make(record: dict, line: int) -> Task | None:
        nonlocal dropped
        question = _gsm8k_question(record, fields)
        if _normalise(question) in held_out:
            dropped += 1
            return None
        target = MathTask.from_gsm8k({"answer": get_field(record, "answer", fields)})
        return Task(f"gsm8k/{split}:{line}", ({"role": "user", "content": question + instruction},), target)

    tasks = _tasks(f"{root}/gsm8k/{split}.jsonl", make, limit=limit, on_error=on_error)
    if dropped:
        logging.warning("gsm8k train: left out %d questions that are also test questions", dropped)
    return tasks


def _gsm8k_question(record: dict, fields: Mapping[str, str] | None) -> str:
    question = get_field(record, "question", fields)
    if not isinstance(question, str):
        raise RecordError(f"field {field_key('question', fields)!r}: expected a string, got {type(question).__name__}")
    return question


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def _gsm8k_test_questions(root: str, fields: Mapping[str, str] | None) -> frozenset[str]:
    """Normalised test questions (empty when there is no test file: nothing to hold out)."""
    path = f"{root}/gsm8k/test.jsonl"
    fs, p = fsspec.core.url_to_fs(path)
    if not fs.exists(p):
        return frozenset()
    return frozenset(_normalise(_gsm8k_question(r.data, fields)) for r in read_jsonl(path, skips=SkipLog("raise")))


def humaneval_split(task_id: str) -> str:
    """The split of a HumanEval problem: "test" for a fixed 20% (by a hash of the task id)."""
    bucket = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "little") % 100
    return "test" if bucket < HUMANEVAL_TEST_PERCENT else "train"


def humaneval_tasks(
    data_dir: str | None = None,
    *,
    split: str = "test",
    limit: int | None = None,
    instruction: str = CODE_INSTRUCTION,
    on_error: str = "raise",
) -> list[Task]:
    """HumanEval problems of `split` (`humaneval_split`) as code tasks, ids = task_id; the user
    message is `instruction` (a str.format template) with the problem's code as {prompt}."""
    _check_split(split)
    path = f"{data_dir or shared_data_dir()}/humaneval/HumanEval.jsonl.gz"

    def make(record: dict, line: int) -> Task | None:
        task_id = str(get_field(record, "task_id"))
        if humaneval_split(task_id) != split:
            return None
        target = CodeTask.from_humaneval(record)
        return Task(task_id, ({"role": "user", "content": instruction.format(prompt=target.prompt)},), target)

    return _tasks(path, make, limit=limit, on_error=on_error)


def arithmetic_tasks(
    n: int, seed: int, *, split: str = "test", instruction: str = MATH_INSTRUCTION, max_value: int = 99
) -> list[Task]:
    """`n` built-in arithmetic problems of `split` (`arithmetic_records("rl", ...)`), ids
    `arithmetic/{split}/{seed}:{i}`. Test problems are distinct (each held-out problem counts once);
    training problems are independent draws."""
    records = arithmetic_records("rl", n, seed, max_value=max_value, split=split, distinct=split == "test")
    return [
        Task(
            f"arithmetic/{split}/{seed}:{i}",
            ({"role": "user", "content": r["prompt"] + instruction},),
            MathTask(r["answer"]),
        )
        for i, r in enumerate(records)
    ]


def gsm8k_domain(make_env: Callable[[], Env], **kw) -> Domain:
    """Domain "gsm8k": `gsm8k_tasks(**kw)` run on `make_env()` environments."""
    return Domain("gsm8k", gsm8k_tasks(**kw), make_env)


def humaneval_domain(make_env: Callable[[], Env], split: str = "train", **kw) -> Domain:
    """Domain "humaneval": `humaneval_tasks(split=split, **kw)` run on `make_env()` environments."""
    return Domain("humaneval", humaneval_tasks(split=split, **kw), make_env)


def arithmetic_domain(make_env: Callable[[], Env], n: int = 1000, seed: int = 0, split: str = "train", **kw) -> Domain:
    """Domain "arithmetic": `arithmetic_tasks(n, seed, split=split, **kw)` run on `make_env()` environments."""
    return Domain("arithmetic", arithmetic_tasks(n, seed, split=split, **kw), make_env)
