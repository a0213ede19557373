"""User verifiers: a Python function named in the config scores responses to the user's own tasks.

The contract (also in the README):
- `score(prompt: str, response: str, record: dict) -> float | tuple[float, dict[str, float]]`:
  `prompt` is the task's prompt text (the record's `prompt`; a message list is joined), `response`
  the model's whole answer text, `record` the task's JSONL record as read (any fields the user put
  there: reference answers, tests, rubric, ...).
- It returns a reward in [0, 1] (the `correct` part of `Reward.parts`, shaped like every other
  verifier's by `rl.format_penalty` / `rl.overlong_buffer`), optionally with named parts (floats,
  e.g. `{"tests_passed": 0.5}`: reported in `Reward.verifier_parts` and the rollout files, not
  added to the score).
- A call that raises, returns something else (a non-finite number, a value outside [0, 1],
  parts that are not numbers) or runs past `timeout_s` is not a judgement of the response: the
  reward is 0 with `Reward.error` saying why, counted in `rl/verifier_errors`, and the run goes on.
  A hung call cannot be killed inside Python: its thread is abandoned (a daemon, so it does not
  block exit) and counted in `abandoned`; a verifier that may run untrusted code must use the
  sandbox itself (or declare the task as code with tests, which does).
- It is called from several threads at once (`rl.verifier_workers`): it must be thread-safe.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.rl.verifiers.base import Verdict

ScoreFn = Callable[[str, str, dict], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class UserTask:
    """A task scored by the user verifier `verifier` (a registry name), with its prompt text and
    the record it came from (handed to the verifier as is)."""

    verifier: str
    prompt: str
    record: Mapping[str, Any]


def load_callable(spec: str) -> ScoreFn:
    """`"package.module:function"` → the function (imported now, so a typo fails at start-up)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"verifier {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"verifier {spec!r}: cannot import {module_name!r} ({e})") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"verifier {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"verifier {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def check_result(value: Any) -> tuple[float, dict[str, float]]:
    """A verifier's return value → (reward, parts), or ValueError saying what is wrong with it."""
    parts: Any = {}
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"returned a tuple of {len(value)}; expected (reward, parts dict)")
        value, parts = value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}; expected a finite number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"returned {value!r}, outside [0, 1]")
    if not isinstance(parts, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in parts.items()
    ):
        raise ValueError(f"returned parts {parts!r}; expected a dict of str -> number")
    return float(value), {k: float(v) for k, v in parts.items()}


class UserVerifier:
    """Scores UserTasks with the registered functions (name → function), each call on its own
    daemon thread with a wall-clock timeout (see module docstring)."""

    def __init__(self, functions: Mapping[str, ScoreFn], timeout_s: float = 30.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"verifier timeout must be > 0 seconds, got {timeout_s}")
        self.functions = dict(functions)
        self.timeout_s = timeout_s
        self.abandoned = 0  # calls that timed out and whose threads still run
        self._lock = threading.Lock()

    def verify(self, task: UserTask, response: str) -> Verdict:
        """Verdict of one response: the function's reward as `correct`, its parts, or an error."""
        fn = self.functions.get(task.verifier)
        if fn is None:
            return Verdict(0.0, True, error=f"no verifier {task.verifier!r}; known: {sorted(self.functions)}")
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                out["value"] = fn(task.prompt, response, dict(task.record))
            except BaseException as e:  # noqa: BLE001 - whatever the user's code raises is reported
                out["error"] = e

        thread = threading.Thread(target=call, daemon=True, name=f"verifier-{task.verifier}")
        thread.start()
        thread.join(self.timeout_s)
        where = f"verifier {task.verifier!r}"
        if thread.is_alive():
            with self._lock:
                self.abandoned += 1
            return Verdict(0.0, True, error=f"{where} timed out after {self.timeout_s:g}s")
        if "error" in out:
            e = out["error"]
            return Verdict(0.0, True, error=f"{where} raised {type(e).__name__}: {e}")
        try:
            reward, parts = check_result(out["value"])
        except ValueError as e:
            return Verdict(0.0, True, error=f"{where} {e}")
        return Verdict(reward, True, parts=parts)

    def verify_many(self, tasks: Sequence[UserTask], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts for many responses (one at a time: the rollout worker's pool runs them in parallel)."""
        return [self.verify(t, r) for t, r in zip(tasks, responses, strict=True)]
