"""The user's own RL tasks from JSONL files (`rl.train_files`, `rl.eval_files`; local, `gs://`, globs).

One record per line; the verifier it needs follows from its fields:
- `{"prompt", "answer"}`: math — the final answer is compared with `answer` (MathVerifier);
- `{"prompt", "tests", "entry_point"}`: code — the fenced code of the response runs against
  `tests` (asserts, or a `check(candidate)` function) in the sandbox (CodeVerifier);
- `{"prompt", ..., "verifier": "<name>"}`: the user verifier of that name (`rl.verifiers`), which
  receives the whole record; `"verifier": "math"` / `"code"` name the built-in ones explicitly.
Optional: `id` (unique per domain; default `path:line`), `domain` (default "user"; each domain is
an entry of the task mixture), `difficulty` (a label or number, reported per domain in metrics).
`prompt` is a string (one user turn) or a list of `{"role", "content"}` messages; a content may
be a list of parts, `{"type": "text", "text"}` and `{"type": "image", "image": path}`, the path
relative to the JSONL file's folder, absolute, or a URL (`gs://`): tasks carry it resolved (relative
paths joined to the file's folder), and a missing image makes the record bad (`path:line`).
`{"prompt", "answer", "choices", "verifier": "label"}`: the answer is one of the labels `choices`,
compared exactly (LabelVerifier: a bar's name, a table row).

A bad record raises `DataError("path:line: ...")`, or with `data.on_error="skip"` is counted and
logged. Held-out means never trained on, in any spelling: an evaluation record whose prompt has
the canonical form of a training prompt (`normalise_prompt`: unicode, case and whitespace folded,
arithmetic written one way, so "What is 48 + 37 ?" is "what is 37+48?"; each image by a hash of its
bytes, so the same picture under another name is the same prompt and the same question about another
picture is not) is dropped, counted and logged (`drop_overlap`), whatever `data.on_error` says: it is
a good record, just not held out.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import posixpath
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import fsspec

import posttrain.rl.verifiers.code  # noqa: F401 (the built-in verifiers register)
import posttrain.rl.verifiers.label  # noqa: F401
import posttrain.rl.verifiers.math  # noqa: F401
from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import RecordError, as_messages, get_field
from posttrain.data.sources import SkipLog, read_jsonl
from posttrain.data.synthetic import canonical_text
from posttrain.rl.envs.base import Task
from posttrain.rl.verifiers.user import UserTask

DEFAULT_DOMAIN = "user"
log = logging.getLogger(__name__)


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


def _image_path(path: Any, base: str | None) -> str:
    """An image part's path resolved against `base` (the record file's folder); RecordError when
    it is not a string or the file is not there."""
    if not isinstance(path, str) or not path:
        raise RecordError(f"image part: expected a path, got {path!r}")
    if base is not None and "://" not in path and not os.path.isabs(path):
        path = posixpath.join(base, path) if "://" in base else os.path.join(os.path.abspath(base), path)
    fs, p = fsspec.core.url_to_fs(path)
    if not fs.isfile(p):
        raise RecordError(f"image {path!r} not found")
    return path


def resolve_images(messages: list[dict], base: str | None) -> list[dict]:
    """The messages with each image part's path resolved (`_image_path`); text contents as they are."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {**part, "image": _image_path(part.get("image"), base)}
                if isinstance(part, dict) and part.get("type") == "image"
                else part
                for part in content
            ]
        out.append({**m, "content": content})
    return out


@functools.lru_cache(maxsize=1 << 16)
def _image_digest(path: str) -> str:
    """A hash of an image file's bytes (the path itself when it cannot be read)."""
    try:
        with fsspec.open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:24]
    except OSError:
        return path


def content_text(content: Any, *, digest: bool = False) -> str:
    """A message's content as text: a string as it is; parts as their texts joined by newlines, an
    image as `<image PATH>` (or, with `digest`, `<image HASH>` of its bytes)."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") == "image":
            texts.append(f"<image {_image_digest(part['image']) if digest else part['image']}>")
        else:
            texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def record_task(record: dict, where: str, verifiers: Collection[str], base: str | None = None) -> tuple[str, Task]:
    """(domain, Task) from one user record (see module docstring); RecordError when it does not fit.

    verifiers: the names of the user verifiers there are (built-ins are always known); base: the
    folder relative image paths are under (the record file's), None to leave them as they are."""
    prompt = resolve_images(as_messages(get_field(record, "prompt"), "prompt", "user", parts=True), base)
    name = _verifier_name(record)
    if name in VERIFIERS:
        target: Any = VERIFIERS[name].from_record(record)
    elif name in verifiers:
        target = UserTask(name, "\n\n".join(content_text(m["content"]) for m in prompt), record)
    else:
        raise RecordError(
            f"field 'verifier': no verifier {name!r}; known: {sorted({*VERIFIERS, *verifiers})} "
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
    whitespace folded, each arithmetic expression written one way; each image by a hash of its
    bytes), the key under which two prompts are the same problem (the train/eval overlap check,
    distinct prompts)."""
    return canonical_text("\n".join(content_text(m["content"], digest=True) for m in task.prompt))


def jsonl_tasks(
    paths: str | Sequence[str], verifiers: Collection[str], skips: SkipLog
) -> Iterator[tuple[str, int, str, Task]]:
    """(`path:line`, line, domain, Task) of each record of the JSONL files / globs `paths` that is a
    task (`record_task`, image paths resolved against the record's folder); bad records go to `skips`."""
    for rec in read_jsonl(paths, skips=skips):
        where = f"{rec.path}:{rec.line}"
        try:
            domain, task = record_task(rec.data, where, verifiers, base=posixpath.dirname(rec.path))
        except (RecordError, ValueError) as e:
            skips.bad(where, str(e))
            continue
        yield where, rec.line, domain, task


def read_task_files(paths: str, verifiers: Collection[str], skips: SkipLog) -> dict[str, list[tuple[str, Task]]]:
    """Tasks of the comma-separated files / globs `paths`, by domain, each with its `path:line`;
    bad records and duplicate ids within a domain go to `skips`."""
    out: dict[str, list[tuple[str, Task]]] = {}
    seen: dict[tuple[str, str], str] = {}
    for where, _, domain, task in jsonl_tasks([p.strip() for p in paths.split(",") if p.strip()], verifiers, skips):
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
