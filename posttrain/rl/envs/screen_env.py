"""The screenshot agent environment: multi-turn episodes on rendered screens (`envs/screen.py`).

An episode of a `ScreenTask` (its `Task.target`) starts with one user message: the first screen
as an image part, then the task's own prompt text (the instruction). Each model turn must be one
action (`click(X, Y)`, `click("LABEL")`, `type("TEXT")`); the environment applies it, and unless
OK or CANCEL was pressed answers with a user message holding the next screen and `NEXT`. Screens
are PNG files in `image_dir`, named by a hash of their bytes (the same screen is one file, the same
episode writes the same names), and appear in messages in the agreed record convention:

    {"role": "user", "content": [{"type": "image", "image": "/abs/dir/<hash>.png"},
                                 {"type": "text", "text": "..."}]}

`messages` and `images` give the episode's conversation and its screens in order; `image_part`
(see `envs/chat.py`) turns image parts into what the tokenizer takes (with the data layer's image
tokens: `lambda part: {"type": "image", "num_patches": spec.num_patches}`), so the placeholder
tokens of the trajectory are the screens of `images`, in order.

Reward (`ChatEnv._finish` with the env's own verdict, shaped by the reward config): correctness 1
only when OK is pressed in the goal state (`screen.check`). The episode ends with correctness 0 on
CANCEL, on a malformed turn (not exactly one action: counted as an invalid tool call, so
`invalid_tool_call_penalty` applies, and `info["malformed"]` is set -- the episode does not go on,
so nothing is gained by writing several actions, prose, or a claim of success), on a turn cut by
the token budget, and at `max_turns` without OK (`info["truncated"] = "max_turns"`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable

from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Step, Task
from posttrain.rl.envs.chat import ChatEnv
from posttrain.rl.envs.draw import png_bytes
from posttrain.rl.envs.screen import ActionError, ScreenState, ScreenTask, apply, check, parse_action, render, solution
from posttrain.rl.reward import RewardFunction
from posttrain.rl.verifiers.base import Verdict

SCREEN_SYSTEM_PROMPT = (
    "You operate the screen shown in the image. Reply with exactly one action per turn: "
    'click(X, Y) with pixel coordinates, click("LABEL"), or type("TEXT") into the focused field. '
    "Press OK when the task is done."
)
NEXT = "Next action?"


def write_screen(image_dir: str, data: bytes) -> str:
    """Write PNG bytes as `image_dir/<hash>.png` (atomically, once); returns the absolute path."""
    path = os.path.abspath(os.path.join(image_dir, hashlib.sha256(data).hexdigest()[:24] + ".png"))
    if not os.path.exists(path):
        os.makedirs(image_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=image_dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


def screen_message(image: str, text: str) -> dict:
    """A user message showing a screen: the image part, then the text part."""
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def prompt_text(task: Task) -> str:
    """The text of a task's prompt messages (text parts of part lists), joined by blank lines."""
    texts = []
    for m in task.prompt:
        content = m["content"]
        parts = (
            [content] if isinstance(content, str) else [p.get("text", "") for p in content if p.get("type") == "text"]
        )
        texts.append("\n".join(parts))
    return "\n\n".join(texts)


def demo_messages(
    task: Task,
    image_dir: str,
    *,
    by_xy: bool = True,
    system_prompt: str | None = SCREEN_SYSTEM_PROMPT,
    actions: list[str] | None = None,
) -> list[dict]:
    """The conversation of an episode of `task` as `ScreenEnv` shows it: an SFT demonstration whose
    screens are written to `image_dir` (absolute paths). `actions` (default: the honest
    `screen.solution`) must end the episode (OK or CANCEL pressed)."""
    target, state = task.target, ScreenState()
    actions = solution(target, by_xy) if actions is None else actions
    screen = lambda: write_screen(image_dir, png_bytes(render(target, state)))  # noqa: E731
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append(screen_message(screen(), prompt_text(task)))
    for action in actions:
        messages.append({"role": "assistant", "content": action})
        apply(target, state, parse_action(action))
        if not state.over:
            messages.append(screen_message(screen(), NEXT))
    if not state.over:
        raise ValueError(f"task {task.id}: the demonstration {actions} never presses OK or CANCEL")
    return messages


class ScreenEnv(ChatEnv):
    """Episodes on rendered screens (module docstring).

    tok, reward_fn: as for `ChatEnv` (the reward function shapes the env's verdict; it needs no
    verifier for screens); image_dir: where screens are written; max_turns: model turns per episode
    (OK must be pressed within them); max_turn_tokens: token budget of one turn; system_prompt: the
    action grammar told to the model (None: none); image_part: as for `ChatEnv`."""

    def __init__(
        self,
        tok: Tokenizer,
        reward_fn: RewardFunction,
        image_dir: str,
        *,
        max_turns: int = 6,
        max_turn_tokens: int = 64,
        system_prompt: str | None = SCREEN_SYSTEM_PROMPT,
        image_part: Callable[[dict], dict] | None = None,
    ) -> None:
        super().__init__(
            tok, reward_fn, max_turn_tokens=max_turn_tokens, system_prompt=system_prompt, image_part=image_part
        )
        if max_turns < 1:
            raise ValueError(f"ScreenEnv: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.image_dir = image_dir
        self._state = ScreenState()

    def _check_target(self, task: Task) -> None:
        if not isinstance(task.target, ScreenTask):
            raise TypeError(f"task {task.id!r}: ScreenEnv runs ScreenTask targets, got {type(task.target).__name__}")

    def _screen(self) -> str:
        return write_screen(self.image_dir, png_bytes(render(self._task.target, self._state)))

    def reset(self, task: Task) -> list[int]:
        """Start an episode: the first screen, then the task's prompt text, in one user message."""
        self._check_target(task)
        self._task, self._state = task, ScreenState()
        prompt = (screen_message(self._screen(), prompt_text(task)),)
        ids = super().reset(Task(task.id, prompt, task.target, task.difficulty))
        self._traj.info.update(malformed=False, actions=[])
        return ids

    @property
    def state(self) -> ScreenState:
        """The screen's state now."""
        return self._state

    def step(self, action: list[int]) -> Step:
        """Apply one model turn: the next screen, or the end of the episode with its reward."""
        text, truncated = self._take(action)
        if truncated:
            return self._finish(text, truncated=truncated)
        info = self._traj.info
        try:
            parsed = parse_action(text)
        except ActionError as e:
            info["malformed"] = True
            info["invalid_tool_calls"] += 1
            return self._finish(text, verdict=Verdict(0.0, False, f"malformed turn: {e}"))
        info["tool_calls"] += 1
        info["actions"].append(f"{parsed}: {apply(self._task.target, self._state, parsed)}")
        if self._state.over:
            done, detail = check(self._task.target, self._state)
            return self._finish(text, verdict=Verdict(float(done), True, detail))
        if self._traj.turns >= self.max_turns:
            return self._finish(text, truncated="max_turns")
        message = {
            "role": "user",
            "content": [{"type": "image", "image": self._screen()}, {"type": "text", "text": NEXT}],
        }
        return Step(self._observe(message), None, False, dict(info))
