"""Multi-turn tool use: the model may run Python in the sandbox and read its output before answering.

Protocol (also what `TOOL_SYSTEM_PROMPT` tells the model). A turn that contains `<tool>` is a
tool call and must be exactly one block, ending the turn:

    <tool>python
    print(sum(range(10)))
    </tool>

The code runs as a fresh program in the sandbox (small limits, no network, nothing kept between
calls); its stdout and stderr (cut to `max_output_chars`, with a `[status: ...]` line when it
did not exit cleanly) come back as a tool message `<output>\\n...</output>`, after which the
model's next turn starts. A turn without `<tool>` is the final answer and is verified. A
malformed call (unclosed, several in one turn, text after `</tool>`, unknown tool) is answered
with an error output and, like a call whose program fails (not a failure of the sandbox
itself), counts as an invalid tool call for the reward. A tool call on the last allowed turn
ends the episode unanswered (`truncated = "max_turns"`, correctness 0).
"""

from __future__ import annotations

import dataclasses
import re

from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Step
from posttrain.rl.envs.chat import ChatEnv
from posttrain.rl.reward import RewardFunction
from posttrain.sandbox import Limits, Sandbox, Status, python_job

TOOLS = ("python",)
TOOL_LIMITS = Limits(
    cpu_s=2,
    wall_s=5.0,
    memory_bytes=512 << 20,
    processes=16,
    file_bytes=4 << 20,
    output_bytes=16 << 10,
    disk_bytes=16 << 20,
)
TOOL_SYSTEM_PROMPT = (
    "You can run Python code before answering. To run code, end your turn with one tool call:\n"
    "<tool>python\nprint(2 + 2)\n</tool>\n"
    "The code runs as a fresh program without network access; you will see what it printed as "
    "<output>...</output>. When you know the answer, reply without a tool call."
)
_CALL = re.compile(r"<tool>([A-Za-z_][\w-]*)\n(.*?)</tool>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and the code (its input)."""

    name: str
    code: str


class ToolCallError(ValueError):
    """A turn that tries to call a tool but does not follow the protocol; the message says how."""


def parse_tool_call(text: str, tools: tuple[str, ...] = TOOLS) -> ToolCall | None:
    """The tool call a turn ends with; None when the turn has no `<tool>` (a final answer).
    Raises ToolCallError when the call is malformed or names a tool not in `tools`."""
    if "<tool>" not in text:
        return None
    calls = list(_CALL.finditer(text))
    if not calls:
        raise ToolCallError("malformed tool call: expected <tool>NAME, a newline, the code, then </tool>")
    if len(calls) > 1 or text.count("<tool>") > 1:
        raise ToolCallError(f"{text.count('<tool>')} tool calls in one turn: make one call per turn")
    if text[calls[0].end() :].strip():
        raise ToolCallError("text after </tool>: a tool call must end the turn")
    if calls[0].group(1) not in tools:
        raise ToolCallError(f"unknown tool {calls[0].group(1)!r}; available: {', '.join(tools)}")
    return ToolCall(calls[0].group(1), calls[0].group(2))


def run_python(sandbox: Sandbox, code: str, limits: Limits, max_chars: int) -> tuple[str, Status]:
    """Run `code` in the sandbox; returns what the model sees (stdout + stderr, cut to
    `max_chars`, plus a status line unless it exited cleanly) and the run's status."""
    res = sandbox.run(python_job(code, limits=limits))
    out = (res.stdout + res.stderr).decode(errors="replace")
    if len(out) > max_chars:
        out = out[:max_chars] + f"\n[... {len(out) - max_chars} more characters]"
    if res.status is not Status.PASS:
        status = res.status.value + (f", {res.limit} limit" if res.limit else "")
        out += ("\n" if out and not out.endswith("\n") else "") + f"[status: {status}]"
    return out, res.status


class ToolCallEnv(ChatEnv):
    """Multi-turn episodes where a turn may end with one tool call (protocol in the module
    docstring): `step` parses the turn, counts the call, ends the episode at `max_turns` and
    answers with the output message; a subclass runs the call in `_call` (`tools` names those it has).

    sandbox: where calls run; max_turns: model turns per episode, tool calls included;
    max_turn_tokens: token budget of each turn; limits: sandbox limits of one call;
    max_output_chars: how much of a call's output the model sees; observation_role: the chat role
    of tool output messages (use "user" for templates without a tool role). The defaults are
    `ToolEnv`'s.
    """

    tools: tuple[str, ...] = TOOLS

    def __init__(
        self,
        tok: Tokenizer,
        reward_fn: RewardFunction,
        sandbox: Sandbox,
        *,
        max_turns: int = 4,
        max_turn_tokens: int = 512,
        limits: Limits = TOOL_LIMITS,
        max_output_chars: int = 2000,
        system_prompt: str | None = TOOL_SYSTEM_PROMPT,
        observation_role: str = "tool",
    ) -> None:
        super().__init__(tok, reward_fn, max_turn_tokens=max_turn_tokens, system_prompt=system_prompt)
        if max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be >= 1, got {max_turns}")
        if max_output_chars < 1:
            raise ValueError(f"{type(self).__name__}: max_output_chars must be >= 1, got {max_output_chars}")
        self.sandbox, self.limits = sandbox, limits
        self.max_turns = max_turns
        self.max_output_chars = max_output_chars
        self.observation_role = observation_role

    def step(self, action: list[int]) -> Step:
        """Take one model turn: answer a tool call with its output, or score a final answer."""
        text, truncated = self._take(action)
        if truncated:
            return self._finish(text, truncated=truncated)
        try:
            call, error = parse_tool_call(text, self.tools), None
        except ToolCallError as e:
            call, error = None, str(e)
        if call is None and error is None:
            return self._finish(text)
        info = self.trajectory().info
        info["tool_calls"] += 1
        info["invalid_tool_calls"] += error is not None
        if self.trajectory().turns >= self.max_turns:
            return self._finish(text, truncated="max_turns")
        output = self._call(call, info) if error is None else f"error: {error}"
        if output and not output.endswith("\n"):
            output += "\n"
        message = {"role": self.observation_role, "content": f"<output>\n{output}</output>"}
        return Step(self._observe(message), None, False, dict(info))

    def _call(self, call: ToolCall, info: dict) -> str:
        """Run one well-formed call, count what it did in `info`; returns what the model sees."""
        raise NotImplementedError


class ToolEnv(ToolCallEnv):
    """Multi-turn episodes with a sandboxed Python tool, each call a fresh program (protocol in
    the module docstring); arguments as for `ToolCallEnv`.
    """

    def _call(self, call: ToolCall, info: dict) -> str:
        """Run the program; a failing one (not a failure of the sandbox itself) is an invalid call."""
        output, status = run_python(self.sandbox, call.code, self.limits, self.max_output_chars)
        info["invalid_tool_calls"] += status not in (Status.PASS, Status.ERROR)  # ERROR: the sandbox's fault
        return output
