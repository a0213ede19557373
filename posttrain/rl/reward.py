"""Reward composition: correctness from a verifier plus format, length and tool-call shaping.

score = correct_weight * correct + format + length + tool_calls, every term reported in
`Reward.parts` so that metrics can show what the policy is being paid for. The score is what the
learner is paid; whether the answer is right is `Reward.correct`, the verifier's unweighted
correctness, which accuracy, pass@k and the gates count (a right answer in the overlong ramp, or
with a redundant tool call, is still right). The length term
is DAPO's soft overlong punishment: 0 up to max_tokens - overlong_buffer, then a linear ramp
down to -1 at max_tokens, and -1 past it (times overlong_penalty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

from posttrain.rl.verifiers.base import Verdict, Verifier
from posttrain.rl.verifiers.code import CodeTask, CodeVerifier
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from posttrain.sandbox import Sandbox


@dataclasses.dataclass(frozen=True)
class Reward:
    """Total reward of one response and its parts (they sum to score); `error` says why the
    verifier could not decide (failed, timed out) — such a reward is not a judgement of the
    response and is counted apart (`rl/verifier_errors`). `verifier_parts` are the named numbers
    the verifier reported beside correctness (not added to the score). `correct` is the verdict's
    correctness in [0, 1], unweighted and without shaping: what accuracy counts (1 = solved);
    when not given, `parts["correct"]`."""

    score: float
    parts: dict[str, float]
    error: str | None = None
    verifier_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    correct: float | None = None

    def __post_init__(self) -> None:
        if self.correct is None:
            object.__setattr__(self, "correct", float(self.parts.get("correct", 0.0)))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward parts; a zero penalty switches its part off (it stays 0)."""

    correct_weight: float = 1.0
    format_penalty: float = 0.0  # subtracted when the answer is not in the expected format
    max_tokens: int | None = None  # L_max of DAPO overlong shaping; None: no length part
    overlong_buffer: int = 0  # L_cache: length of the ramp before max_tokens
    overlong_penalty: float = 1.0  # scale of the length part (its minimum is -overlong_penalty)
    invalid_tool_call_penalty: float = 0.0  # per malformed / failed tool call
    max_tool_calls: int | None = None  # calls beyond this cost excess_tool_call_penalty each
    excess_tool_call_penalty: float = 0.0
    redundant_tool_call_penalty: float = 0.0  # per call repeating an earlier one on an unchanged state

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not 0 <= self.overlong_buffer < self.max_tokens:
            raise ValueError(
                f"RewardConfig.overlong_buffer must be in [0, max_tokens={self.max_tokens}), got {self.overlong_buffer}"
            )
        for name in (
            "format_penalty",
            "overlong_penalty",
            "invalid_tool_call_penalty",
            "excess_tool_call_penalty",
            "redundant_tool_call_penalty",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"RewardConfig.{name} is a penalty size and must be >= 0, got {getattr(self, name)}")


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment in [-1, 0]: 0 while num_tokens <= max_tokens - buffer,
    then (max_tokens - buffer - num_tokens) / buffer, and -1 beyond max_tokens."""
    if num_tokens > max_tokens:
        return -1.0
    start = max_tokens - buffer
    return 0.0 if num_tokens <= start else (start - num_tokens) / buffer


class Usage(TypedDict, total=False):
    """What a response spent, for the shaping terms of `compose` (its defaults where left out)."""

    num_tokens: int | None
    tool_calls: int
    invalid_tool_calls: int
    redundant_tool_calls: int


def compose(
    verdict: Verdict,
    config: RewardConfig,
    *,
    num_tokens: int | None = None,
    tool_calls: int = 0,
    invalid_tool_calls: int = 0,
    redundant_tool_calls: int = 0,
) -> Reward:
    """Combine a verifier's verdict with the shaping terms of `config` into a Reward."""
    if config.max_tokens is not None and num_tokens is None:
        raise ValueError("RewardConfig.max_tokens is set, so num_tokens (response length in tokens) is required")
    length = 0.0
    if config.max_tokens is not None:
        length = config.overlong_penalty * overlong_penalty(num_tokens, config.max_tokens, config.overlong_buffer)
    excess = max(0, tool_calls - config.max_tool_calls) if config.max_tool_calls is not None else 0
    tools = (
        config.invalid_tool_call_penalty * invalid_tool_calls
        + config.excess_tool_call_penalty * excess
        + config.redundant_tool_call_penalty * redundant_tool_calls
    )
    parts = {
        "correct": config.correct_weight * verdict.correct,
        "format": 0.0 if verdict.format_ok or not config.format_penalty else -config.format_penalty,
        "length": length,
        "tool_calls": -tools if tools else 0.0,
    }
    return Reward(
        score=sum(parts.values()),
        parts=parts,
        error=verdict.error,
        verifier_parts=dict(verdict.parts),
        correct=float(verdict.correct),
    )


class RewardFunction:
    """Scores responses to tasks of several domains: `verifiers` maps a task type (MathTask,
    CodeTask, ...) to the Verifier for it; `config` sets the shaping."""

    def __init__(self, verifiers: Mapping[type, Verifier], config: RewardConfig = RewardConfig()) -> None:
        self.verifiers = dict(verifiers)
        self.config = config

    def _verifier(self, task: Any) -> Verifier:
        try:
            return self.verifiers[type(task)]
        except KeyError:
            raise TypeError(
                f"no verifier for task type {type(task).__name__}; known: {[t.__name__ for t in self.verifiers]}"
            ) from None

    def verify(self, task: Any, response: str, **usage: Unpack[Usage]) -> Reward:
        """Reward of one response; `usage` as for `compose`."""
        return compose(self._verifier(task).verify(task, response), self.config, **usage)

    def verify_many(
        self,
        tasks: Sequence[Any],
        responses: Sequence[str],
        *,
        num_tokens: Sequence[int] | None = None,
        tool_calls: Sequence[int] | None = None,
        invalid_tool_calls: Sequence[int] | None = None,
    ) -> list[Reward]:
        """Rewards of many responses; each domain's verifier gets its responses in one call
        (so code runs concurrently on the sandbox pool). Results in input order."""
        n = len(tasks)
        for name, seq in (
            ("responses", responses),
            ("num_tokens", num_tokens),
            ("tool_calls", tool_calls),
            ("invalid_tool_calls", invalid_tool_calls),
        ):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{n} tasks but {len(seq)} {name}")
        verdicts: list[Verdict | None] = [None] * n
        by_type: dict[type, list[int]] = {}
        for i, task in enumerate(tasks):
            by_type.setdefault(type(task), []).append(i)
        for idx in by_type.values():
            found = self._verifier(tasks[idx[0]]).verify_many([tasks[i] for i in idx], [responses[i] for i in idx])
            for i, verdict in zip(idx, found):
                verdicts[i] = verdict
        return [
            compose(
                v,
                self.config,
                num_tokens=None if num_tokens is None else num_tokens[i],
                tool_calls=0 if tool_calls is None else tool_calls[i],
                invalid_tool_calls=0 if invalid_tool_calls is None else invalid_tool_calls[i],
            )
            for i, v in enumerate(verdicts)
        ]


def default_reward_function(config: RewardConfig = RewardConfig(), sandbox: Sandbox | None = None) -> RewardFunction:
    """Math answers (MathVerifier) and code with tests (CodeVerifier on `sandbox`, a new
    Sandbox by default)."""
    return RewardFunction({MathTask: MathVerifier(), CodeTask: CodeVerifier(sandbox)}, config)
