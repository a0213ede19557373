"""The user's own RL tasks from JSONL files (`rl.train_files`, `rl.eval_files`; local, `gs://`, globs).

One record per line; the verifier it needs follows from its fields:
- `{"prompt", "answer"}`: math — the final answer is compared with `answer` (MathVerifier);
- `{"prompt", "tests", "entry_point"}`: code — the fenced code of the response runs against
  `tests` (asserts, or a `check(candidate)` function) in the sandbox (CodeVerifier);
- `{"prompt", ..., "verifier": "<name>"}`: the user verifier of that name (`rl.verifiers`), which
  receives the whole record; `"verifier": "math"` / `"code"` name the built-in ones explicitly.
Optional: `id` (unique per domain; default `path:line`), `domain` (default "user"; each domain is
an entry of the task mixture), `difficulty` (a label or number, reported per domain in metrics).
`prompt` is a string (one user turn) or a list of `{"role", "content"}` messages.

A bad record raises `DataError("path:line: ...")`, or with `data.on_error="skip"` is counted and
logged. Held-out means never trained on, in any spelling: an evaluation record whose prompt has
the canonical form of a training prompt (`normalise_prompt`: unicode, case and whitespace folded,
arithmetic written one way, so "What is 48 + 37 ?" is "what is 37+48?") is dropped, counted and
logged (`drop_overlap`), whatever `data.on_error` says: it is a good record, just not held out.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from posttrain.data.examples import RecordError, as_messages, get_field
from posttrain.data.sources import SkipLog, read_jsonl
from posttrain.data.synthetic import canonical_text
from posttrain.rl.envs.base import Task
from posttrain.rl.verifiers.code import CodeTask
from posttrain.rl.verifiers.math import MathTask
from posttrain.rl.verifiers.user import UserTask

BUILTIN_VERIFIERS = ("math", "code")
DEFAULT_DOMAIN = "user"
log = logging.getLogger(__name__)


def _text(record: dict, name: str, *, joinable: bool = False) -> str:
    value = get_field(record, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not joinable:
        return str(value)
    if joinable and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        expected = "a string or a list of strings" if joinable else "a string or a number"
        raise RecordError(f"field {name!r}: expected {expected}, got {type(value).__name__}")
    return value


def _verifier_name(record: dict) -> str:
    """The verifier a record names, or the built-in one its fields imply."""
    name = record.get("verifier")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise RecordError(f"field 'verifier': expected a verifier name, got {name!r}")
        return name
    if "answer" in record:
        return "math"
    if "tests" in record:
        return "code"
    raise RecordError(
        f"cannot tell how to verify this record (fields {sorted(record)}): expected 'answer' "
        "(math), 'tests' and 'entry_point' (code), or 'verifier' naming a verifier"
    )


def record_task(record: dict, where: str, verifiers: Collection[str]) -> tuple[str, Task]:
    """(domain, Task) from one user record (see module docstring); RecordError when it does not fit.

    verifiers: the names of the user verifiers there are (built-ins are always known)."""
    prompt = as_messages(get_field(record, "prompt"), "prompt", "user")
    name = _verifier_name(record)
    if name == "math":
        target: Any = MathTask(_text(record, "answer"))
    elif name == "code":
        entry_point = get_field(record, "entry_point")
        if not isinstance(entry_point, str):
            raise RecordError(f"field 'entry_point': expected a function name, got {entry_point!r}")
        target = CodeTask(test=_text(record, "tests", joinable=True), entry_point=entry_point)
    elif name in verifiers:
        target = UserTask(name, "\n\n".join(m["content"] for m in prompt), record)
    else:
        raise RecordError(
            f"field 'verifier': no verifier {name!r}; known: {sorted({*BUILTIN_VERIFIERS, *verifiers})} "
            "(add yours with rl.verifiers='package.module:function')"
        )
    fields = {}
    for key, default in (("domain", DEFAULT_DOMAIN), ("id", where), ("difficulty", None)):
        value = record.get(key, default)
        if isinstance(value, bool) or (value is not None and not isinstance(value, (str, int))):
            raise RecordError(f"field {key!r}: expected a string or an integer, got {value!r}")
        fields[key] = None if value is None else str(value)
    return fields["domain"], Task(fields["id"], tuple(prompt), target, difficulty=fields["difficulty"])


def normalise_prompt(task: Task) -> str:
    """A task's prompt text in canonical form (`data.synthetic.canonical_text`: unicode, case and
    whitespace folded, each arithmetic expression written one way), the key under which two
    prompts are the same problem (the train/eval overlap check, distinct prompts)."""
    return canonical_text("\n".join(m["content"] for m in task.prompt))


def read_task_files(paths: str, verifiers: Collection[str], skips: SkipLog) -> dict[str, list[tuple[str, Task]]]:
    """Tasks of the comma-separated files / globs `paths`, by domain, each with its `path:line`;
    bad records and duplicate ids within a domain go to `skips`."""
    out: dict[str, list[tuple[str, Task]]] = {}
    seen: dict[tuple[str, str], str] = {}
    for rec in read_jsonl([p.strip() for p in paths.split(",") if p.strip()], skips=skips):
        where = f"{rec.path}:{rec.line}"
        try:
            domain, task = record_task(rec.data, where, verifiers)
        except (RecordError, ValueError) as e:
            skips.bad(where, str(e))
            continue
        if (domain, task.id) in seen:
            skips.bad(where, f"task id {task.id!r} of domain {domain!r} is also at {seen[domain, task.id]}")
            continue
        seen[domain, task.id] = where
        out.setdefault(domain, []).append((where, task))
    return out


def drop_overlap(eval_tasks: dict[str, list[tuple[str, Task]]], train_prompts: dict[str, str]) -> int:
    """Remove (in place) evaluation tasks whose prompt is, in canonical form, a training prompt
    (`train_prompts`: normalised prompt → where); log how many and the first few. Returns the count."""
    dropped: list[str] = []
    for tasks in eval_tasks.values():
        kept = []
        for where, task in tasks:
            also = train_prompts.get(normalise_prompt(task))
            if also is None:
                kept.append((where, task))
            else:
                dropped.append(f"{where} (= {also})")
        tasks[:] = kept
    if dropped:
        log.warning(
            "rl.eval_files: dropped %d held-out tasks whose prompt is, in canonical form, a training "
            "prompt (held-out tasks must not be trained on), e.g. %s",
            len(dropped),
            ", ".join(dropped[:3]),
        )
    return len(dropped)
