"""A sampler keeps its lease by progress, not by a beating thread (rl/rollout/liveness.py): a hung
generation or verifier lets the lease lapse, and the learner re-issues the batch."""

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import numpy as np

from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.reward import Reward
from posttrain.rl.rollout.liveness import Heartbeat, Progress
from posttrain.rl.rollout.worker import Pending, RolloutWorker
from posttrain.rl.rollout.workqueue import WorkQueue, read_json

TASKS = [("arithmetic", Task("t1", ({"role": "user", "content": "1+1"},), "2"))]


def beat_time(queue: WorkQueue, name: str) -> float:
    """When sampler `name` last beat (wall time)."""
    return read_json(queue.path("samplers", f"{name}.json"))["t"]


def test_a_hung_workers_lease_lapses_and_its_batch_is_reissued(tmp_path):
    """rl.progress_deadline_s = 5 (a fake clock): a worker that bumps every 3 s keeps beating; one
    that hangs stops beating once 5 s have passed without a bump, its heartbeat ages past
    rl.lease_timeout_s and the learner re-issues its batch to another sampler."""
    queue, now = WorkQueue(str(tmp_path)), [0.0]
    queue.issue(0, TASKS, min_version=0, run="r")
    assert queue.lease("a", bound=1)["batch"] == 0
    progress = Progress(clock=lambda: now[0])
    beat = Heartbeat(queue, "a", every_s=1.0, progress=progress, deadline_s=5.0).start()
    beat.stop()  # (ticked by hand here, not by the thread)
    with progress.working():
        for t in (3.0, 6.0, 9.0):  # generating: a bump every 3 s
            now[0] = t
            progress.bump()
            assert beat.tick()
        now[0] = 14.0  # hung since 9 s: 5 s without a bump is still within the deadline
        assert beat.tick()
        last = beat_time(queue, "a")
        now[0] = 14.5
        assert not beat.tick() and beat_time(queue, "a") == last  # stalled: no beat
        assert queue.reissue_dead(timeout_s=60.0, now=last + 30) == []  # not yet past rl.lease_timeout_s
        assert queue.reissue_dead(timeout_s=60.0, now=last + 61) == [0]
    assert queue.lease("b", bound=1)["batch"] == 0  # the batch, to another sampler
    assert beat.tick()  # waiting (no work under way): a sampler beats whatever its counter


def test_the_heartbeat_thread_stops_when_a_verifier_hangs(tmp_path):
    """A real worker's verifier hangs on its second response: the worker bumped progress after
    the first only, and the heartbeat thread (every 10 ms, deadline 50 ms) stops renewing."""
    queue, release = WorkQueue(str(tmp_path)), threading.Event()
    progress = Progress()

    class Env:
        def __init__(self, hang):
            self.hang = hang

        def step(self, completion):
            if self.hang:
                release.wait(10)
            return SimpleNamespace(reward=Reward(1.0, {}))

        def trajectory(self):
            return Trajectory("t1", [1, 2], [False, True], 1, Reward(1.0, {}))

    samples = SimpleNamespace(
        completion=lambda i: [2],
        sampling_logprobs=np.zeros((2, 1), np.float32),
        routing=None,
        versions=None,
        lengths=np.ones(2, np.int32),
        stop_reason=np.zeros(2, np.int32),
    )
    pool = concurrent.futures.ThreadPoolExecutor(1)  # the verifier pool: responses verified in turn
    worker = RolloutWorker(None, {}, None, 0, pool, progress=progress.bump)
    beat = Heartbeat(queue, "a", every_s=0.01, progress=progress, deadline_s=0.05).start()
    try:
        with progress.working():
            done = concurrent.futures.ThreadPoolExecutor(1).submit(
                worker.verify, Pending(TASKS, [[Env(False), Env(True)]], samples, 0.0)
            )
            deadline = time.monotonic() + 5
            while progress.count < 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.15)  # past the deadline (50 ms) with the verifier hung
            last = beat_time(queue, "a")
            time.sleep(0.05)
            assert beat_time(queue, "a") == last and progress.count == 1
            release.set()
            assert len(done.result(5).groups) == 1 and progress.count == 2
    finally:
        release.set()
        beat.stop()
        pool.shutdown()
