"""RLVR across processes (hosts): groups are process-local by construction.

Every process runs the same task scheduler (same seed, same records), so all draw the same tasks.
Sampling is one program on the global mesh over every drawn prompt; its outputs reach every
process (`sampling.generate.host_outputs`). Process p then keeps a contiguous share of the groups
— all G samples of a prompt live on one process — and verifies and scores only those on its own
verifier pool, so verification scales with hosts. Group statistics (GRPO baselines) therefore
never cross hosts; the learner batch is the concatenation of the processes' rows
(`put_batch`). What does cross hosts is small host data, exchanged as JSON: every group's rewards
(so each scheduler records all groups and the schedulers stay identical), rewards and rollout
info for metrics, and held-out evaluation results. With `rl.minibatches > 1` each minibatch takes
a share of every process's rows (the learner permutes each process's rows with the same seed), so
the minibatches differ from a single-process run's; with one minibatch (the default) the losses
are the same.

Not supported with several processes (refused at start, naming the key): dynamic sampling
(`rl.filter_groups`: kept groups would be spread unevenly over processes), the overlapped producer
(`rl.max_staleness > 0`, except where sampler groups sample: `rl.placement = disaggregated`), a
learned reward model (`rl.reward_model`) and PPO with a critic
(`rl.advantage = "gae"`: its whitening is a batch-wide statistic), and trajectory dumps
(`rl.rollouts_every`: process 0 would write only its own groups). Multi-turn episodes
(`rl.env = "tool"`, and stage eval's `repo_fix`) run across processes: each process steps its
share's environments and the observations are exchanged after every turn (`episodes.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from posttrain.errors import UserError
from posttrain.parallel import allgather_json


def group_share(num_groups: int, *, exact: bool) -> slice:
    """This process's contiguous share of `num_groups` groups. With `exact` (training batches)
    every process must get as many; otherwise (evaluation) the first ones get one more."""
    n, i = jax.process_count(), jax.process_index()
    if exact and num_groups % n:
        raise ValueError(f"{num_groups} groups cannot be split evenly over {n} processes")
    bounds = (
        np.linspace(0, num_groups, n + 1).round().astype(int) if not exact else np.arange(n + 1) * (num_groups // n)
    )
    return slice(int(bounds[i]), int(bounds[i + 1]))


def check_multihost_rl(cfg) -> None:
    """Refuse, naming the key, what RLVR cannot do across several processes (module docstring)."""
    n, r = jax.process_count(), cfg.rl
    if n == 1:
        return
    refused = {
        "rl.filter_groups": bool(r.filter_groups),
        "rl.max_staleness": r.max_staleness > 0 and r.placement != "disaggregated",  # (no producer thread there)
        "rl.reward_model": bool(r.reward_model),
        "rl.advantage": r.advantage == "gae",
        "rl.rollouts_every": r.rollouts_every > 0,
    }
    for key, bad in refused.items():
        if bad:
            raise UserError(
                f"{key}={getattr(r, key.split('.')[1])!r} is not supported with {n} processes (see posttrain/rl/"
                "hosts.py); run it in one process or change the key",
                key=key,
            )
    if r.prompts_per_step % n:
        raise UserError(
            f"rl.prompts_per_step={r.prompts_per_step}: with {n} processes each holds whole groups; "
            f"use a multiple of {n}",
            key="rl.prompts_per_step",
        )


def all_group_rewards(groups: list) -> list[tuple[str, str, list[float | None]]]:
    """(domain, task id, rewards) of every process's groups, in process order (global task order);
    None for a sample without a verdict (`Group.verdicts`), which the scheduler does not count."""
    mine = [[g.domain, g.task.id, [None if x is None else float(x) for x in g.verdicts]] for g in groups]
    return [tuple(row) for part in allgather_json(mine) for row in part]


def all_rewards(groups: list) -> list[list[float]]:
    """The rewards of every process's groups, in process order (global task order)."""
    mine = [[float(x) for x in g.rewards] for g in groups]
    return [row for part in allgather_json(mine) for row in part]


def all_values(values: np.ndarray) -> np.ndarray:
    """Every process's 1-D `values`, concatenated in process order."""
    if jax.process_count() == 1:
        return np.asarray(values)
    return np.asarray([x for part in allgather_json(np.asarray(values, np.float64).tolist()) for x in part])


# rate -> (numerator, denominator): rates of counts (e.g. of multi-turn episodes) recomputed from the
# counts once these are summed over sampling rounds and processes
RATIOS = {
    "tool_success_rate": ("episodes_solved", "responses"),
    "turns_per_episode": ("episode_turns", "responses"),
    "calls_per_turn": ("episode_calls", "episode_turns"),
    "tool_call_ok_rate": ("episode_calls_ok", "episode_calls"),
    "invalid_call_rate": ("episode_calls_invalid", "episode_calls"),
}


def ratios(info: dict[str, Any]) -> dict[str, float]:
    """The `RATIOS` whose counts `info` holds (0 where the denominator is 0)."""
    return {
        k: info[num] / info[den] if info[den] else 0.0
        for k, (num, den) in RATIOS.items()
        if num in info and den in info
    }


def combine_info(info: dict[str, Any], summed: tuple[str, ...]) -> dict[str, Any]:
    """Rollout info of every process as one: `summed` keys added, `*_max` the max, means weighted
    by each process's responses, `RATIOS` recomputed from their summed counts, anything else
    process 0's."""
    if jax.process_count() == 1:
        return {**info, **ratios(info)}
    parts = allgather_json(info)
    weights = np.asarray([p.get("responses", 1) for p in parts], np.float64)
    out = dict(parts[0])
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k in summed:
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith(("_mean", "_frac")):
            out[k] = float(np.average(vals, weights=weights)) if weights.sum() else vals[0]
    return {**out, **ratios(out)}


SAMPLED_REWARD_KEYS = ("sampled_judged", "sampled_reward_sum", "sampled_reward_sq_sum")


def combine_rounds(infos: list[dict[str, Any]], summed: tuple[str, ...]) -> dict[str, Any]:
    """The rollout info of several sampling rounds of one batch (dynamic sampling) as one, so it
    describes every round: `summed` keys and times (`*_s`) added, `*_max` the max, means and
    fractions (`*_mean`, `*_frac`) weighted by each round's responses (`env_frac` recomputed from
    the summed times), anything else the last round's."""
    if len(infos) <= 1:
        return dict(infos[0]) if infos else {}
    weights = np.asarray([i.get("responses", 1) for i in infos], np.float64)
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for i in infos for k in i):
        vals = [i[k] for i in infos if k in i]
        if k in summed or k.endswith("_s"):
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith(("_mean", "_frac")):
            w = np.asarray([wt for i, wt in zip(infos, weights) if k in i])
            out[k] = float(np.average(vals, weights=w)) if w.sum() else vals[-1]
        else:
            out[k] = vals[-1]
    if "env_frac" in out and "model_s" in out and "env_s" in out:
        out["env_frac"] = out["env_s"] / max(out["model_s"] + out["env_s"], 1e-9)
    return out


def sampled_rewards(groups: list) -> dict[str, float]:
    """Counts for the reward of every sampled group (kept or not, over all rounds): the samples
    with a verdict, their rewards' sum and sum of squares (`SAMPLED_REWARD_KEYS`, summed over
    processes; `sampled_reward_stats` turns them into a mean and std)."""
    judged = np.asarray([x for g in groups for x in g.verdicts if x is not None], np.float64)
    return dict(zip(SAMPLED_REWARD_KEYS, (float(judged.size), float(judged.sum()), float((judged**2).sum()))))


def sampled_reward_stats(info: dict[str, Any], scale: float = 1.0) -> dict[str, float]:
    """`rl/reward_mean` and `rl/reward_std` of every sampled group from `sampled_rewards`' counts
    (popped from `info`), times `scale` (rl.verifier_weight: the reward trained on)."""
    n, total, sq = (info.pop(k, 0.0) for k in SAMPLED_REWARD_KEYS)
    if not n:
        return {}
    mean = total / n
    return {"rl/reward_mean": scale * mean, "rl/reward_std": abs(scale) * max(sq / n - mean * mean, 0.0) ** 0.5}
