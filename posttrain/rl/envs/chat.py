"""Chat environments on token ids: the prompt through the tokenizer's chat template, model turns
checked against a per-turn token budget, the final answer scored by the reward function.

`SingleTurnEnv` is one model turn whose text is the answer (math, code with tests). `ChatEnv`
holds what multi-turn environments share: turn bookkeeping, the trajectory, scoring, and
`continuation`, the tokens the template puts between a model turn and the next one.

A turn is well formed when it ends with one of the tokenizer's stop tokens (the sampler stops
there). A turn that does not (it hit `max_turn_tokens`, or the sampler stopped for its own
reasons) ends the episode unanswered: correctness 0, and `info["truncated"]` says why, so the
loop can also filter such samples.

Images: a message content may be a list of parts (`{"type": "text", "text"}`, `{"type": "image",
"image": path}`, the record convention). `messages` keeps them as they are; `images` lists the
episode's image paths in the order they appear; `image_part`, when given, turns each image part
into what the tokenizer takes (the data layer's `{"type": "image", "num_patches": n}`) before
`encode_chat`, so the image tokens of `tokens` are the images of `images`, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Step, Task, Trajectory
from posttrain.rl.reward import RewardFunction, compose
from posttrain.rl.verifiers.base import Verdict


def continuation(tok: Tokenizer, messages: list[dict], new: list[dict]) -> list[int]:
    """Tokens that follow the stop token ending the last (assistant) message of `messages`
    when the `new` messages come next and the model's next turn starts.

    That is what the chat template writes after the model's stop token (e.g. a newline), the
    new messages, and the generation prompt. Requires a template that renders a conversation's
    prefix as a prefix of the whole (the data layer needs the same for loss masks).
    """
    before, _ = tok.encode_chat(messages)
    after, _ = tok.encode_chat(messages + new, add_generation_prompt=True)
    if after[: len(before)] != before:
        raise ValueError(
            "the chat template renders the conversation differently when "
            f"{[m['role'] for m in new]} messages follow, so turns cannot be appended as tokens"
        )
    stops = [i for i, t in enumerate(before) if t in tok.stop_ids]
    if not stops:
        raise ValueError(f"the chat template ends an assistant turn with none of the stop tokens {tok.stop_ids}")
    return before[stops[-1] + 1 :] + after[len(before) :]


class ChatEnv:
    """Shared machinery of chat environments (see module docstring); subclasses define `step`.

    tok: the tokenizer whose chat template frames the turns; reward_fn: scores the final answer
    (its verifiers decide the task types this env accepts); max_turn_tokens: the most tokens
    the model may generate in one turn (pass it to the sampler as its max new tokens);
    system_prompt: an optional system message before the task's prompt; image_part: how an image
    part reaches the tokenizer (module docstring; None: as it is).
    """

    max_turns = 1

    def __init__(
        self,
        tok: Tokenizer,
        reward_fn: RewardFunction,
        *,
        max_turn_tokens: int,
        system_prompt: str | None = None,
        image_part: Callable[[dict], dict] | None = None,
    ) -> None:
        if max_turn_tokens <= 0:
            raise ValueError(f"max_turn_tokens must be positive, got {max_turn_tokens}")
        self.tok = tok
        self.reward_fn = reward_fn
        self.max_turn_tokens = max_turn_tokens
        self.system_prompt = system_prompt
        self.image_part = image_part
        self._task: Task | None = None
        self._traj: Trajectory | None = None
        self._messages: list[dict] = []
        self._done = False

    def reset(self, task: Task) -> list[int]:
        """Start an episode on `task`; returns the prompt tokens (ending with the generation prompt)."""
        self._check_target(task)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self._messages = system + list(task.prompt)
        ids, _ = self.tok.encode_chat(self._for_tokenizer(self._messages), add_generation_prompt=True)
        self._task, self._done = task, False
        self._traj = Trajectory(
            task.id,
            list(ids),
            [False] * len(ids),
            len(ids),
            info={"tool_calls": 0, "invalid_tool_calls": 0, "truncated": None},
        )
        return list(ids)

    def _for_tokenizer(self, messages: list[dict]) -> list[dict]:
        """`messages` with each image part through `image_part` (as they are without one)."""
        if self.image_part is None:
            return messages
        convert = lambda p: self.image_part(p) if isinstance(p, dict) and p.get("type") == "image" else p  # noqa: E731
        return [
            {**m, "content": [convert(p) for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in messages
        ]

    def _continuation(self, new: list[dict]) -> list[int]:
        """`continuation` of the episode's messages by `new` (image parts as the tokenizer takes them)."""
        return continuation(self.tok, self._for_tokenizer(self._messages), self._for_tokenizer(new))

    def _observe(self, message: dict) -> list[int]:
        """Answer the model's turn with `message` (a tool output, the next screen): its tokens
        (`_continuation`) join the trajectory as not generated and it joins the conversation;
        returns those tokens, the observation of the step."""
        observation = self._continuation([message])
        self._messages.append(message)
        self._traj.extend(observation, generated=False)
        return observation

    @property
    def images(self) -> list[str]:
        """The image paths of the episode's messages, in the order they appear (and their tokens do)."""
        return [
            p["image"]
            for m in self._messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if isinstance(p, dict) and p.get("type") == "image"
        ]

    @property
    def messages(self) -> list[dict]:
        """The episode's conversation so far (system, prompt, model turns, tool messages): e.g. a
        scripted episode written out as SFT data."""
        return [dict(m) for m in self._messages]

    def _check_target(self, task: Task) -> None:
        """Raise TypeError unless this env can score `task` (its reward function has a verifier for it)."""
        if type(task.target) not in self.reward_fn.verifiers:
            raise TypeError(
                f"task {task.id!r}: the reward function has no verifier for "
                f"{type(task.target).__name__}; known: {[t.__name__ for t in self.reward_fn.verifiers]}"
            )

    def trajectory(self) -> Trajectory:
        """The current episode's trajectory (complete once `step` returned done)."""
        if self._traj is None:
            raise RuntimeError(f"{type(self).__name__}.trajectory() before reset()")
        return self._traj

    def _take(self, action: Sequence[int]) -> tuple[str, str | None]:
        """Record the model's turn (cut to the token budget); returns its text and, when the
        turn did not end with a stop token, why (`"turn_tokens"` or `"no_stop"`)."""
        if self._traj is None or self._done:
            raise RuntimeError(
                f"{type(self).__name__}.step() needs reset() first (episode {'over' if self._done else 'not started'})"
            )
        kept = [int(t) for t in action[: self.max_turn_tokens]]
        stops = [i for i, t in enumerate(kept) if t in self.tok.stop_ids]
        if stops and stops[0] != len(kept) - 1:
            raise ValueError(
                f"action has a stop token at position {stops[0]} of {len(kept)}: a turn "
                "must end at its first stop token"
            )
        self._traj.extend(kept, generated=True)
        self._traj.turns += 1
        text = self.tok.decode(kept)
        self._messages.append({"role": "assistant", "content": text})
        if stops:
            return text, None
        return text, "turn_tokens" if len(action) >= self.max_turn_tokens else "no_stop"

    def _finish(self, answer: str, *, truncated: str | None = None, verdict: Verdict | None = None) -> Step:
        """End the episode: score `answer` (or take the env's own `verdict`; correctness 0 when
        truncated) with the episode's tool-call counts, and store the reward in the trajectory."""
        traj, info = self._traj, self._traj.info
        kw: dict[str, Any] = {
            "num_tokens": traj.num_generated,
            "tool_calls": info["tool_calls"],
            "invalid_tool_calls": info["invalid_tool_calls"],
            "redundant_tool_calls": info.get("redundant_tool_calls", 0),
        }
        if truncated is not None:
            verdict = Verdict(0.0, False, f"truncated: {truncated}")
        if verdict is None:
            reward = self.reward_fn.verify(self._task.target, answer, **kw)
        else:
            reward = compose(verdict, self.reward_fn.config, **kw)
        info["truncated"] = truncated
        traj.reward, self._done = reward, True
        return Step([], reward, True, dict(info))


class SingleTurnEnv(ChatEnv):
    """One model turn, whose text is the answer (math: the final answer; code: a fenced block)."""

    def step(self, action: list[int]) -> Step:
        """Record the model's answer and score it; the episode is done."""
        text, truncated = self._take(action)
        return self._finish(text, truncated=truncated)
