"""Episodes on token ids: tasks, the environment interface, and the trajectory an episode leaves.

The policy is the sampler: it continues a token context with the model's tokens (one turn,
ending with a stop token). An environment turns a task into prompt tokens (`reset`) and answers
each model turn (`step`) with the tokens the environment adds before the model's next turn (a
tool's output, the next turn's header) and, on the last turn, the reward. The trajectory keeps
every token of the episode with whether the model generated it: `loss_mask` is True exactly on
the model's tokens, so the learner trains on those and treats prompts and environment output
as context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from posttrain.rl.reward import Reward


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem: a stable id (pass rates are tracked by it), the prompt messages the model
    sees (`[{"role", "content"}, ...]`) and the verifier's task (MathTask, CodeTask, ...) that
    the final answer is checked against; `difficulty`, when the data gives one, is reported per
    label in the scheduler's metrics."""

    id: str
    prompt: tuple[dict, ...]
    target: Any
    difficulty: str | None = None


class Step(NamedTuple):
    """What `Env.step` returns: tokens the environment appends (empty when done), the reward
    (only on the last step), whether the episode ended, and details for logs."""

    observation: list[int]
    reward: Reward | None
    done: bool
    info: dict[str, Any]


@dataclasses.dataclass
class Trajectory:
    """All tokens of one episode. `loss_mask[i]` is True when the model generated `tokens[i]`;
    `tokens[:prompt_len]` is the prompt. `reward` is set when the episode is done; `patches`, set by
    the rollout when the episode showed images, are those images at their placeholder tokens."""

    task_id: str
    tokens: list[int]
    loss_mask: list[bool]
    prompt_len: int
    reward: Reward | None = None
    turns: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    patches: Any = None  # float32 [len(tokens), patch_dim]: the images the episode showed (`envs.images`)

    def extend(self, ids: Sequence[int], *, generated: bool) -> None:
        """Append tokens, marked as the model's (`generated`) or the environment's."""
        self.tokens.extend(int(i) for i in ids)
        self.loss_mask.extend([generated] * len(ids))

    @property
    def num_generated(self) -> int:
        """How many tokens the model generated in this episode (over all turns)."""
        return sum(self.loss_mask)


class Env(Protocol):
    """One episode at a time: `reset(task)`, then `step(action)` until `done`, then
    `trajectory()`. Episodes end after at most `max_turns` steps."""

    max_turns: int

    def reset(self, task: Task) -> list[int]:
        """Start an episode; returns the prompt tokens (ending where the model's turn starts)."""
        ...

    def step(self, action: list[int]) -> Step:
        """Take the model's tokens for one turn; returns what the environment appends."""
        ...

    def trajectory(self) -> Trajectory:
        """The episode so far (complete once a step returned done)."""
        ...


Policy = Callable[[list[int]], list[int]]  # token context -> the model's tokens for one turn
