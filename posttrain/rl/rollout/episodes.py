"""Multi-turn rollouts (`rl.env = "tool"`): episodes batched across the sampler, turn by turn,
in cohorts whose environment steps overlap the other cohorts' sampling.

The episodes of a batch (episode i = sample i % G of task i // G) are split into C fixed cohorts
(`rl.episode_cohorts`), round-robin by episode index: cohort c holds episodes c, c + C, c + 2C, ...
(a group's samples may be spread over cohorts; the batch is assembled in episode order, so groups
are whole). A cohort's turn is one sampler call (`RolloutWorker.sample`) continuing every
unfinished episode of the cohort (their contexts, of different lengths after different tool
outputs, are simply prompts of different lengths; finished episodes drop out), then its
environment steps, submitted to the worker's thread pool (tool calls wait on sandboxes, not the
GIL), which append the tool output. The cohorts take turns in a fixed order 0, 1, ..., C-1, 0, ...:
before its next sampler call a cohort waits for its own environment steps, so while cohort k's
steps run on the host the sampler runs the next cohort's turn on the device, and episodes of
different cohorts, at different turns, share the device in turn. With C = 1 this is the lockstep
of rounds: one sampler call for every unfinished episode, then all environment steps.

How samples are keyed (so the same seed gives the same episodes on every run, whatever the
timing, and a resumed run reproduces the uninterrupted one): cohort c's t-th sampler call draws
from fold_in(key, t * C + c), and within it row j (the cohort's j-th unfinished episode, in
episode order) from fold_in(that, j), as every sampler call keys its rows. The call order is fixed
too (the same on every process of a multi-process mesh). With C = 1 the keys are those of the
rounds, fold_in(key, turn). With `sampling.continuous_batching` each call runs its contexts as
requests through continuously refilled slots (same samples as static batching), so within a call
one long turn holds one slot, not the whole batch; the prefix cache serves each call as any other.

Several processes (`hosts.py`): every sampler call is one program on the global mesh over every
episode's context, so every process must hold the same contexts. Process p runs the environments
of its own share of the tasks only (`hosts.group_share`: all G episodes of a task on one
process, as many tasks on each when their count divides evenly, as training's
`rl.prompts_per_step` must); after each cohort turn the processes exchange their episodes'
observations and done flags (`allgather_json`, in the fixed cohort order), so each extends every
context alike, and p returns its share's groups.

The behaviour log-prob of every model token is recorded at its position in the episode's token
row, turn by turn (0 on prompt and environment tokens), so the learner's `rl_batch` sees the same
[tokens, loss_mask, behav_logp] layout as for single-turn samples: the loss mask is True exactly
on the model's tokens (`Trajectory.loss_mask`).

Metrics (`info`, logged by the loop as `rl/...`, and by evaluation): `tool_success_rate` (the
fraction of episodes whose final check passed, i.e. correctness 1), `turns_per_episode`,
`calls_per_turn`, `tool_call_ok_rate` (calls that ran and exited 0), `invalid_call_rate`,
`model_s` (wall seconds in sampler calls, summed), `env_s` (wall seconds of each cohort turn's
environment steps, first start to last end, summed), `env_frac` = env_s / (model_s + env_s), and
`episodes_s`, the wall time of the whole batch: with C > 1 the overlap shows as
episodes_s < model_s + env_s. The rates come with their counts (`episode_turns`, `episode_calls`,
...), so that over sampling rounds and processes they are recomputed from the summed counts
(`hosts.combine_info`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from posttrain.parallel import allgather_json
from posttrain.rl.envs.images import episode_patches
from posttrain.rl.rollout.hosts import group_share, ratios
from posttrain.rl.rollout.worker import RolloutBatch, RolloutWorker, with_patches
from posttrain.rl.tasks.scheduler import Group
from posttrain.sampling.generate import Samples
from posttrain.sampling.rules import SamplingParams


@dataclasses.dataclass
class Cohort:
    """A fixed set of a batch's episodes that share sampler calls, turn by turn."""

    index: int
    active: list[int]  # unfinished episodes, in episode order
    turn: int = 0  # sampler calls made so far
    samples: Samples | None = None  # the last call's samples, while its steps run
    actions: list[list[int]] | None = None  # their completions (the actions stepped)
    steps: dict[int, concurrent.futures.Future] | None = None  # this process's environment steps of that call


@dataclasses.dataclass
class Episodes:
    """The episodes of one batch: the token context of every episode (on every process), and the
    environments and behaviour log-probs of this process's share."""

    contexts: list[list[int]]
    envs: dict[int, object]
    behav: dict[int, list[float]]
    times: dict[str, float]


def rollout_episodes(
    worker: RolloutWorker,
    params,
    rest,
    tasks: list[tuple[str, object]],
    key,
    sampling: SamplingParams | None = None,
    *,
    cohorts: int = 1,
) -> RolloutBatch:
    """Run `sampling.num_samples` episodes of each (domain, task) to the end with the given weights
    and `sampling` (None: the worker's; `RolloutWorker.group_sampling`), in `cohorts` pipelined
    cohorts (module docstring), and return this process's share of them as verified groups
    (rewards from the environments' final checks)."""
    if cohorts < 1:
        raise ValueError(f"rl.episode_cohorts={cohorts}: expected >= 1")
    t_start = time.perf_counter()
    g = (sampling or worker.sampling).num_samples
    sampling = dataclasses.replace(sampling or worker.sampling, num_samples=1)
    share = group_share(len(tasks), exact=False)
    envs = {i: worker.domains[tasks[i // g][0]].make_env() for i in range(share.start * g, share.stop * g)}
    prompts = [[i, [int(t) for t in env.reset(tasks[i // g][1])]] for i, env in envs.items()]
    contexts = [list(p) for _, p in sorted(x for part in allgather_json(prompts) for x in part)]
    batch = Episodes(contexts, envs, {i: [0.0] * len(contexts[i]) for i in envs}, {"model_s": 0.0, "env_s": 0.0})
    live = [Cohort(c, list(range(c, len(contexts), cohorts))) for c in range(cohorts)]
    while live := [c for c in live if c.active]:
        for cohort in live:
            if cohort.steps is not None:
                _finish_steps(cohort, batch)
            if cohort.active:
                _start_turn(
                    worker, params, rest, cohort, batch, sampling, turn_key(key, cohort.index, cohort.turn, cohorts)
                )
    return _as_batch(
        tasks[share],
        g,
        [envs[i] for i in sorted(envs)],
        [batch.behav[i] for i in sorted(envs)],
        batch.times["model_s"],
        batch.times["env_s"],
        time.perf_counter() - t_start,
    )


def turn_key(key: jax.Array, cohort: int, turn: int, cohorts: int) -> jax.Array:
    """The key of cohort `cohort`'s `turn`-th sampler call out of `cohorts` cohorts (C = 1: the
    rounds' fold_in(key, turn)); row j of the call draws from fold_in(turn_key, j)."""
    return jax.random.fold_in(key, turn * cohorts + cohort)


def _start_turn(worker: RolloutWorker, params, rest, cohort: Cohort, batch: Episodes, sampling, key) -> None:
    """The cohort's next sampler call, then this process's environment steps of it submitted to the
    worker's pool."""
    t0 = time.perf_counter()
    contexts = [batch.contexts[i] for i in cohort.active]
    patches = [episode_patches(batch.envs[i], batch.contexts[i]) if i in batch.envs else None for i in cohort.active]
    images = {"patches": patches} if any(p is not None for p in patches) else {}  # text only: the call as before
    samples = worker.sample(params, rest, contexts, sampling, key, **images)
    batch.times["model_s"] += time.perf_counter() - t0

    def step(i: int, action: list[int]):
        t = time.perf_counter()
        return batch.envs[i].step(action), t, time.perf_counter()

    cohort.samples, cohort.turn = samples, cohort.turn + 1
    cohort.actions = [samples.completion(j) for j in range(len(cohort.active))]
    cohort.steps = {i: worker.pool.submit(step, i, a) for i, a in zip(cohort.active, cohort.actions) if i in batch.envs}


def _finish_steps(cohort: Cohort, batch: Episodes) -> None:
    """Wait for the cohort's environment steps, share their observations with every process (each
    steps only its own episodes' environments), extend the contexts, record the turn's behaviour
    log-probs at its tokens and drop the finished episodes."""
    results = {i: f.result() for i, f in cohort.steps.items()}
    if results:
        batch.times["env_s"] += max(r[2] for r in results.values()) - min(r[1] for r in results.values())
    mine = [[i, [int(t) for t in step.observation], bool(step.done)] for i, (step, _, _) in results.items()]
    stepped = {i: (obs, done) for part in allgather_json(mine) for i, obs, done in part}
    for j, i in enumerate(cohort.active):
        obs, _ = stepped[i]
        batch.contexts[i] = batch.contexts[i] + cohort.actions[j] + obs
        if i in batch.envs:
            batch.behav[i] += cohort.samples.sampling_logprobs[j, : len(cohort.actions[j])].tolist() + [0.0] * len(obs)
            if not len(batch.behav[i]) == len(batch.contexts[i]) == len(batch.envs[i].trajectory().tokens):
                raise RuntimeError(
                    f"episode {i}: {len(batch.behav[i])} log-probs for "
                    f"{len(batch.envs[i].trajectory().tokens)} tokens (the environment must keep a "
                    "turn's tokens as sampled)"
                )
    cohort.active = [i for i in cohort.active if not stepped[i][1]]
    cohort.samples, cohort.actions, cohort.steps = None, None, None


def _as_batch(
    tasks, g: int, envs: list, behav: list[list[float]], model_s: float, env_s: float, episodes_s: float
) -> RolloutBatch:
    """The finished episodes as groups of `g`, with the episode metrics."""
    trajs = [with_patches(env) for env in envs]
    groups = [
        Group(
            d,
            task,
            [t.reward.score for t in trajs[j * g : (j + 1) * g]],
            trajs[j * g : (j + 1) * g],
            [t.reward.correct for t in trajs[j * g : (j + 1) * g]],
        )
        for j, (d, task) in enumerate(tasks)
    ]
    lengths = np.array([t.num_generated for t in trajs])
    turns = sum(t.turns for t in trajs)
    calls = sum(t.info.get("tool_calls", 0) for t in trajs)
    info = {
        "gen_s": model_s,
        "verify_s": env_s,
        "model_s": model_s,
        "env_s": env_s,
        "env_frac": env_s / max(model_s + env_s, 1e-9),
        "episodes_s": episodes_s,
        # means of no episodes (an empty share) are 0: weighted by `responses` (0) across processes
        "response_len_mean": float(lengths.mean()) if trajs else 0.0,
        "response_len_max": int(lengths.max()) if trajs else 0,
        "truncated_frac": float(np.mean([t.info.get("truncated") is not None for t in trajs])) if trajs else 0.0,
        "new_tokens": int(lengths.sum()),
        "responses": len(trajs),
        "verifier_errors": sum(t.reward.error is not None for t in trajs),
        # counts, summed over processes and sampling rounds; the rates below are their ratios (hosts.RATIOS)
        "episodes_solved": sum(t.reward.correct >= 1.0 for t in trajs),
        "episode_turns": turns,
        "episode_calls": calls,
        "episode_calls_ok": sum(t.info.get("tool_ok", 0) for t in trajs),
        "episode_calls_invalid": sum(t.info.get("invalid_tool_calls", 0) for t in trajs),
    }
    info.update(ratios(info))
    return RolloutBatch(
        groups, [[np.asarray(b, np.float32) for b in behav[j * g : (j + 1) * g]] for j in range(len(tasks))], info
    )
