"""The overlapped RL producer without a model: a fake rollout worker, a task scheduler of ten
arithmetic tasks, and the producer over them on one device."""

import jax
import numpy as np

from posttrain.parallel import make_mesh, parse_rules
from posttrain.rl.envs import Task
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.rollout.producer import AsyncProducer
from posttrain.rl.rollout.worker import RolloutBatch
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.scheduler import Group, TaskScheduler
from posttrain.rl.verifiers import MathTask

TRAJ = Trajectory("t", [1, 2, 3], [False, True, True], 1)
LP = np.zeros(3, np.float32)


class VerifierCrashed(Exception):
    pass


class FakeWorker:
    """generate → the tasks; verify → groups of 2 samples with rewards (1, 0), or all equal."""

    def __init__(self, fail_at: int | None = None, informative: bool = True):
        self.fail_at, self.informative, self.verified = fail_at, informative, 0

    def generate(self, params, rest, tasks, key, **kw):
        return tasks

    def verify(self, tasks):
        if self.verified == self.fail_at:
            raise VerifierCrashed(f"verifier crashed on batch {self.verified}")
        self.verified += 1
        rewards = [1.0, 0.0] if self.informative else [0.0, 0.0]
        return RolloutBatch(
            [Group(d, t, rewards, [TRAJ, TRAJ]) for d, t in tasks], [[LP, LP]] * len(tasks), {"verifier_errors": 0}
        )

    def rollout(self, params, rest, tasks, key, **kw):
        return self.verify(self.generate(params, rest, tasks, key))


def scheduler():
    tasks = [Task(f"a{i}", ({"role": "user", "content": str(i)},), MathTask(str(i))) for i in range(10)]
    return TaskScheduler({"a": Domain("a", tasks, make_env=lambda: None)}, seed=0)


def producer(worker, sched, max_staleness=1, *, start=0, num_groups=2):
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])
    return AsyncProducer(
        worker,
        sched,
        num_groups=num_groups,
        max_staleness=max_staleness,
        base_key=jax.random.key(0),
        start=start,
        weights=(None, None),
        mesh=mesh,
        rules=parse_rules({}),
        poll_s=0.05,
    ).start()
