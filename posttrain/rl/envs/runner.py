"""Running episodes: one with a policy callable (scripted tests), or many in lockstep with a
batched sampler (the RL loop)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence

from posttrain.rl.envs.base import Env, Policy, Task, Trajectory

BatchPolicy = Callable[[list[list[int]]], list[list[int]]]  # contexts -> one turn of tokens each


def run_episodes(
    envs: Sequence[Env], tasks: Sequence[Task], sample: BatchPolicy, *, max_workers: int | None = None
) -> list[Trajectory]:
    """Run one episode per (env, task) in lockstep: each round, one `sample` call continues
    every unfinished episode (so the sampler batches them), then their environments step on a
    thread pool of `max_workers` (tool runs and code verification wait on sandboxes, not the
    GIL). Returns the trajectories in input order.

    max_workers=1 steps in the calling thread: math verification keeps its sympy timeouts only
    in the main thread (see verifiers/math.py); elsewhere only its input guard protects it.
    """
    if len(envs) != len(tasks):
        raise ValueError(f"{len(envs)} envs but {len(tasks)} tasks")
    if len(set(map(id, envs))) != len(envs):
        raise ValueError("run_episodes needs a separate env per episode (envs hold episode state)")
    for env, task in zip(envs, tasks):
        env.reset(task)
    workers = max_workers or min(32, max(1, len(envs)))
    active = list(range(len(envs)))
    with concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        step_all = pool.map if pool else map
        while active:
            actions = sample([list(envs[i].trajectory().tokens) for i in active])
            if len(actions) != len(active):
                raise ValueError(f"sampler returned {len(actions)} completions for {len(active)} contexts")
            steps = list(step_all(lambda i, a: envs[i].step(a), active, actions))
            active = [i for i, s in zip(active, steps) if not s.done]
            for i in active:
                if envs[i].trajectory().turns >= envs[i].max_turns:
                    raise RuntimeError(
                        f"{type(envs[i]).__name__} did not end task {tasks[i].id!r} "
                        f"after its max_turns={envs[i].max_turns}"
                    )
    return [env.trajectory() for env in envs]


def run_episode(env: Env, task: Task, policy: Policy) -> Trajectory:
    """One episode of `task` on `env` in the calling thread, `policy` called with the full
    context once per turn."""
    return run_episodes([env], [task], lambda contexts: [policy(c) for c in contexts], max_workers=1)[0]
