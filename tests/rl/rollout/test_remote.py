"""`rl.placement = disaggregated` (rl/rollout/{transfer,workqueue,remote}.py, stages/rlvr_sampler.py):
the weight transfer with its token, the workdir queue's leases and re-issue, the address file, and
a learner and a sampler process group training `rlvr_tiny` on loopback."""

import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.config import RLConfig
from posttrain.errors import UserError
from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.reward import Reward
from posttrain.rl.rollout import transfer, workqueue
from posttrain.rl.rollout.workqueue import WorkQueue
from posttrain.rl.tasks.scheduler import Group
from tests.support import paths
from tests.support.rl_processes import golden_rows, spawn, wait
from tests.support.typed_configs import run_cfg
from tests.test_golden import GOLDEN, TIMING_SUFFIXES, logged

ROOT = str(paths.ROOT)


@pytest.mark.parametrize(
    "placement, role, words",
    [("disaggregated", "none", "set rl.role='learner'"), ("colocated", "sampler", "only used with rl.placement")],
)
def test_the_config_refuses_a_role_without_disaggregated_and_the_reverse(placement, role, words):
    cfg = run_cfg({"rl.placement": placement, "rl.role": role}, stage="rlvr")
    with pytest.raises(UserError, match=words) as e:
        cfg.check_stages()  # the rl section's rules: a run that reaches the rlvr stage
    assert e.value.key == "rl.role"


@pytest.mark.parametrize("key, value", [("rl.filter_groups", True), ("sampling.quantize", "int8")])
def test_what_disaggregated_cannot_do_yet_is_refused_naming_the_key(key, value):
    from posttrain.rl.rollout.remote import check_disaggregated

    cfg = run_cfg({"rl.placement": "disaggregated", "rl.role": "learner", key: value}, stage="rlvr")
    with pytest.raises(UserError, match="disaggregated") as e:
        check_disaggregated(cfg)
    assert e.value.key == key


def test_a_sampler_group_of_another_process_count_than_the_learner_is_refused(tmp_path, monkeypatch):
    """Sampler process i pulls its shards from learner process i: a one-process group facing a
    learner of two processes (learner.json lists two addresses) is refused, naming the key."""
    monkeypatch.setenv(transfer.HOST_ENV, "127.0.0.1")
    queue, mesh = WorkQueue(str(tmp_path)), jax.make_mesh((8,), ("data",))
    info = {"address": "a:1", "addresses": ["a:1", "b:1"], "token": "t", "version": 0, "mesh": dict(mesh.shape)}
    client = transfer.WeightClient(queue, "s1", ({}, {}), mesh)
    with pytest.raises(UserError, match="runs 1 process.*the learner 2") as e:
        client._connect(info)
    assert e.value.key == "rl.placement"


def test_a_sampler_role_that_reaches_the_learner_is_refused():
    """(`rl.role=sampler` inside a pipeline: main.run sends only stage rlvr's to the sampler loop)"""
    from types import SimpleNamespace

    from posttrain.rl.rollout.remote import RemoteProducer

    cfg = run_cfg({"rl.placement": "disaggregated", "rl.role": "sampler"}, stage="rlvr")
    with pytest.raises(UserError, match="reached the learner") as e:
        RemoteProducer.for_learner(SimpleNamespace(cfg=cfg), 0, ((), ()))
    assert e.value.key == "rl.role"


def test_weights_round_trip_only_under_the_token(tmp_path, monkeypatch):
    """The learner's server offers a version; a sampler reads the address file, asks, pulls it;
    the offer's name is the token's HMAC (a peer without the token names another offer)."""
    monkeypatch.setenv(transfer.HOST_ENV, "127.0.0.1")
    queue = WorkQueue(str(tmp_path))
    mesh = jax.make_mesh((8,), ("data",))
    learner = transfer.WeightServer(queue, mesh, {}, "learner")
    weights = ({"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, PartitionSpec("data")))}, {})
    shardings = transfer.weight_shardings(weights, mesh, {}, "learner")  # as the sampler computes them
    specs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), weights, shardings)
    learner.publish(3, weights)
    info = json.loads((tmp_path / "rl" / "learner.json").read_text())
    assert info["version"] == 3 and info["address"] == learner.server.address() and len(info["token"]) == 32
    assert (tmp_path / "rl" / "learner.json").stat().st_mode & 0o777 == 0o600  # the token: this user's only
    client = transfer.WeightClient(queue, "s1", specs, mesh)
    (params, _), version = client.newest(min_version=3)
    np.testing.assert_array_equal(params["w"], np.arange(16.0))
    assert version == 3 and client.pulled_bytes == 64 and learner.offers == 1
    uuid = transfer.offer_uuid(info["token"], "s1", "n", 3)
    assert uuid != transfer.offer_uuid("another token", "s1", "n", 3) and 0 <= uuid < 2**63
    learner.publish(4, jax.tree.map(lambda x: x + 1, weights))  # a newer version: pulled on the next ask
    (params, _), version = client.newest(min_version=0)
    assert version == 4 and float(params["w"][0]) == 1.0
    learner.close()


def test_leases_back_pressure_and_reissue_of_a_dead_samplers_batch(tmp_path):
    queue = WorkQueue(str(tmp_path))
    task = Task("t1", ({"role": "user", "content": "1+1"},), "2")
    for p in range(3):
        queue.issue(p, [("arithmetic", task)], min_version=p)
    queue.heartbeat("a")
    first = queue.lease("a", bound=2)
    assert first["batch"] == 0
    queue.heartbeat("b")
    second = queue.lease("b", bound=2)
    assert second["batch"] == 1  # one sampler per batch
    assert queue.deliver(0, {"version": 0, "lease": first["lease"]})
    assert queue.deliver(1, {"version": 0, "lease": second["lease"]})
    assert queue.lease("b", bound=2) is None  # two results wait: back-pressure
    queue.consume(0)
    assert queue.lease("a", bound=2)["batch"] == 2
    assert queue.reissue_dead(timeout_s=60) == []  # alive (and batch 1 is finished)
    assert queue.reissue_dead(timeout_s=60, now=time.time() + 120) == [2]  # a's heartbeat is old
    assert queue.lease("b", bound=3)["batch"] == 2  # batch 2 again, for another sampler
    queue.finish()
    assert queue.finished()
    queue.reset()
    assert not queue.finished() and os.listdir(queue.path("tasks")) == []


def test_a_batch_survives_the_json_round_trip_exactly():
    task = Task("t1", ({"role": "user", "content": "1+1"},), "2")
    traj = Trajectory("t1", [1, 2, 3], [False, True, True], 1, Reward(0.5, {"correct": 0.5}), 1, {"truncated": None})
    behav = [np.asarray([0.0, -0.1234567, -2.5e-8], np.float32)]
    payload = json.loads(
        json.dumps(workqueue.encode_batch([Group("d", task, [0.5], [traj], [1.0])], [behav], {}, 7, "s"))
    )
    groups, got, routing = workqueue.decode_batch(payload, {("d", "t1"): task})
    assert groups[0].trajectories[0] == traj and groups[0].task is task and payload["version"] == 7
    np.testing.assert_array_equal(got[0][0], behav[0])
    assert routing is None  # the sampler recorded none
    # model.moe.routing_replay=sampler: the experts of every token (3 tokens, 2 MoE layers, top-2) travel too
    experts = [np.arange(12, dtype=np.uint8).reshape(3, 2, 2)]
    group = Group("d", task, [0.5], [traj], [1.0])
    payload = json.loads(json.dumps(workqueue.encode_batch([group], [behav], {}, 7, "s", routing=[experts])))
    routing = workqueue.decode_batch(payload, {("d", "t1"): task})[2]
    assert routing[0][0].dtype == np.uint8
    np.testing.assert_array_equal(routing[0][0], experts[0])


@pytest.mark.slow  # (in CI: the same on gs:// with groups of two processes, tests/rl/rollout/test_group.py)
@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_learner_and_a_sampler_process_group_train_rlvr_tiny(where, tmp_path, request):
    """The sampler starts first (it waits for the address file); the learner trains 5 steps with
    its rollouts, as the colocated run does, and finishes; the sampler then exits 0. On gs:// (the
    GCS emulator) the queue, learner.json, checkpoints and metrics live in the bucket, so learner and
    sampler hosts need no shared disk; the local run shares a folder. (Without the held-out
    evaluations, which only cost time here: the slow test below has them.)"""
    from posttrain.core.metrics import read_metrics

    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    run = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('gcs')}/{tmp_path.name}"
    sampler = spawn(run, "sampler", tmp_path / "sampler.log", **no_eval)
    learner = spawn(run, "learner", tmp_path / "learner.log", **no_eval)
    wait(learner, tmp_path / "learner.log")
    wait(sampler, tmp_path / "sampler.log", timeout=60)
    rows = [{k: v for k, v in r.items() if not k.endswith(TIMING_SUFFIXES)} for r in read_metrics(run)]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and WorkQueue(run).finished()
    assert all(r["rl/staleness_max"] == 0 and r["rl/buffer_dropped_stale"] == r["rl/reissued"] == 0 for r in rows)
    golden_rows(rows, evals=False)
    assert "5 batches delivered" in (tmp_path / "sampler.log").read_text()


@pytest.mark.slow
def test_killing_the_sampler_mid_run_and_starting_another_completes_the_run(tmp_path):
    """The first sampler is killed after step 1; its leased batch is re-issued once its heartbeat
    is `rl.lease_timeout_s` old, a second sampler takes it with the same key and version, and the
    run logs the uninterrupted run's rows, evaluations included."""
    run, timeout = tmp_path / "run", {"rl.lease_timeout_s": 3.0}
    learner = spawn(run, "learner", tmp_path / "learner.log", **timeout)
    first = spawn(run, "sampler", tmp_path / "first.log", **timeout)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").exists() or '"step": 1' not in (run / "metrics.jsonl").read_text():
        assert time.time() < deadline and learner.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
        time.sleep(0.2)
    first.kill()
    first.wait()
    second = spawn(run, "sampler", tmp_path / "second.log", **timeout)
    wait(learner, tmp_path / "learner.log")
    wait(second, tmp_path / "second.log", timeout=60)
    rows = logged(run)
    golden_rows(rows, evals=True)
    assert "batches delivered" in (tmp_path / "second.log").read_text()


class FakeServer:
    def __init__(self):
        self.published = []

    def publish(self, version, weights):
        self.published.append(version)

    def close(self):
        pass


def deliver(queue, batch, version, tasks, run=None):
    """What a sampler writes for batch `batch` of `tasks`, sampled by `version` (for learner `run`),
    leasing it first (it must be the oldest batch no sampler holds)."""
    lease = queue.lease("s", bound=99)
    assert lease["batch"] == batch
    run = lease["run"] if run is None else run
    groups = [
        Group(d, t, [1.0], [Trajectory(t.id, [1, 2], [False, True], 1, Reward(1.0, {}))], [1.0]) for d, t in tasks
    ]
    behav = [[np.zeros(2, np.float32)]] * len(groups)
    assert queue.deliver(batch, workqueue.encode_batch(groups, behav, {}, version, "s", run, lease=lease["lease"]))


def wait_reissued(queue, batch):
    deadline = time.time() + 10
    while queue.lease_token(batch) is not None:  # until the learner has dropped it and freed its lease
        assert time.time() < deadline
        time.sleep(0.01)


def test_the_learner_issues_the_seeds_tasks_in_a_window_and_drops_a_too_stale_batch(tmp_path):
    """max_staleness = 1: batches 0, 1 issued at step 0 (not 2: back-pressure); at step 2 a result
    for an earlier learner in the workdir, then one of version 0, are dropped, counted and the batch
    re-issued; a fresh one is taken, the last: the samplers are told to exit."""
    from posttrain.rl.rollout.remote import RemoteProducer
    from tests.support.producer import scheduler

    queue, sched, reference = WorkQueue(str(tmp_path)), scheduler(), scheduler()
    p = RemoteProducer(queue, FakeServer(), sched, sched.domains, num_groups=2, max_staleness=1, start=0,
                       lease_timeout_s=60, steps=3, poll_s=0.01)  # fmt: skip
    p.publish(0, ((), ()))
    expected = [reference.next_batch(2) for _ in range(4)]
    p._issue_upto(0)
    assert sorted(os.listdir(queue.path("tasks"))) == ["0.json", "1.json"]
    for b in range(2):
        assert workqueue.read_json(queue.path("tasks", f"{b}.json"))["tasks"] == [[d, t.id] for d, t in expected[b]]
        assert workqueue.read_json(queue.path("tasks", f"{b}.json"))["min_version"] == max(0, b - 1)
    deliver(queue, 0, 0, expected[0])
    rollouts, batch = p.take(0)
    assert [ro.group.task.id for ro in rollouts] == [t.id for _, t in expected[0]] and batch.scheduler_state[
        "batches"
    ] == 1
    deliver(queue, 1, 0, expected[1])
    p.take(1)
    p.publish(2, ((), ()))
    got = {}
    t = threading.Thread(target=lambda: got.update(zip(("rollouts", "batch"), p.take(2))), daemon=True)
    t.start()
    deliver(queue, 2, 2, expected[2], run="an earlier learner's")  # (version 2 of a learner that died)
    wait_reissued(queue, 2)
    deliver(queue, 2, 0, expected[2])  # version 0 at step 2: staler than 1
    wait_reissued(queue, 2)
    assert p.buffer.stats()["rl/buffer_dropped_stale"] == 4  # two groups each time, counted
    assert not queue.finished()
    deliver(queue, 2, 1, expected[2])  # re-sampled by version 1
    t.join(10)
    assert queue.finished()  # the last of the 3 steps taken: the samplers may exit
    assert [ro.version for ro in got["rollouts"]] == [1, 1] and p.buffer.stats()["rl/staleness_max"] == 1
    assert sorted(os.listdir(queue.path("tasks"))) == []  # 2 + 1 is past the run's last step: not issued


@pytest.mark.slow
def test_a_restarted_learner_resumes_and_the_sampler_reconnects(tmp_path):
    """The learner is stopped (SIGTERM: it saves at the step) after step 1; the sampler keeps
    waiting (no finished marker), the rerun learner resumes from the checkpoint under a new token
    and run id, the sampler reconnects, and the run logs the uninterrupted run's training rows
    (the same task sequence, keys and weights)."""
    run = tmp_path / "run"
    sampler = spawn(run, "sampler", tmp_path / "sampler.log")
    first = spawn(run, "learner", tmp_path / "first.log")
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").exists() or '"step": 1' not in (run / "metrics.jsonl").read_text():
        assert time.time() < deadline and first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 143, (tmp_path / "first.log").read_text()[-3000:]
    token = json.loads((run / "rl" / "learner.json").read_text())["token"]
    assert not (run / "rl" / "finished.json").exists() and sampler.poll() is None
    second = spawn(run, "learner", tmp_path / "second.log")
    wait(second, tmp_path / "second.log")
    wait(sampler, tmp_path / "sampler.log", timeout=60)
    assert json.loads((run / "rl" / "learner.json").read_text())["token"] != token
    trained = {r["step"]: r for r in logged(run) if "loss" in r}  # the rerun's rows of a step win
    golden = [r for r in json.loads(GOLDEN.read_text())["rlvr_tiny_sync"] if "loss" in r]
    assert sorted(trained) == [r["step"] for r in golden]
    for want in golden:
        for key, value in want.items():
            np.testing.assert_allclose(trained[want["step"]][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_overlapped_disaggregated_never_trains_past_the_staleness_bound(tmp_path):
    """rl.max_staleness = 1 with two samplers: every batch the learner takes at step s was sampled
    by a version v with s − 1 <= v <= s, and the run completes with both samplers exiting 0."""
    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    run, overlapped = tmp_path / "run", {"rl.max_staleness": 1, **no_eval}
    samplers = [spawn(run, "sampler", tmp_path / f"s{i}.log", **overlapped) for i in (0, 1)]
    learner = spawn(run, "learner", tmp_path / "learner.log", **overlapped)
    wait(learner, tmp_path / "learner.log")
    for i, s in enumerate(samplers):
        wait(s, tmp_path / f"s{i}.log", timeout=60)
    rows = logged(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(0 <= r["rl/staleness_max"] <= 1 and r["rl/buffer_dropped_stale"] == 0 for r in rows)


@pytest.mark.slow
def test_a_sampler_group_with_inflight_updates_stays_within_the_staleness_bound(tmp_path):
    """rl.max_staleness = 1 with in-flight updates every 2 decode steps (rl.inflight_update_every):
    the sampler group pulls newer weights between decode steps, its tokens' versions travel with
    the batch, and no token the learner trains on lags it by more than the bound."""
    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    run, overlapped = tmp_path / "run", {"rl.max_staleness": 1, "rl.inflight_update_every": 2, **no_eval}
    sampler = spawn(run, "sampler", tmp_path / "sampler.log", **overlapped)
    learner = spawn(run, "learner", tmp_path / "learner.log", **overlapped)
    wait(learner, tmp_path / "learner.log")
    wait(sampler, tmp_path / "sampler.log", timeout=60)
    rows = logged(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["rl/version_lag_max"] <= 1 and "rl/tokens_stale_dropped" not in r for r in rows)
    assert all(0 <= r["rl/staleness_max"] <= 1 and r["rl/buffer_dropped_stale"] == 0 for r in rows)
