"""Multi-turn rollouts (`rl.env = "tool"`): episodes batched across the sampler, turn by turn.

Each round, one sampler call (`RolloutWorker.sample`) continues every unfinished episode of the
batch (their contexts, of different lengths after different tool outputs, are simply prompts of
different lengths; finished episodes drop out of the batch). With `sampling.continuous_batching`
that call runs the round's contexts as requests through continuously refilled slots, so within a
round one long turn holds one slot, not the whole batch; the samples are the same as static
batching's (same RNG ids: the context's index in the round, key fold_in(key, round)). Not done:
interleaving *across* rounds: an episode's next turn waits for its round to end (the environment
steps run on the host between two device programs), so a round still lasts as long as its longest
turn. After each round the environments step on the worker's thread pool (tool calls wait on
sandboxes, not the GIL) and append the tool output. The behaviour log-prob of every model token is recorded at its position
in the episode's token row, turn by turn (0 on prompt and environment tokens), so the learner's
`rl_batch` sees the same [tokens, loss_mask, behav_logp] layout as for single-turn samples: the
loss mask is True exactly on the model's tokens (`Trajectory.loss_mask`).

Metrics (`info`, logged by the loop as `rl/...`, and by evaluation): `tool_success_rate` (the
fraction of episodes whose final check passed, i.e. correctness 1), `turns_per_episode`,
`calls_per_turn`, `tool_call_ok_rate` (calls that ran and exited 0), `invalid_call_rate`,
`model_s` / `env_s` (wall seconds in sampler calls / in environment steps) and `env_frac`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from posttrain.rl.rollout import RolloutBatch, RolloutWorker
from posttrain.rl.scheduler import Group


def rollout_episodes(worker: RolloutWorker, params, rest, tasks: list[tuple[str, object]], key, *,
                     num_samples: int | None = None, greedy: bool = False) -> RolloutBatch:
    """Run `num_samples` episodes of each (domain, task) to the end with the given weights and
    return them as verified groups (rewards from the environments' final checks)."""
    g = num_samples or worker.sampling.num_samples
    sampling = dataclasses.replace(worker.sampling, num_samples=1, **({"temperature": 0.0} if greedy else {}))
    envs = [worker.domains[d].make_env() for d, _ in tasks for _ in range(g)]
    for env, (_, task) in zip(envs, [dt for dt in tasks for _ in range(g)]):
        env.reset(task)
    behav = [[0.0] * len(env.trajectory().tokens) for env in envs]
    active, model_s, env_s, turn = list(range(len(envs))), 0.0, 0.0, 0
    while active:
        t0 = time.perf_counter()
        samples = worker.sample(params, rest, [envs[i].trajectory().tokens for i in active], sampling,
                                jax.random.fold_in(key, turn))
        t1 = time.perf_counter()
        actions = [samples.completion(j) for j in range(len(active))]
        steps = list(worker.pool.map(lambda i, a: envs[i].step(a), active, actions))
        env_s += time.perf_counter() - t1
        model_s += t1 - t0
        for j, (i, step) in enumerate(zip(active, steps)):
            behav[i] += samples.sampling_logprobs[j, :len(actions[j])].tolist() + [0.0] * len(step.observation)
            if len(behav[i]) != len(envs[i].trajectory().tokens):
                raise RuntimeError(f"episode {i}: {len(behav[i])} log-probs for {len(envs[i].trajectory().tokens)} "
                                   "tokens (the environment must keep a turn's tokens as sampled)")
        active = [i for i, s in zip(active, steps) if not s.done]
        turn += 1
    return _as_batch(tasks, g, envs, behav, model_s, env_s)


def _as_batch(tasks, g: int, envs: list, behav: list[list[float]], model_s: float, env_s: float) -> RolloutBatch:
    """The finished episodes as groups of `g`, with the episode metrics."""
    trajs = [env.trajectory() for env in envs]
    groups = [Group(d, task, [t.reward.score for t in trajs[j * g:(j + 1) * g]], trajs[j * g:(j + 1) * g])
              for j, (d, task) in enumerate(tasks)]
    lengths = np.array([t.num_generated for t in trajs])
    turns = sum(t.turns for t in trajs)
    calls = sum(t.info.get("tool_calls", 0) for t in trajs)
    info = {"gen_s": model_s, "verify_s": env_s, "model_s": model_s, "env_s": env_s,
            "env_frac": env_s / max(model_s + env_s, 1e-9),
            "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
            "truncated_frac": float(np.mean([t.info.get("truncated") is not None for t in trajs])),
            "new_tokens": int(lengths.sum()), "responses": len(trajs),
            "verifier_errors": sum(t.reward.error is not None for t in trajs),
            "tool_success_rate": float(np.mean([t.reward.parts["correct"] >= 1.0 for t in trajs])),
            "turns_per_episode": turns / len(trajs), "calls_per_turn": calls / max(turns, 1),
            "tool_call_ok_rate": sum(t.info.get("tool_ok", 0) for t in trajs) / max(calls, 1),
            "invalid_call_rate": sum(t.info.get("invalid_tool_calls", 0) for t in trajs) / max(calls, 1)}
    return RolloutBatch(groups, [[np.asarray(b, np.float32) for b in behav[j * g:(j + 1) * g]]
                                 for j in range(len(tasks))], info)
