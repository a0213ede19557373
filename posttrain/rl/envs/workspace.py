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
state is checked (the task's pristine tests run on the working directory, in a fresh sandbox: the
agent cannot pass by editing the tests); any other task's final answer goes to the reward
function's verifier (e.g. math, having computed with the tools).

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
import time

from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Step, Task
from posttrain.rl.envs.tool import ToolCall, ToolCallEnv
from posttrain.rl.reward import RewardFunction
from posttrain.rl.verifiers.base import Verdict
from posttrain.sandbox import Job, Limits, Sandbox, Status
from posttrain.sandbox.isolation import sandbox_python
from posttrain.sandbox.session import SESSION_TOOLS, Session, Snapshot

WORKSPACE_LIMITS = Limits(
    cpu_s=2,
    wall_s=5.0,
    memory_bytes=512 << 20,
    processes=16,
    file_bytes=1 << 20,
    output_bytes=16 << 10,
    disk_bytes=1 << 20,
)
WORKSPACE_SYSTEM_PROMPT = (
    "Run shell commands in the repository with one call per turn:\n<tool>sh\nls\n</tool>\n"
    "Reply without a call when you are done."
)


@dataclasses.dataclass(frozen=True)
class RepoTask:
    """A repository to fix: `files` the agent starts with (path, content); `tests` (path,
    content) are written over the agent's final working directory before `command` runs them
    there (exit 0: solved). `python` in `command` is the sandbox's interpreter."""

    files: tuple[tuple[str, str], ...]
    tests: tuple[tuple[str, str], ...]
    command: tuple[str, ...]


def check_repo(sandbox: Sandbox, task: RepoTask, state: Snapshot, limits: Limits) -> Verdict:
    """The final-state check: the task's pristine tests on the agent's files, in a fresh sandbox."""
    files = {**state.as_dict(), **dict(task.tests)}
    argv = tuple(sandbox_python() if a == "python" else a for a in task.command)
    res = sandbox.run(Job(argv, files=files, limits=limits))
    error = res.error if res.status is Status.ERROR else None
    tail = (res.stdout + res.stderr).decode(errors="replace")[-200:]
    return Verdict(float(res.passed), True, f"tests {res.status.value}: {tail}", error=error)


class WorkspaceEnv(ToolCallEnv):
    """Episodes with sandboxed shell/Python tools in a persistent working directory (protocol,
    reward and limits in the module docstring).

    max_turns: model turns per episode (calls included; also the session's call limit);
    max_turn_tokens: each turn's token budget; limits: sandbox limits of one call (`wall_s` the
    command's time); max_output_chars: how much of a call's output the model sees;
    max_workspace_bytes: the most the working directory may hold between calls.
    """

    tools = SESSION_TOOLS

    def __init__(
        self,
        tok: Tokenizer,
        reward_fn: RewardFunction,
        sandbox: Sandbox,
        *,
        max_turns: int = 4,
        max_turn_tokens: int = 128,
        limits: Limits = WORKSPACE_LIMITS,
        max_output_chars: int = 1000,
        max_workspace_bytes: int = 256 << 10,
        system_prompt: str | None = WORKSPACE_SYSTEM_PROMPT,
        observation_role: str = "tool",
    ) -> None:
        super().__init__(
            tok,
            reward_fn,
            max_turns=max_turns,
            max_turn_tokens=max_turn_tokens,
            max_output_chars=max_output_chars,
            system_prompt=system_prompt,
            observation_role=observation_role,
        )
        self.sandbox, self.limits, self.max_workspace_bytes = sandbox, limits, max_workspace_bytes
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
