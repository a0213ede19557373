"""Rollout buffer: staleness bound, drop counting, bounded concurrent producer/consumer, close()."""

import threading
import time

import numpy as np
import pytest

from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.rollout.buffer import BufferClosed, Rollout, RolloutBuffer
from posttrain.rl.tasks.scheduler import Group


def rollout(name: str, version: int) -> Rollout:
    return Rollout(Group("d", Task(name, (), None), rewards=[0.0, 1.0]), version)


def names(rollouts) -> list[str]:
    return [r.group.task.id for r in rollouts]


def test_get_never_hands_out_stale_rollouts_and_counts_the_dropped():
    buf = RolloutBuffer(capacity_groups=8, max_staleness=1)
    for v in range(5):
        buf.put(rollout(f"v{v}", v))
    assert names(buf.get(2, current_version=4, timeout=1)) == ["v3", "v4"]
    stats = buf.stats()
    assert stats["rl/buffer_dropped_stale"] == 3 and stats["rl/buffer_size"] == 0
    assert stats["rl/staleness_mean"] == 0.5 and stats["rl/staleness_max"] == 1


def test_on_policy_buffer_keeps_only_the_current_version():
    buf = RolloutBuffer(capacity_groups=4, max_staleness=0)
    buf.put(rollout("old", 0))
    buf.put(rollout("new", 1))
    with pytest.raises(TimeoutError):
        buf.get(2, current_version=1, timeout=0.05)  # "old" is dropped, "new" stays queued
    assert buf.stats()["rl/buffer_dropped_stale"] == 1 and len(buf) == 1
    assert names(buf.get(1, current_version=1, timeout=1)) == ["new"]


def test_put_waits_for_room_and_times_out():
    buf = RolloutBuffer(capacity_groups=1, max_staleness=0)
    buf.put(rollout("a", 0))
    with pytest.raises(TimeoutError):
        buf.put(rollout("b", 0), timeout=0.05)
    threading.Timer(0.05, lambda: buf.get(1, current_version=0)).start()
    buf.put(rollout("b", 0), timeout=5)  # room made by the consumer
    assert names(buf.get(1, current_version=0, timeout=1)) == ["b"]


def test_concurrent_producers_and_consumer_lose_and_duplicate_nothing():
    buf = RolloutBuffer(capacity_groups=3, max_staleness=0)
    per_producer = 50

    def produce(p: int) -> None:
        for i in range(per_producer):
            buf.put(rollout(f"p{p}-{i}", 0), timeout=10)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    for t in producers:
        t.start()
    received = []
    while len(received) < 3 * per_producer:
        received += names(buf.get(2, current_version=0, timeout=10))
        assert len(buf) <= 3
    for t in producers:
        t.join(timeout=10)
    assert sorted(received) == sorted(f"p{p}-{i}" for p in range(3) for i in range(per_producer))
    for p in range(3):  # FIFO: each producer's groups come out in the order put
        assert [n for n in received if n.startswith(f"p{p}-")] == [f"p{p}-{i}" for i in range(per_producer)]
    assert buf.stats()["rl/buffer_dropped_stale"] == 0 and buf.stats()["rl/buffer_handed_out"] == 150


def test_concurrent_staleness_every_group_trained_or_counted():
    buf = RolloutBuffer(capacity_groups=4, max_staleness=1)
    version = [0]  # the learner's version, read by the sampler when it tags a rollout

    def produce(p: int) -> None:
        for i in range(30):
            buf.put(rollout(f"p{p}-{i}", version[0]), timeout=10)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(2)]
    for t in producers:
        t.start()
    handed_out = []
    while any(t.is_alive() for t in producers) or len(buf):
        try:
            got = buf.get(1, current_version=version[0], timeout=0.02)
        except TimeoutError:
            continue
        assert version[0] - got[0].version <= 1
        handed_out += got
        version[0] += len(handed_out) % 3 == 0  # an update every third group: a backlog goes stale
    assert len(set(names(handed_out))) == len(handed_out)
    assert len(handed_out) + buf.stats()["rl/buffer_dropped_stale"] == 60


def test_close_wakes_blocked_producer_and_consumer():
    full = RolloutBuffer(capacity_groups=1, max_staleness=0)
    full.put(rollout("a", 0))
    empty = RolloutBuffer(capacity_groups=2, max_staleness=0)
    outcome = {}

    def blocked_put():
        try:
            full.put(rollout("b", 0))
        except BufferClosed:
            outcome["put"] = "closed"

    def blocked_get():
        outcome["get"] = empty.get(2, current_version=0)

    threads = [threading.Thread(target=blocked_put), threading.Thread(target=blocked_get)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    full.close()
    empty.close()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()
    assert outcome == {"put": "closed", "get": []}
    assert names(full.get(1, current_version=0)) == ["a"]  # a closed buffer still drains
    assert full.get(1, current_version=0) == []
    with pytest.raises(BufferClosed):
        full.put(rollout("c", 0))


def test_rollout_checks_behaviour_logprobs_against_trajectories():
    traj = Trajectory("t", tokens=[1, 2, 3], loss_mask=[False, True, True], prompt_len=1)
    group = Group("d", Task("t", (), None), rewards=[1.0], trajectories=[traj])
    Rollout(group, 0, [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="1 trajectories"):
        Rollout(group, 0, [])
    with pytest.raises(ValueError, match=r"behav_logprobs\[0\] has 2 entries for 3 tokens"):
        Rollout(group, 0, [np.zeros(2, np.float32)])
