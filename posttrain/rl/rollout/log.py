"""Trajectories kept: a sampled fraction of every n-th batch's rollouts, as JSONL, for spot checks
of what the policy is being paid for (reward hacking shows up in the text long before the curves).

`{workdir}/rollouts/{step:07d}.jsonl`, one strict-JSON object per sampled response: step, the policy
version that sampled it, domain, task id and difficulty, prompt and response text, reward with its
parts (and the verifier's own named parts), the verifier's error if any, why the turn was cut
(`truncated`), model turns and tokens. Written by process 0 only; which samples are kept depends
only on (seed, step), so a resumed run writes the same file again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain import storage
from posttrain.rl.rollout.buffer import Rollout


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: such numbers become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


class RolloutLog:
    """Writes `fraction` of the samples of every `every`-th step (see module docstring)."""

    def __init__(self, workdir: str, tok, *, every: int, fraction: float, seed: int, enabled: bool = True) -> None:
        if every < 1 or not 0 < fraction <= 1:
            raise ValueError(f"rollout log: every={every} must be >= 1 and fraction={fraction} in (0, 1]")
        self.dir = storage.join(workdir, "rollouts")
        self.tok, self.every, self.fraction, self.seed, self.enabled = tok, every, fraction, seed, enabled

    def records(self, step: int, rollouts: Sequence[Rollout]) -> list[dict]:
        """The sampled records of one step's rollouts."""
        samples = [(ro, g, t) for ro in rollouts for g, t in enumerate(ro.group.trajectories)]
        if not samples:
            return []
        keep = max(1, round(self.fraction * len(samples)))
        picked = np.sort(np.random.default_rng([self.seed, step]).choice(len(samples), keep, replace=False))
        out = []
        for i in picked:
            ro, g, traj = samples[i]
            reward = traj.reward
            out.append(
                _finite(
                    {
                        "step": step,
                        "policy_version": ro.version,
                        "domain": ro.group.domain,
                        "task_id": traj.task_id,
                        "difficulty": getattr(ro.group.task, "difficulty", None),
                        "sample": g,
                        "prompt": self.tok.decode(traj.tokens[: traj.prompt_len]),
                        "response": self.tok.decode(traj.tokens[traj.prompt_len :]),
                        "reward": float(ro.group.rewards[g]),
                        "parts": dict(reward.parts) if reward else {},
                        "verifier_parts": dict(reward.verifier_parts) if reward else {},
                        "error": reward.error if reward else None,
                        "truncated": traj.info.get("truncated"),
                        "turns": traj.turns,
                        "num_tokens": traj.num_generated,
                    }
                )
            )
        return out

    def write(self, step: int, rollouts: Sequence[Rollout]) -> str | None:
        """Write step `step`'s sampled rollouts when it is due; returns the file written (or None)."""
        if not self.enabled or step % self.every:
            return None
        storage.makedirs(self.dir)
        path = storage.join(self.dir, f"{step:07d}.jsonl")
        text = "".join(
            json.dumps(rec, allow_nan=False, ensure_ascii=False) + "\n" for rec in self.records(step, rollouts)
        )
        if storage.is_url(path):  # an object appears whole when its upload completes
            storage.write_text(path, text)
        else:
            storage.write_text(path + ".tmp", text)
            storage.replace(path + ".tmp", path)
        return path
