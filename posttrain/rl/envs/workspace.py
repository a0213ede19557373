"""Multi-turn agent episodes in a persistent sandboxed workspace (shell and Python tools).

Protocol (what `WORKSPACE_SYSTEM_PROMPT` tells the model): a turn that contains `<tool>` is one
call that ends the turn,

    <tool>sh
    cat test_config.py
    </tool>

(`sh`: a shell command; `python`: a Python program), run in the episode's own working directory
(`sandbox.session.Session`: it persists across the episode's calls, so a file written by one call
is there for the next). Its output comes back as a tool message `<output>\\n...</output>` and the
model's next turn starts. A turn without `<tool>` ends the episode: for a `RepoTask` the final
state is checked (`check_repo`: in a fresh sandbox holding the agent's files with the task's
pristine tests written over them, the trusted `state_harness` imports the task's module and
passes its values out as plain data; the host compares them with the task's expected values, so
nothing the agent's code does inside the sandbox -- exiting 0, printing, rigging `__eq__`,
editing the tests -- can pass it); any other task's final answer goes to the reward function's
verifier (e.g. math, having computed with the tools).

Reward: correctness from that check plus the configured penalties (`RewardConfig`): per invalid
call (malformed, unknown tool, or the command failed: non-zero exit, timeout, a limit), per
redundant call (the same call again on an unchanged working directory: its output is already in
the context), per call beyond `max_tool_calls`, and the overlong ramp over the episode's model
tokens. An episode that reaches `max_turns` with a call, or a turn cut by the token budget, ends
unanswered (correctness 0, `info["truncated"]`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import Any

from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Step, Task
from posttrain.rl.envs.state_harness import plain
from posttrain.rl.envs.tool import TOOL_LIMITS, ToolCall, ToolCallEnv
from posttrain.rl.reward import RewardFunction
from posttrain.rl.verifiers.base import Verdict
from posttrain.sandbox import Job, Limits, Sandbox, Status
from posttrain.sandbox.isolation import sandbox_python
from posttrain.sandbox.session import SESSION_TOOLS, Session, Snapshot

WORKSPACE_LIMITS = dataclasses.replace(TOOL_LIMITS, file_bytes=1 << 20, disk_bytes=1 << 20)  # a repository's files
WORKSPACE_SYSTEM_PROMPT = (
    "Run shell commands in the repository with one call per turn:\n<tool>sh\nls\n</tool>\n"
    "Reply without a call when you are done."
)
# WorkspaceEnv's defaults where they differ from ToolCallEnv's
WORKSPACE_DEFAULTS = {
    "max_turn_tokens": 128,
    "limits": WORKSPACE_LIMITS,
    "max_output_chars": 1000,
    "system_prompt": WORKSPACE_SYSTEM_PROMPT,
}
HARNESS_SOURCE = (Path(__file__).parent / "state_harness.py").read_text()


@dataclasses.dataclass(frozen=True)
class RepoTask:
    """A repository to fix: `files` the agent starts with (path, content); `module` the module
    whose final state is checked and `expect` the (name, value) pairs it must then hold (plain
    JSON data: exact builtin types, see `state_harness.plain`); `tests` (path, content) are what
    the agent reads to learn them -- written over the agent's final files for the check, so
    editing or deleting them changes nothing. The expected values stay on the host."""

    files: tuple[tuple[str, str], ...]
    tests: tuple[tuple[str, str], ...]
    module: str
    expect: tuple[tuple[str, Any], ...]

    @property
    def source(self) -> str:
        """The module's source file, the one the check executes: `a/b/__init__.py` when the task's
        files hold that package, else `a/b.py`."""
        path = self.module.replace(".", "/")
        return f"{path}/__init__.py" if f"{path}/__init__.py" in dict(self.files) else f"{path}.py"

    def __post_init__(self) -> None:
        if not all(part.isidentifier() for part in self.module.split(".")):
            raise ValueError(f"RepoTask.module must be a dotted module name, got {self.module!r}")
        names = [name for name, _ in self.expect]
        if not names or not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"RepoTask.expect needs distinct identifier names, got {names}")
        for name, value in self.expect:
            try:
                plain(value)
            except TypeError as e:
                raise ValueError(f"RepoTask.expect[{name!r}]: {e}") from None


def same_value(got: Any, want: Any) -> bool:
    """Equality of plain data with exact types at every level (`True` is not `1`, `37.0` is
    not `37`), on values the host parsed itself: no object of the agent's is ever compared."""
    if type(got) is not type(want):
        return False
    if type(want) is list:
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want))
    if type(want) is dict:
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    return got == want


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not plain data")


def read_report(stdout: bytes, nonce: str) -> dict | None:
    """The harness's report: the one stdout line holding `nonce`, which must start with it and
    carry `{"values": {...}}` or `{"error": str}`. None when no line or several lines hold the
    nonce (a forged line beside the harness's) or the line is anything else."""
    lines = [line for line in stdout.decode(errors="replace").split("\n") if nonce in line]
    if len(lines) != 1 or not lines[0].startswith(nonce + " "):
        return None
    try:
        report = json.loads(lines[0][len(nonce) + 1 :], parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # RecursionError: a forged line nested a thousand deep
        return None
    if not isinstance(report, dict) or len(report) != 1:
        return None
    if isinstance(report.get("values"), dict) or isinstance(report.get("error"), str):
        return report
    return None


def with_tests(state: Snapshot, tests: tuple[tuple[str, str], ...]) -> dict[str, bytes | str]:
    """The agent's files with the pristine `tests` written over them; an agent file in a test's
    way (the test path made a directory, or a file where a test's directory goes) is dropped, so
    no layout the agent leaves can keep the tests from being restored or break the check."""
    paths = [t for t, _ in tests]
    clash = lambda p: any(p == t or p.startswith(t + "/") or t.startswith(p + "/") for t in paths)
    return {**{p: c for p, c in state.as_dict().items() if not clash(p)}, **dict(tests)}


def check_repo(sandbox: Sandbox, task: RepoTask, state: Snapshot, limits: Limits) -> Verdict:
    """The final-state check: in a fresh sandbox holding the agent's files and the task's
    pristine tests, the trusted harness (`state_harness`) reports the values of `task.module`;
    solved when the run was clean, printed exactly one line with this check's random nonce, and
    every value equals the task's expected one (`same_value`). The verdict is the host's."""
    nonce = secrets.token_hex(16)
    expect = dict(task.expect)
    request = {"nonce": nonce, "module": task.module, "source": task.source, "names": list(expect)}
    job = Job(
        (sandbox_python(), "-I", "-S", "-B", "-X", "pycache_prefix=/dev/null", "-c", HARNESS_SOURCE),
        files=with_tests(state, task.tests),
        stdin=json.dumps(request).encode(),
        limits=limits,
    )
    res = sandbox.run(job)
    if res.status is Status.ERROR:
        return Verdict(0.0, True, f"state check: sandbox error: {res.error}", error=res.error)
    report = read_report(res.stdout, nonce)
    if res.status is not Status.PASS or report is None:
        tail = res.stderr.decode(errors="replace")[-200:]
        why = res.status.value + (f" ({res.limit})" if res.limit else "")
        lines = "not one result line" if report is None else "a result line"
        return Verdict(0.0, True, f"state check: {why}, {lines}: {tail}")
    if "error" in report:
        return Verdict(0.0, True, f"state check: {task.module} raised or held no plain value: {report['error']}")
    got = report["values"]
    wrong = [n for n, want in expect.items() if n not in got or not same_value(got[n], want)]
    if wrong or got.keys() != expect.keys():
        shown = {n: got.get(n, "<missing>") for n in wrong}
        return Verdict(0.0, True, f"state check: {task.module} holds {str(shown)[:200]}, not the expected values")
    return Verdict(1.0, True, f"state check: {task.module} holds the expected {', '.join(expect)}")


class WorkspaceEnv(ToolCallEnv):
    """Episodes with sandboxed shell/Python tools in a persistent working directory (protocol,
    reward and limits in the module docstring).

    Arguments as for `ToolCallEnv` (max_turns is also the session's call limit; `wall_s` of the
    limits, a command's time), with the defaults of `WORKSPACE_DEFAULTS`; max_workspace_bytes: the
    most the working directory may hold between calls.
    """

    tools = SESSION_TOOLS

    def __init__(
        self,
        tok: Tokenizer,
        reward_fn: RewardFunction,
        sandbox: Sandbox,
        *,
        max_workspace_bytes: int = 256 << 10,
        **options,
    ) -> None:
        super().__init__(tok, reward_fn, sandbox, **(WORKSPACE_DEFAULTS | options))
        self.max_workspace_bytes = max_workspace_bytes
        self.session: Session | None = None
        self.snapshots: list[Snapshot] = []  # after each call of the episode
        self._seen: set[str] = set()

    def _check_target(self, task: Task) -> None:
        """Repository tasks are checked by the env itself; others need a verifier."""
        if not isinstance(task.target, RepoTask):
            super()._check_target(task)

    def reset(self, task: Task) -> list[int]:
        """Start an episode: a fresh session holding the task's files (none for other tasks)."""
        ids = super().reset(task)
        files = dict(task.target.files) if isinstance(task.target, RepoTask) else {}
        self.session = self._session(Snapshot.of(files))
        self.snapshots, self._seen = [], set()
        self.trajectory().info.update(redundant_tool_calls=0, tool_ok=0, env_s=0.0)
        return ids

    def _session(self, state: Snapshot) -> Session:
        return Session(
            self.sandbox,
            state,
            limits=self.limits,
            max_calls=self.max_turns,
            max_bytes=self.max_workspace_bytes,
            max_output_bytes=4 * self.max_output_chars,
        )

    def _call(self, call: ToolCall, info: dict) -> str:
        """Run one call in the session; count it (ok / invalid / redundant); returns what the model sees."""
        key = hashlib.sha256(repr((call.name, call.code, self.session.snapshot().files)).encode()).hexdigest()
        info["redundant_tool_calls"] += key in self._seen
        self._seen.add(key)
        t0 = time.perf_counter()
        res = self.session.run(call.name, call.code)
        info["env_s"] += time.perf_counter() - t0
        self.snapshots.append(self.session.snapshot())
        info["tool_ok"] += res.ok
        info["invalid_tool_calls"] += res.status not in (Status.PASS, Status.ERROR)  # ERROR: the sandbox's fault
        out = res.output.decode(errors="replace")
        if len(out) > self.max_output_chars:
            out = out[: self.max_output_chars] + f"\n[... {len(out) - self.max_output_chars} more characters]"
        if res.status is not Status.PASS:
            status = (
                res.status.value
                + (f", exit {res.exit_code}" if res.exit_code else "")
                + (f", {res.limit} limit" if res.limit else "")
            )
            out += ("\n" if out and not out.endswith("\n") else "") + f"[status: {status}]"
        return out

    def _finish(self, answer: str, *, truncated: str | None = None, verdict: Verdict | None = None) -> Step:
        """End the episode: a repository task's final state is checked by its tests (others: the answer)."""
        target, info = self._task.target, self.trajectory().info
        if isinstance(target, RepoTask) and truncated is None:
            t0 = time.perf_counter()
            verdict = check_repo(self.sandbox, target, self.session.snapshot(), self.limits)
            info["env_s"] += time.perf_counter() - t0
            info["detail"] = verdict.detail
        return super()._finish(answer, truncated=truncated, verdict=verdict)

    def replay(self, call_index: int) -> Session:
        """A new session holding the working directory as it was after call `call_index` (0-based)
        of the current episode, to continue the episode differently from there."""
        if not 0 <= call_index < len(self.snapshots):
            raise IndexError(f"replay: call {call_index} of an episode with {len(self.snapshots)} calls run")
        return self._session(self.snapshots[call_index])
